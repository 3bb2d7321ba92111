"""What the patched Megatron training loop calls when ``--use-dynamic-batch-size`` is on.

The patches in ``patches/`` keep Megatron's code paths unchanged with the flag off; with it on they
call :func:`prepare_train_step` once per optimizer step (in ``train_step``),
:func:`prepare_eval_step` once per validation iteration (in ``evaluate``), and read
:func:`last_train_step` / :func:`dynamic_log_string` when logging.

Contract of the data iterators (the ones Megatron passes to ``train_step`` and ``evaluate``):

* Every rank (all DP, TP, PP and CP ranks) gets an iterator, and every ``next()`` yields the same
  global batch on every rank: a :class:`RolloutBatch` (samples in memory) or a
  :class:`LazyRolloutBatch` (sample lengths plus a function loading one sample by index). Every
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

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.core.utils import get_model_config

from megatron_dynbatch.integrations.megatron_lm.arguments import (
    dynbatch_config_from_args,
    parallel_layout_from_args,
)
from megatron_dynbatch.integrations.megatron_lm.calibration import (
    calibration_log_string,
    observe_train_step,
    reset_calibration_state,
    resume_calibration,
)
from megatron_dynbatch.mcore.agreement import (
    PlanMismatchError,
    StepAgreementError,
    step_agreement,
)
from megatron_dynbatch.mcore.schedule import check_schedule_config
from megatron_dynbatch.planning import ParallelLayout, Plan, plan_schedule
from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches
from megatron_dynbatch.runtime.iterators import chunk_data_iterators

__all__ = [
    "DynamicStep",
    "LazyRolloutBatch",
    "PlanMismatchError",
    "RolloutBatch",
    "StepAgreementError",
    "coerce_batch",
    "dynamic_log_string",
    "last_train_step",
    "prepare_eval_step",
    "prepare_forward_only_step",
    "prepare_train_step",
    "reset_dynamic_batch_state",
]


def _prompt_length(sample: Mapping[str, Any]) -> Optional[int]:
    prompt = sample.get("prompt_length")
    if isinstance(prompt, torch.Tensor):
        prompt = int(prompt.item())
    return prompt


@dataclass(frozen=True)
class RolloutBatch:
    """The global samples of one or more optimizer steps, in memory, identical on every rank."""

    samples: Sequence[Mapping[str, Any]]
    """Sample ``i``: ``tokens`` (int64 ``[L]``), optionally ``loss_mask`` or ``prompt_length``, and
    every field the schema declares (see :mod:`megatron_dynbatch.runtime.schema`)."""
    rollout_ids: Optional[Sequence[Hashable]] = None
    """One str/int id per sample; a rollout's samples always share a step. ``None``: one rollout
    per sample."""
    schema: BatchSchema = field(default_factory=BatchSchema)
    """Declared extra fields (advantages, old log-probs, ...) and the padding token."""

    def __post_init__(self) -> None:
        if not isinstance(self.samples, Sequence) or isinstance(self.samples, (str, bytes)):
            raise ValueError(
                f"RolloutBatch.samples must be a sequence of sample dicts, got "
                f"{type(self.samples).__name__}."
            )
        if not self.samples:
            raise ValueError("RolloutBatch.samples is empty; yield at least one sample per batch.")
        _check_rollout_ids(self.rollout_ids, len(self.samples))
        if not isinstance(self.schema, BatchSchema):
            raise ValueError(f"RolloutBatch.schema must be a BatchSchema, got {self.schema!r}.")

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> List[int]:
        return [int(sample["tokens"].shape[0]) for sample in self.samples]

    def prompt_lengths(self) -> List[Optional[int]]:
        """Per-sample prompt lengths for the cost model's response term (``None`` if unknown)."""
        return [_prompt_length(sample) for sample in self.samples]

    def load(self, indices: Sequence[int]) -> Dict[int, Mapping[str, Any]]:
        """The samples ``indices`` (this rank's share of a step)."""
        return {i: self.samples[i] for i in indices}


