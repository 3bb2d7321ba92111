"""What the patched Megatron training loop calls when ``--use-dynamic-batch-size`` is on.

The patches in ``patches/`` keep Megatron's code paths unchanged with the flag off; with it on they
call :func:`configure` once after argument validation (the arguments become one
:class:`~megatron_dynbatch.config.DynBatchConfig`, held with everything else of the run in one
:class:`DynamicBatchHooks`), :func:`prepare` once per optimizer step (in ``train_step``) and once
per validation iteration (in ``evaluate``), and :func:`last_train_step`, :func:`dynamic_log_string`
and :func:`write_dynamic_scalars` (TensorBoard / W&B) when logging.

Contract of the data iterators (the ones Megatron passes to ``train_step`` and ``evaluate``):

* Every rank (all DP, TP, PP and CP ranks) gets an iterator, and every ``next()`` yields the same
  global batch on every rank: a :class:`~megatron_dynbatch.runtime.batches.RolloutBatch` (samples
  in memory) or a :class:`~megatron_dynbatch.runtime.batches.LazyRolloutBatch` (sample lengths plus a function loading one sample by index). Every
  rank plans the whole batch from the **lengths** alone with the pure planner (so agreement needs
  no data exchange) and then loads only the samples of **its own DP rank**: TP and CP peers of a
  DP rank load the same ones; pipeline stages that are neither first nor last load none (they need
  the micro-batch shapes and the attention layout, which lengths give, not tokens).
* What ``--global-batch-size`` means: the number of samples per optimizer step, or, with
  ``--rollouts-per-step`` (which must then equal it), the number of rollouts (samples sharing a
  rollout id, e.g. a GRPO group) per step. A batch holds exactly one step's worth, or with
  ``--rollouts-per-step`` a whole number of steps (served in order before the iterator is read
  again). Megatron sizes the run (``--train-iters`` / ``--train-samples``), the LR schedule,
  ``consumed_train_samples``, the logged batch size and the checkpoint's counters from
  ``--global-batch-size``; because every step trains exactly that many, they all count what was
  trained. A batch of another size stops every rank at once with an error naming the flag and the
  count seen. Validation batches hold ``--eval-global-batch-size`` (default: the global batch
  size) samples or rollouts, one forward-only pass each, planned under
  ``--log-probs-max-tokens-per-gpu``.
* After ``--load``, the iterator resumes where ``args.consumed_train_samples`` (in the same units)
  says, as Megatron's own samplers do; a multi-step batch interrupted by a checkpoint resumes with
  its remaining steps as a (shorter, still whole-step) batch.
* With virtual pipelining Megatron passes one iterator per model chunk; one batch is read from each
  (distinct) iterator so they stay aligned, and the first is used.

Every step's local work (reading the batch, the size check, planning, loading and materializing)
runs inside :func:`~megatron_dynbatch.mcore.agreement.step_agreement`: an error on one rank
becomes the same error on every rank, and ranks that planned differently raise
:class:`PlanMismatchError`, before any pipeline communication.

The ``forward_step_func`` then receives this rank's micro-batch dicts (see
:func:`megatron_dynbatch.runtime.materialize_microbatches`: ``tokens``, ``labels``, ``loss_mask``,
``position_ids``, ``segment_ids``, ``sample_index``, ``cu_seqlens`` and the schema's fields). What
each stage reads from them: the first stage ``tokens`` and ``position_ids``; the last stage
``labels``, ``loss_mask`` and the schema's fields; every stage the attention layout
(``segment_ids``, or ``cu_seqlens`` for THD). It must return the 3-tuple loss
(``--calculate-per-token-loss``) of :func:`megatron_dynbatch.runtime.microbatch_loss`.

Process groups come from the ``pg_collection`` Megatron passes to ``train_step`` (or the model's);
this integration layer is the only place that falls back to Megatron's global groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.core.utils import get_model_config

from megatron_dynbatch.config import DynBatchConfig
from megatron_dynbatch.errors import DynBatchRuntimeError, DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    VARIABLE_ROW_MULTIPLE,
    dynbatch_config_from_args,
    parallel_layout_from_args,
    validate_dynamic_batch_args,
    variable_seq_lengths,
)
from megatron_dynbatch.integrations.megatron_lm.calibration import Calibrator
from megatron_dynbatch.integrations.megatron_lm.data.documents import DocumentBatchStream
from megatron_dynbatch.integrations.megatron_lm.layout_checks import (
    check_model_layout,
    check_world_size,
)
from megatron_dynbatch.integrations.megatron_lm.memory import (
    SEQ_LENGTH_ROW,
    StepMemory,
    check_memory_budget,
    memory_model_from_args,
    resolve_budget,
)
from megatron_dynbatch.integrations.megatron_lm.plan_ahead import PlanAhead
from megatron_dynbatch.mcore.agreement import (
    step_agreement,
)
from megatron_dynbatch.mcore.schedule import check_schedule_config
from megatron_dynbatch.planning import ParallelLayout, Plan, PlannerConfig, SampleSet
from megatron_dynbatch.planning.memory import MIB, MemoryLimit, predicted_step_peaks, step_shapes
from megatron_dynbatch.planning.registry import run_planner
from megatron_dynbatch.runtime import materialize_microbatches
from megatron_dynbatch.runtime.batches import coerce_batch
from megatron_dynbatch.runtime.iterators import chunk_data_iterators
from megatron_dynbatch.runtime.placeholders import shape_only_sample

__all__ = [
    "DynamicBatchHooks",
    "DynamicStep",
    "StepKind",
    "configure",
    "current_hooks",
    "dynamic_log_string",
    "entry_check",
    "hooks_for",
    "last_train_step",
    "prepare",
    "prepare_eval_step",
    "prepare_forward_only_step",
    "prepare_train_step",
    "reset_dynamic_batch_state",
    "write_dynamic_scalars",
]

StepKind = Literal["train", "eval", "forward_only"]
"""What :func:`prepare` plans: the next optimizer step, one validation batch, or one given batch
as a forward-only pass (log-probs)."""


@dataclass(frozen=True)
class DynamicStep:
    """One planned forward(-backward) pass on this rank: what the schedule is called with."""

    num_microbatches: int
    """Micro-batches per DP rank this step (``num_microbatches`` of ``forward_backward_func``)."""
    seq_length: int
    """The step's row length (sizes the pipeline's p2p buffers); with ``--variable-seq-lengths``
    the longest row, each micro-batch's own shape being exchanged before its send."""
    micro_batch_size: int
    """Rows per micro-batch (packed: usually 1, more where attention pays S**2 a row)."""
    data_iterator: Any
    """A ``RerunDataIterator`` over :attr:`microbatches`, or one per model chunk (interleaving)."""
    microbatches: Tuple[Dict[str, torch.Tensor], ...]
    """This rank's micro-batch dicts in schedule order (placeholders included)."""
    sample_indices: Tuple[int, ...]
    """This rank's samples (indices into the batch) in schedule order."""
    num_samples: int
    """Samples of the step over all DP ranks."""
    num_rollouts: int
    """Rollouts of the step."""
    real_tokens: int
    """Unpadded tokens of the step over all DP ranks."""
    computed_tokens: int
    """Tokens the step computes over all DP ranks: ``dp * num_microbatches * B * S``."""
    step_index: int
    """Index of the step within its batch's plan."""
    plan_fingerprint: str
    """The plan's fingerprint, equal on every rank."""
    loaded_samples: int
    """Samples this rank read from the batch (0 on middle pipeline stages)."""
    truncated_tokens: int = 0
    """Tokens cut from oversize samples (``--oversize-samples truncate``), never trained."""
    num_placeholders: int = 0
    """Placeholder micro-batches of the step over all DP ranks (no samples, zero loss weight)."""
    dp_size: int = 1
    """Data-parallel ranks the step was planned over."""
    dp_imbalance: float = 1.0
    """max / mean over DP ranks of the step's computed cost (1.0: balanced)."""
    planning_seconds: float = 0.0
    """Wall time this step spent planning the batch it came from (0.0 for the later steps of a
    batch; with the plan made ahead, the time it waited for that plan)."""
    planned_ahead: bool = False
    """Whether the batch was planned while the step before it trained
    (``--dynamic-batch-plan-ahead``)."""


