"""``--max-memory-gib`` in slime: the memory model of slime's (Megatron's) arguments, the budget
the rollout side plans every step under, the check that the longest sample fits it, and each
step's predicted peak.

slime parses Megatron's arguments, so the model is the Megatron-LM entry's
(:func:`~megatron_dynbatch.integrations.model_args.memory_model_from_flags`, the same reading of
the same flags). Differences, and why:

* no ``auto``: slime plans on its rollout manager, which does not see the training GPUs;
* no memory fit: the trainer's measured peaks do not flow back to the rollout manager, so the
  planner keeps to the model as counted, its activations times
  :data:`~megatron_dynbatch.planning.memory.UNFITTED_SAFETY` (what the Megatron-LM entry
  predicts before its first measured step), and ``base_bytes`` is 0: on a GPU the budget is
  compared with ``torch.cuda.max_memory_allocated``, which counts tensors only;
* attention is what slime runs: THD rows (``packed``), ``dense`` only with Megatron's ``local``
  transformer implementation or an unfused backend
  (:func:`~megatron_dynbatch.config.attention_from_megatron`).

Standard library and the pure planner only: slime's rollout manager imports it without torch work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from megatron_dynbatch.config import GIB_RANGE, attention_from_megatron, is_gib
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.host_memory import check_row_fits
from megatron_dynbatch.integrations.hosts import SLIME
from megatron_dynbatch.integrations.model_args import memory_model_from_flags
from megatron_dynbatch.planning.memory import (
    MemoryLimit,
    MemoryModel,
    gib_to_bytes,
    predicted_step_peaks,
)
from megatron_dynbatch.planning.spec import ParallelLayout, round_up

__all__ = [
    "StepPeaks",
    "check_longest_sample",
    "slime_max_memory_gib",
    "slime_memory_limit",
    "slime_memory_model",
    "step_peaks",
]

#: slime's flag, as the SLIME host record names it (patch 0005 registers it).
FLAG = SLIME.key("max_memory_gib")


def slime_max_memory_gib(args: Any) -> Optional[float]:
    """``args.max_memory_gib`` in GiB, or ``None`` (not set, or a bare namespace without it)."""
    value = getattr(args, "max_memory_gib", None)
    if value is None:
        return None
    if value == "auto":
        raise DynBatchValueError(
            f"{FLAG} auto: slime plans the steps on its rollout manager, which does not see the "
            f"training GPUs; give the GiB one training GPU may hold at its peak, e.g. {FLAG} 70 "
            "on an 80 GiB GPU."
        )
    if not is_gib(value):
        raise DynBatchValueError(
            f"{FLAG} {value!r} must be a number of GiB > 0 ({GIB_RANGE}: what one training GPU "
            f"may hold at its peak), e.g. {FLAG} 70."
        )
    return float(value)


def slime_memory_model(args: Any, parallel: ParallelLayout) -> MemoryModel:
    """The per-stage memory model of slime's arguments, as the planner uses it (see the module
    docstring: counted activations times ``UNFITTED_SAFETY``, nothing besides tensors).

    Raises:
        DynBatchValueError: the model's dimensions are missing from ``args``, naming the flag.
    """
    attention = attention_from_megatron(
        getattr(args, "transformer_impl", None), getattr(args, "attention_backend", None), "packed"
    )
    try:
        return memory_model_from_flags(args, parallel, attention, unfitted=True)
    except (AttributeError, TypeError) as error:
        raise DynBatchValueError(
            f"{FLAG} needs the model's Megatron arguments (--num-layers, --hidden-size, "
            f"--num-attention-heads, ...), which slime's args lack here ({error}); pass them, or "
            f"drop {FLAG} to plan by --max-tokens-per-gpu alone."
        ) from error


def slime_memory_limit(args: Any, parallel: ParallelLayout) -> Optional[MemoryLimit]:
    """The budget the planner keeps every stage's predicted peak within; ``None`` without
    ``--max-memory-gib``. Rows are multiples of the sample multiple, as the planner's."""
    gib = slime_max_memory_gib(args)
    if gib is None:
        return None
    return MemoryLimit(
        model=slime_memory_model(args, parallel),
        budget_bytes=gib_to_bytes(gib),
        row_multiple=parallel.sample_multiple,
    )


def check_longest_sample(limit: MemoryLimit, lengths: Sequence[int], gib: float) -> None:
    """Refuse, before planning, a budget under which the longest sample cannot run alone.

    A packed row of that sample alone is the smallest micro-batch that holds it: if even that
    breaks the budget on some stage, no plan exists (and an oversize sample must not run over the
    memory budget as it may over the token budget).

    ``gib``: the budget as the user gave it (named in the message).

    Raises:
        DynBatchValueError: naming ``--max-memory-gib``, its value, the stage, and the smallest
            budget that works.
    """
    longest = max(lengths)
    row = round_up(longest, limit.row_multiple)
    cp = limit.model.dims.parallel.cp_size
    what = (
        f"one sample of {longest} tokens (the longest of the rollout, one packed row of {row} "
        f"tokens{f' over {cp} context-parallel ranks' if cp > 1 else ''})"
    )
    check_row_fits(
        limit,
        row,
        setting=f"{FLAG} {gib:g}",
        what=what,
        fix=lambda smallest: (
            f"raise {FLAG} to at least {smallest:.3f}, recompute activations "
            "(--recompute-granularity selective / full), or cut long samples at rollout time "
            "(--rollout-max-response-len)"
        ),
    )


@dataclass(frozen=True)
class StepPeaks:
    """Every step's predicted peak, as planned (``DPSchedule.memory``)."""

    budget_bytes: int
    """``--max-memory-gib`` in bytes."""
    per_rank: List[List[List[float]]]
    """``per_rank[r][s][stage]``: predicted peak bytes of pipeline stage ``stage`` of DP rank
    ``r`` in step ``s`` (its micro-batches, placeholders included, in schedule order)."""


def step_peaks(
    model: MemoryModel,
    budget_bytes: int,
    gpu_rows: Sequence[Sequence[int]],
    num_microbatches: Sequence[int],
) -> StepPeaks:
    """Predicted peaks of a schedule's steps, from the rows it really runs.

    Args:
        model: The planner's memory model.
        budget_bytes: The budget (kept for the report).
        gpu_rows: ``DPSchedule.row_lengths``: per DP rank, every micro-batch's row on one GPU
            (per context-parallel rank), all steps in order.
        num_microbatches: Micro-batches per rank of each step.
    """
    cp = model.dims.parallel.cp_size
    per_rank: List[List[List[float]]] = [[] for _ in gpu_rows]
    start = 0
    for count in num_microbatches:
        end = start + count
        for r, rows in enumerate(gpu_rows):
            shapes = [(1, row * cp) for row in rows[start:end]]
            peaks = predicted_step_peaks(model, [shapes])
            per_rank[r].append([terms.total for terms in peaks])
        start = end
    return StepPeaks(budget_bytes=budget_bytes, per_rank=per_rank)