@dataclass(frozen=True)
class LazyRolloutBatch:
    """The global samples of one or more optimizer steps, as lengths and a per-sample loader.

    Every rank plans from ``lengths`` and calls ``load_sample`` only for the samples its DP rank
    trains (on the first and last pipeline stages). Use it when a batch is too large to read on
    every rank.
    """

    sample_lengths: Sequence[int]
    """Token count of every sample (what the plan needs)."""
    load_sample: Callable[[int], Mapping[str, Any]]
    """``load_sample(i)`` returns sample ``i`` as a :class:`RolloutBatch` sample dict; its
    ``tokens`` must have ``sample_lengths[i]`` entries."""
    rollout_ids: Optional[Sequence[Hashable]] = None
    """As in :class:`RolloutBatch`."""
    sample_prompt_lengths: Optional[Sequence[Optional[int]]] = None
    """Per-sample prompt lengths (cost model only), or ``None``."""
    schema: BatchSchema = field(default_factory=BatchSchema)
    """As in :class:`RolloutBatch`."""

    def __post_init__(self) -> None:
        if not self.sample_lengths:
            raise ValueError("LazyRolloutBatch.sample_lengths is empty; yield at least one sample.")
        _check_rollout_ids(self.rollout_ids, len(self.sample_lengths))
        if self.sample_prompt_lengths is not None and len(self.sample_prompt_lengths) != len(
            self.sample_lengths
        ):
            raise ValueError(
                f"LazyRolloutBatch has {len(self.sample_lengths)} lengths but "
                f"{len(self.sample_prompt_lengths)} prompt lengths; give one per sample or none."
            )
        if not callable(self.load_sample):
            raise ValueError("LazyRolloutBatch.load_sample must be callable: index -> sample.")
        if not isinstance(self.schema, BatchSchema):
            raise ValueError(f"LazyRolloutBatch.schema must be a BatchSchema, got {self.schema!r}.")

    def __len__(self) -> int:
        return len(self.sample_lengths)

    def lengths(self) -> List[int]:
        return [int(length) for length in self.sample_lengths]

    def prompt_lengths(self) -> List[Optional[int]]:
        if self.sample_prompt_lengths is None:
            return [None] * len(self.sample_lengths)
        return list(self.sample_prompt_lengths)

    def load(self, indices: Sequence[int]) -> Dict[int, Mapping[str, Any]]:
        samples = {}
        for i in indices:
            sample = self.load_sample(i)
            got = int(sample["tokens"].shape[0])
            if got != int(self.sample_lengths[i]):
                raise ValueError(
                    f"LazyRolloutBatch sample {i}: load_sample returned {got} tokens but sample_lengths "
                    f"says {int(self.sample_lengths[i])}; the plan was made from sample_lengths."
                )
            samples[i] = sample
        return samples


def _check_rollout_ids(rollout_ids: Optional[Sequence[Hashable]], count: int) -> None:
    if rollout_ids is not None and len(rollout_ids) != count:
        raise ValueError(
            f"the batch has {count} samples but {len(rollout_ids)} rollout ids; give one id per "
            "sample or none."
        )


def coerce_batch(value: Any) -> Any:
    """Accept a :class:`RolloutBatch`, a :class:`LazyRolloutBatch`, or a RolloutBatch dict."""
    if isinstance(value, (RolloutBatch, LazyRolloutBatch)):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"samples", "rollout_ids", "schema"})
        if unknown or "samples" not in value:
            raise ValueError(
                "a rollout-batch dict needs 'samples' and may have 'rollout_ids' and 'schema'; got "
                f"keys {sorted(value)}. With --use-dynamic-batch-size the data iterator yields "
                "whole batches (megatron_dynbatch RolloutBatch / LazyRolloutBatch), not Megatron's "
                "fixed micro-batches: use launch/pretrain_gpt_dynbatch.py's data path or yield "
                "rollout batches (see megatron_dynbatch/integrations/megatron_lm/hooks.py)."
            )
        return RolloutBatch(**value)
    raise ValueError(
        f"the data iterator yielded a {type(value).__name__}; with --use-dynamic-batch-size it "
        "must yield a megatron_dynbatch RolloutBatch or LazyRolloutBatch holding the global batch "
        "(every rank the same)."
    )


