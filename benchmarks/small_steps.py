"""Small steps against the peers and against the planner without its small-step candidates.

Random steps of 1-8 samples per DP rank (GRPO groups, bimodal, uniform, short, multi-turn; dp
1-128, pp 1/2/4, vpp 1/2, caps 4k-16k, a per-micro-batch overhead of 0, 1% or 5% of a full row),
where the planner scores more constructions (:mod:`megatron_dynbatch.planning.candidates`). Every
schedule is scored with the same true cost (:data:`benchmarks.metrics.EVAL_COST` plus the
overhead) by the pipeline simulator, in two row modes, each against ours planned in that mode:

* one row a step (the longest micro-batch), as a peer runs Megatron without
  ``variable_seq_lengths``;
* each micro-batch its own row, rounded up to 64 or 128 tokens (with ``variable_seq_lengths``).

A peer (:mod:`benchmarks.baselines`, written from the peers' code and diffed against it by
``benchmarks.peers``) counts where it keeps the cap. Printed: how often a peer is more than 0.5%
faster than ours, the worst ratio, and ours against ``before`` (the planner with
``StepProblem.disable_more_candidates``: the shape search alone) on the same steps.

``--wide`` draws other steps (:func:`wide_steps`): pp 3 and 8, vpp 4, odd dp, up to 40 samples a
rank, lengths all alike, full rows among tiny ones, heavy tails, two lengths.

Run: ``.venv/bin/python -m benchmarks.small_steps [--cases 150] [--seed 1] [--wide]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import sys
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple
from unittest import mock

from benchmarks.baselines import BASELINES, BaselineFailure
from benchmarks.lengths import LengthSet
from benchmarks.metrics import EVAL_COST, evaluate, ideal_step_time, step_time
from benchmarks.search import FAMILIES, _family
from megatron_dynbatch.planning import CostModel, ParallelLayout, PlannerConfig, plan_schedule
from megatron_dynbatch.planning import planner as planner_module
from megatron_dynbatch.planning.shape import choose_shape

__all__ = ["before", "compare", "overhead_cost", "random_steps", "wide_steps"]

#: The peers that plan packed micro-batches (fixed micro-batches are far behind on every step).
PEERS = {
    **{name: fn for name, fn in BASELINES.items() if name != "fixed_mbs"},
    "verl_kk_capped": functools.partial(BASELINES["verl_kk"], keep_cap=True),
}
TOLERANCE = 0.005


@contextmanager
def before() -> Iterator[None]:
    """The planner without the small-step candidates (the shape search alone)."""

    def without(problem):
        return choose_shape(dataclasses.replace(problem, disable_more_candidates=True))

    with mock.patch.object(planner_module, "choose_shape", without):
        yield


def overhead_cost(cap: int, overhead: float) -> CostModel:
    """:data:`EVAL_COST` with a per-micro-batch overhead of ``overhead`` of a full row at ``cap``."""
    return CostModel(
        token_weight=EVAL_COST.token_weight,
        attention_weight=EVAL_COST.attention_weight,
        microbatch_overhead=overhead * EVAL_COST.full_row_cost(cap),
    )


def random_steps(
    seed: int, count: int
) -> Iterator[Tuple[str, Any, ParallelLayout, int, CostModel, int]]:
    """``(label, samples, parallel, cap, cost, row_multiple)`` of ``count`` random small steps."""
    rng = random.Random(seed)
    for _ in range(count):
        family = rng.choice(FAMILIES)
        dp = rng.choice((1, 2, 4, 8, 16, 32, 64, 128))
        per_rank = rng.randint(1, 8)
        pp = rng.choice((1, 1, 2, 4))
        vpp = rng.choice((1, 2)) if pp > 1 else 1
        cap = rng.choice((4096, 8192, 16384))
        seed_ = rng.randrange(1 << 30)
        samples = _family(family, dp * per_rank, cap, seed_)
        overhead = rng.choice((0.0, 0.01, 0.05))
        cost = overhead_cost(cap, overhead)
        rows = rng.choice((64, 128))
        label = (
            f"{family} n={len(samples.lengths)} dp{dp} pp{pp} vpp{vpp} cap{cap} "
            f"overhead {overhead:.0%} rows {rows} seed{seed_}"
        )
        yield label, samples, ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp), cap, cost, rows


#: ``--wide``: length families none of the others draw (every sample alike, full rows among tiny
#: ones, a heavy tail, two lengths, all near the cap, all tiny).
WIDE_FAMILIES = ("equal", "cap_mix", "pareto", "two_point", "near_cap", "tiny")


def _wide_lengths(family: str, n: int, cap: int, rng: random.Random) -> List[int]:
    if family == "equal":
        return [max(1, min(cap, rng.choice((cap, cap // 2, cap // 3, 1000, 37))))] * n
    if family == "cap_mix":
        return [cap if rng.random() < 0.3 else rng.randint(1, 200) for _ in range(n)]
    if family == "pareto":
        return [max(1, min(cap, int(50 * rng.paretovariate(1.1)))) for _ in range(n)]
    if family == "two_point":
        a, b = rng.randint(1, cap), rng.randint(1, cap)
        return [a if rng.random() < 0.5 else b for _ in range(n)]
    if family == "near_cap":
        return [rng.randint(int(cap * 0.45), cap) for _ in range(n)]
    return [rng.randint(1, 16) for _ in range(n)]  # tiny


def wide_steps(
    seed: int, count: int
) -> Iterator[Tuple[str, Any, ParallelLayout, int, CostModel, int]]:
    """``--wide``: as :func:`random_steps`, from layouts and lengths the others do not draw: dp
    of 3, 5, 6, 12 and 24 too, pp 3 and 8, vpp 4, 1-40 samples a rank (one more or fewer than
    dp times that at times), :data:`WIDE_FAMILIES`, rollouts of 1, 4 or 8 samples, caps 1k-16k."""
    rng = random.Random(seed)
    for _ in range(count):
        family = rng.choice(WIDE_FAMILIES)
        dp = rng.choice((1, 2, 3, 5, 6, 8, 12, 16, 24, 64))
        per_rank = rng.choice((1, 2, 3, 5, 8, 13, 24, 40))
        pp = rng.choice((1, 2, 3, 4, 8))
        vpp = rng.choice((1, 2, 4)) if pp > 1 else 1
        cap = rng.choice((1024, 4096, 16384))
        n = dp * per_rank + rng.choice((0, 0, 1, -1 if dp * per_rank > 1 else 0))
        lengths = _wide_lengths(family, n, cap, rng)
        group = rng.choice((1, 4, 8))
        samples = LengthSet(lengths, [i // group for i in range(n)], None)
        overhead = rng.choice((0.0, 0.01, 0.05))
        cost = overhead_cost(cap, overhead)
        rows = rng.choice((64, 128))
        label = (
            f"{family} n={n} dp{dp} pp{pp} vpp{vpp} cap{cap} overhead {overhead:.0%} rows {rows}"
        )
        yield label, samples, ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp), cap, cost, rows


def _score(ranks, samples, parallel, cap, cost, rows, dummies=()) -> Tuple[float, int]:
    m = evaluate(
        ranks,
        samples.lengths,
        token_cap=cap,
        cost=cost,
        dummy_lengths=dummies,
        row_multiple=rows,
    )
    ideal = ideal_step_time(samples.lengths, parallel, cost)
    return step_time(m["microbatch_costs"], parallel) / ideal, m["over_cap_microbatches"]


def _ours(samples, parallel, cap, cost, rows: Optional[int]) -> float:
    config = PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=parallel,
        cost=cost,
        variable_row_lengths=rows is not None,
        row_multiple=rows or 64,
        oversize_samples="allow",
    )
    step = plan_schedule(samples.lengths, samples.rollout_ids, config=config).steps[0]
    ranks = [[list(mb) for mb in rank] for rank in step.ranks]
    return _score(ranks, samples, parallel, cap, cost, rows if step.row_lengths else None)[0]


def compare(samples, parallel, cap, cost, rows) -> Dict[str, Any]:
    """Per row mode (``None``: one row a step): ours, ours before, and the fastest peer that
    keeps the cap."""
    result: Dict[str, Any] = {}
    for mode in (None, rows):
        ours = _ours(samples, parallel, cap, cost, mode)
        with before():
            old = _ours(samples, parallel, cap, cost, mode)
        result[mode] = {"ours": ours, "before": old, "peer": None}
    for name, fn in PEERS.items():
        try:
            theirs = fn(
                samples.lengths,
                dp_size=parallel.dp_size,
                token_cap=cap,
                microbatch_multiple=parallel.microbatch_multiple,
                rollout_ids=samples.rollout_ids,
            )
        except BaselineFailure:
            continue
        dummies = getattr(theirs, "dummy_lengths", ())
        for mode in (None, rows):
            step, over = _score(theirs, samples, parallel, cap, cost, mode, dummies)
            best = result[mode]["peer"]
            if not over and (best is None or step < best[1]):
                result[mode]["peer"] = (name, step)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--wide",
        action="store_true",
        help="steps of other layouts and lengths (wide_steps: pp 3/8, vpp 4, odd dp, ...)",
    )
    args = parser.parse_args(argv)
    losses, changes, compared = [], [], 0
    steps = (wide_steps if args.wide else random_steps)(args.seed, args.cases)
    for label, samples, parallel, cap, cost, rows in steps:
        for mode, r in compare(samples, parallel, cap, cost, rows).items():
            where = f"{label}, {'one row a step' if mode is None else 'own rows'}"
            changes.append((r["ours"] / r["before"], where))
            if r["peer"] is not None:
                compared += 1
                name, step = r["peer"]
                losses.append((r["ours"] / step, where, name, r["before"] / step))
    behind = [loss for loss in losses if loss[0] > 1 + TOLERANCE]
    behind_before = [loss for loss in losses if loss[3] > 1 + TOLERANCE]
    worst = max(losses)
    print(
        f"{args.cases} random {'wide' if args.wide else 'small'} steps (seed {args.seed}), two "
        f"row modes each: {compared} "
        f"with a peer keeping the cap. A peer more than {TOLERANCE:.1%} faster than ours: "
        f"{len(behind)} (before: {len(behind_before)}); worst ours / best peer {worst[0]:.4f} "
        f"({worst[2]}, {worst[1]}; before {worst[3]:.4f}); worst before / best peer "
        f"{max(loss[3] for loss in losses):.4f}"
    )
    faster = sum(1 for ratio, _ in changes if ratio < 1 - 1e-3)
    slower = [(ratio, where) for ratio, where in changes if ratio > 1 + 1e-4]
    best = min(changes)
    print(
        f"ours / before: faster by more than 0.1% in {faster} of {len(changes)}, best "
        f"{best[0]:.4f} ({best[1]}); slower by more than 0.01% in {len(slower)}"
        + (f": worst {max(slower)[0]:.5f} ({max(slower)[1]})" if slower else "")
    )
    for ratio, where, name, old in sorted(behind, reverse=True):
        print(f"  behind {ratio:.4f} vs {name}: {where} (before {old:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