@dataclass
class _Cursor:
    """A batch whose plan still has steps to serve."""

    batch: Any
    plan: Plan
    planning_seconds: float
    next_step: int = 0
    planned_ahead: bool = False


@dataclass
class _Totals:
    """Counters since the last :func:`dynamic_log_string`."""

    steps: int = 0
    samples: int = 0
    real_tokens: int = 0
    computed_tokens: int = 0
    truncated_tokens: int = 0
    prepare_seconds: float = 0.0
    batches: int = 0
    batches_planned_ahead: int = 0


class DynamicBatchHooks:
    """One run's dynamic-batching state: its config, planner configs, training progress and
    calibration.

    Built once per run from the validated arguments (:func:`configure`); nothing is written back
    into the argument namespace. The calibration (:attr:`calibration`, a
    :class:`~.calibration.Calibrator`) is this object's own: two hooks objects in one process
    never share it, and its varied budgets and fit reach the planner through the config it
    returns, not through ``args``. The planner configs come from
    :meth:`DynBatchConfig.planner_config`, once per parallel layout (the layout is the one the
    schedule runs: DP size from the process group, VPP from the model chunks).
    """

    def __init__(self, args: Any, config: DynBatchConfig) -> None:
        self.args = args
        self.config = config
        self._planners: Dict[Tuple[ParallelLayout, bool], PlannerConfig] = {}
        self.cursor: Optional[_Cursor] = None
        self.last_step: Optional[DynamicStep] = None
        self.totals = _Totals()
        self.calibration = Calibrator(config)
        self.memory = _step_memory(args, config)
        self._variable_rows: Optional[bool] = None
        # --[no-]dynamic-batch-plan-ahead (None: on for the launch script's own data only,
        # _fixed_order): the next batch, read and being planned.
        self._plan_ahead: Optional[bool] = getattr(args, "dynamic_batch_plan_ahead", None)
        self._ahead: Optional[PlanAhead] = None

    @property
    def variable_rows(self) -> bool:
        """Every micro-batch its own row, shapes exchanged: ``--[no-]variable-seq-lengths``, by
        default on with NCCL (:func:`.arguments.variable_seq_lengths`)."""
        if self._variable_rows is None:
            backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
            self._variable_rows = variable_seq_lengths(self.args, backend, self.config.layout)
        return self._variable_rows

    def planner(self, layout: ParallelLayout, *, forward_only: bool) -> PlannerConfig:
        """The planner config of ``layout`` (training, or forward-only under the log-prob budget)."""
        # Forward-only passes keep no activations for a backward: the training bound is safe.
        limit = None if self.memory is None else self.memory.limit()
        config = self._calibrated(forward_only, limit)
        key = (layout, forward_only, config, limit)
        if limit is not None and key not in self._planners:
            # The memory model changes with every measured step: keep only the current one's.
            self._planners = {k: v for k, v in self._planners.items() if k[3] == limit}
        if key not in self._planners:
            self._planners[key] = config.planner_config(
                layout,
                forward_only=forward_only,
                row_multiple=VARIABLE_ROW_MULTIPLE if self.variable_rows else None,
                memory=limit,
            )
        return self._planners[key]

    def _calibrated(
        self, forward_only: bool, limit: Optional[MemoryLimit] = None
    ) -> DynBatchConfig:
        """The run's config with what calibration has changed so far (its state, not ``args``)."""
        return self.calibration.calibrated_config(self.config, forward_only=forward_only)

    def _plan(self, batch: Any, layout: ParallelLayout, forward_only: bool) -> Tuple[Plan, float]:
        config = self.planner(layout, forward_only=forward_only)
        start = time.perf_counter()
        samples = SampleSet.build(batch.lengths(), batch.rollout_ids, batch.prompt_lengths())
        plan = run_planner(samples, config)
        return plan, time.perf_counter() - start

    def prepare(
        self,
        kind: StepKind,
        source: Any,
        model: Any,
        *,
        pg_collection: Any = None,
        check_group: Any = None,
    ) -> DynamicStep:
        """See :func:`prepare`."""
        if kind not in ("train", "eval", "forward_only"):
            raise DynBatchValueError(
                f"prepare(kind={kind!r}): kind must be 'train', 'eval' or 'forward_only'."
            )
        if kind != "train":
            return self._prepare(kind, source, model, pg_collection, check_group)
        # Reading and building the step's micro-batches is the step's data time: Megatron's
        # ``batch-generator`` timer (--timing-log-level 2), which the forward steps, reading
        # micro-batches already built, would otherwise show as about nothing.
        with _megatron_timer("batch-generator", log_level=2):
            return self._prepare(kind, source, model, pg_collection, check_group)

    def _prepare(
        self, kind: StepKind, source: Any, model: Any, pg_collection: Any, check_group: Any
    ) -> DynamicStep:
        started = time.perf_counter()
        model_chunks = _as_chunks(model)
        dp_group, pp_group = _groups(model_chunks, pg_collection)
        if kind == "train":
            self.calibration.resume(self.args)  # before planning: a resumed run plans with its fit
            if self.memory is not None:
                # Every rank: the last step's measured peaks, gathered and fitted, before planning.
                self.memory.before_plan(dist.get_rank(pp_group), check_group or dist.group.WORLD)
        elif self.memory is not None:
            self.memory.pause()  # an evaluation's peak is not the training step's
        with step_agreement(check_group or dist.group.WORLD, what=self._what(kind)) as agreement:
            if self.variable_rows:
                # Megatron-LM's validate_args resets args.variable_seq_lengths; the schedule's p2p
                # reads the model config's at every call. Checked (interleaving at pp 2) as on.
                _exchange_shapes(model_chunks, True)
            layout = _parallel_layout(self.args, model_chunks, dp_group)
            if kind == "train":
                cursor = self._train_cursor(source, layout)
                step_index, plan = cursor.next_step, cursor.plan
                batch, seconds = cursor.batch, cursor.planning_seconds
            else:
                if self._ahead is not None:
                    self._ahead.wait()  # one planner at a time (its replay caches are shared)
                if kind == "eval":
                    batch = _next_batch(source, "validation")
                    eval_batch = self.args.eval_global_batch_size or self.args.global_batch_size
                    _check_batch_size(
                        batch, eval_batch, "--eval-global-batch-size", self._by_rollouts, False
                    )
                else:
                    batch = coerce_batch(source)
                plan, seconds = self._plan(batch, layout, forward_only=True)
                assert len(plan.steps) == 1, "a forward-only plan has one step"
                step_index = 0
            agreement.fingerprint = plan.fingerprint()
            if self.variable_rows:
                # Shapes are exchanged only for a step whose rows differ: the planner ran uniform
                # rows where the exchange's cost made them faster (every rank planned the same).
                _exchange_shapes(model_chunks, bool(plan.steps[step_index].row_lengths))
            step = _materialize(batch, plan, step_index, dp_group, pp_group, model_chunks, seconds)
            if kind == "train" and self.cursor.planned_ahead:
                step = dataclasses.replace(step, planned_ahead=True)
        if kind == "train":
            _count_real_lengths(batch, plan.steps[step_index].kept_lengths, step.sample_indices)
            self._record(step)
            # Outside the agreement: it may all-reduce the last step's time (every rank gets here).
            self.calibration.observe_train_step(self.args, batch, plan, step_index)
            if self.memory is not None:
                # Also every rank: gathers the last step's measured peaks, then resets the peak.
                planned = plan.steps[step_index]
                shapes = step_shapes(
                    planned.num_microbatches,
                    planned.micro_batch_size,
                    planned.seq_length,
                    planned.row_lengths,
                    layout.dp_size,
                )
                iteration = getattr(self.args, "curr_iteration", None)
                self.memory.begin(
                    iteration + 1 if isinstance(iteration, int) else None,
                    predicted_step_peaks(self.memory.current, shapes),
                    shapes,
                )
            if self._reads_ahead(source) and self.cursor.next_step >= len(self.cursor.plan.steps):
                # The batch is served: read the next one and plan it while this step trains.
                self._ahead = self._read_ahead(source, layout)
            # Host work before the step's first micro-batch (the GPU waits for it): planning,
            # reading and building the rank's micro-batches, the agreement and the measurements.
            self.totals.prepare_seconds += time.perf_counter() - started
        return step

    @property
    def _by_rollouts(self) -> bool:
        return self.config.rollouts_per_step is not None

    def _what(self, kind: StepKind) -> str:
        if kind == "eval":
            return "validation"
        if kind == "forward_only":
            return "forward-only pass"
        iteration = getattr(self.args, "curr_iteration", None)
        return f"training iteration {iteration + 1}" if isinstance(iteration, int) else "training"

    def _train_cursor(self, data_iterator: Any, layout: ParallelLayout) -> _Cursor:
        if self.cursor is None or self.cursor.next_step >= len(self.cursor.plan.steps):
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                # Kept only under the config this step plans with (calibration or the memory
                # model may have changed since): the plan the line below would make.
                batch, plan, seconds, planned_ahead = ahead.take(
                    self.planner(layout, forward_only=False),
                    lambda batch: self._plan(batch, layout, forward_only=False),
                )
            else:
                batch = self._train_batch(data_iterator)
                plan, seconds = self._plan(batch, layout, forward_only=False)
                planned_ahead = False
            self.cursor = _Cursor(
                batch=batch, plan=plan, planning_seconds=seconds, planned_ahead=planned_ahead
            )
            self.totals.batches += 1
            self.totals.batches_planned_ahead += planned_ahead
        return self.cursor

    def _train_batch(self, data_iterator: Any) -> Any:
        batch = _next_batch(data_iterator, "training")
        _check_batch_size(
            batch,
            self.args.global_batch_size,
            "--global-batch-size",
            self._by_rollouts,
            self._by_rollouts,
        )
        return batch

    def _reads_ahead(self, data_iterator: Any) -> bool:
        """``--dynamic-batch-plan-ahead`` as given, else (the default) whether the training
        batches come from the launch script's own data (:func:`_fixed_order`)."""
        if self._plan_ahead is None:
            self._plan_ahead = _fixed_order(data_iterator)
        return self._plan_ahead

    def _read_ahead(self, data_iterator: Any, layout: ParallelLayout) -> PlanAhead:
        """The next training batch, being planned under this step's config; a failure to read it
        is raised by the step that needs it (inside that step's agreement, as it was before)."""
        try:
            batch = self._train_batch(data_iterator)
            config = self.planner(layout, forward_only=False)
        except Exception as error:
            return PlanAhead.failed(error)
        return PlanAhead(batch, config)

    def _record(self, step: DynamicStep) -> None:
        self.cursor.next_step += 1
        self.cursor.planning_seconds = 0.0  # counted once, with the batch's first step
        self.last_step = step
        self.totals.steps += 1
        self.totals.samples += step.num_samples
        self.totals.real_tokens += step.real_tokens
        self.totals.computed_tokens += step.computed_tokens
        self.totals.truncated_tokens += step.truncated_tokens

    def log_string(self) -> str:
        """See :func:`dynamic_log_string`."""
        # A collective (every rank builds Megatron's iteration line): before any early return.
        memory = "" if self.memory is None else self.memory.log_string(dist.group.WORLD)
        totals, self.totals = self.totals, _Totals()
        if self.last_step is None or totals.steps == 0:
            return ""
        step = self.last_step
        fill = totals.real_tokens / totals.computed_tokens if totals.computed_tokens else 0.0
        line = (
            f" micro-batches/rank: {step.num_microbatches} [{step.micro_batch_size}x"
            f"{step.seq_length}] | real tokens: {totals.real_tokens} | computed tokens: "
            f"{totals.computed_tokens} | fill: {fill:.3f} | host prep (ms): "
            f"{totals.prepare_seconds / totals.steps * 1e3:.1f} |"
        )
        if self._plan_ahead and totals.batches:  # None (not yet known) only before a step
            line += f" planned ahead: {totals.batches_planned_ahead}/{totals.batches} |"
        if totals.truncated_tokens:
            line += f" truncated tokens: {totals.truncated_tokens} |"
        line += self.calibration.log_string()
        if self.memory is not None:
            line += memory
        return line

    def scalars(self) -> Dict[str, float]:
        """The last training step's figures, by TensorBoard tag."""
        step = self.last_step
        if step is None:
            return {}
        return {
            "dynbatch/micro-batches per rank": float(step.num_microbatches),
            "dynbatch/row length": float(step.seq_length),
            "dynbatch/real tokens": float(step.real_tokens),
            "dynbatch/computed tokens": float(step.computed_tokens),
            "dynbatch/fill": (
                step.real_tokens / step.computed_tokens if step.computed_tokens else 0.0
            ),
            "dynbatch/dp imbalance": float(step.dp_imbalance),
            "dynbatch/placeholders": float(step.num_placeholders),
            "dynbatch/truncated tokens": float(step.truncated_tokens),
            "dynbatch/planning seconds": float(step.planning_seconds),
            "dynbatch/planned ahead": float(step.planned_ahead),
            **self.calibration.scalars(),
        }


