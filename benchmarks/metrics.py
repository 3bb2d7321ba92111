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

import argparse
import json
import random
import statistics
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning.cost import microbatch_cost
from megatron_dynbatch.planning.simulate import BACKWARD_TO_FORWARD_RATIO, pipeline_makespan
from megatron_dynbatch.planning.spec import (
    ATTENTION_CROSSOVER_7B,
    LAYOUTS,
    CostModel,
    ParallelLayout,
    PlannerConfig,
    ceil_div,
    round_up,
)

__all__ = [
    "as_run_search",
    "as_run_main",
    "ratio_lines",
    "ratio_table",
    "DEFAULT_ATTENTION_CROSSOVER",
    "EVAL_COST",
    "evaluate",
    "ideal_step_time",
    "planner_config",
    "step_time",
]

#: Sequence length at which self-attention's quadratic work equals the linear (MLP, projection) work
#: of a dense transformer, for a 7B model (:data:`~megatron_dynbatch.planning.spec.ATTENTION_CROSSOVER_7B`;
#: the same ratio verl's workload estimate uses).
DEFAULT_ATTENTION_CROSSOVER = ATTENTION_CROSSOVER_7B

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
        raise DynBatchValueError(f"layout={layout!r} is not one of {LAYOUTS}.")
    if row_multiple is not None and (layout != "packed" or row_multiple < 1):
        raise DynBatchValueError(
            f"row_multiple={row_multiple!r} needs layout packed and a value >= 1."
        )
    if isinstance(token_cap, bool) or not isinstance(token_cap, int) or token_cap < 1:
        raise DynBatchValueError(f"token_cap={token_cap!r} must be an integer >= 1.")
    if not ranks:
        raise DynBatchValueError("ranks is empty; pass one list of micro-batches per DP rank.")
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
        # A placeholder runs one multiple, the shortest row (planning.step_search.variable_rows).
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


def ratio_table(
    cases: Sequence[Mapping[str, Any]],
    fractions: Sequence[float],
    keys: Sequence[str],
    tolerance: float,
) -> Dict[float, Dict[str, Dict[str, Any]]]:
    """Per overhead and ratio key (ours / a host's own), over the cases holding it: how many
    are more than ``tolerance`` slower, the worst ``(ratio, case label)``, the median and best.
    Each case is ``{"case": label, "ratios": {fraction: {key: ratio}}}``."""
    by_overhead: Dict[float, Dict[str, Dict[str, Any]]] = {}
    for fraction in fractions:
        table = {}
        for key in keys:
            ratios = [
                (c["ratios"][fraction][key], c["case"])
                for c in cases
                if key in c["ratios"][fraction]
            ]
            values = [r for r, _ in ratios]
            table[key] = {
                "compared": len(values),
                "theirs_faster_over_half_pct": sum(1 for r in values if r > 1 + tolerance),
                "worst": max(ratios, default=(1.0, "")),
                "median": statistics.median(values) if values else None,
                "best": min(values, default=None),
            }
        by_overhead[fraction] = table
    return by_overhead


def ratio_lines(
    by_overhead: Mapping[float, Mapping[str, Mapping[str, Any]]],
    names: Mapping[str, str],
    theirs: str,
) -> List[str]:
    """One line per overhead and key of :func:`ratio_table`, ``theirs`` naming the host."""
    lines = []
    for fraction, table in by_overhead.items():
        for key, row in table.items():
            worst, label = row["worst"]
            lines.append(
                f"  overhead {fraction:>4.0%} | {names[key]}: {theirs} >0.5% faster in "
                f"{row['theirs_faster_over_half_pct']}/{row['compared']}; median "
                f"{row['median']:.4f}, best {row['best']:.4f}, worst {worst:.4f} ({label})"
            )
    return lines


def packed_step(
    ranks: Sequence[Sequence[Sequence[int]]], cost: CostModel, pp: int, vpp: int = 1
) -> float:
    """The slowest rank's makespan, ``ranks[r][m]`` the padded sizes of the samples of one packed
    row (a micro-batch at its own length, attention per sample), replayed in Megatron's 1F1B or
    interleaved order (group ``pp``)."""
    return max(
        pipeline_makespan(
            [microbatch_cost(cost, "packed", sum(mb), 1, list(mb), [0] * len(mb)) for mb in rank],
            pp,
            vpp,
            pp,
        )
        for rank in ranks
    )