@dataclass(frozen=True)
class DynamicStep:
    """One planned forward(-backward) pass on this rank: what the schedule is called with."""

    num_microbatches: int
    """Micro-batches per DP rank this step (``num_microbatches`` of ``forward_backward_func``)."""
    seq_length: int
    """The step's uniform row length (sizes the pipeline's p2p buffers)."""
    micro_batch_size: int
    """Rows per micro-batch (1 for ``packed``)."""
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


@dataclass
class _Cursor:
    """A batch whose plan still has steps to serve."""

    batch: Any
    plan: Plan
    next_step: int = 0


@dataclass
class _Totals:
    """Counters since the last :func:`dynamic_log_string`."""

    steps: int = 0
    samples: int = 0
    real_tokens: int = 0
    computed_tokens: int = 0
    truncated_tokens: int = 0


_train_cursor: Optional[_Cursor] = None
_last_train_step: Optional[DynamicStep] = None
_totals = _Totals()


def reset_dynamic_batch_state() -> None:
    """Forget the partly consumed batch, the last step and the log counters."""
    global _train_cursor, _last_train_step, _totals
    _train_cursor = None
    _last_train_step = None
    _totals = _Totals()
    reset_calibration_state()


def last_train_step() -> DynamicStep:
    """The step :func:`prepare_train_step` planned last (read by the patched loop after it)."""
    if _last_train_step is None:
        raise RuntimeError(
            "no dynamic-batch step has run yet: the patched train loop reads it after train_step; "
            "is megatron_dynbatch's train_step patch applied (see patches/README.md)?"
        )
    return _last_train_step


def dynamic_log_string() -> str:
    """The dynamic-batching part of Megatron's iteration line, over the steps since the last call.

    ``micro-batches`` is the last step's per-rank count and row shape ``[B x S]``; ``real`` and
    ``computed tokens`` and ``fill`` (their ratio) sum all steps since the previous line, and so
    does ``truncated tokens`` (shown when ``--oversize-samples truncate`` cut any).
    """
    global _totals
    totals, _totals = _totals, _Totals()
    if _last_train_step is None or totals.steps == 0:
        return ""
    step = _last_train_step
    fill = totals.real_tokens / totals.computed_tokens if totals.computed_tokens else 0.0
    line = (
        f" micro-batches/rank: {step.num_microbatches} [{step.micro_batch_size}x"
        f"{step.seq_length}] | real tokens: {totals.real_tokens} | computed tokens: "
        f"{totals.computed_tokens} | fill: {fill:.3f} |"
    )
    if totals.truncated_tokens:
        line += f" truncated tokens: {totals.truncated_tokens} |"
    return line + calibration_log_string()


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


def _reads_tokens(pp_group: Any) -> bool:
    """First and last pipeline stages read sample tokens; middle stages only need lengths."""
    size = dist.get_world_size(pp_group)
    rank = dist.get_rank(pp_group)
    return rank == 0 or rank == size - 1


def _shape_only_sample(length: int, schema: BatchSchema) -> Dict[str, torch.Tensor]:
    """A stand-in sample of the right length for a middle pipeline stage (no data read)."""
    sample: Dict[str, torch.Tensor] = {"tokens": torch.zeros(length, dtype=torch.int64)}
    for spec in schema.fields:
        shape = (length, *spec.trailing_shape) if spec.kind == "token" else spec.trailing_shape
        sample[spec.name] = torch.zeros(shape, dtype=spec.dtype)
    return sample


