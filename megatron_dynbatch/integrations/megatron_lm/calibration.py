"""Calibrate the planner's cost model from the run itself, in Megatron-LM's training loop.

During the first ``--dynamic-batch-calibration-steps`` measured iterations (default 8; 0 turns it
off) every rank times the iteration (from the end of one :func:`~.hooks.prepare_train_step` to the
end of the next: forward-backward, optimizer, logging and the next plan, which is what Megatron's
"elapsed time per iteration" shows) and takes the slowest rank's time (one all-reduce per step).
Iterations that also run an evaluation or save a checkpoint, and the first two (warm-up), are not
used. While calibrating, each step is the planner's own plan under the configured budgets (token
and memory) with the configured per-micro-batch overhead times 1, 4 or 1/4 in turn
(:data:`OVERHEAD_FACTORS`): fewer, fuller micro-batches or more, shorter ones, each a plan the
planner considers near the best, so a calibration step costs about what the step it replaces
would, and the micro-batch counts differ so the overhead can be told from the work. Then every
rank fits the same weights from the same numbers (:func:`~megatron_dynbatch.planning.calibration.fit_cost_model`), rank 0's fit is broadcast (one
collective, so plans stay identical even if floating point differed) and held by the run's
:class:`Calibrator` (owned by its :class:`~.hooks.DynamicBatchHooks`;
:meth:`Calibrator.calibrated_config` applies it to the run's config; nothing is written into
Megatron's ``args``): the next batch is planned with it. Rank 0 logs it and writes
``dynbatch_calibration.yaml`` (the ``cost_*`` keys ``--dynamic-batch-config`` loads) and
``dynbatch_calibration.json`` (the fit in seconds, whether it is applied, the layout, budget and
model it was measured on, the model it fitted scales of (``prior``), and the measured steps, which
``megatron-dynbatch calibrate`` reads) into
``--save`` (or ``--dynamic-batch-calibration-output``).

The fit is of scales of the run's cost model (the physical default of
:func:`~megatron_dynbatch.planning.model_cost.physical_cost`, or the configured weights): a
throughput scale and the overhead, or one scale of the whole model where the steps cannot tell the
overhead apart, never a weight of 0 for a term the model has. A fit plans the run only when it has
every term above 0 and its median relative error over the measured steps is at most
``--dynamic-batch-calibration-max-error`` (default :data:`DEFAULT_CALIBRATION_MAX_ERROR`); otherwise as many steps again are measured and the
fit is made on all of them (:data:`MAX_CALIBRATION_ROUNDS` rounds in all), and a fit still short of
that is not used: the configured cost model plans on, and rank 0 says why. The log line names the
iteration from which the fit (or the configured model) plans: the fit is made while the iteration
after the last measured one is planned, so that iteration still runs a calibration shape.

A run resumed from a ``--load`` directory holding ``dynbatch_calibration.json`` uses that fit and
does not calibrate again (so it plans exactly as the straight run did after calibrating) when the
fit was measured on the same parallel layout, budget and model (:func:`measured_on`); otherwise,
or with ``--dynamic-batch-recalibrate``, it calibrates again and says why.

The iteration line shows ``predicted`` against ``measured`` iteration time and where the prediction
comes from: ``(fit)`` (a fit that plans the run), ``(model)`` (the default model in its assumed
seconds, where no weight was configured), or ``step time predicted: none`` (no applied fit and a
configured model, whose relative weights give no seconds), so a user sees when the model is wrong
and never a prediction from a fit that was refused.

Where the shapes cannot separate the weights (a budget under :data:`MIN_BUDGET_RATIO` x
``--seq-length``, or ``--rollouts-per-step``), the run skips calibration on its first step and
rank 0 says why (:func:`why_not_calibrate`): no iteration is planned in another shape, no file is
written. ``dynbatch_calibration.yaml`` is written only for a fit that is applied; the ``.json`` for
every final fit (a resumed run must not calibrate again).

With TensorBoard, :meth:`Calibrator.scalars` gives the iteration line's predicted and measured step
time and the fit's error as ``dynbatch/*`` scalars.

The calibration's progress lives in one :class:`Calibrator` per run (the hooks object creates it),
never in this module, so two runs in one process (tests, a custom loop) never share it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_dynbatch.config import DynBatchConfig, config_from_mapping

# The flags and file names live with the other arguments (no torch there); re-exported here.
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    CALIBRATION_JSON,
    CALIBRATION_YAML,
    DEFAULT_CALIBRATION_MAX_ERROR,
    DEFAULT_CALIBRATION_STEPS,
    add_calibration_args,
    setting_given,
)
from megatron_dynbatch.mcore.agreement import collective_device
from megatron_dynbatch.planning.calibration import (
    Calibration,
    Observation,
    fit_cost_model,
    predict_seconds,
)
from megatron_dynbatch.planning.spec import CostModel, round_up

__all__ = [
    "CALIBRATED_FIELDS",
    "CALIBRATION_JSON",
    "CALIBRATION_YAML",
    "DEFAULT_CALIBRATION_MAX_ERROR",
    "DEFAULT_CALIBRATION_STEPS",
    "MAX_CALIBRATION_ROUNDS",
    "MIN_BUDGET_RATIO",
    "Calibrator",
    "add_calibration_args",
    "measured_on",
    "why_not_calibrate",
]

#: Iterations at the start of a run that are never used (allocator and kernel warm-up).
WARMUP_STEPS = 2
#: A fit over its error bound measures another ``--dynamic-batch-calibration-steps`` and refits
#: on all of them, up to this many rounds in all; still over, it is not used.
MAX_CALIBRATION_ROUNDS = 2
#: The DynBatchConfig fields calibration changes (in :attr:`Calibrator.overrides`, never in
#: Megatron's arguments): the budget and overhead while it varies shapes, then the fitted weights.
CALIBRATED_FIELDS = (
    "max_tokens_per_gpu",
    "cost_token_weight",
    "cost_attention_weight",
    "cost_microbatch_overhead",
    "min_gain",
)

#: Calibration shapes, by iteration number modulo their count: the factor on the configured
#: per-micro-batch overhead the planner sees. Every shape is a plan the planner itself would choose
#: under a plausible overhead (never a deliberately bad one: the earlier shapes, a halved budget
#: or one long row a micro-batch, ran up to twice the step time), under the configured token and
#: memory budgets; the micro-batch counts they differ in tell the overhead from the work.
OVERHEAD_FACTORS = (1.0, 4.0, 0.25)
#: A fit whose per-step constant (optimizer, logging) is over this share of a typical measured step
#: is refused: the work's scale then rests on the noise (a busy machine's fit put 15 s of a 3 s
#: step into the constant and 0.0003 us into each token).
_MAX_CONSTANT_SHARE = 0.5
#: A step predicted faster than this is a fit of no work (all weights 0, e.g. refused on noisy
#: steps), not a prediction: the iteration line and TensorBoard then show none.
_NO_PREDICTION_S = 1e-6

#: Below this ratio of budget to ``--seq-length`` a micro-batch holds so few samples that the
#: plans calibration can choose between hardly differ, and the steps cannot tell the overhead from
#: the work (issue 29: at ``--max-tokens-per-gpu`` = 2 x ``--seq-length`` 8 calibration steps
#: changed nothing). The run then skips calibration at once and plans with the default model.
MIN_BUDGET_RATIO = 4


def _steps(args: Any) -> int:
    # Arguments built without add_dynamic_batch_args (tests, other loops) do not calibrate.
    steps = getattr(args, "dynamic_batch_calibration_steps", 0)
    return 0 if steps is None else int(steps)


def _interrupted(args: Any, iteration: int) -> bool:
    """Whether the loop evaluates or saves after ``iteration`` (1-based): not a plain step."""
    for name in ("eval_interval", "save_interval"):
        interval = getattr(args, name, None)
        if interval and iteration % interval == 0:
            return True
    return False


def _too_short_to_calibrate(args: Any, start: int) -> Optional[str]:
    """Why a run starting after ``start`` iterations cannot complete a calibration fit, or None:
    the iterations left before ``--train-iters`` or the next ``--exit-interval`` or
    ``--phase-transition-iterations`` exit are fewer
    than the warm-up, the first step (timed by the next) and ``--dynamic-batch-calibration-steps``
    measured ones. Such a run (each piece of one stopped and resumed that often) planned its
    steps at calibration's varied budgets, fitted nothing, and said nothing (a probe); it now
    plans with the configured budget and weights, and says so."""
    ends = []
    total = getattr(args, "train_iters", None)
    if isinstance(total, int) and total > 0:
        ends.append((total - start, f"--train-iters {total}"))
    interval = getattr(args, "exit_interval", None)
    if isinstance(interval, int) and interval > 0:
        ends.append((interval - start % interval, f"--exit-interval {interval}"))
    # Megatron exits at each of these too (a re-probe: calibration started and never fitted).
    phases = [
        p
        for p in getattr(args, "phase_transition_iterations", None) or ()
        if isinstance(p, int) and p > start
    ]
    if phases:
        ends.append((min(phases) - start, f"--phase-transition-iterations {min(phases)}"))
    if not ends:
        return None
    left, why = min(ends)
    need = WARMUP_STEPS + 1 + _steps(args)
    if left >= need:
        return None
    room = left - WARMUP_STEPS - 1
    fits = f"--dynamic-batch-calibration-steps {room} fits in it, " if room >= 2 else ""
    return (
        f"this run has {left} iteration(s) left (from iteration {start}, {why}) and a fit needs "
        f"{need} ({WARMUP_STEPS} warm-up, one timed by the next, {_steps(args)} measured: "
        f"--dynamic-batch-calibration-steps); {fits}a longer run calibrates"
    )


def _output_dir(args: Any) -> Optional[str]:
    return getattr(args, "dynamic_batch_calibration_output", None) or getattr(args, "save", None)


def _log(text: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)


def _agree_seconds(seconds: float) -> float:
    """The slowest rank's time (the step ends when the last rank ends)."""
    if not dist.is_initialized():
        return seconds
    # On the device the backend moves (NCCL: the GPU), as every collective here.
    value = torch.tensor([seconds], dtype=torch.float64, device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _agree_fit(fit: Calibration) -> Calibration:
    """Rank 0's weights on every rank (one broadcast): plans must be identical everywhere."""
    if not dist.is_initialized():
        return fit
    values = torch.tensor(
        [*fit.weights, fit.step_seconds], dtype=torch.float64, device=collective_device()
    )
    dist.broadcast(values, src=0)
    token, attention, overhead, step = (float(v) for v in values.tolist())
    return dataclasses.replace(
        fit,
        token_weight=token,
        attention_weight=attention,
        microbatch_overhead=overhead,
        step_seconds=step,
    )


def why_not_calibrate(args: Any, config: DynBatchConfig) -> Optional[str]:
    """Why this run's calibration shapes cannot separate the cost weights, or ``None``.

    Decided from the arguments and the run's config alone (the same for a straight and a resumed
    run).
    """
    if config.rollouts_per_step is not None:
        return (
            "with --rollouts-per-step a batch spans several steps planned at once, so the "
            "calibration cannot vary the budget between steps, and steps of one shape cannot "
            "separate token work from per-micro-batch overhead"
        )
    budget = int(config.max_tokens_per_gpu)
    seq_length = int(getattr(args, "seq_length", 1) or 1)
    if budget < MIN_BUDGET_RATIO * seq_length:
        return (
            f"--max-tokens-per-gpu {budget} is less than {MIN_BUDGET_RATIO} x --seq-length "
            f"{seq_length}, so a micro-batch holds so few samples that the plans calibration "
            "chooses between hardly differ and the steps cannot tell the per-micro-batch overhead "
            "from the work"
        )
    return None


def _max_error(args: Any) -> float:
    value = getattr(args, "dynamic_batch_calibration_max_error", None)
    return DEFAULT_CALIBRATION_MAX_ERROR if value is None else float(value)


def measured_on(args: Any, config: DynBatchConfig) -> Dict[str, Any]:
    """What a fit depends on besides the machine: the layout, the budget and the model.

    Saved with the fit (``"measured_on"`` in ``dynbatch_calibration.json``); a run resumed with
    other values refits instead of planning with step times of another configuration.
    """
    from .arguments import parallel_layout_from_args

    layout = parallel_layout_from_args(args)
    values: Dict[str, Any] = {
        "dp_size": layout.dp_size,
        "pp_size": layout.pp_size,
        "vpp_size": layout.vpp_size,
        "microbatch_group_size_per_vp_stage": layout.microbatch_group_size_per_vp_stage,
        "tp_size": layout.tp_size,
        "cp_size": layout.cp_size,
        "max_tokens_per_gpu": config.max_tokens_per_gpu,
        "layout": config.layout,
        "attention": config.cost_attention,
    }
    for name in _MODEL_ARGS:
        value = getattr(args, name, None)
        if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
            # Without GQA every head is its own group; Megatron's memory report writes that into
            # args after the first iteration, so read it the same way before and after.
            value = getattr(args, "num_attention_heads", None)
        values[name] = (
            value if value is None or isinstance(value, (bool, int, float)) else str(value)
        )
    return values


#: Megatron arguments that change what a step costs per token (the model), saved with a fit.
_MODEL_ARGS = (
    "seq_length",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "padded_vocab_size",
    "num_experts",
    "moe_router_topk",
    "transformer_impl",
    "recompute_granularity",
    "bf16",
    "fp16",
)


def _median_error(observations: List[Observation], predict: Any) -> float:
    """Median relative error of ``predict`` (an observation's predicted seconds) over steps."""
    return statistics.median([abs(predict(o) - o.seconds) / o.seconds for o in observations])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class Calibrator:
    """One run's calibration: what it measured, its fit, and the settings it plans with now.

    Created and owned by the run's :class:`~.hooks.DynamicBatchHooks` (``hooks.calibration``):
    a new run (a new hooks object) starts with a new one, and two runs in one process never share
    one. Megatron's ``args`` are only read: the varied budgets and the fit reach the planner
    through :meth:`calibrated_config`. Every rank calls :meth:`resume` and
    :meth:`observe_train_step` once per training step, in the same order (both may run
    collectives).
    """

    def __init__(self, config: Optional[DynBatchConfig] = None) -> None:
        self.config: Optional[DynBatchConfig] = config
        """The run's resolved config (the hooks pass theirs: the arguments are parsed once per
        run); ``None``: resolved from the arguments on first use, once."""
        self.observations: List[Observation] = []
        """The measured steps so far (their shapes and the slowest rank's seconds)."""
        self.fit: Optional[Calibration] = None
        """The fit (made by this run, or loaded from ``--load``), or None before it."""
        self.pending: Optional[Observation] = None
        """The last step's shapes, waiting for its time (known at the next step)."""
        self.pending_iteration: int = -1
        self.last_end: Optional[float] = None
        self.steps_seen: int = 0
        self.resumed_checked: bool = False
        self.budget: Optional[int] = None
        """The configured ``--max-tokens-per-gpu``, restored after calibration."""
        self.overhead: Optional[float] = None
        """The configured per-micro-batch overhead, restored after calibration."""
        self.attention_weight: Optional[float] = None
        """The configured attention weight, restored after calibration."""
        self.attention: Optional[str] = None
        """The attention kind the planner prices (resolved from Megatron's flags), read once."""
        self.skipped: Optional[str] = None
        """Why calibration does not run in this configuration (decided on the first step), or
        None."""
        self.applied: bool = False
        """Whether :attr:`fit` plans the run (separable and within the error bound)."""
        self._timing: Optional[tuple] = None
        """(steps seen, predicted, measured seconds, source) of the last step, shared by the
        iteration line and the TensorBoard scalars so both show the same figures."""
        self._seconds: Optional[tuple] = None
        """``(weights in seconds or None,)`` of the default model, once read
        (:meth:`_model_seconds`)."""
        self.overrides: Dict[str, Any] = {}
        """DynBatchConfig field -> the value calibration plans with now (a varied budget or
        overhead while it measures, then the fitted weights); :meth:`calibrated_config` applies
        them."""
        self.seq_length: Optional[int] = None
        """``--seq-length`` (the longest sample), read when the shapes are first varied."""
        self.shape: Optional[int] = None
        """While calibrating, the next step's iteration number, which picks its shape (modulo the
        count of :data:`OVERHEAD_FACTORS`); ``None`` otherwise."""

    def calibrated_config(
        self,
        config: DynBatchConfig,
        *,
        forward_only: bool = False,
    ) -> DynBatchConfig:
        """``config`` with calibration's changes so far (forward-only passes keep their budget).

        Calibration is the one thing that changes the settings mid-run: while it measures it
        varies the training budget and overhead, then it applies its fit. A resumed run gets the
        fit back from the ``--load`` directory's ``dynbatch_calibration.json`` and the varied
        shapes from the iteration number, so it plans as the straight run did.
        """
        overrides = dict(self.overrides)
        changes = {
            name: value
            for name, value in overrides.items()
            if value is not None
            and not (forward_only and name == "max_tokens_per_gpu")
            and value != getattr(config, name)
        }
        if not changes:
            return config
        return config_from_mapping({**dataclasses.asdict(config), **changes})

    def _configured(self, args: Any) -> DynBatchConfig:
        """The run's config: the hooks' (one parse per run), else resolved once from ``args``."""
        if self.config is None:
            from .arguments import dynbatch_config_from_args

            self.config = dynbatch_config_from_args(args)
        return self.config

    def resume(self, args: Any) -> None:
        """On a run's first step, before it plans: reuse the fit a ``--load`` directory holds.

        Called by :meth:`~.hooks.DynamicBatchHooks.prepare` on every rank before a training step
        is planned; after the first call it returns at once.
        """
        if not self.resumed_checked:
            self.resumed_checked = True
            self._load_resumed(args)
            if self.fit is None and _steps(args) > 0:
                self.skipped = why_not_calibrate(args, self._configured(args))
                if self.skipped is None:
                    start = int(getattr(args, "curr_iteration", 0) or 0)
                    self.skipped = _too_short_to_calibrate(args, start)
            if self.skipped is not None:
                _log(
                    f"dynamic-batch calibration skipped: {self.skipped}; planning keeps the "
                    "configured cost model (give --dynamic-batch-cost-* weights, e.g. from "
                    "`megatron-dynbatch calibrate` on steps timed at budgets of 4x --seq-length "
                    "and more, or pass --dynamic-batch-calibration-steps 0 to silence this)"
                )
            elif self.fit is None and _steps(args) > 0:
                # The first step's budget too follows its iteration number (a resumed run's first
                # step then plans as the straight run's did).
                self._vary_budget(args, int(getattr(args, "curr_iteration", 0) or 0) + 1)

    def observe_train_step(self, args: Any, batch: Any, plan: Any, step_index: int) -> None:
        """Record the step just planned; time the previous one; fit once enough are measured.

        Called by :meth:`~.hooks.DynamicBatchHooks.prepare` on every rank after a training step
        is materialized.
        """
        self._model_seconds(args)
        now = time.perf_counter()
        iteration = int(getattr(args, "curr_iteration", self.steps_seen) or 0) + 1
        previous, previous_end = self.pending, self.last_end
        previous_iteration = self.pending_iteration
        self.last_end = now
        self.steps_seen += 1
        shapes = self._observation_of(batch, plan, step_index, args)
        self.pending, self.pending_iteration = shapes, iteration
        calibrating = self.skipped is None and self.fit is None and _steps(args) > 0
        if calibrating:
            self._vary_budget(args, iteration + 1)
        if not calibrating or previous is None or previous_end is None:
            return
        seconds = _agree_seconds(now - previous_end)  # every rank calls it: same count everywhere
        measured = (
            self.steps_seen > WARMUP_STEPS + 1
            and iteration == previous_iteration + 1
            and not _interrupted(args, previous_iteration)
        )
        if not measured:
            return
        data = previous.to_dict()
        data["seconds"] = seconds
        self.observations.append(Observation.from_dict(data))
        if len(self.observations) % _steps(args):
            return  # fit after every round of --dynamic-batch-calibration-steps measured steps
        fit = _agree_fit(fit_cost_model(self.observations, prior=self._prior(args)))
        # The fit runs once, inside the next step's window: it would be measured as that step's
        # work (a second round then fits a step seconds too slow), so the window starts after it.
        self.last_end = time.perf_counter()
        usable, why = self._usable(fit, args)
        if not usable and len(self.observations) < MAX_CALIBRATION_ROUNDS * _steps(args):
            # Noisy steps (another job on the machine): measure as many again and fit on all.
            _log(f"{fit.summary()}; not used yet: {why}; measuring {_steps(args)} more steps")
            return
        self._restore()  # the next batch plans under the configured budget again
        self.applied = usable
        self._write(args, fit)  # also when not applied: a resumed run must not calibrate again
        self._adopt(fit, args, why, after=f" from iteration {iteration + 1}")

    def _adopt(self, fit: Calibration, args: Any, why: str, before: str = "", after: str = ""):
        """Hold ``fit``; plan with it where :meth:`_usable` said so (``why`` empty), else keep
        the configured model; say which, between ``before`` and ``after``."""
        self.fit, self.applied = fit, not why
        if self.applied:
            self._apply(fit, args)
            _log(f"{before}{fit.summary()}; planning with it{after}")
        else:
            # Planning with an arbitrary split of token work and overhead, or with a model that
            # misses the measured steps by more than the bound, would be a guess: keep the
            # configured weights, and still show predicted against measured time.
            _log(
                f"{before}{fit.summary()}; not used: {why}, so planning keeps the configured "
                f"cost model{after}"
            )

    def _usable(self, fit: Calibration, args: Any) -> tuple:
        """``(True, "")`` when ``fit`` may plan the run, else ``(False, why)``: it has every term
        of the model above 0 (token work, the per-micro-batch overhead, attention where the model
        prices it), told apart, and its median error is within the bound."""
        missing = [
            name
            for name, value in (
                ("token work", fit.token_weight),
                ("per-micro-batch overhead", fit.microbatch_overhead),
                (
                    "attention",
                    fit.attention_weight if self._prior(args).attention_weight > 0 else 1.0,
                ),
            )
            if not value > 0
        ]
        if missing or not fit.separable:
            what = f"it has no {' and no '.join(missing)}" if missing else "it could not separate "
            if not missing:
                what += ", ".join(fit.unidentified)
            return False, (
                f"{what}: the steps measured had too similar shapes (run `megatron-dynbatch "
                "calibrate` on steps of varied budgets to fit it)"
            )
        if self.observations:
            typical = sorted(o.seconds for o in self.observations)[len(self.observations) // 2]
            if fit.step_seconds > _MAX_CONSTANT_SHARE * typical:
                # The constant took the step (a busy machine's slow steps): the work's scale
                # is then a guess, however small the error.
                return False, (
                    f"its per-step constant ({fit.step_seconds * 1e3:.4g} ms) is over "
                    f"{100 * _MAX_CONSTANT_SHARE:.0f}% of a typical measured step "
                    f"({typical * 1e3:.4g} ms): the steps could not tell the work from it"
                )
        bound = _max_error(args)
        if fit.relative_error > bound:
            return False, (
                f"its median error {100 * fit.relative_error:.1f}% is over the "
                f"{100 * bound:.0f}% bound (--dynamic-batch-calibration-max-error {bound:g}; the "
                "step times were too noisy; raise the bound or the calibration steps)"
            )
        default = self._model_seconds(args)
        if default is not None and self.observations:
            # Noisy steps can fit a model that explains them worse than the default does; it
            # would replace a good plan with a worse one (a fit's overhead also drops the gain
            # threshold). Both are judged on every measured step, the default at its best scale
            # (the planner's weights are relative: a scale of the default plans as it does).
            fitted = _median_error(self.observations, fit.predict)
            scale = statistics.median(
                [o.seconds / predict_seconds(o, default) for o in self.observations]
            )
            model = _median_error(self.observations, lambda o: scale * predict_seconds(o, default))
            if fitted >= model:
                return False, (
                    f"over the {len(self.observations)} measured steps it is off by "
                    f"{100 * fitted:.1f}% (median), no better than the default model at its "
                    f"best scale ({100 * model:.1f}%)"
                )
        return True, ""

    def _model_seconds(self, args: Any) -> Optional[tuple]:
        """The default cost model in seconds (:data:`~megatron_dynbatch.planning.calibration
        .FIT_WEIGHTS` order) where the run plans with it (no weight configured), else None: a
        configured model's weights are relative, so they predict no seconds."""
        if self._seconds is None:
            from .arguments import physical_cost_from_args

            config = self._configured(args)
            physical = physical_cost_from_args(args, config.cost_attention or "segment")
            self._seconds = (None,)
            if physical is not None:
                model = physical.cost_model()
                same = all(
                    abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-300)
                    for a, b in (
                        (config.cost_token_weight, model.token_weight),
                        (config.cost_attention_weight, model.attention_weight),
                        (config.cost_microbatch_overhead or 0.0, model.overhead),
                    )
                )
                if same:
                    self._seconds = (
                        (
                            physical.token_seconds,
                            physical.attention_seconds,
                            physical.overhead_seconds,
                        ),
                    )
        return self._seconds[0]

    def timing(self) -> Optional[tuple]:
        """``(predicted, measured, source)`` seconds of the last iteration, or None before any.

        ``source`` says where ``predicted`` comes from: ``fit`` (a fit that plans the run),
        ``model`` (the default model, in its assumed seconds, where no fit plans the run and no
        weight was configured) or ``None`` (no prediction; ``predicted`` is then None: a refused
        fit predicts nothing). ``measured`` is this rank's wall clock from the end of the step's
        planning to the first call after it (the forward-backward pass and the optimizer step;
        Megatron's ``elapsed time per iteration`` adds its own planning); later calls for the
        same step repeat it.
        """
        if self.pending is None or self.last_end is None:
            return None
        if self._timing is None or self._timing[0] != self.steps_seen:
            measured = time.perf_counter() - self.last_end
            predicted, source = None, None
            if self.fit is not None and self.applied:
                predicted, source = self.fit.predict(self.pending), "fit"
            elif self._seconds is not None and self._seconds[0] is not None:
                predicted, source = predict_seconds(self.pending, self._seconds[0]), "model"
            if predicted is not None and predicted < _NO_PREDICTION_S:
                predicted, source = None, None  # a fit of no work at all predicts nothing
            self._timing = (self.steps_seen, predicted, measured, source)
        return self._timing[1:]

    def log_string(self) -> str:
        """The last iteration's predicted (and where from) against measured time, for the line."""
        timing = self.timing()
        if timing is None:
            return ""
        predicted, measured, source = timing
        if predicted is None:
            why = "fit refused" if self.fit is not None else "no fit"
            return f" step time predicted: none ({why}) |"
        return (
            f" step time predicted/measured (ms): {predicted * 1e3:.1f}/{measured * 1e3:.1f} "
            f"({source}) |"
        )

    def scalars(self) -> Dict[str, float]:
        """The same figures and the applied fit's median error, by TensorBoard tag."""
        timing = self.timing()
        if timing is None or timing[0] is None:
            return {}
        predicted, measured, _source = timing
        values = {
            "dynbatch/step time predicted (ms)": predicted * 1e3,
            "dynbatch/step time measured (ms)": measured * 1e3,
        }
        if self.fit is not None and self.applied:
            values["dynbatch/calibration error"] = float(self.fit.relative_error)
        return values

    def _observation_of(self, batch: Any, plan: Any, step_index: int, args: Any) -> Observation:
        """The shapes of one planned step (every DP rank's micro-batches), its time unknown yet."""
        from .arguments import parallel_layout_from_args

        step = plan.steps[step_index]
        lengths = batch.lengths()
        kept = plan.kept_lengths()
        multiple = plan.sample_multiple
        ranks = [
            [[round_up(kept.get(i, lengths[i]), multiple) for i in mb] for mb in rank]
            for rank in step.ranks
        ]
        layout = parallel_layout_from_args(args)
        return Observation(
            seconds=1.0,
            seq_length=step.seq_length,
            micro_batch_size=step.micro_batch_size,
            layout=plan.layout,
            ranks=ranks,
            pp_size=layout.pp_size,
            vpp_size=layout.vpp_size,
            group=layout.microbatch_group_size_per_vp_stage,
            attention=self._attention_kind(args),
            row_lengths=step.row_lengths or None,
        )

    def _attention_kind(self, args: Any) -> str:
        """The attention kind the planner prices, resolved as it resolves it (read once).

        ``--transformer-impl local`` (CPU) runs a dense mask; the flag alone is None unless given,
        which a fit would read as THD segments and so could not explain why one row of 1,024
        costs more than four of 256.
        """
        if self.attention is None:
            self.attention = self._configured(args).cost_attention
        return self.attention

    def _apply(self, fit: Calibration, args: Any) -> None:
        """Plan the following batches with ``fit``."""
        model = fit.cost_model()
        for name in ("token_weight", "attention_weight", "microbatch_overhead"):
            self.overrides["cost_" + name] = getattr(model, name)
        if not setting_given(args, "min_gain") and fit.form != "physical":
            # A measured overhead: the model is trusted (no gain threshold), unless one was given.
            # A "physical" fit scales the whole model, its overhead in the estimated proportion:
            # that overhead is still an estimate, so the estimate's threshold stays (at equal
            # memory on the CPU mix such a fit dropped it, and 16 x [2 x 256] replaced 11 x
            # [3 x 256] for the rest of the run, at 1.2-1.4x fixed's time).
            self.overrides["min_gain"] = 0.0

    def _load_resumed(self, args: Any) -> None:
        """Reuse the fit a checkpoint directory holds, when this run resumes from one and was
        measured on the same layout, budget and model (else calibrate again, saying why)."""
        load = getattr(args, "load", None)
        resumed = bool(getattr(args, "iteration", 0) or getattr(args, "curr_iteration", 0))
        if not load or not resumed:
            return
        path = os.path.join(load, CALIBRATION_JSON)
        if not os.path.isfile(path):
            return
        if getattr(args, "dynamic_batch_recalibrate", False):
            _log(
                f"dynamic-batch calibration: --dynamic-batch-recalibrate given, so the fit in "
                f"{path} is not reused; calibrating again"
            )
            return
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        saved_on = data.pop("measured_on", None)
        now = measured_on(args, self._configured(args))
        if saved_on is None:
            changed = "it holds no record of the layout, budget and model it was measured on"
        else:
            changed = ", ".join(
                f"{_flag(name)} {saved_on.get(name)} -> {value}"
                for name, value in now.items()
                if saved_on.get(name) != value
            )
            changed = changed and f"it was measured with other settings ({changed})"
        if changed:
            _log(f"dynamic-batch calibration in {path} not reused: {changed}; calibrating again")
            return
        for key in ("steps", "applied", "prior"):
            data.pop(key, None)
        fit = Calibration.from_dict(data)
        _, why = self._usable(fit, args)
        self._adopt(fit, args, why, before=f"dynamic-batch calibration loaded from {path}: ")

    def _write(self, args: Any, fit: Calibration) -> None:
        directory = _output_dir(args)
        if directory is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        os.makedirs(directory, exist_ok=True)
        yaml_path = os.path.join(directory, CALIBRATION_YAML)
        if self.applied:
            with open(yaml_path, "w", encoding="utf-8") as handle:
                handle.write(fit.to_yaml())
        elif os.path.isfile(yaml_path):
            os.remove(yaml_path)  # an older applied fit's: it no longer describes this run
        payload = {
            **fit.to_dict(),
            "applied": self.applied,
            "measured_on": measured_on(args, self._configured(args)),
            # The model the fit is of scales of: `megatron-dynbatch calibrate` refits the same.
            "prior": dataclasses.asdict(self._prior(args)),
            "steps": [o.to_dict() for o in self.observations],
        }
        with open(os.path.join(directory, CALIBRATION_JSON), "w", encoding="utf-8") as handle:
            json.dump(payload, handle)

    def _vary_budget(self, args: Any, next_iteration: int) -> None:
        """Plan the next calibration step with the configured overhead times one of
        :data:`OVERHEAD_FACTORS`, in turn.

        Steps of one configuration have much the same shape, so the per-micro-batch overhead and
        the work grow together and no fit can tell them apart. Each shape is what the planner
        chooses under the configured budgets (token and memory: every shape is safe) with a
        larger or smaller overhead: fewer, fuller micro-batches or more, shorter ones, each a plan
        it considers near the best, so calibration steps cost about what the steps they replace
        would. The shape follows the iteration number, so a run resumed before calibration ends
        plans as the straight run did; and only where every batch is one step (no
        ``--rollouts-per-step``), since a batch that spans steps is planned once and a resumed run
        re-plans it.
        """
        configured = self._configured(args)
        if configured.rollouts_per_step is not None:
            return
        if self.budget is None:
            self.budget = configured.max_tokens_per_gpu
            self.overhead = configured.cost_microbatch_overhead
            self.attention_weight = configured.cost_attention_weight
        self.seq_length = int(getattr(args, "seq_length", 1) or 1)
        self.shape = next_iteration
        factor = OVERHEAD_FACTORS[next_iteration % len(OVERHEAD_FACTORS)]
        self.overrides["cost_microbatch_overhead"] = self._prior(args).overhead * factor
        # The varied shapes are the model's own optimum under that overhead (no gain threshold:
        # with one, a smaller overhead would often change nothing); the configured one keeps it.
        self.overrides["min_gain"] = None if factor == 1.0 else 0.0

    def _prior(self, args: Any) -> CostModel:
        """The configured cost model, its overhead resolved as the planner resolves an unknown
        one: what calibration fits scales of (:func:`fit_cost_model`'s ``prior``)."""
        config = self._configured(args)
        seq_length = int(getattr(args, "seq_length", 1) or 1)
        model = CostModel(
            token_weight=config.cost_token_weight,
            attention_weight=config.cost_attention_weight,
            microbatch_overhead=config.cost_microbatch_overhead,
            attention=config.cost_attention,
        )
        # An unknown overhead: the planner's share of a full row, at a row the budget allows.
        return model.resolved(min(config.max_tokens_per_gpu, 8 * seq_length), config.layout)

    def _restore(self) -> None:
        """The configured budget and overhead again (before a fit, if any, is applied)."""
        self.shape = None
        for name in (
            "max_tokens_per_gpu",
            "cost_microbatch_overhead",
            "cost_attention_weight",
            "min_gain",
        ):
            self.overrides.pop(name, None)
