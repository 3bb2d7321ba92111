"""Megatron's stock batching expressed as a plan: fixed ``micro_batch_size`` rows of ``seq_length``.

Without dynamic batching Megatron pads every sample to ``--seq-length`` and gives each DP rank
``global_batch / (dp * micro_batch_size)`` micro-batches, taking samples in arrival order (each
rank its slice of every ``dp * micro_batch_size`` consecutive samples). Expressing that as a
:class:`Plan` lets the same runtime and schedule code run both, so comparisons measure batching
and nothing else.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from megatron_dynbatch.errors import DynBatchValueError

from .cost import rank_costs
from .plan import Plan, PlanStats, StepPlan, imbalance
from .samples import SampleSet
from .spec import CostModel, ceil_div, round_up

__all__ = ["plan_fixed_microbatches", "plan_fixed_samples"]


def plan_fixed_microbatches(
    lengths: Sequence[int], rollout_ids: Optional[Sequence[Any]] = None, **shape: Any
) -> Plan:
    """Fixed-shape plan: ``[micro_batch_size, seq_length]`` rows in arrival order.

    ``shape``: the keyword arguments of :func:`plan_fixed_samples` (``dp_size``,
    ``micro_batch_size``, ``seq_length``, optionally ``rollouts_per_step`` and
    ``microbatch_multiple``). A step whose sample count does not fill the last micro-batches gets
    placeholder rows (Megatron itself would require the global batch to divide evenly). Raises
    ValueError if a sample is longer than ``seq_length`` (Megatron would truncate it; we refuse
    to lose tokens).
    """
    return plan_fixed_samples(SampleSet.build(lengths, rollout_ids), **shape)


def plan_fixed_samples(
    samples: SampleSet,
    *,
    dp_size: int,
    micro_batch_size: int,
    seq_length: int,
    rollouts_per_step: Optional[int] = None,
    microbatch_multiple: int = 1,
    token_cap: Optional[int] = None,
    sample_multiple: int = 1,
    cost: Optional[CostModel] = None,
) -> Plan:
    """:func:`plan_fixed_microbatches` on an already validated :class:`SampleSet` (the ``fixed``
    registered planner, :mod:`.registry`). ``token_cap`` and ``sample_multiple``: what the plan
    reports (the budget's cap, the tp / cp padding the lengths were rounded to); by default the
    shape's ``micro_batch_size * seq_length`` and 1. ``cost``: the model the step's cost figures
    (``dp_imbalance_cost``, ``dp_imbalance_computed``) are read by, as every planner reports
    them; by default :class:`CostModel`'s defaults."""
    for name, value in (
        ("dp_size", dp_size),
        ("micro_batch_size", micro_batch_size),
        ("seq_length", seq_length),
        ("microbatch_multiple", microbatch_multiple),
    ):
        if value < 1:
            raise DynBatchValueError(f"{name}={value} must be >= 1.")
    longest = max(samples.lengths)
    if longest > seq_length:
        raise DynBatchValueError(
            f"a sample of {longest} tokens does not fit seq_length={seq_length}; raise --seq-length "
            f"(fixed batching pads every sample to it)."
        )
    cap = micro_batch_size * seq_length if token_cap is None else token_cap
    model = cost if cost is not None else CostModel()
    lengths = samples.lengths
    sizes = [round_up(length, sample_multiple) for length in lengths]
    responses = [max(0, n - p) for n, p in zip(lengths, samples.prompt_lengths, strict=True)]
    steps: List[StepPlan] = []
    for num_rollouts, items in samples.steps(rollouts_per_step):
        per_rank = round_up(ceil_div(len(items), dp_size * micro_batch_size), microbatch_multiple)
        ranks: List[List[tuple]] = [[] for _ in range(dp_size)]
        block = dp_size * micro_batch_size
        for m in range(per_rank):
            window = items[m * block : (m + 1) * block]
            for r in range(dp_size):
                ranks[r].append(tuple(window[r * micro_batch_size : (r + 1) * micro_batch_size]))
        real = sum(lengths[i] for i in items)
        rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in ranks]
        # Every micro-batch runs all its micro_batch_size rows of seq_length, placeholders too.
        own, computed = rank_costs(
            model, "padded", seq_length, micro_batch_size, ranks, lengths, sizes, responses
        )
        steps.append(
            StepPlan(
                num_microbatches=per_rank,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                ranks=tuple(tuple(rank) for rank in ranks),
                num_rollouts=num_rollouts,
                num_placeholders=sum(1 for rank in ranks for mb in rank if not mb),
                real_tokens=real,
                fill=real / (dp_size * per_rank * micro_batch_size * seq_length),
                dp_imbalance=imbalance(rank_tokens),
                dp_imbalance_cost=imbalance(own),
                oversize_samples=(),
                # The one formula of every plan (no sample is over seq_length here, so none is
                # oversize unless the cap is under it).
                lower_bound_microbatches=sum(1 for i in items if sizes[i] > cap)
                + ceil_div(sum(sizes[i] for i in items if sizes[i] <= cap), cap),
                min_microbatches=per_rank,
                dp_imbalance_computed=imbalance(computed),
                idle_ranks=sum(1 for rank in ranks if not any(rank)),
                sample_lengths=tuple((i, lengths[i]) for i in sorted(items)),
            )
        )
    return Plan(
        steps=tuple(steps),
        stats=PlanStats.from_steps(steps, num_samples=len(samples), dp_size=dp_size),
        layout="padded",
        sample_multiple=sample_multiple,
        token_cap=cap,
        dp_size=dp_size,
    )
