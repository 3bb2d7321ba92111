"""Calibrate the cost model from measured step times: a non-negative least-squares fit.

Pure standard library. An :class:`Observation` is one optimizer step as it ran: its micro-batches
(the padded sample sizes of every micro-batch on every DP rank, in schedule order), the row shape,
the pipeline layout and the measured wall-clock seconds. :func:`fit_cost_model` finds the cost
weights, in seconds, that make the planner's own pipeline simulation (:mod:`.simulate` over
:mod:`.cost`) plus a constant per-step time (optimizer, logging: the same whatever the plan) match
the measurements best.

The simulated step time is piecewise linear in the weights and homogeneous of degree one (doubling
every weight doubles the makespan, and the critical path only depends on the ratios). On the piece
that holds a weight vector ``w``, ``T(w) = g(w) . w`` where ``g`` is ``T``'s gradient, so the fit
alternates: take the gradient at the current weights (finite differences along each weight), solve
the linear non-negative least-squares problem ``[g, 1] . [w, c] ~= seconds``
(Lawson-Hanson, :func:`nnls`), repeat until the weights stop moving.

The weights come back in seconds; :meth:`Calibration.cost_model` normalises them to the planner's
relative units (``token_weight = 1``) and :meth:`Calibration.to_yaml` writes the ``cost_*`` keys
``--dynamic-batch-config`` loads. A weight the observations cannot tell apart from another (every
step had the same shape, so overhead and token work grow together) is reported in
:attr:`Calibration.unidentified`: vary the budget or the batch to separate them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .cost import microbatch_cost
from .plan import plain_fields
from .simulate import simulate_step
from .spec import LAYOUTS, CostModel

__all__ = [
    "FIT_WEIGHTS",
    "Calibration",
    "Observation",
    "fit_cost_model",
    "nnls",
    "predict_seconds",
]

#: The cost-model weights a calibration fits, in the order of its coefficient vectors.
FIT_WEIGHTS: Tuple[str, ...] = ("token_weight", "attention_weight", "microbatch_overhead")


def _bad(message: str) -> DynBatchValueError:
    return DynBatchValueError(message)


@dataclass(frozen=True, kw_only=True)
class Observation:
    """One measured optimizer step.

    ``ranks[r][m]`` lists the padded segment sizes of the samples of micro-batch ``m`` on DP rank
    ``r`` (``[]`` for a placeholder); every rank runs the same number of micro-batches.
    """

    seconds: float
    """Measured wall-clock time of the step (the slowest rank's)."""
    seq_length: int
    """The step's row length ``S``."""
    ranks: Tuple[Tuple[Tuple[int, ...], ...], ...]
    """Padded sample sizes per micro-batch per DP rank."""
    micro_batch_size: int = 1
    """Rows per micro-batch (packed: usually 1, more where attention pays S**2 a row)."""
    layout: str = "packed"
    """``packed`` or ``padded``."""
    pp_size: int = 1
    """Pipeline stages."""
    vpp_size: int = 1
    """Virtual pipeline chunks per stage."""
    group: Optional[int] = None
    """``microbatch_group_size_per_vp_stage`` (``None``: ``pp_size``)."""
    attention: Optional[str] = None
    """What the attention kernel runs (``segment``, ``causal``, ``dense``), where the cost model
    knows attention kinds; ``None``: by layout."""
    row_lengths: Optional[Tuple[Tuple[int, ...], ...]] = None
    """Variable rows: ``row_lengths[r][m]`` is micro-batch ``m``'s own row on DP rank ``r``
    (``None``: every row is ``seq_length``). Their shape exchange is then part of each
    micro-batch's fixed cost, which the fit measures."""

    def __post_init__(self) -> None:
        seconds = self.seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise _bad(f"observation seconds={seconds!r} must be a number; pass the step's time.")
        if not math.isfinite(seconds) or seconds <= 0:
            raise _bad(
                f"observation seconds={seconds!r} must be finite and > 0; drop steps whose time "
                "was not measured."
            )
        object.__setattr__(self, "seconds", float(seconds))
        for name in ("seq_length", "micro_batch_size", "pp_size", "vpp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(f"observation {name}={value!r} must be an integer >= 1.")
        if self.layout not in LAYOUTS:
            raise _bad(f"observation layout={self.layout!r} is not one of {LAYOUTS}.")
        ranks = tuple(tuple(tuple(int(s) for s in mb) for mb in rank) for rank in self.ranks)
        if not ranks or not ranks[0]:
            raise _bad("observation ranks is empty; give every DP rank's micro-batches.")
        counts = {len(rank) for rank in ranks}
        if len(counts) != 1:
            raise _bad(
                f"observation ranks have different micro-batch counts {sorted(counts)}; every DP "
                "rank runs the same number per step."
            )
        rows = None
        if self.row_lengths is not None:
            rows = tuple(tuple(int(s) for s in rank) for rank in self.row_lengths)
            if [len(r) for r in rows] != [len(r) for r in ranks] or any(
                not 1 <= s <= self.seq_length for rank in rows for s in rank
            ):
                raise _bad(
                    "observation row_lengths must give every micro-batch of every rank a row of "
                    f"1..seq_length={self.seq_length} tokens."
                )
        for r, rank in enumerate(ranks):
            for m, mb in enumerate(rank):
                row = self.seq_length if rows is None else rows[r][m]
                if any(s < 1 for s in mb) or sum(mb) > row * self.micro_batch_size:
                    raise _bad(
                        f"observation micro-batch sizes {list(mb)} do not fit rows of "
                        f"{self.micro_batch_size}x{row} tokens; sizes must be >= 1."
                    )
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "row_lengths", rows)

    def row(self, r: int, m: int) -> int:
        """The row length micro-batch ``m`` of DP rank ``r`` ran."""
        return self.seq_length if self.row_lengths is None else self.row_lengths[r][m]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Observation":
        """An observation from its :meth:`to_dict` form (the ``calibrate`` command's JSON)."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise _bad(f"observation has unknown key(s) {unknown}; valid keys are {sorted(known)}.")
        missing = sorted({"seconds", "seq_length", "ranks"} - set(data))
        if missing:
            raise _bad(f"observation lacks key(s) {missing}.")
        return cls(**dict(data))

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (``row_lengths`` only for variable rows)."""
        values = plain_fields(self)
        if self.row_lengths is None:
            del values["row_lengths"]
        return values


def _model(weights: Sequence[float], attention: Optional[str] = None) -> CostModel:
    values = dict(zip(FIT_WEIGHTS, weights, strict=True))
    if attention is not None:
        if "attention" not in CostModel.__dataclass_fields__:
            raise _bad(
                f"observation attention={attention!r}: this cost model has no attention kinds; "
                "omit the key."
            )
        values["attention"] = attention
    if values["token_weight"] == 0 and values["attention_weight"] == 0:
        # CostModel refuses all-zero work weights; a vanishing token weight keeps it valid and
        # changes no makespan measurably.
        values["token_weight"] = 1e-300
    return CostModel(**values)


def predict_seconds(obs: Observation, weights: Sequence[float], step_seconds: float = 0.0) -> float:
    """Predicted time of ``obs`` with ``weights`` (in :data:`FIT_WEIGHTS` order, seconds)."""
    model = _model(weights, obs.attention)
    costs = [
        [
            microbatch_cost(
                model, obs.layout, obs.row(r, m), obs.micro_batch_size, mb, [0] * len(mb)
            )
            for m, mb in enumerate(rank)
        ]
        for r, rank in enumerate(obs.ranks)
    ]
    return step_seconds + simulate_step(costs, obs.pp_size, obs.vpp_size, obs.group).step_time


def _gradient(obs: Observation, weights: Sequence[float], units: Sequence[float]) -> List[float]:
    """The makespan's gradient in the weights, by forward differences on the current piece
    (``units[k]``: :func:`_unit_makespan` of weight ``k``, which does not change with them)."""
    base = predict_seconds(obs, weights)
    scale = max(base, 1e-300)
    grad = []
    for k in range(len(weights)):
        # A step relative to the makespan keeps the critical path (a tiny move stays on its piece).
        step = 1e-6 * scale / max(1.0, units[k])
        bumped = list(weights)
        bumped[k] += step
        grad.append((predict_seconds(obs, bumped) - base) / step)
    return grad


def _unit_makespan(obs: Observation, k: int) -> float:
    unit = [0.0] * len(FIT_WEIGHTS)
    unit[k] = 1.0
    return predict_seconds(obs, unit)


def nnls(
    a: Sequence[Sequence[float]], b: Sequence[float], max_iter: int = 200
) -> Tuple[List[float], float]:
    """Non-negative least squares ``min ||A x - b||, x >= 0`` (Lawson-Hanson active set).

    Args:
        a: ``m x n`` matrix (rows of features).
        b: ``m`` targets.
        max_iter: Bound on the outer iterations (the method converges in at most ``n`` for the
            small problems here).

    Returns:
        ``(x, residual_norm)``.
    """
    m = len(a)
    n = len(a[0]) if m else 0
    if m == 0 or n == 0 or len(b) != m or any(len(row) != n for row in a):
        raise _bad(f"nnls needs an m x n matrix and m targets, got {m} rows and {len(b)} targets.")
    x = [0.0] * n
    passive: List[int] = []
    tol = 1e-12 * max(1.0, max(abs(v) for row in a for v in row))

    def residual(vec: Sequence[float]) -> List[float]:
        return [b[i] - sum(a[i][j] * vec[j] for j in range(n)) for i in range(m)]

    def gradient(vec: Sequence[float]) -> List[float]:
        r = residual(vec)
        return [sum(a[i][j] * r[i] for i in range(m)) for j in range(n)]

    def solve_passive(cols: Sequence[int]) -> List[float]:
        z = _least_squares([[a[i][j] for j in cols] for i in range(m)], b)
        full = [0.0] * n
        for value, j in zip(z, cols, strict=True):
            full[j] = value
        return full

    for _ in range(max_iter):
        w = gradient(x)
        candidates = [j for j in range(n) if j not in passive and w[j] > tol]
        if not candidates:
            break
        passive.append(max(candidates, key=lambda j: w[j]))
        while True:
            z = solve_passive(passive)
            if all(z[j] > 0 for j in passive):
                x = z
                break
            alpha = min(x[j] / (x[j] - z[j]) for j in passive if z[j] <= 0)
            x = [x[j] + alpha * (z[j] - x[j]) for j in range(n)]
            passive = [j for j in passive if x[j] > tol]
            for j in range(n):
                if j not in passive:
                    x[j] = 0.0
    r = residual(x)
    return x, math.sqrt(sum(v * v for v in r))


def _least_squares(a: Sequence[Sequence[float]], b: Sequence[float]) -> List[float]:
    """Unconstrained least squares by the normal equations with column scaling and a tiny ridge.

    The problems are a handful of columns with very different magnitudes (tokens vs squared
    lengths), so columns are scaled to unit norm first; the ridge keeps dependent columns solvable
    (they are reported as unidentified by the caller, not here).
    """
    n = len(a[0])
    norms = [math.sqrt(sum(row[j] ** 2 for row in a)) or 1.0 for j in range(n)]
    scaled = [[row[j] / norms[j] for j in range(n)] for row in a]
    ata = [[sum(r[i] * r[j] for r in scaled) for j in range(n)] for i in range(n)]
    atb = [sum(r[i] * t for r, t in zip(scaled, b, strict=True)) for i in range(n)]
    for i in range(n):
        ata[i][i] += 1e-12
    y = _solve(ata, atb)
    return [y[j] / norms[j] for j in range(n)]


def _solve(matrix: List[List[float]], rhs: List[float]) -> List[float]:
    """Gaussian elimination with partial pivoting on a small square system."""
    n = len(rhs)
    aug = [list(row) + [value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(aug[r][col]))
        aug[col], aug[pivot] = aug[pivot], aug[col]
        if aug[col][col] == 0:
            continue
        for r in range(col + 1, n):
            factor = aug[r][col] / aug[col][col]
            for c in range(col, n + 1):
                aug[r][c] -= factor * aug[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        if aug[r][r] == 0:
            continue
        out[r] = (aug[r][n] - sum(aug[r][c] * out[c] for c in range(r + 1, n))) / aug[r][r]
    return out


def _unidentified(rows: Sequence[Sequence[float]], names: Sequence[str]) -> Tuple[str, ...]:
    """Names of the columns that are (nearly) a combination of the others over these rows."""
    n = len(names)
    norms = [math.sqrt(sum(row[j] ** 2 for row in rows)) for j in range(n)]
    out = []
    for j in range(n):
        if norms[j] == 0:
            out.append(names[j])
            continue
        others = [k for k in range(n) if k != j and norms[k] > 0]
        if not others:
            continue
        target = [row[j] / norms[j] for row in rows]
        fit = _least_squares([[row[k] / norms[k] for k in others] for row in rows], target)
        resid = [
            t - sum(c * row[k] / norms[k] for c, k in zip(fit, others, strict=True))
            for t, row in zip(target, rows, strict=True)
        ]
        if math.sqrt(sum(v * v for v in resid)) < 1e-3:
            out.append(names[j])
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """A fitted cost model, in seconds, with how well it fits."""

    token_weight: float
    """Seconds of linear work per position of a row (forward; backward is the simulator's ratio)."""
    attention_weight: float
    """Seconds per squared token of an attention segment (forward)."""
    microbatch_overhead: float
    """Seconds of fixed cost per micro-batch (forward)."""
    step_seconds: float
    """Seconds per step that do not depend on the plan (optimizer, logging)."""
    observations: int
    """How many steps the fit used."""
    relative_error: float
    """Median ``|predicted - measured| / measured`` over the observations."""
    unidentified: Tuple[str, ...] = ()
    """Weights the observations could not separate from the others (vary shapes to fix)."""
    extra: Dict[str, Any] = field(default_factory=dict)
    """Free-form provenance (written to the YAML as comments)."""
    form: str = "free"
    """What was fitted (:func:`fit_cost_model`): ``scales`` (a throughput scale of the prior's
    token and attention work, and an overhead), ``physical`` (one scale of the whole prior) or
    ``free`` (every weight on its own)."""

    @property
    def weights(self) -> Tuple[float, float, float]:
        """The fitted weights in :data:`FIT_WEIGHTS` order (seconds)."""
        return (self.token_weight, self.attention_weight, self.microbatch_overhead)

    @property
    def separable(self) -> bool:
        """Whether the fit found token work and a per-micro-batch overhead, both above 0 and told
        apart from the rest (safe to plan with).

        When every measured step had much the same shape, any split between them predicts those
        steps equally well, so planning with the split would be a guess; a fit of scales of a prior
        (:func:`fit_cost_model`) keeps the prior's split where the steps cannot tell it.
        """
        return (
            self.token_weight > 0
            and self.microbatch_overhead > 0
            and not {"token_weight", "microbatch_overhead", "compute_scale"}
            & set(self.unidentified)
        )

    @property
    def seconds_per_unit(self) -> float:
        """Seconds of one unit of the normalised :meth:`cost_model` (its token weight is 1)."""
        if self.token_weight > 0:
            return self.token_weight
        if self.attention_weight > 0:
            return self.attention_weight
        raise _bad(
            "the calibration found neither token nor attention work in the step times (every "
            "weight but the overhead is 0); calibrate over steps of different lengths."
        )

    def cost_model(self) -> CostModel:
        """The fitted weights in the planner's relative units (``token_weight = 1`` when > 0)."""
        unit = self.seconds_per_unit
        return CostModel(
            token_weight=self.token_weight / unit,
            attention_weight=self.attention_weight / unit,
            microbatch_overhead=self.microbatch_overhead / unit,
        )

    def predict(self, obs: Observation) -> float:
        """Predicted seconds of one step."""
        return predict_seconds(obs, self.weights, self.step_seconds)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (round-trips through :meth:`from_dict`)."""
        return plain_fields(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        values["unidentified"] = tuple(values.get("unidentified", ()))
        return cls(**values)

    def to_yaml(self) -> str:
        """The ``cost_*`` keys ``--dynamic-batch-config`` loads, with the fit as comments."""
        model = self.cost_model()
        lines = [
            "# Cost model calibrated by megatron-dynbatch from measured step times.",
            f"# seconds per unit: {self.seconds_per_unit!r}; per-step constant: "
            f"{self.step_seconds!r} s",
            f"# fitted on {self.observations} steps, median relative error "
            f"{self.relative_error:.4f}",
        ]
        if self.unidentified:
            lines.append(
                f"# not separable from the others on these steps: {', '.join(self.unidentified)}"
            )
        lines.extend(f"# {key}: {value}" for key, value in sorted(self.extra.items()))
        lines += [
            f"cost_token_weight: {model.token_weight!r}",
            f"cost_attention_weight: {model.attention_weight!r}",
            f"cost_microbatch_overhead: {model.microbatch_overhead!r}",
        ]
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        """One log line (forward costs; the simulator adds the backward pass)."""
        text = (
            f"dynamic-batch calibration over {self.observations} steps "
            f"({_FORMS.get(self.form, self.form)}): {self.token_weight * 1e6:.4g} us per token, {self.attention_weight * 1e9:.4g} ns per "
            f"squared attention token, {self.microbatch_overhead * 1e3:.4g} ms per micro-batch, "
            f"{self.step_seconds * 1e3:.4g} ms per step besides; median error "
            f"{100 * self.relative_error:.1f}%"
        )
        if self.token_weight > 0:
            model = self.cost_model()
            text += (
                f" (planner units: attention_weight {model.attention_weight:.4g}, "
                f"microbatch_overhead {model.microbatch_overhead:.4g} tokens)"
            )
        if self.unidentified:
            text += f"; could not separate {', '.join(self.unidentified)} (vary shapes)"
        return text


_FORMS = {
    "scales": "a throughput scale of the model's token and attention work, and an overhead",
    "physical": "one scale of the whole model, its overhead in proportion",
    "free": "every weight on its own",
}


def fit_cost_model(
    observations: Sequence[Observation],
    *,
    prior: Optional[CostModel] = None,
    iterations: int = 20,
    fit_attention: bool = True,
    fit_step_seconds: bool = True,
) -> Calibration:
    """Fit the cost weights (seconds) to measured steps.

    With a ``prior`` (the physical model the run planned with: token weight, attention weight and
    per-micro-batch overhead in its relative units, :func:`.model_cost.physical_cost`) the fit
    finds **scales** of that model, never a weight of 0 for a term it has:

    1. ``scales``: one throughput scale of its token and attention work (their ratio kept) plus a
       per-micro-batch overhead in seconds and the per-step constant;
    2. where the steps cannot tell the overhead apart (or put it at 0), ``physical``: one scale of
       the whole model (the overhead in its physical proportion) plus the constant;
    3. ``free``: every weight on its own, taken over the above only when every term the prior has
       comes out above 0 and identified, attention within :data:`PRIOR_RATIO_RANGE` of the prior's
       ratio to token work, and its median error clearly lower.

    Without a prior (``megatron-dynbatch calibrate`` on recorded steps) the weights are free and a
    weight the steps cannot support may come out 0 (reported in :attr:`Calibration.unidentified`).

    Args:
        observations: The measured steps (at least 2).
        prior: The model whose scales to fit (``None``: free weights).
        iterations: Bound on the linearise-and-solve rounds (it usually settles in 2 or 3).
        fit_attention: ``False`` pins the attention weight at 0 (short rows, where the quadratic
            term is invisible in the noise and only makes the fit worse).
        fit_step_seconds: ``False`` pins the per-step constant at 0 (the times cover the
            forward-backward pass alone).

    Returns:
        The :class:`Calibration` (its ``extra["form"]`` says which of the above it is).

    Raises:
        DynBatchValueError: On fewer than 2 observations.
    """
    obs = list(observations)
    if len(obs) < 2:
        raise _bad(
            f"calibration needs at least 2 measured steps, got {len(obs)}; measure more steps "
            "before fitting (a launch measures --dynamic-batch-calibration-steps N of them, "
            "N >= 2, into dynbatch_calibration.json)."
        )
    longest = max(o.seq_length for o in obs)
    unit = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
    free_basis = [unit[0], unit[2]] + ([unit[1]] if fit_attention else [])
    free_names = ["token_weight", "microbatch_overhead"] + (
        ["attention_weight"] if fit_attention else []
    )
    free = _robust_fit(
        obs, free_basis, free_names, fit_step_seconds, iterations, (1.0, 1.0 / longest, 1.0)
    )
    if prior is None:
        return _calibration(free, "free")
    p_token = prior.token_weight
    p_attention = prior.attention_weight if fit_attention else 0.0
    p_overhead = prior.overhead
    if p_token <= 0:
        raise _bad(f"the prior cost model has token_weight={p_token}; give one > 0.")
    compute = (p_token, p_attention, 0.0)
    start = (p_token, p_attention, max(p_overhead, p_token))
    scales = _robust_fit(
        obs,
        [compute, unit[2]],
        ["compute_scale", "microbatch_overhead"],
        fit_step_seconds,
        iterations,
        start,
    )
    chosen, form = scales, "scales"
    if scales.weights[2] <= 0 or scales.weights[0] <= 0 or scales.unidentified:
        whole = (p_token, p_attention, p_overhead if p_overhead > 0 else p_token)
        chosen = _robust_fit(obs, [whole], ["compute_scale"], fit_step_seconds, iterations, whole)
        form = "physical"
    if _free_is_better(free, chosen, prior, fit_attention):
        chosen, form = free, "free"
    return _calibration(chosen, form)


#: A free fit replaces the scaled one only with its attention weight within this factor of the
#: prior's ratio of attention to token work, and its median error below
#: ``_FREE_ERROR_FACTOR`` times the scaled fit's: noisy steps move a free split far more than they
#: move a throughput scale.
PRIOR_RATIO_RANGE = 8.0
_FREE_ERROR_FACTOR = 0.8


def _free_is_better(free: "_Fit", scaled: "_Fit", prior: CostModel, fit_attention: bool) -> bool:
    token, attention, overhead = free.weights
    if token <= 0 or overhead <= 0 or free.unidentified:
        return False
    if fit_attention and prior.attention_weight > 0:
        if attention <= 0:
            return False
        ratio = (attention / token) / (prior.attention_weight / prior.token_weight)
        if not 1.0 / PRIOR_RATIO_RANGE <= ratio <= PRIOR_RATIO_RANGE:
            return False
    scaled_error = _median(scaled.errors)
    return _median(free.errors) < _FREE_ERROR_FACTOR * scaled_error


@dataclass
class _Fit:
    """One fit's outcome, in :data:`FIT_WEIGHTS` seconds."""

    weights: List[float]
    step_seconds: float
    observations: List[Observation]
    errors: List[float]
    unidentified: Tuple[str, ...]
    extra: Dict[str, Any]


def _calibration(fit: _Fit, form: str) -> Calibration:
    return Calibration(
        token_weight=fit.weights[0],
        attention_weight=fit.weights[1],
        microbatch_overhead=fit.weights[2],
        step_seconds=fit.step_seconds,
        observations=len(fit.observations),
        relative_error=_median(fit.errors),
        unidentified=fit.unidentified,
        extra=fit.extra,
        form=form,
    )


def _robust_fit(
    observations: Sequence[Observation],
    basis: Sequence[Sequence[float]],
    names: Sequence[str],
    fit_step_seconds: bool,
    iterations: int,
    start: Sequence[float],
) -> _Fit:
    """Fit the coefficients of ``basis`` (weights = their non-negative combination), dropping
    outlier steps and pinning the per-step constant where it swallowed the work."""
    obs = list(observations)
    names = list(names) + (["step_seconds"] if fit_step_seconds else [])
    weights, step_seconds, rows = _fit(obs, basis, fit_step_seconds, iterations, start)
    errors = _relative_errors(obs, weights, step_seconds)
    # A step another job slowed down (on a shared machine one step can take 3x its neighbours)
    # pulls every weight towards it: drop, one at a time, the step (of the few furthest off)
    # without which the others fit far better and which that fit then puts far off (a quarter of
    # the steps at most).
    extra: Dict[str, Any] = {}
    dropped = 0
    while (
        dropped < len(observations) // 4
        and len(obs) > _OUTLIER_MIN_STEPS
        and _median(errors) > _OUTLIER_MIN_ERROR
    ):
        best = None
        # The candidates: the steps the current fit puts furthest off.
        worst = sorted(range(len(obs)), key=lambda k: -errors[k])[:_OUTLIER_CANDIDATES]
        for i in worst:
            rest = obs[:i] + obs[i + 1 :]
            fitted = _fit(rest, basis, fit_step_seconds, iterations, start)
            spread = _median(_relative_errors(rest, fitted[0], fitted[1]))
            if best is None or spread < best[0]:
                best = (spread, i, fitted)
        spread, i, fitted = best
        off = _relative_errors([obs[i]], fitted[0], fitted[1])[0]
        if spread > _median(errors) / 2 or off <= max(_OUTLIER_FACTOR * spread, _OUTLIER_FLOOR):
            break
        if len(_unidentified(fitted[2], names)) > len(_unidentified(rows, names)) or (
            _work(fitted[0]) <= 0 < _work(weights)
        ):
            break  # without it the rest cannot tell the weights apart (or lose token work): keep it
        obs = obs[:i] + obs[i + 1 :]
        weights, step_seconds, rows = fitted
        errors = _relative_errors(obs, weights, step_seconds)
        dropped += 1
    if dropped:
        extra["outlier_steps"] = dropped
    if fit_step_seconds and weights[0] <= 0:
        # Steps of one batch size compute much the same tokens, so token work and the per-step
        # constant can trade places, and NNLS may put it all in the constant: a model without
        # token work cannot plan. The constant pinned at 0 gives token work its share; taken when
        # it explains the steps nearly as well.
        pinned = _fit(obs, basis, False, iterations, start)
        pinned_errors = _relative_errors(obs, pinned[0], pinned[1])
        if pinned[0][0] > 0 and _median(pinned_errors) <= _median(errors) + _PINNED_SLACK:
            weights, step_seconds, rows = pinned
            errors = pinned_errors
            names = [name for name in names if name != "step_seconds"]
            extra["step_seconds_pinned"] = True
    return _Fit(
        weights=list(weights),
        step_seconds=step_seconds,
        observations=obs,
        errors=errors,
        unidentified=_unidentified(rows, names),
        extra=extra,
    )


def _work(weights: Sequence[float]) -> float:
    """Token plus attention weight: 0 when the fit found no work at all."""
    return weights[0] + weights[1]


#: Outlier steps (see fit_cost_model): only while the fit is off by more than _OUTLIER_MIN_ERROR
#: (median) and more than _OUTLIER_MIN_STEPS steps remain; a dropped step is off the others' fit by
#: more than _OUTLIER_FACTOR times their median error and more than _OUTLIER_FLOOR (a step another
#: job slowed down takes 1.5-3x its time; shapes alone move a good fit by 10-20%).
_OUTLIER_FACTOR = 3.0
_OUTLIER_FLOOR = 0.25
_OUTLIER_MIN_ERROR = 0.01
_OUTLIER_MIN_STEPS = 5
#: How much worse (median relative error) a fit without the per-step constant may be and still
#: replace one that put token work into that constant.
_PINNED_SLACK = 0.05
#: Steps tried as the outlier per round (a refit each): the furthest off the current fit.
_OUTLIER_CANDIDATES = 3


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


def _relative_errors(
    obs: Sequence[Observation], weights: Sequence[float], step_seconds: float
) -> List[float]:
    return [abs(predict_seconds(o, weights, step_seconds) - o.seconds) / o.seconds for o in obs]


#: The fit has settled when no weight moves by more than this (relative) in a round: far below
#: what measured step times can resolve, and it spares rounds that only chase float noise.
_SETTLED = 1e-6


def _fit(
    obs: Sequence[Observation],
    basis: Sequence[Sequence[float]],
    fit_step_seconds: bool,
    iterations: int,
    start: Sequence[float],
) -> Tuple[List[float], float, List[List[float]]]:
    """Linearise and solve until the weights settle: ``(weights, step_seconds, rows)``.

    The weights are ``sum(x[j] * basis[j])`` with ``x >= 0`` (one unit vector per weight: free
    weights; a prior's direction: its scale); ``rows`` are the design rows in ``x``.
    """
    times = [o.seconds for o in obs]
    # Start with every term on the critical path.
    weights = list(start)
    step_seconds = 0.0
    rows: List[List[float]] = []
    units = [[_unit_makespan(o, k) for k in range(len(FIT_WEIGHTS))] for o in obs]
    for _ in range(iterations):
        grads = [_gradient(o, weights, u) for o, u in zip(obs, units, strict=True)]
        rows = [
            [sum(g * b for g, b in zip(grad, vector, strict=True)) for vector in basis]
            + ([1.0] if fit_step_seconds else [])
            for grad in grads
        ]
        x, _ = nnls(rows, times)
        new = [sum(x[j] * basis[j][k] for j in range(len(basis))) for k in range(len(FIT_WEIGHTS))]
        new_step = x[len(basis)] if fit_step_seconds else 0.0
        if not any(new):
            # No work at all fits best (the per-step constant took it): the makespan's gradient
            # is the same at any multiple of the weights, but at 0 it is undefined, so the next
            # round would linearise at nothing and solve garbage. This piece's answer stands.
            weights, step_seconds = new, new_step
            break
        moved = max(
            abs(a - b) / max(abs(a), abs(b), 1e-300) for a, b in zip(new, weights, strict=True)
        )
        weights, step_seconds = new, new_step
        if moved < _SETTLED:
            break
    return weights, step_seconds, rows
