"""Quality measures of one step's schedule, the same for the planner and every baseline.

:func:`evaluate` takes ``ranks[r][m]`` (sample indices per micro-batch per DP rank; an empty list is a
placeholder) and reports how many micro-batches it runs against a lower bound, how much of the
computed tokens are real, the DP balance, cap violations and whether every sample is trained exactly
once. Each micro-batch's compute cost comes from the planner's own cost model
(:mod:`megatron_dynbatch.planning.cost`), and :func:`step_time` replays the ranks through Megatron's
pipeline order (:mod:`megatron_dynbatch.planning.simulate`), so every scheduler is scored by the
formula the planner optimises.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Optional, Sequence

from megatron_dynbatch.planning.cost import microbatch_cost
from megatron_dynbatch.planning.simulate import BACKWARD_TO_FORWARD_RATIO, pipeline_makespan
from megatron_dynbatch.planning.spec import (
    DEFAULT_ATTENTION_CROSSOVER,
    LAYOUTS,
    CostModel,
    ParallelLayout,
    PlannerConfig,
    ceil_div,
    round_up,
)

__all__ = [
    "DEFAULT_ATTENTION_CROSSOVER",
    "EVAL_COST",
    "evaluate",
    "ideal_step_time",
    "planner_config",
    "step_time",
]

# DEFAULT_ATTENTION_CROSSOVER (planning/spec.py): the sequence length at which self-attention's
# quadratic work equals a dense transformer's linear work (24576: a 7B model; the same ratio verl's
# workload estimate uses). Re-exported for the benchmarks.

#: The cost model of every benchmark figure: ``L + L^2 / 24576`` per sample, padding included.
EVAL_COST = CostModel(token_weight=1.0, attention_weight=1.0 / DEFAULT_ATTENTION_CROSSOVER)


def planner_config(
    token_cap: int, parallel: ParallelLayout, cost: CostModel = EVAL_COST
) -> PlannerConfig:
    """Our planner's config for a benchmark, built as training builds it
    (``config_from_mapping(...).planner_config(...)``); an unknown overhead stays unknown (the
    shipped default), oversize samples run alone (``allow``)."""
    from megatron_dynbatch.config import config_from_mapping

    values = {
        "max_tokens_per_gpu": token_cap,
        "cost_token_weight": cost.token_weight,
        "cost_attention_weight": cost.attention_weight,
        "cost_response_weight": cost.response_weight,
        "cost_microbatch_overhead": cost.microbatch_overhead,
        "cost_shape_exchange_overhead": cost.shape_exchange_overhead,
        "cost_attention": cost.attention,
    }
    fixed = {"oversize_samples": "allow"}
    return config_from_mapping(values, fixed=fixed, host="benchmark").planner_config(parallel)


def _ratio_max_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def evaluate(
    ranks: Sequence[Sequence[Sequence[int]]],
    lengths: Sequence[int],
    *,
    token_cap: int,
    layout: str = "packed",
    cost: CostModel = EVAL_COST,
    sample_multiple: int = 1,
    prompt_lengths: Optional[Sequence[int]] = None,
    dummy_lengths: Sequence[int] = (),
    row_multiple: Optional[int] = None,
) -> Dict[str, Any]:
    """Measures one step's schedule.

    By default the step runs with one uniform micro-batch shape, as Megatron's pipeline
    communication needs without ``variable_seq_lengths``: ``packed`` rows of length ``S`` = the
    largest micro-batch's padded tokens, or ``padded`` ``[B, S]`` with ``B`` = the most samples in
    any micro-batch and ``S`` = the longest sample. Placeholders run that same shape. With
    ``row_multiple`` (``packed`` only) every micro-batch runs its own row, its padded tokens rounded
    up to that multiple, as slime runs Megatron (``variable_seq_lengths``, rows padded to 128), and
    pays the cost model's ``shape_exchange_overhead``; a placeholder runs one ``row_multiple``.

    Args:
        ranks: ``ranks[r][m]`` = global sample indices; ``[]`` = placeholder micro-batch.
        lengths: Token length of every sample of the step (indices refer to this list).
        token_cap: The per-micro-batch token budget the schedule was made for.
        layout: ``packed`` or ``padded``.
        cost: The cost model of every micro-batch (default :data:`EVAL_COST`).
        sample_multiple: Every sample's segment is padded to a multiple of this (TP/CP).
        prompt_lengths: Prompt tokens per sample (0 where ``None``), for the response term.
        dummy_lengths: Loss-masked filler samples a framework computes besides the real ones
            (SkyRL pads a mini-batch with copies of sample 0); index ``len(lengths) + k`` in
            ``ranks`` is filler ``k``. They count as computed, never as real tokens.
        row_multiple: Variable row lengths, each micro-batch's rounded up to this (see above);
            ``seq_length`` then reports the longest row.

    Returns:
        A dict with:

        * ``dp_size``, ``microbatches_per_rank``, ``num_microbatches`` (max over ranks),
          ``equal_counts``;
        * ``num_placeholders`` (empty micro-batches, all ranks), ``num_real_microbatches``;
        * ``lower_bound_microbatches``: oversize samples + ``ceil(other tokens / token_cap)``, all
          ranks together; ``lower_bound_per_rank`` = that over ``dp``, rounded up;
        * ``real_tokens``, ``seq_length`` (S), ``micro_batch_size`` (B), ``computed_tokens``
          (``dp * M * B * S``), ``fill`` (real / computed);
        * ``max_microbatch_tokens`` (largest footprint: tokens packed, rows x longest padded),
          ``over_cap_microbatches`` (footprint > cap with two or more samples), ``oversize_samples``;
        * ``rank_tokens``, ``dp_imbalance`` (max / mean real tokens over ranks), ``rank_costs``,
          ``dp_imbalance_cost`` (the same by the computed cost, padding included);
        * ``microbatch_costs[r][m]``: forward cost of the micro-batch in the uniform shape
          (:func:`megatron_dynbatch.planning.cost.microbatch_cost`), for the simulator;
        * ``coverage_ok``, ``missing``, ``duplicated``, ``out_of_range``: every sample exactly once.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}.")
    if row_multiple is not None and (layout != "packed" or row_multiple < 1):
        raise ValueError(f"row_multiple={row_multiple!r} needs layout packed and a value >= 1.")
    if isinstance(token_cap, bool) or not isinstance(token_cap, int) or token_cap < 1:
        raise ValueError(f"token_cap={token_cap!r} must be an integer >= 1.")
    if not ranks:
        raise ValueError("ranks is empty; pass one list of micro-batches per DP rank.")
    n = len(lengths)
    every_length = list(lengths) + list(dummy_lengths)
    prompts = list(prompt_lengths) if prompt_lengths is not None else [0] * n
    prompts += [0] * len(dummy_lengths)
    sizes = [round_up(length, sample_multiple) for length in every_length]
    dp_size = len(ranks)

    seen = Counter(i for rank in ranks for mb in rank for i in mb)
    total = len(every_length)
    out_of_range = sorted(i for i in seen if not (isinstance(i, int) and 0 <= i < total))
    duplicated = sorted(i for i, count in seen.items() if count > 1 and i not in out_of_range)
    missing = [i for i in range(total) if i not in seen]
    valid = [[[i for i in mb if i not in out_of_range] for mb in rank] for rank in ranks]

    counts = [len(rank) for rank in valid]
    num_microbatches = max(counts)
    all_mbs = [mb for rank in valid for mb in rank]
    num_placeholders = sum(1 for mb in all_mbs if not mb)

    oversize = sorted(i for i in range(n) if sizes[i] > token_cap)
    other_tokens = sum(size for size in sizes[:n] if size <= token_cap)
    lower_bound = len(oversize) + ceil_div(other_tokens, token_cap)

    def footprint(mb: Sequence[int]) -> int:
        if not mb:
            return 0
        if layout == "packed":
            return sum(sizes[i] for i in mb)
        return len(mb) * max(sizes[i] for i in mb)

    real_tokens = sum(lengths[i] for mb in all_mbs for i in mb if i < n)
    if layout == "packed":
        micro_batch_size = 1
        seq_length = max((footprint(mb) for mb in all_mbs), default=0)
    else:
        micro_batch_size = max((len(mb) for mb in all_mbs), default=1) or 1
        seq_length = max((sizes[i] for mb in all_mbs for i in mb), default=0)
    computed = dp_size * num_microbatches * micro_batch_size * seq_length
    placeholder_row = row_multiple
    if row_multiple is not None:
        real_rows = [round_up(footprint(mb), row_multiple) for mb in all_mbs if mb]
        # A placeholder runs one multiple, the shortest row (planning.shape.variable_rows).
        placeholder_row = row_multiple
        placeholders = dp_size * num_microbatches - len(real_rows)
        computed = sum(real_rows) + placeholder_row * placeholders
    over_cap = sum(1 for mb in all_mbs if len(mb) > 1 and footprint(mb) > token_cap)

    def computed_cost(mb: Sequence[int]) -> float:
        row, extra = seq_length, 0.0
        if row_multiple is not None:
            row = round_up(footprint(mb), row_multiple) if mb else placeholder_row
            extra = cost.shape_exchange_overhead
        return extra + microbatch_cost(
            cost,
            layout,
            row,
            micro_batch_size,
            [sizes[i] for i in mb],
            [every_length[i] - prompts[i] for i in mb],
        )

    microbatch_costs = [[computed_cost(mb) for mb in rank] for rank in valid]
    rank_tokens = [sum(lengths[i] for mb in rank for i in mb if i < n) for rank in valid]
    rank_costs = [sum(rank) for rank in microbatch_costs]
    return {
        "dp_size": dp_size,
        "microbatches_per_rank": counts,
        "num_microbatches": num_microbatches,
        "equal_counts": len(set(counts)) == 1,
        "num_placeholders": num_placeholders,
        "num_real_microbatches": len(all_mbs) - num_placeholders,
        "lower_bound_microbatches": lower_bound,
        "lower_bound_per_rank": ceil_div(lower_bound, dp_size),
        "real_tokens": real_tokens,
        "seq_length": seq_length,
        "micro_batch_size": micro_batch_size,
        "computed_tokens": computed,
        "fill": real_tokens / computed if computed else 0.0,
        "max_microbatch_tokens": max((footprint(mb) for mb in all_mbs), default=0),
        "over_cap_microbatches": over_cap,
        "oversize_samples": oversize,
        "rank_tokens": rank_tokens,
        "dp_imbalance": _ratio_max_mean(rank_tokens),
        "rank_costs": rank_costs,
        "dp_imbalance_cost": _ratio_max_mean(rank_costs),
        "microbatch_costs": microbatch_costs,
        "coverage_ok": not (missing or duplicated or out_of_range),
        "missing": missing,
        "duplicated": duplicated,
        "out_of_range": out_of_range,
    }


def step_time(microbatch_costs: Sequence[Sequence[float]], parallel: ParallelLayout) -> float:
    """Simulated step time: the slowest DP rank's pipeline makespan (Megatron's order)."""
    return max(
        pipeline_makespan(
            costs,
            parallel.pp_size,
            parallel.vpp_size,
            parallel.microbatch_group_size_per_vp_stage,
        )
        for costs in microbatch_costs
    )


def ideal_step_time(
    lengths: Sequence[int],
    parallel: ParallelLayout,
    cost: CostModel = EVAL_COST,
    prompt_lengths: Optional[Sequence[int]] = None,
) -> float:
    """All real forward+backward work over ``dp * pp`` GPUs: no padding, no bubble, no imbalance.

    The same for every scheduler of a step, so *step / ideal* charges padding, placeholders,
    per-micro-batch overhead, imbalance and bubbles to the schedule that causes them.
    """
    prompts = prompt_lengths if prompt_lengths is not None else [0] * len(lengths)
    work = sum(cost.cost(length, length - p) for length, p in zip(lengths, prompts, strict=True))
    return work * (1.0 + BACKWARD_TO_FORWARD_RATIO) / (parallel.dp_size * parallel.pp_size)