def draw_layout(
    rng: random.Random,
    dp_sizes: Sequence[int],
    pp_sizes: Sequence[int] = (1, 2, 4),
    caps: Sequence[int] = (4096, 8192, 16384),
) -> Tuple[int, int, int, int]:
    """``(dp, pp, tp, cap)`` of a sharded host's random step, drawn in that order from ``rng``
    (tp 1 or 2)."""
    return rng.choice(dp_sizes), rng.choice(pp_sizes), rng.choice((1, 2)), rng.choice(caps)


def sharded_planning_time(plan: Callable[[List[List[int]], int, int], Any]) -> str:
    """CPU of one plan of a sharded host's step (what every rank computes, each step):
    ``plan(lengths_per_rank, pp, vpp)`` on log-normal lengths (median ~1,800 tokens, budget
    16,384) at dp 512 x 32, 64 x 64, 8 x 256 and 4 x 1,024 samples, pp 1 and pp 4 x vpp 2."""
    rng = random.Random(0)
    lines = []
    for dp, per_rank in ((512, 32), (64, 64), (8, 256), (4, 1024)):
        lengths = [
            [min(16384, max(1, int(rng.lognormvariate(7.5, 1.0)))) for _ in range(per_rank)]
            for _ in range(dp)
        ]
        for pp, vpp in ((1, 1), (4, 2)):
            start = time.process_time()
            planned = plan(lengths, pp, vpp)
            seconds = time.process_time() - start
            lines.append(
                f"dp {dp} x {per_rank} samples, pp {pp} vpp {vpp}: {planned.num_microbatches} "
                f"micro-batches a rank, planned in {seconds:.2f} s of CPU"
            )
    return "\n".join(lines)


def as_run_main(
    argv: Optional[List[str]],
    description: str,
    search: Callable[[int, int, Sequence[float], float], Dict[str, Any]],
    format_summary: Callable[[Dict[str, Any]], str],
    default_cases: int,
    planning_time: Optional[Callable[[], str]] = None,
    parents: Sequence[argparse.ArgumentParser] = (),
) -> int:
    """The command line of an as-the-host-runs-it benchmark: ``--cases``, ``--seed``,
    ``--overheads`` (fractions of a full row), ``--crossover``, ``--json``; with
    ``planning_time``, ``--planning-time`` prints what it returns instead. ``parents``: a
    benchmark's own options (``add_help=False``), which it read before; listed in ``--help``."""
    parser = argparse.ArgumentParser(description=description, parents=list(parents))
    parser.add_argument("--cases", type=int, default=default_cases)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--overheads", default="0,0.01,0.05")
    parser.add_argument("--crossover", type=float, default=DEFAULT_ATTENTION_CROSSOVER)
    parser.add_argument("--json", action="store_true")
    if planning_time is not None:
        parser.add_argument("--planning-time", action="store_true")
    options = parser.parse_args(argv)
    if planning_time is not None and options.planning_time:
        print(planning_time())
        return 0
    overheads = [float(x) for x in options.overheads.split(",")]
    summary = search(options.cases, options.seed, overheads, options.crossover)
    print(json.dumps(summary, default=str) if options.json else format_summary(summary))
    return 0


def as_run_search(
    random_case: Callable[[random.Random, int], Any],
    run_case: Callable[[Any, Sequence[float], float], Dict[str, Any]],
    num_cases: int,
    seed: int,
    overheads: Sequence[float],
    crossover: float,
    keys: Sequence[str],
    tolerance: float,
    describe: Callable[[List[Dict[str, Any]]], Dict[str, Any]],
) -> Dict[str, Any]:
    """Run ``num_cases`` cases drawn from ``seed`` and summarise them: what ``describe`` says of
    them, the micro-batches of ours over the budget, and :func:`ratio_table` per overhead."""
    rng = random.Random(seed)
    cases = [run_case(random_case(rng, k), overheads, crossover) for k in range(num_cases)]
    return {
        "num_cases": num_cases,
        "seed": seed,
        "crossover": crossover,
        **describe(cases),
        "ours_over_cap": sum(c["ours_over_cap"] for c in cases),
        "by_overhead": ratio_table(cases, overheads, keys, tolerance),
        "cases": cases,
    }