def _plan(batch: Any, planner_config) -> Plan:
    return plan_schedule(
        batch.lengths(), batch.rollout_ids, batch.prompt_lengths(), config=planner_config
    )


def _materialize(
    batch: Any,
    plan: Plan,
    step_index: int,
    dp_group: Any,
    pp_group: Any,
    model_chunks: List[torch.nn.Module],
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
        samples = {i: _shape_only_sample(lengths[i], batch.schema) for i in indices}
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
        computed_tokens=dp_size * step.num_microbatches * step.micro_batch_size * step.seq_length,
        step_index=step_index,
        plan_fingerprint=plan.fingerprint(),
        loaded_samples=loaded,
        truncated_tokens=step.truncated_tokens,
    )


def _parallel_layout(args: Any, model_chunks: List[torch.nn.Module], dp_group) -> ParallelLayout:
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


def _next_batch(data_iterator: Any, what: str) -> Any:
    candidates = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    iterators, seen = [], set()
    for iterator in candidates:
        if iterator is not None and id(iterator) not in seen:
            seen.add(id(iterator))
            iterators.append(iterator)
    if not iterators:
        raise ValueError(
            f"this rank's {what} data iterator is None; with --use-dynamic-batch-size every rank "
            "(every TP, PP and CP rank too) must get an iterator yielding the global batch, e.g. "
            "build it on all ranks (mark the dataset provider is_distributed=True)."
        )
    batches = []
    for iterator in iterators:
        if isinstance(iterator, RerunDataIterator):
            # The rerun state machine only sees the materialized iterators, so this one's replay
            # buffer would grow by a batch per step; drop it as Megatron does per step.
            iterator.advance()
        try:
            batches.append(next(iterator))
        except StopIteration:
            raise ValueError(
                f"the {what} data iterator is exhausted: it must yield a batch for every "
                "iteration Megatron runs (--train-iters / --train-samples, --eval-iters)."
            ) from None
    return coerce_batch(batches[0])


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
    raise ValueError(
        f"the data iterator yielded a batch of {units} {what}, but {flag} is {per_step}: with "
        f"--use-dynamic-batch-size every optimizer step trains exactly {flag} {what} (Megatron "
        f"sizes the run, the learning-rate schedule and consumed samples from it), so a batch "
        f"must hold {expected} {what}. Yield batches of that size, or set {flag} {units}."
    )


def prepare_train_step(
    args: Any,
    data_iterator: Any,
    model: Any,
    *,
    pg_collection: Any = None,
    check_group: Any = None,
) -> DynamicStep:
    """Plan (when needed) and materialize this rank's micro-batches of the next optimizer step.

    Args:
        args: Megatron's arguments after :func:`~megatron_dynbatch.integrations.megatron_lm.arguments.
            validate_dynamic_batch_args`.
        data_iterator: The training iterator (or one per model chunk) yielding batches.
        model: The model chunks (a list, as in ``train_step``) or one module.
        pg_collection: The ``ProcessGroupCollection`` of ``train_step``; ``None`` uses the model's,
            then Megatron's global groups.
        check_group: Group over which ranks agree; default the whole world (pipeline stages must
            agree on the shapes too, not only DP ranks).

    Returns:
        The :class:`DynamicStep` to pass to ``forward_backward_func``.

    Raises:
        StepAgreementError: On every rank, when any rank failed (a batch of the wrong size, a bad
            sample, an exhausted iterator), naming the ranks and the reason.
        PlanMismatchError: On every rank, when any rank planned a different schedule.
    """
    global _train_cursor, _last_train_step
    model_chunks = _as_chunks(model)
    dp_group, pp_group = _groups(model_chunks, pg_collection)
    iteration = getattr(args, "curr_iteration", None)
    what = f"training iteration {iteration + 1}" if isinstance(iteration, int) else "training"
    resume_calibration(args)  # before planning: a resumed run plans with the saved fit
    with step_agreement(check_group or dist.group.WORLD, what=what) as agreement:
        if _train_cursor is None or _train_cursor.next_step >= len(_train_cursor.plan.steps):
            batch = _next_batch(data_iterator, "training")
            by_rollouts = getattr(args, "rollouts_per_step", None) is not None
            _check_batch_size(
                batch, args.global_batch_size, "--global-batch-size", by_rollouts, by_rollouts
            )
            layout = _parallel_layout(args, model_chunks, dp_group)
            plan = _plan(batch, dynbatch_config_from_args(args).planner_config(layout))
            _train_cursor = _Cursor(batch=batch, plan=plan)
        cursor = _train_cursor
        agreement.fingerprint = cursor.plan.fingerprint()
        step = _materialize(
            cursor.batch, cursor.plan, cursor.next_step, dp_group, pp_group, model_chunks
        )
    cursor.next_step += 1
    # Outside the agreement: it may all-reduce the last step's time (every rank gets here).
    observe_train_step(args, cursor.batch, cursor.plan, cursor.next_step - 1)
    _last_train_step = step
    _totals.steps += 1
    _totals.samples += step.num_samples
    _totals.real_tokens += step.real_tokens
    _totals.computed_tokens += step.computed_tokens
    _totals.truncated_tokens += step.truncated_tokens
    return step


