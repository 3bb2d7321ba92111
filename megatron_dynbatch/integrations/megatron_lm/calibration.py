"""Calibrate the planner's cost model from the run itself, in Megatron-LM's training loop.

During the first ``--dynamic-batch-calibration-steps`` measured iterations (default 8; 0 turns it
off) every rank times the iteration (from the end of one :func:`~.hooks.prepare_train_step` to the
end of the next: forward-backward, optimizer, logging and the next plan, which is what Megatron's
"elapsed time per iteration" shows) and takes the slowest rank's time (one all-reduce per step).
Iterations that also run an evaluation or save a checkpoint, and the first two (warm-up), are not
used. While calibrating, steps are planned in four shapes in turn (the budget; few full
micro-batches, of short rows where attention pays S^2 a row; half the budget in few long rows; a
quarter of it, never below ``--seq-length``): smaller budgets are safe for memory, and without
different shapes token work, attention, per-micro-batch overhead and the per-step constant cannot
be told apart. Then every rank fits the same weights from the same numbers
(:func:`~megatron_dynbatch.planning.calibration.fit_cost_model`), rank 0's fit is broadcast (one
collective, so plans stay identical even if floating point differed) and held in this module's
calibration state (:func:`calibrated_config` applies it to the run's config; nothing is written
into Megatron's ``args``): the next batch is planned with it. Rank 0 logs it and writes
``dynbatch_calibration.yaml`` (the ``cost_*`` keys ``--dynamic-batch-config`` loads) and ``dynbatch_calibration.json`` (the fit in
seconds) into ``--save`` (or ``--dynamic-batch-calibration-output``). A run resumed from a
``--load`` directory holding ``dynbatch_calibration.json`` uses that fit and does not calibrate
again, so it plans exactly as the straight run did after calibrating.

After calibration the iteration line shows ``predicted`` against ``measured`` iteration time, so a
user sees when the model is wrong.

Where the shapes cannot separate the weights (a budget under :data:`MIN_BUDGET_RATIO` x
``--seq-length``, or ``--rollouts-per-step``), the run skips calibration on its first step and
rank 0 says why (:func:`why_not_calibrate`): no iteration is planned in another shape, no file is
written. ``dynbatch_calibration.yaml`` is written only for a fit that is applied; the ``.json`` for
every fit (a resumed run must not calibrate again).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_dynbatch.config import DynBatchConfig, config_from_mapping

# The flags and file names live with the other arguments (no torch there); re-exported here.
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    CALIBRATION_JSON,
    CALIBRATION_YAML,
    DEFAULT_CALIBRATION_STEPS,
    add_calibration_args,
)
from megatron_dynbatch.planning.calibration import Calibration, Observation, fit_cost_model
from megatron_dynbatch.planning.spec import round_up

__all__ = [
    "CALIBRATED_FIELDS",
    "CALIBRATION_JSON",
    "CALIBRATION_YAML",
    "DEFAULT_CALIBRATION_STEPS",
    "MIN_BUDGET_RATIO",
    "add_calibration_args",
    "calibrated_config",
    "calibration_log_string",
    "calibration_state",
    "observe_train_step",
    "reset_calibration_state",
    "resume_calibration",
    "why_not_calibrate",
]

#: Iterations at the start of a run that are never used (allocator and kernel warm-up).
WARMUP_STEPS = 2
#: The DynBatchConfig fields calibration changes (in its state's ``overrides``, never in Megatron's
#: arguments): the budget and overhead while it varies shapes, then the fitted weights.
CALIBRATED_FIELDS = (
    "max_tokens_per_gpu",
    "cost_token_weight",
    "cost_attention_weight",
    "cost_microbatch_overhead",
)


@dataclass
class _State:
    """Calibration progress of this process."""

    observations: List[Observation] = field(default_factory=list)
    fit: Optional[Calibration] = None
    pending: Optional[Observation] = None
    """The last step's shapes, waiting for its time (known at the next step)."""
    pending_iteration: int = -1
    last_end: Optional[float] = None
    steps_seen: int = 0
    resumed_checked: bool = False
    budget: Optional[int] = None
    """The configured ``--max-tokens-per-gpu``, restored after calibration."""
    overhead: Optional[float] = None
    """The configured per-micro-batch overhead, restored after calibration."""
    attention_weight: Optional[float] = None
    """The configured attention weight, restored after calibration."""
    attention: Optional[str] = None
    """The attention kind the planner prices (resolved from Megatron's flags), read once."""
    skipped: Optional[str] = None
    """Why calibration does not run in this configuration (decided on the first step), or None."""
    overrides: Dict[str, Any] = field(default_factory=dict)
    """DynBatchConfig field -> the value calibration plans with now (a varied budget or overhead
    while it measures, then the fitted weights); :func:`calibrated_config` applies them."""


