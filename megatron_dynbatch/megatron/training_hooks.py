"""What the patched Megatron training loop calls when ``--use-dynamic-batch-size`` is on.

The patches in ``patches/`` keep Megatron's code paths unchanged with the flag off; with it on they
call :func:`prepare_train_step` once per optimizer step (in ``train_step``) and read
:func:`last_train_step` where Megatron would multiply the fixed micro-batch count out (consumed
samples, the learning-rate schedule, logging).

Contract of the training data iterator (the one Megatron passes to ``train_step``):

* Every rank (all DP, TP, PP and CP ranks) gets an iterator, and every ``next()`` yields the same
  **global** :class:`RolloutBatch` on every rank: all samples of one or more optimizer steps, in the
  same order, with the same rollout ids. Each rank plans the whole batch with the pure planner and
  materializes only its own DP rank's micro-batches, so agreement needs no data exchange; a
  fingerprint all-gather checks it and raises :class:`PlanMismatchError` instead of letting the
  pipeline hang on mismatched shapes.
* With ``--rollouts-per-step`` a batch may hold several steps' worth of rollouts; the next steps
  are served from it before the iterator is read again. Without it, one batch is one step.
* With virtual pipelining Megatron passes one iterator per model chunk; one batch is read from
  each (distinct) iterator so they stay aligned, and the first is used.

The ``forward_step_func`` then receives this rank's micro-batch dicts (see
:func:`megatron_dynbatch.runtime.materialize_microbatches`: ``tokens``, ``labels``, ``loss_mask``,
``position_ids``, ``segment_ids``, ``sample_index``, ``cu_seqlens`` and the schema's fields), e.g.
through :func:`megatron_dynbatch.megatron.forward.make_forward_step`, and must return the 3-tuple
loss (``--calculate-per-token-loss``) of :func:`megatron_dynbatch.runtime.microbatch_loss`.

Process groups come from the ``pg_collection`` Megatron passes to ``train_step`` (or the model's);
this integration layer is the only place that falls back to Megatron's global groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.core.utils import get_model_config

from megatron_dynbatch.megatron.arguments import (
    dynbatch_config_from_args,
    parallel_layout_from_args,
)
from megatron_dynbatch.megatron.step import PlanMismatchError, check_plan_agreement
from megatron_dynbatch.planning import ParallelLayout, Plan, plan_schedule
from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches

__all__ = [
    "DynamicStep",
    "PlanMismatchError",
    "RolloutBatch",
    "last_train_step",
    "prepare_forward_only_step",
    "prepare_train_step",
    "reset_dynamic_batch_state",
]


@dataclass(frozen=True)
class RolloutBatch:
    """The global samples of one or more optimizer steps, identical on every rank."""

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
        if self.rollout_ids is not None and len(self.rollout_ids) != len(self.samples):
            raise ValueError(
                f"RolloutBatch has {len(self.samples)} samples but {len(self.rollout_ids)} "
                "rollout ids; give one id per sample or none."
            )
        if not isinstance(self.schema, BatchSchema):
            raise ValueError(f"RolloutBatch.schema must be a BatchSchema, got {self.schema!r}.")

    @classmethod
    def coerce(cls, value: Any) -> "RolloutBatch":
        """Accept a :class:`RolloutBatch` or a dict with its field names as keys."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"samples", "rollout_ids", "schema"})
            if unknown or "samples" not in value:
                raise ValueError(
                    "a rollout-batch dict needs 'samples' and may have 'rollout_ids' and "
                    f"'schema'; got keys {sorted(value)}."
                )
            return cls(**value)
        raise ValueError(
            f"the training data iterator yielded a {type(value).__name__}; with "
            "--use-dynamic-batch-size it must yield a megatron_dynbatch RolloutBatch (or a dict "
            "with 'samples', 'rollout_ids', 'schema') holding the global batch."
        )

    def lengths(self) -> List[int]:
        return [int(sample["tokens"].shape[0]) for sample in self.samples]

    def prompt_lengths(self) -> List[Optional[int]]:
        """Per-sample prompt lengths for the cost model's response term (``None`` if unknown)."""
        prompts: List[Optional[int]] = []
        for sample in self.samples:
            prompt = sample.get("prompt_length")
            if isinstance(prompt, torch.Tensor):
                prompt = int(prompt.item())
            prompts.append(prompt)
        return prompts


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
    """This rank's samples (indices into the rollout batch) in schedule order."""
    num_samples: int
    """Samples of the step over all DP ranks (Megatron's consumed samples)."""
    num_rollouts: int
    """Rollouts of the step."""
    real_tokens: int
    """Unpadded tokens of the step over all DP ranks."""
    step_index: int
    """Index of the step within its rollout batch's plan."""
    plan_fingerprint: str
    """The plan's fingerprint, equal on every rank."""


@dataclass
class _Cursor:
    """A rollout batch whose plan still has steps to serve."""

    batch: RolloutBatch
    plan: Plan
    next_step: int = 0


_train_cursor: Optional[_Cursor] = None
_last_train_step: Optional[DynamicStep] = None


def reset_dynamic_batch_state() -> None:
    """Forget the partly consumed rollout batch and the last step (tests, a new data iterator)."""
    global _train_cursor, _last_train_step
    _train_cursor = None
    _last_train_step = None


def last_train_step() -> DynamicStep:
    """The step :func:`prepare_train_step` planned last (read by the patched loop after it)."""
    if _last_train_step is None:
        raise RuntimeError(
            "no dynamic-batch step has run yet: the patched train loop reads it after train_step; "
            "is megatron_dynbatch's train_step patch applied (see patches/README.md)?"
        )
    return _last_train_step