_hooks: Optional[DynamicBatchHooks] = None
"""The run's state: set by :func:`configure` (argument validation), read by every hook."""

_entry_check: Optional[Callable[[Any], None]] = None
"""The parsing entry's own start-up check (:func:`entry_check`), or ``None``."""


@contextlib.contextmanager
def entry_check(check: Callable[[Any], None]) -> Iterator[None]:
    """Run ``check(args)`` in :func:`configure` while the block parses Megatron's arguments.

    For the checks of an entry (``launch/pretrain_gpt_dynbatch.py``'s core attention, a launch
    without torchrun) that read only flags: :func:`configure` runs before Megatron's
    ``validate_args`` prints every argument (patch 0001), so their refusal is one line too, not
    one after an ~850-line argument dump. Run after our own checks and the memory model (a
    one-process launch meets those first), before :func:`~.layout_checks.check_world_size`.
    Other hosts that register our flags run no such check.
    """
    global _entry_check
    previous, _entry_check = _entry_check, check
    try:
        yield
    finally:
        _entry_check = previous


def configure(args: Any) -> Optional[DynamicBatchHooks]:
    """Check the dynamic-batching flags and build the run's state (patch 0001, after validation).

    Returns:
        The run's :class:`DynamicBatchHooks`, or ``None`` when ``--use-dynamic-batch-size`` is off
        (its flags are then refused by :func:`validate_dynamic_batch_args`).
    """
    global _hooks
    # Megatron's own layout asserts, with flags and fixes (issue 44); layers and positions first,
    # as the memory model below reads them.
    check_model_layout(args)
    config = validate_dynamic_batch_args(args)
    _hooks = None if config is None else DynamicBatchHooks(args, config)
    if _entry_check is not None:
        _entry_check(args)
    # Last: the other refusals are found in one process too (a launch without torchrun).
    check_world_size(args)
    if _hooks is not None:
        _say_microbatches_are_planned()
    return _hooks