_state = _State()


def reset_calibration_state() -> None:
    """Forget the observations and the fit (tests; a new run in the same process)."""
    global _state
    _state = _State()


def calibration_state() -> _State:
    """This process's calibration progress (read-only use)."""
    return _state


def calibrated_config(config: DynBatchConfig, *, forward_only: bool = False) -> DynBatchConfig:
    """``config`` with what calibration has changed so far (forward-only passes keep their budget).

    Calibration is the one thing that changes the settings mid-run: while it measures it varies
    the training budget and overhead, then it applies its fit. A resumed run gets the fit back
    from the ``--load`` directory's ``dynbatch_calibration.json`` and the varied shapes from the
    iteration number, so it plans as the straight run did.
    """
    changes = {
        name: value
        for name, value in _state.overrides.items()
        if value is not None
        and not (forward_only and name == "max_tokens_per_gpu")
        and value != getattr(config, name)
    }
    if not changes:
        return config
    return config_from_mapping({**dataclasses.asdict(config), **changes})


def _steps(args: Any) -> int:
    # Arguments built without add_dynamic_batch_args (tests, other loops) do not calibrate.
    steps = getattr(args, "dynamic_batch_calibration_steps", 0)
    return 0 if steps is None else int(steps)


def _observation_of(batch: Any, plan: Any, step_index: int, args: Any) -> Observation:
    """The shapes of one planned step (every DP rank's micro-batches), its time still unknown."""
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
        attention=_attention_kind(args),
        row_lengths=step.row_lengths or None,
    )


def _attention_kind(args: Any) -> str:
    """The attention kind the planner prices, resolved as it resolves it (read once).

    ``--transformer-impl local`` (CPU) runs a dense mask; the flag alone is None unless given,
    which a fit would read as THD segments and so could not explain why one row of 1,024 costs
    more than four of 256.
    """
    if _state.attention is None:
        from .arguments import dynbatch_config_from_args

        _state.attention = dynbatch_config_from_args(args).cost_attention
    return _state.attention


def _interrupted(args: Any, iteration: int) -> bool:
    """Whether the loop evaluates or saves after ``iteration`` (1-based): not a plain step."""
    for name in ("eval_interval", "save_interval"):
        interval = getattr(args, name, None)
        if interval and iteration % interval == 0:
            return True
    return False


def _output_dir(args: Any) -> Optional[str]:
    return getattr(args, "dynamic_batch_calibration_output", None) or getattr(args, "save", None)


def _apply(args: Any, fit: Calibration) -> None:
    """Plan the following batches with ``fit``."""
    model = fit.cost_model()
    for name in ("token_weight", "attention_weight", "microbatch_overhead"):
        _state.overrides["cost_" + name] = getattr(model, name)


def _load_resumed(args: Any) -> None:
    """Reuse the fit a checkpoint directory holds, when this run resumes from one."""
    load = getattr(args, "load", None)
    resumed = bool(getattr(args, "iteration", 0) or getattr(args, "curr_iteration", 0))
    if not load or not resumed:
        return
    path = os.path.join(load, CALIBRATION_JSON)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    data.pop("steps", None)
    _state.fit = Calibration.from_dict(data)
    if _state.fit.separable:
        _apply(args, _state.fit)
    _log(f"dynamic-batch calibration loaded from {path}: {_state.fit.summary()}")


def _log(text: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)


def _agree_seconds(seconds: float) -> float:
    """The slowest rank's time (the step ends when the last rank ends)."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _agree_fit(fit: Calibration) -> Calibration:
    """Rank 0's weights on every rank (one broadcast): plans must be identical everywhere."""
    if not dist.is_initialized():
        return fit
    values = torch.tensor([*fit.weights, fit.step_seconds], dtype=torch.float64)
    dist.broadcast(values, src=0)
    token, attention, overhead, step = (float(v) for v in values.tolist())
    return Calibration(
        token_weight=token,
        attention_weight=attention,
        microbatch_overhead=overhead,
        step_seconds=step,
        observations=fit.observations,
        relative_error=fit.relative_error,
        unidentified=fit.unidentified,
        extra=fit.extra,
    )


