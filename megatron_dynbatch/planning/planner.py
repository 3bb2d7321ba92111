"""The global dynamic-batch planner: sample lengths in, one schedule for every step and DP rank out.

Every rank calls :func:`plan_schedule` on the same global inputs and derives the same plan with no
collective: the constraints all ranks must share (dp_size, the interleaving group) are arguments.

Per step the planner

1. takes the next ``rollouts_per_step`` rollouts (whole rollouts only, in order of first appearance;
   a short last step is trained, not dropped);
2. picks the smallest per-rank micro-batch count M that Megatron accepts (a multiple of
   ``microbatch_group_size_per_vp_stage`` when interleaving) for which the samples fit into
   ``dp_size * M`` micro-batches under the token cap, then minimises the step's row length S at that
   count (every rank computes about M x S tokens, placeholders included);
3. spreads the micro-batches over the ranks and balances the ranks sample by sample by the cost
   model; micro-batches that find no samples become placeholders (never dropped, never absent);
4. orders each rank's micro-batches light-heavy-light for the pipeline's warm-up and cool-down.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence

from .balance import assign_bins_to_ranks, pipeline_order_simulated, refine_ranks
from .packing import count_best_fit_bins, pack_count_limited, pack_min_max_load
from .plan import Plan, PlanStats, StepPlan
from .samples import SampleSet
from .spec import PlannerConfig, ceil_div, round_up

__all__ = ["plan_schedule", "plan_samples", "OversizeSampleWarning"]


class OversizeSampleWarning(UserWarning):
    """A sample is longer than the token cap; it runs alone in its micro-batch, over the cap."""


def plan_schedule(
    lengths: Sequence[int],
    rollout_ids: Optional[Sequence[Any]] = None,
    prompt_lengths: Optional[Sequence[Optional[int]]] = None,
    *,
    config: PlannerConfig,
) -> Plan:
    """Plan every optimizer step of a batch of samples.

    Args:
        lengths: Total token length of every sample (prompt + response).
        rollout_ids: One id (str or int) per sample; samples sharing an id (a multi-turn trajectory,
            a GRPO prompt group) always land in the same step. ``None``: each sample its own rollout.
        prompt_lengths: Prompt tokens per sample, for the cost model's response term.
        config: The parallel layout, token cap, layout and cost model.

    Returns:
        The :class:`Plan`; ``plan.steps[s].ranks[r][m]`` lists the global sample indices of
        micro-batch ``m`` on DP rank ``r`` in step ``s`` (``()`` is a placeholder).

    Raises:
        ValueError: on bad lengths, mismatched ids or prompt lengths (see :class:`SampleSet`).
    """
    if not isinstance(config, PlannerConfig):
        raise ValueError(f"config must be a PlannerConfig, got {type(config).__name__}.")
    return plan_samples(SampleSet.build(lengths, rollout_ids, prompt_lengths), config)


def plan_samples(samples: SampleSet, config: PlannerConfig) -> Plan:
    """:func:`plan_schedule` on an already validated :class:`SampleSet`."""
    parallel = config.parallel
    multiple = parallel.sample_multiple
    sizes = [round_up(length, multiple) for length in samples.lengths]
    costs = [
        config.cost.cost(length, length - prompt)
        for length, prompt in zip(samples.lengths, samples.prompt_lengths, strict=True)
    ]
    rollouts = samples.rollouts()
    per_step = config.rollouts_per_step or len(rollouts)
    steps: List[StepPlan] = []
    for start in range(0, len(rollouts), per_step):
        chunk = rollouts[start : start + per_step]
        items = sorted(i for _, members in chunk for i in members)
        steps.append(_plan_step(items, len(chunk), samples.lengths, sizes, costs, config))

    oversize = tuple(i for step in steps for i in step.oversize_samples)
    if oversize:
        warnings.warn(
            f"{len(oversize)} sample(s) exceed the token cap {config.token_cap} "
            f"(max_tokens_per_gpu={config.max_tokens_per_gpu} x cp_size={parallel.cp_size}) and run "
            f"alone in their micro-batch, over the cap: indices {list(oversize[:10])}"
            f"{' ...' if len(oversize) > 10 else ''}. Raise --max-tokens-per-gpu or truncate them.",
            OversizeSampleWarning,
            stacklevel=3,
        )
    computed = sum(
        parallel.dp_size * s.num_microbatches * s.micro_batch_size * s.seq_length for s in steps
    )
    real = sum(s.real_tokens for s in steps)
    stats = PlanStats(
        num_samples=len(samples),
        num_steps=len(steps),
        num_placeholders=sum(s.num_placeholders for s in steps),
        num_microbatches=sum(parallel.dp_size * s.num_microbatches for s in steps),
        num_real_microbatches=sum(
            parallel.dp_size * s.num_microbatches - s.num_placeholders for s in steps
        ),
        lower_bound_microbatches=sum(s.lower_bound_microbatches for s in steps),
        fill=real / computed,
        dp_imbalance=max(s.dp_imbalance for s in steps),
        dp_imbalance_cost=max(s.dp_imbalance_cost for s in steps),
        oversize_samples=oversize,
        max_microbatch_tokens=max(s.micro_batch_size * s.seq_length for s in steps),
    )
    return Plan(
        steps=tuple(steps),
        stats=stats,
        layout=config.layout,
        sample_multiple=multiple,
        token_cap=config.token_cap,
        dp_size=parallel.dp_size,
    )


def _plan_step(
    items: List[int],
    num_rollouts: int,
    lengths: Sequence[int],
    sizes: Sequence[int],
    costs: Sequence[float],
    config: PlannerConfig,
) -> StepPlan:
    parallel = config.parallel
    dp = parallel.dp_size
    multiple = parallel.microbatch_multiple
    cap = config.token_cap
    oversize = [i for i in items if sizes[i] > cap]
    regular = [i for i in items if sizes[i] <= cap]
    # Oversize samples need a micro-batch each; the rest at least their padded tokens / cap.
    lower_bound = len(oversize) + ceil_div(sum(sizes[i] for i in regular), cap)

    if config.layout == "packed":
        # Samples over half the cap cannot share a micro-batch: a second, often tighter bound.
        num_halves = sum(1 for i in regular if 2 * sizes[i] > cap)
        bound = max(lower_bound, len(oversize) + num_halves)
        per_rank = round_up(max(1, ceil_div(bound, dp)), multiple)
        packed = pack_min_max_load(sizes, regular, dp * per_rank - len(oversize), cap)
        if packed is None:
            # Large samples that pair badly: one best-fit pass into unlimited bins gives a bin count
            # within a few percent of optimal, and that count always packs again.
            per_rank = round_up(
                max(1, ceil_div(len(oversize) + count_best_fit_bins(sizes, regular, cap), dp)),
                multiple,
            )
            packed = pack_min_max_load(sizes, regular, dp * per_rank - len(oversize), cap)
            assert packed is not None, "best fit packs into the bins it counted"
        bins = [[i] for i in oversize] + packed[0]
        loads = [sizes[i] for i in oversize] + packed[1]
        row_length = max(loads)
        # Samples may move between bins while balancing ranks, up to the row the step pays for
        # anyway, but never above the cap (an oversize sample alone is the only exception).
        capacity = min(cap, row_length)
        unit_sizes: Sequence[int] = sizes
    else:
        row_length = max(sizes[i] for i in items)
        rows_per_bin = max(1, cap // row_length)
        num_bins = ceil_div(len(items), rows_per_bin)
        per_rank = round_up(max(1, ceil_div(num_bins, dp)), multiple)
        capacity = ceil_div(len(items), dp * per_rank)  # rows per micro-batch, spread evenly
        bins = pack_count_limited(costs, items, dp * per_rank, capacity)
        unit_sizes = [1] * len(sizes)

    # What a rank computes besides its samples' own work: a packed row's padding tail is one
    # attention segment whose quadratic cost shrinks as the row fills; a padded row pads each
    # sample to S. The linear part of padding is the same M x S for every rank and cancels.
    attention = config.cost.attention_weight
    if config.layout == "packed":
        pad_row = row_length

        def bin_extra(load: int) -> float:
            return attention * float(pad_row - load) ** 2

        balance_costs: Sequence[float] = costs
    else:
        bin_extra = None
        balance_costs = [
            c + attention * float(row_length - sizes[i]) ** 2 for i, c in enumerate(costs)
        ]
    bin_costs = [
        sum(balance_costs[i] for i in members)
        + (bin_extra(sum(sizes[i] for i in members)) if bin_extra else 0.0)
        for members in bins
    ]
    rank_bins = assign_bins_to_ranks(bin_costs, dp, per_rank)
    refine_ranks(
        bins, rank_bins, balance_costs, unit_sizes, capacity, bin_extra if attention else None
    )

    if config.layout == "packed":
        seq_length = max(sum(sizes[i] for i in members) for members in bins)
        micro_batch_size = 1
    else:
        seq_length = row_length
        micro_batch_size = max(len(members) for members in bins)
    # Rank micro-batches by real work plus their padding tail's attention (placeholders lightest);
    # simulate with what they compute: a full row of linear work each, placeholders included.
    loads = [sum(sizes[i] for i in members) for members in bins]
    bin_costs = [
        sum(balance_costs[i] for i in members) + (bin_extra(load) if bin_extra else 0.0)
        for members, load in zip(bins, loads, strict=True)
    ]
    if config.layout == "packed":
        row = max(loads)
        sim_costs = [
            cost + config.cost.token_weight * (row - load)
            for cost, load in zip(bin_costs, loads, strict=True)
        ]
    else:
        sim_costs = bin_costs
    orders = pipeline_order_simulated(
        rank_bins,
        bin_costs,
        pp_size=parallel.pp_size,
        vpp_size=parallel.vpp_size,
        group=parallel.group_size,
        sim_costs=sim_costs,
    )
    ranks = tuple(tuple(tuple(sorted(bins[b])) for b in order) for order in orders)
    rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in ranks]
    rank_costs = [sum(costs[i] for mb in rank for i in mb) for rank in ranks]
    real_tokens = sum(rank_tokens)
    assert (
        sorted(i for rank in ranks for mb in rank for i in mb) == items
    ), "lost or duplicated sample"
    return StepPlan(
        num_microbatches=per_rank,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        ranks=ranks,
        num_rollouts=num_rollouts,
        num_placeholders=sum(1 for rank in ranks for mb in rank if not mb),
        real_tokens=real_tokens,
        fill=real_tokens / (dp * per_rank * micro_batch_size * seq_length),
        dp_imbalance=_imbalance(rank_tokens),
        dp_imbalance_cost=_imbalance(rank_costs),
        oversize_samples=tuple(oversize),
        lower_bound_microbatches=lower_bound,
    )


def _imbalance(per_rank: Sequence[float]) -> float:
    """max / mean; 1.0 when nothing is there to balance."""
    total = sum(per_rank)
    return max(per_rank) * len(per_rank) / total if total > 0 else 1.0