class _PlannedMicrobatchCount(logging.Filter):
    """Megatron's "setting number of microbatches to constant N" is not what runs: say so."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _hooks is not None and str(record.msg).startswith(_CONSTANT_COUNT):
            record.msg = (
                f"{record.getMessage()} (Megatron's count for global batch / micro-batch size / "
                "dp; not used: --use-dynamic-batch-size plans the micro-batches of every step)"
            )
            record.args = None
        return True


_CONSTANT_COUNT = "setting number of microbatches to constant"
_COUNT_FILTER = _PlannedMicrobatchCount()


def _planned_count_logger() -> logging.Logger:
    return logging.getLogger("megatron.core.num_microbatches_calculator")


def _say_microbatches_are_planned() -> None:
    logger = _planned_count_logger()
    if _COUNT_FILTER not in logger.filters:
        logger.addFilter(_COUNT_FILTER)


def hooks_for(args: Any) -> DynamicBatchHooks:
    """The state of the run ``args`` belongs to: the configured one, else built once from ``args``.

    The fallback serves callers that drive the hooks without Megatron's patched argument
    validation (tests, custom loops); it resolves the same config :func:`configure` would.
    """
    global _hooks
    if _hooks is None or _hooks.args is not args:
        _hooks = DynamicBatchHooks(args, dynbatch_config_from_args(args))
    return _hooks


def current_hooks() -> Optional[DynamicBatchHooks]:
    """The configured run's state, or ``None``."""
    return _hooks