def _write(args: Any, fit: Calibration) -> None:
    directory = _output_dir(args)
    if directory is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    os.makedirs(directory, exist_ok=True)
    if fit.separable:
        with open(os.path.join(directory, CALIBRATION_YAML), "w", encoding="utf-8") as handle:
            handle.write(fit.to_yaml())
    payload = {**fit.to_dict(), "steps": [o.to_dict() for o in _state.observations]}
    with open(os.path.join(directory, CALIBRATION_JSON), "w", encoding="utf-8") as handle:
        json.dump(payload, handle)


#: Calibration shapes, by iteration number modulo their count: (budget divisor, whether the
#: planner sees a large per-micro-batch overhead, which makes it pack few full rows, and whether
#: it sees attention priced, which under row-wise attention makes those rows short).
_SHAPES = ((1, False, False), (1, True, True), (2, True, False), (4, False, False))
#: Attention kinds whose row costs its whole S^2 whatever it holds (planning/spec.py).
_ROW_WISE = ("dense", "causal")


def _vary_budget(args: Any, next_iteration: int) -> None:
    """Plan the next calibration step in one of four shapes, in turn.

    Steps of one configuration have much the same shape, so token work, per-micro-batch overhead
    and the per-step constant grow together and no fit can tell them apart. The shapes: the
    budget as configured; the budget with a large per-micro-batch overhead in the planner's model
    (few full micro-batches; where attention pays S^2 a row, with attention priced too, so they
    are several short rows, as fixed micro-batches run, not one row of the whole budget, which
    costs the local attention's dense mask 3-4x a step); half the budget with the large overhead
    (one long row each, so rows of two lengths are measured and attention is told apart from
    token work); a quarter of the budget (many short rows). Smaller
    budgets are always safe for memory, and never below ``--seq-length`` (the longest sample), so
    no sample becomes oversize. The shape follows the iteration number, so a run resumed before
    calibration ends plans as the straight run did; and only where every batch is one step (no
    ``--rollouts-per-step``), since a batch that spans steps is planned once and a resumed run
    re-plans it.
    """
    if getattr(args, "rollouts_per_step", None) is not None:
        return
    if _state.budget is None:
        from .arguments import dynbatch_config_from_args

        configured = dynbatch_config_from_args(args)
        _state.budget = configured.max_tokens_per_gpu
        _state.overhead = configured.cost_microbatch_overhead
        _state.attention_weight = configured.cost_attention_weight
    # Never below the longest sample (--seq-length), so no sample becomes oversize, and never
    # above the configured budget: a budget already below --seq-length (truncate / allow) stays as
    # it is, since a smaller one would cut, and so train, different tokens.
    floor = min(_state.budget, int(getattr(args, "seq_length", 1) or 1))
    divisor, heavy, short = _SHAPES[next_iteration % len(_SHAPES)]
    overrides = _state.overrides
    overrides["max_tokens_per_gpu"] = max(floor, _state.budget // divisor)
    overrides["cost_microbatch_overhead"] = float(_state.budget) if heavy else _state.overhead
    if short and _attention_kind(args) in _ROW_WISE:
        # A row's attention as costly as its tokens at the budget: the fewest micro-batches still
        # win (the overhead above), and among them the shortest rows.
        overrides["cost_attention_weight"] = 1.0 / _state.budget
    else:
        overrides["cost_attention_weight"] = _state.attention_weight


def _restore(args: Any) -> None:
    """The configured budget and overhead again (before a fit, if any, is applied)."""
    for name in ("max_tokens_per_gpu", "cost_microbatch_overhead", "cost_attention_weight"):
        _state.overrides.pop(name, None)


#: Calibration varies the budget down to a quarter, never below ``--seq-length``; below this ratio
#: of budget to ``--seq-length`` the quarter (and at 2x the half) collapses onto ``--seq-length``,
#: and the steps' token work varies too little to be told from the per-step constant: at
#: ``--max-tokens-per-gpu`` = 2 x ``--seq-length`` 8 calibration steps fit "0 us per token" and
#: changed nothing (issue 29). The run then skips calibration at once instead.
MIN_BUDGET_RATIO = 4


def why_not_calibrate(args: Any) -> Optional[str]:
    """Why this run's calibration shapes cannot separate the cost weights, or ``None``.

    Decided from the arguments alone (the same for a straight and a resumed run).
    """
    if getattr(args, "rollouts_per_step", None) is not None:
        return (
            "with --rollouts-per-step a batch spans several steps planned at once, so the "
            "calibration cannot vary the budget between steps, and steps of one shape cannot "
            "separate token work from per-micro-batch overhead"
        )
    budget = getattr(args, "max_tokens_per_gpu", None)
    if budget is None:  # given in the --dynamic-batch-config YAML only
        from .arguments import dynbatch_config_from_args

        budget = dynbatch_config_from_args(args).max_tokens_per_gpu
    budget = int(budget)
    seq_length = int(getattr(args, "seq_length", 1) or 1)
    if budget < MIN_BUDGET_RATIO * seq_length:
        return (
            f"--max-tokens-per-gpu {budget} is less than {MIN_BUDGET_RATIO} x --seq-length "
            f"{seq_length}, so the calibration's smaller budgets (half and a quarter of it, never "
            f"below --seq-length, the longest sample) collapse onto {max(seq_length, budget // 2)} "
            "and the steps' token work varies too little to be told from the per-step constant"
        )
    return None


def resume_calibration(args: Any) -> None:
    """On a run's first step, before it plans: reuse the fit a ``--load`` directory holds.

    Called by :func:`~.hooks.prepare_train_step` on every rank; after the first call it returns
    at once.
    """
    if not _state.resumed_checked:
        _state.resumed_checked = True
        _load_resumed(args)
        if _state.fit is None and _steps(args) > 0:
            _state.skipped = why_not_calibrate(args)
        if _state.skipped is not None:
            _log(
                f"dynamic-batch calibration skipped: {_state.skipped}; planning keeps the "
                "configured cost model (give --dynamic-batch-cost-* weights, e.g. from "
                "`megatron-dynbatch calibrate` on steps timed at budgets of 4x --seq-length and "
                "more, or pass --dynamic-batch-calibration-steps 0 to silence this)"
            )
        elif _state.fit is None and _steps(args) > 0:
            # The first step's budget too follows its iteration number (a resumed run's first
            # step then plans as the straight run's did).
            _vary_budget(args, int(getattr(args, "curr_iteration", 0) or 0) + 1)


def observe_train_step(args: Any, batch: Any, plan: Any, step_index: int) -> None:
    """Record the step just planned; time the previous one; fit once enough are measured.

    Called by :func:`~.hooks.prepare_train_step` on every rank after the step is materialized.
    """
    if _state.skipped is not None or (_state.fit is None and _steps(args) <= 0):
        return  # off or skipped: nothing to measure or show
    now = time.perf_counter()
    iteration = int(getattr(args, "curr_iteration", _state.steps_seen) or 0) + 1
    previous, previous_end = _state.pending, _state.last_end
    previous_iteration = _state.pending_iteration
    _state.last_end = now
    _state.steps_seen += 1
    shapes = _observation_of(batch, plan, step_index, args)
    _state.pending, _state.pending_iteration = shapes, iteration
    calibrating = _state.fit is None and _steps(args) > 0
    if calibrating:
        _vary_budget(args, iteration + 1)
    if not calibrating or previous is None or previous_end is None:
        return
    seconds = _agree_seconds(now - previous_end)  # every rank calls it: same count everywhere
    usable = (
        _state.steps_seen > WARMUP_STEPS + 1
        and iteration == previous_iteration + 1
        and not _interrupted(args, previous_iteration)
    )
    if usable:
        data = previous.to_dict()
        data["seconds"] = seconds
        _state.observations.append(Observation.from_dict(data))
    if len(_state.observations) < _steps(args):
        return
    fit = _agree_fit(fit_cost_model(_state.observations))
    _state.fit = fit
    _restore(args)  # the next batch plans under the configured budget again
    _write(args, fit)  # also when not applied: a resumed run must not calibrate again
    if fit.separable:
        _apply(args, fit)
        _log(fit.summary())
    else:
        # Planning with an arbitrary split of token work and overhead would be a guess: keep the
        # configured weights, and still show predicted against measured time.
        _log(
            fit.summary() + "; the steps measured had too similar shapes to separate token work "
            "from per-micro-batch overhead, so planning keeps the configured cost model (run "
            "`megatron-dynbatch calibrate` on steps of varied budgets to fit it)"
        )


def calibration_log_string() -> str:
    """Predicted against measured time of the last iteration (after calibration), for the line.

    ``measured`` is this rank's wall clock from the end of the step's planning to this call (the
    forward-backward pass and the optimizer step; Megatron's ``elapsed time per iteration`` adds
    its own planning).
    """
    if _state.fit is None or _state.pending is None or _state.last_end is None:
        return ""
    predicted = _state.fit.predict(_state.pending)
    measured = time.perf_counter() - _state.last_end
    return f" step time predicted/measured (ms): {predicted * 1e3:.1f}/{measured * 1e3:.1f} |"