def _as_chunks(model: Any) -> List[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _model_pg_collection(chunk: torch.nn.Module) -> Any:
    """The ``pg_collection`` of a (DDP / Float16Module wrapped) model chunk, or ``None``."""
    while chunk is not None:
        if getattr(chunk, "pg_collection", None) is not None:
            return chunk.pg_collection
        chunk = getattr(chunk, "module", None)
    return None


def _dp_group(model_chunks: List[torch.nn.Module], pg_collection: Any):
    """The data-parallel group: from ``pg_collection``, the model's, or Megatron's global groups."""
    for candidate in (pg_collection, _model_pg_collection(model_chunks[0])):
        if getattr(candidate, "dp", None) is not None:
            return candidate.dp
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["dp"]).dp


def _plan(batch: RolloutBatch, planner_config) -> Plan:
    return plan_schedule(
        batch.lengths(), batch.rollout_ids, batch.prompt_lengths(), config=planner_config
    )


def _materialize(
    batch: RolloutBatch,
    plan: Plan,
    step_index: int,
    dp_rank: int,
    model_chunks: List[torch.nn.Module],
) -> DynamicStep:
    step = plan.steps[step_index]
    own = step.rank_microbatches(dp_rank)
    indices = tuple(i for microbatch in own for i in microbatch)
    microbatches = materialize_microbatches(
        step,
        dp_rank,
        {i: batch.samples[i] for i in indices},
        batch.schema,
        layout=plan.layout,
        sample_multiple=plan.sample_multiple,
    )
    # RerunDataIterator: Megatron's rerun state machine (on by default) asserts it and replays
    # the step from it; the interleaved schedule reads one iterator per model chunk.
    if len(model_chunks) > 1:
        data_iterator: Any = [RerunDataIterator(iter(microbatches)) for _ in model_chunks]
    else:
        data_iterator = RerunDataIterator(iter(microbatches))
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
        step_index=step_index,
        plan_fingerprint=plan.fingerprint(),
    )


def _parallel_layout(args: Any, model_chunks: List[torch.nn.Module], dp_group) -> ParallelLayout:
    layout = parallel_layout_from_args(
        args, dp_size=dist.get_world_size(dp_group), vpp_size=len(model_chunks)
    )
    if layout.vpp_size > 1:
        # Plan for the interleaving group the schedule will use: the model config's (Megatron
        # defaults it to pp_size in ModelParallelConfig).
        group = get_model_config(model_chunks[0]).microbatch_group_size_per_vp_stage
        layout = dataclasses.replace(layout, microbatch_group_size_per_vp_stage=group)
    return layout


def _next_rollout_batch(data_iterator: Any) -> RolloutBatch:
    candidates = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    iterators, seen = [], set()
    for iterator in candidates:
        if iterator is not None and id(iterator) not in seen:
            seen.add(id(iterator))
            iterators.append(iterator)
    if not iterators:
        raise ValueError(
            "this rank's training data iterator is None; with --use-dynamic-batch-size every rank "
            "(every TP, PP and CP rank too) must get an iterator yielding the global RolloutBatch, "
            "e.g. build it on all ranks (mark the dataset provider is_distributed=True)."
        )
    batches = []
    for iterator in iterators:
        if isinstance(iterator, RerunDataIterator):
            # The rerun state machine only sees the materialized iterators, so this one's replay
            # buffer would grow by a rollout batch per step; drop it as Megatron does per step.
            iterator.advance()
        batches.append(next(iterator))
    return RolloutBatch.coerce(batches[0])


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
        args: Megatron's arguments after :func:`~megatron_dynbatch.megatron.arguments.
            validate_dynamic_batch_args`.
        data_iterator: The training iterator (or one per model chunk) yielding rollout batches.
        model: The model chunks (a list, as in ``train_step``) or one module.
        pg_collection: The ``ProcessGroupCollection`` of ``train_step``; ``None`` uses the model's,
            then Megatron's global groups.
        check_group: Group over which plans must agree; default the whole world (pipeline stages
            must agree on the shapes too, not only DP ranks).

    Returns:
        The :class:`DynamicStep` to pass to ``forward_backward_func``.

    Raises:
        PlanMismatchError: On every rank, when any rank planned a different schedule.
        ValueError: On a bad rollout batch (naming the sample) or a missing iterator.
    """
    global _train_cursor, _last_train_step
    model_chunks = _as_chunks(model)
    dp_group = _dp_group(model_chunks, pg_collection)
    if _train_cursor is None or _train_cursor.next_step >= len(_train_cursor.plan.steps):
        batch = _next_rollout_batch(data_iterator)
        layout = _parallel_layout(args, model_chunks, dp_group)
        plan = _plan(batch, dynbatch_config_from_args(args).planner_config(layout))
        check_plan_agreement(plan, check_group or dist.group.WORLD)
        _train_cursor = _Cursor(batch=batch, plan=plan)
    cursor = _train_cursor
    step = _materialize(
        cursor.batch, cursor.plan, cursor.next_step, dist.get_rank(dp_group), model_chunks
    )
    cursor.next_step += 1
    _last_train_step = step
    return step


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
    dp_group = _dp_group(model_chunks, pg_collection)
    batch = RolloutBatch.coerce(batch)
    layout = _parallel_layout(args, model_chunks, dp_group)
    config = dynbatch_config_from_args(args).planner_config(layout, forward_only=True)
    plan = _plan(batch, config)
    assert len(plan.steps) == 1, "a forward-only plan has one step"
    check_plan_agreement(plan, check_group or dist.group.WORLD)
    return _materialize(batch, plan, 0, dist.get_rank(dp_group), model_chunks)