def reset_dynamic_batch_state() -> None:
    """Forget the run's state: the partly consumed batch, the last step, the log counters and the
    calibration (all held by the hooks object)."""
    global _hooks
    _hooks = None


def prepare(
    args: Any,
    source: Any,
    model: Any,
    *,
    kind: StepKind = "train",
    pg_collection: Any = None,
    check_group: Any = None,
) -> DynamicStep:
    """Plan (when needed) and materialize this rank's micro-batches of one pass.

    ``kind="train"`` (``train_step``): the next optimizer step of the training iterator
    ``source``; a batch of several steps is served over several calls. ``kind="eval"``
    (``evaluate``): one validation batch of ``source``, ``--eval-global-batch-size`` samples
    (rollouts), planned as one forward-only pass under ``--log-probs-max-tokens-per-gpu``.
    ``kind="forward_only"``: the batch ``source`` itself as one forward-only pass (e.g. log-probs
    of a rollout batch; ``--rollouts-per-step`` only splits optimizer steps). Evaluation and
    forward-only passes leave the training state (:func:`last_train_step`, a partly served batch,
    the log counters) alone. Run the schedule with the returned count, shapes and iterator
    (``forward_only=True`` for the last two kinds); the last stage's outputs come back in
    ``microbatches`` order, and :func:`megatron_dynbatch.runtime.split_outputs` /
    ``restore_order`` map them to samples.

    Args:
        args: Megatron's arguments (validated; see :func:`configure`).
        source: The data iterator (or one per model chunk) for ``train`` / ``eval``; the batch
            for ``forward_only``.
        model: The model chunks (a list, as in ``train_step``) or one module.
        kind: Which pass, see above.
        pg_collection: The ``ProcessGroupCollection`` of ``train_step`` / ``evaluate``; ``None``
            uses the model's, then Megatron's global groups.
        check_group: Group over which ranks agree; default the whole world (pipeline stages must
            agree on the shapes too, not only DP ranks).

    Returns:
        The :class:`DynamicStep` to pass to ``forward_backward_func``.

    Raises:
        StepAgreementError: On every rank, when any rank failed (a batch of the wrong size, a bad
            sample, an exhausted iterator), naming the ranks and the reason.
        PlanMismatchError: On every rank, when any rank planned a different schedule.
    """
    return hooks_for(args).prepare(
        kind, source, model, pg_collection=pg_collection, check_group=check_group
    )