def prepare_eval_step(
    args: Any,
    data_iterator: Any,
    model: Any,
    *,
    pg_collection: Any = None,
    check_group: Any = None,
) -> DynamicStep:
    """Read one validation batch and plan it as one forward-only pass (the patched ``evaluate``).

    The batch holds ``--eval-global-batch-size`` samples (rollouts with ``--rollouts-per-step``),
    planned under ``--log-probs-max-tokens-per-gpu``. Training state is not touched.
    """
    model_chunks = _as_chunks(model)
    dp_group, pp_group = _groups(model_chunks, pg_collection)
    with step_agreement(check_group or dist.group.WORLD, what="validation") as agreement:
        batch = _next_batch(data_iterator, "validation")
        by_rollouts = getattr(args, "rollouts_per_step", None) is not None
        eval_batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
        _check_batch_size(batch, eval_batch, "--eval-global-batch-size", by_rollouts, False)
        step = _forward_only(args, batch, model_chunks, dp_group, pp_group, agreement)
    return step


def _forward_only(args, batch, model_chunks, dp_group, pp_group, agreement) -> DynamicStep:
    layout = _parallel_layout(args, model_chunks, dp_group)
    config = dynbatch_config_from_args(args).planner_config(layout, forward_only=True)
    plan = _plan(batch, config)
    assert len(plan.steps) == 1, "a forward-only plan has one step"
    agreement.fingerprint = plan.fingerprint()
    return _materialize(batch, plan, 0, dp_group, pp_group, model_chunks)


def prepare_forward_only_step(
    args: Any,
    batch: Any,
    model: Any,
    *,
    pg_collection: Any = None,
    check_group: Any = None,
) -> DynamicStep:
    """Plan one forward-only pass (e.g. log-probs of a rollout batch) under the log-prob budget.

    The whole batch is one pass (``--rollouts-per-step`` only splits optimizer steps) with
    ``--log-probs-max-tokens-per-gpu``. Run the schedule with ``forward_only=True`` and the
    returned shapes; the last stage's outputs come back in ``microbatches`` order, and
    :func:`megatron_dynbatch.runtime.split_outputs` / ``restore_order`` map them to samples.
    Training state (:func:`last_train_step`, a partly served batch) is not touched.
    """
    model_chunks = _as_chunks(model)
    dp_group, pp_group = _groups(model_chunks, pg_collection)
    with step_agreement(check_group or dist.group.WORLD, what="forward-only pass") as agreement:
        step = _forward_only(args, coerce_batch(batch), model_chunks, dp_group, pp_group, agreement)
    return step