def prepare_train_step(args: Any, data_iterator: Any, model: Any, **groups: Any) -> DynamicStep:
    """:func:`prepare` with ``kind="train"``."""
    return prepare(args, data_iterator, model, kind="train", **groups)


def prepare_eval_step(args: Any, data_iterator: Any, model: Any, **groups: Any) -> DynamicStep:
    """:func:`prepare` with ``kind="eval"``."""
    return prepare(args, data_iterator, model, kind="eval", **groups)


def prepare_forward_only_step(args: Any, batch: Any, model: Any, **groups: Any) -> DynamicStep:
    """:func:`prepare` with ``kind="forward_only"``."""
    return prepare(args, batch, model, kind="forward_only", **groups)


def _configured() -> DynamicBatchHooks:
    if _hooks is None or _hooks.last_step is None:
        raise DynBatchRuntimeError(
            "no dynamic-batch step has run yet: the patched train loop reads it after train_step; "
            "is megatron_dynbatch's train_step patch applied (see patches/README.md)?"
        )
    return _hooks


def last_train_step() -> DynamicStep:
    """The step the last ``prepare(kind="train")`` planned (read by the patched loop after it)."""
    return _configured().last_step


def loss_logging_microbatches(step: DynamicStep) -> float:
    """What Megatron's MoE, MTP and indexer loss logs divide their per-micro-batch sums by (the
    patched ``training_log``): the real micro-batches a DP rank ran, on average over the ranks
    (the logs are averaged over DP). A placeholder records no loss (its tokens are padding), so
    counting it read each logged loss at about half with one placeholder in two (a probe)."""
    return step.num_microbatches - step.num_placeholders / step.dp_size


def dynamic_log_string() -> str:
    """The dynamic-batching part of Megatron's iteration line, over the steps since the last call.

    ``micro-batches`` is the last step's per-rank count and row shape ``[B x S]``; ``real`` and
    ``computed tokens`` and ``fill`` (their ratio) sum all steps since the previous line, and so
    does ``truncated tokens`` (shown when ``--oversize-samples truncate`` cut any). ``planned
    ahead: k/n``: of the n batches planned since the previous line, k were planned while the step
    before them trained (``--dynamic-batch-plan-ahead``; not shown with it off).
    """
    return "" if _hooks is None else _hooks.log_string()


def write_dynamic_scalars(iteration: int, writer: Any = None, wandb_writer: Any = None) -> None:
    """Write the last training step's figures to Megatron's TensorBoard and W&B writers.

    Called by the patched ``training_log`` where Megatron writes its own scalars (every
    ``--tensorboard-log-interval`` iterations, on the rank that holds the writers). Tags:
    ``dynbatch/micro-batches per rank``, ``row length``, ``real tokens``, ``computed tokens``,
    ``fill``, ``dp imbalance`` (computed cost, max / mean over DP ranks), ``placeholders``,
    ``truncated tokens``, ``planning seconds`` (what the step waited for its plan) and ``planned
    ahead`` (1 where its batch was planned while the step before it trained); after calibration also ``step time predicted
    (ms)``, ``step time measured (ms)`` (the iteration line's figures) and ``calibration error``
    (the fit's median relative error). ``peak memory
    predicted (MiB)`` and ``peak memory measured (MiB)`` (and each per pipeline stage) follow at
    the same iteration once the step's peak is read, with the iteration line or the next plan.
    """
    if _hooks is not None and _hooks.memory is not None and (writer or wandb_writer):
        # The step's peak is read (a collective) after this, with the iteration line: its
        # scalars follow then, at this iteration.
        _hooks.memory.writers = (writer, wandb_writer, iteration)
    scalars = {} if _hooks is None else _hooks.scalars()
    if not scalars:
        return
    if writer is not None:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)


def _step_memory(args: Any, config: DynBatchConfig) -> Optional[StepMemory]:
    """The run's memory model, budget and measurements; ``None`` where the model cannot be built
    from the arguments and no budget asks for it (measuring is then skipped, planning is not).

    Raises:
        DynBatchValueError: A budget that one ``--seq-length`` sample cannot fit (start-up).
    """
    from megatron_dynbatch.config import FLAGS

    parallel = parallel_layout_from_args(args)
    try:
        model = memory_model_from_args(args, parallel, config.cost_attention or "segment")
    except (ValueError, TypeError, AttributeError):
        if config.max_memory_gib is not None:
            raise
        return None
    budget = None
    if config.max_memory_gib is not None:
        budget, source = resolve_budget(config.max_memory_gib)
        if int(os.environ.get("RANK", "0") or 0) == 0:
            # Once, at start-up (before the process group exists: torchrun's RANK says who).
            print(
                f"dynamic batching: memory budget {budget / MIB:.0f} MiB per GPU ({source})",
                flush=True,
            )
    # With --variable-seq-lengths rows are multiples of VARIABLE_ROW_MULTIPLE: so are the caps.
    row_multiple = parallel.sample_multiple
    # (The process group does not exist yet: Megatron's --distributed-backend says what it will be.)
    if variable_seq_lengths(args, getattr(args, "distributed_backend", None), config.layout):
        row_multiple = math.lcm(row_multiple, VARIABLE_ROW_MULTIPLE)
    longest, name = int(getattr(args, "seq_length", None) or 1), SEQ_LENGTH_ROW
    # Under --oversize-samples truncate samples are cut to the token budget, so no row is
    # longer: a budget is checked, and the probe step planned, at that row (a probe's
    # --max-memory-gib was refused for --seq-length 2048 rows the run could never hold).
    cut = config.truncation(parallel, longest)
    if cut is not None:
        longest, name = cut
    memory = StepMemory(
        model=model,
        budget=budget,
        row_multiple=row_multiple,
        min_row=longest,
        min_row_name=name,
        # On CPU the peak is the resident set, which keeps what the heap freed (StepMemory).
        resident=not torch.cuda.is_available(),
    )
    if budget is not None:
        # The first step's arithmetic (its model and rows): a budget this passes trains.
        limit = MemoryLimit(model=memory.current, budget_bytes=budget, row_multiple=row_multiple)
        check_memory_budget(limit, longest, FLAGS["max_memory_gib"], name)
    return memory


def _exchange_shapes(model_chunks: List[torch.nn.Module], on: bool) -> None:
    """Whether megatron.core's p2p exchanges each micro-batch's shape before sending it."""
    for chunk in model_chunks:
        get_model_config(chunk).variable_seq_lengths = on


def _as_chunks(model: Any) -> List[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _model_pg_collection(chunk: torch.nn.Module) -> Any:
    """The ``pg_collection`` of a (DDP / Float16Module wrapped) model chunk, or ``None``."""
    while chunk is not None:
        if getattr(chunk, "pg_collection", None) is not None:
            return chunk.pg_collection
        chunk = getattr(chunk, "module", None)
    return None


def _groups(model_chunks: List[torch.nn.Module], pg_collection: Any) -> Tuple[Any, Any]:
    """The data-parallel and pipeline groups: from ``pg_collection``, the model's, or Megatron's."""
    found = {}
    for name in ("dp", "pp"):
        for candidate in (pg_collection, _model_pg_collection(model_chunks[0])):
            if getattr(candidate, name, None) is not None:
                found[name] = getattr(candidate, name)
                break
        else:
            found[name] = getattr(
                ProcessGroupCollection.use_mpu_process_groups(required_pgs=[name]), name
            )
    return found["dp"], found["pp"]


def _count_real_lengths(
    batch: Any, kept_lengths: Tuple[Tuple[int, int], ...], own: Tuple[int, ...]
) -> None:
    """Give Megatron's FLOPs count (``--log-throughput``, ``num_floating_point_operations_so_far``
    in checkpoints) the real lengths of this rank's samples ``own`` of the step.

    Megatron 0.19's train loop counts every sample of a step as ``--seq-length`` tokens with a
    full ``seq_length**2`` of attention unless the step reported its real lengths through
    ``update_seqlen_stats_from_cu_seqlens`` (its THD path does; ours had not: a probe read 1.3-2x
    the TFLOP/s of the tokens trained, the same count whatever the step held). Every rank of a DP
    rank's model-parallel group reports the same lengths, as that function expects (it sums over
    the world and divides by tp x cp x pp); a rank of placeholders only reports nothing, but
    reports, or it would skip the sum the others enter. Lengths as trained: a truncated sample's
    kept tokens; placeholders count nothing. Only inside Megatron's train loop (its module
    imported): a trainer of its own that calls :func:`prepare` has no such count to feed.
    """
    training = sys.modules.get("megatron.training.training")
    update_seqlen_stats_from_cu_seqlens = getattr(
        training, "update_seqlen_stats_from_cu_seqlens", None
    )
    if update_seqlen_stats_from_cu_seqlens is None:  # not Megatron's loop, or a Megatron without it
        return
    lengths, kept = batch.lengths(), dict(kept_lengths)
    trained = [int(kept.get(i, lengths[i])) for i in own] or [0]
    cumulative = [0, *itertools.accumulate(trained)]
    update_seqlen_stats_from_cu_seqlens(torch.tensor(cumulative, dtype=torch.int64))


def _reads_tokens(pp_group: Any) -> bool:
    """First and last pipeline stages read sample tokens; middle stages only need lengths."""
    size = dist.get_world_size(pp_group)
    rank = dist.get_rank(pp_group)
    return rank == 0 or rank == size - 1


def _materialize(
    batch: Any,
    plan: Plan,
    step_index: int,
    dp_group: Any,
    pp_group: Any,
    model_chunks: List[torch.nn.Module],
    planning_seconds: float = 0.0,
) -> DynamicStep:
    step = plan.steps[step_index]
    dp_rank = dist.get_rank(dp_group)
    own = step.rank_microbatches(dp_rank)
    indices = tuple(i for microbatch in own for i in microbatch)
    if _reads_tokens(pp_group):
        samples = batch.load(indices)
        loaded = len(indices)
    else:
        lengths = batch.lengths()
        samples = {i: shape_only_sample(lengths[i], batch.schema) for i in indices}
        loaded = 0
    microbatches = materialize_microbatches(
        step,
        dp_rank,
        samples,
        batch.schema,
        layout=plan.layout,
        sample_multiple=plan.sample_multiple,
    )
    # RerunDataIterator: Megatron's rerun state machine (on by default) asserts it and replays
    # the step from it; the interleaved schedule reads one iterator per model chunk.
    data_iterator = chunk_data_iterators(microbatches, len(model_chunks), wrap=RerunDataIterator)
    dp_size = dist.get_world_size(dp_group)
    return DynamicStep(
        num_microbatches=step.num_microbatches,
        seq_length=step.seq_length,
        micro_batch_size=step.micro_batch_size,
        data_iterator=data_iterator,
        microbatches=tuple(microbatches),
        sample_indices=indices,
        num_samples=len(step.sample_indices()),
        num_rollouts=step.num_rollouts,
        real_tokens=step.real_tokens,
        computed_tokens=(
            sum(map(sum, step.row_lengths))
            if step.row_lengths
            else dp_size * step.num_microbatches * step.micro_batch_size * step.seq_length
        ),
        step_index=step_index,
        plan_fingerprint=plan.fingerprint(),
        loaded_samples=loaded,
        truncated_tokens=step.truncated_tokens,
        num_placeholders=step.num_placeholders,
        dp_size=dp_size,
        dp_imbalance=step.dp_imbalance_computed,
        planning_seconds=planning_seconds,
    )


def _parallel_layout(args: Any, model_chunks: List[torch.nn.Module], dp_group) -> ParallelLayout:
    """The layout the schedule will run: DP size from the group, VPP from the model chunks."""
    if len(model_chunks) > 1 or hasattr(model_chunks[0], "config"):
        check_schedule_config(get_model_config(model_chunks[0]))
    layout = parallel_layout_from_args(
        args, dp_size=dist.get_world_size(dp_group), vpp_size=len(model_chunks)
    )
    if layout.vpp_size > 1:
        # Plan for the interleaving group the schedule will use: the model config's (Megatron
        # defaults it to pp_size in ModelParallelConfig).
        group = get_model_config(model_chunks[0]).microbatch_group_size_per_vp_stage
        layout = dataclasses.replace(layout, microbatch_group_size_per_vp_stage=group)
    return layout


def _distinct_iterators(data_iterator: Any) -> List[Any]:
    """The iterator, or the distinct ones of a list (one per model chunk), without ``None``."""
    candidates = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    iterators, seen = [], set()
    for iterator in candidates:
        if iterator is not None and id(iterator) not in seen:
            seen.add(id(iterator))
            iterators.append(iterator)
    return iterators


def _next_batch(data_iterator: Any, what: str) -> Any:
    iterators = _distinct_iterators(data_iterator)
    if not iterators:
        raise DynBatchValueError(
            f"this rank's {what} data iterator is None; with --use-dynamic-batch-size every rank "
            "(every TP, PP and CP rank too) must get an iterator yielding the global batch, e.g. "
            "build it on all ranks (mark the dataset provider is_distributed=True)."
        )
    batches = []
    for iterator in iterators:
        rerun = isinstance(iterator, RerunDataIterator)
        if rerun:
            iterator.advance()
        try:
            batches.append(next(iterator))
        except StopIteration:
            raise DynBatchValueError(
                f"the {what} data iterator is exhausted: it must yield a batch for every "
                "iteration Megatron runs (--train-iters / --train-samples, --eval-iters)."
            ) from None
        if rerun:
            # Its replay buffer stays empty. The rerun state machine replays the step's
            # materialized micro-batches (their own RerunDataIterators), never this one, so the
            # buffer would only grow by a batch a step, and a rerun checkpoint (torch_dist)
            # would pickle the batch: a lazy batch's loader is a closure over the whole split, and
            # the probe's checkpoint failed on it. A run resumed from that checkpoint reads the
            # same batch again from its consumed samples, as Megatron's samplers do.
            iterator.advance()
    return coerce_batch(batches[0])


@contextlib.contextmanager
def _megatron_timer(name: str, log_level: int) -> Iterator[None]:
    """Megatron's timer ``name`` around the block, where Megatron's timers exist (the training
    entry; not a loop that drives the hooks without ``initialize_megatron``)."""
    timers = getattr(sys.modules.get("megatron.training.global_vars"), "_GLOBAL_TIMERS", None)
    if timers is None:
        yield
        return
    timer = timers(name, log_level=log_level)  # a stand-in above --timing-log-level
    timer.start()
    try:
        yield
    finally:
        timer.stop()


def _fixed_order(data_iterator: Any) -> bool:
    """Whether every training iterator is the launch script's own document stream (documents,
    blends, conversations), whose batches are fixed by position: reading one a step early changes
    nothing. A host's own iterator may make its next batch from the model being trained (on-policy
    rollouts), which must not be read before the step that trains the model runs."""
    iterators = _distinct_iterators(data_iterator)
    return bool(iterators) and all(
        isinstance(
            iterator.iterable if isinstance(iterator, RerunDataIterator) else iterator,
            DocumentBatchStream,
        )
        for iterator in iterators
    )


def _count_units(batch: Any, by_rollouts: bool) -> int:
    if not by_rollouts or batch.rollout_ids is None:
        return len(batch)
    return len(set(batch.rollout_ids))


def _check_batch_size(batch: Any, per_step: int, flag: str, by_rollouts: bool, whole: bool) -> None:
    """Every step trains exactly ``per_step`` samples (rollouts), the count Megatron assumes."""
    units = _count_units(batch, by_rollouts)
    what = "rollouts" if by_rollouts else "samples"
    if units == per_step or (whole and units > 0 and units % per_step == 0):
        return
    expected = f"{per_step}" if not whole else f"a multiple of {per_step}"
    raise DynBatchValueError(
        f"the data iterator yielded a batch of {units} {what}, but {flag} is {per_step}: with "
        f"--use-dynamic-batch-size every optimizer step trains exactly {flag} {what} (Megatron "
        f"sizes the run, the learning-rate schedule and consumed samples from it), so a batch "
        f"must hold {expected} {what}. Yield batches of that size, or set {flag} {units}."
    )
