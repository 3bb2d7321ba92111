"""A floor under every plan of a GPU-regime step (issue 45): a linear program over Megatron's
pipeline order, with the step's work made divisible.

What no plan can beat, by this argument (the cost model and simulator of
``benchmarks.gpu_regime``):

1. A micro-batch costs at least ``overhead + token_weight * t + a``, where ``t`` is the tokens of
   its samples and ``a`` their attention (``attention_weight * L**2`` each): the row is at least
   its load and the padding's cost is not negative. ``t`` is at most the cap (no GPU-regime sample
   is longer), and ``a <= attention_weight * longest * t``.
2. :func:`~megatron_dynbatch.planning.simulate.pipeline_makespan` is the longest path through
   Megatron's order (1F1B or interleaved) with each step as long as its micro-batch's cost, so
   it never shrinks when a cost grows; for a fixed count M the least makespan of a rank holding
   ``tau`` tokens and ``alpha`` attention, over every split into micro-batches obeying (1), is a
   linear program (start times above each step's stage predecessor and dependency).
3. That least makespan is convex in ``(tau, alpha)`` (a linear program's value in its right-hand
   side), so the slowest rank of any plan is at least the value at the mean rank's share (max >=
   mean >= value at the mean), whatever the split over ranks.
4. Every count is tried, from the fewest the cap allows up to where ``M`` overheads alone reach
   the best value found (a stage runs ``3 * (M * overhead + work) / pp`` whatever the order).

Printed per case: the floor over the bound (``work / (dp x pp)``, as ``gpu_regime``), our
default and thorough planners beside it, and with ``--shape`` the floor's own micro-batch costs
(per stage, ms): a short geometric rise, the largest micro-batches, then a long descent, the
shape :func:`megatron_dynbatch.planning.cluster.tent_profile` packs to. The floor lets every
sample be cut at will, so it is below what whole samples reach; a mean above 1.10 would prove
the issue's goal out of reach, a mean below it proves nothing.

Needs scipy (``.venv/bin/pip install scipy``; not a dependency of the project).
Run: ``.venv/bin/python -m benchmarks.pipeline_floor [--seeds 0] [--shape]`` (about 15 s a seed).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, Tuple

from benchmarks.gpu_regime import CAP, Assumptions, Case, _told, cases, true_cost
from megatron_dynbatch.planning.simulate import BACKWARD_TO_FORWARD_RATIO, _replay_order
from megatron_dynbatch.planning.spec import THOROUGH_PLANNER, CostModel


def rank_floor(
    count: int,
    pp: int,
    vpp: int,
    group: int,
    cost: CostModel,
    tokens: float,
    attention: float,
    longest: int,
) -> Tuple[float, List[float]]:
    """The least makespan of a rank of ``count`` micro-batches holding ``tokens`` and
    ``attention`` (divisible as in the module's (1)), and its micro-batches' costs."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    order = _replay_order(count, pp, vpp, group if vpp > 1 else 1)
    share = float(pp * vpp)
    tw, aw, overhead = cost.token_weight, cost.attention_weight, cost.overhead
    # Variables: t_m, a_m (m < count), a start time per step, the makespan.
    starts = 2 * count
    makespan = starts + len(order)
    rows, cols, values, bounds_ub = [], [], [], []

    def after(step: int, m: int, backward: bool, later: int) -> None:
        """``later`` starts after ``step`` (micro-batch ``m``) ends."""
        scale = (BACKWARD_TO_FORWARD_RATIO if backward else 1.0) / share
        row = len(bounds_ub)
        rows.extend([row] * 4)
        cols.extend([starts + step, m, count + m, later])
        values.extend([1.0, scale * tw, scale, -1.0])
        bounds_ub.append(-scale * overhead)

    index, last = {}, {}
    for k, (stage, slot, dep, m, backward) in enumerate(order):
        index[slot] = (k, m, backward)
        if stage in last:
            after(*last[stage], starts + k)
        if dep >= 0:
            after(*index[dep], starts + k)
        last[stage] = (k, m, backward)
    for k, m, backward in last.values():
        after(k, m, backward, makespan)
    for m in range(count):
        row = len(bounds_ub)
        rows.extend([row, row])
        cols.extend([count + m, m])
        values.extend([1.0, -aw * longest])
        bounds_ub.append(0.0)
    width = makespan + 1
    a_ub = coo_matrix((values, (rows, cols)), shape=(len(bounds_ub), width)).tocsr()
    a_eq = np.zeros((2, width))
    a_eq[0, :count] = 1.0
    a_eq[1, count : 2 * count] = 1.0
    objective = np.zeros(width)
    objective[makespan] = 1.0
    bounds = [(0.0, float(CAP))] * count + [(0.0, None)] * (width - count)
    result = linprog(
        objective,
        A_ub=a_ub,
        b_ub=np.array(bounds_ub),
        A_eq=a_eq,
        b_eq=[tokens, attention],
        bounds=bounds,
        method="highs",
    )
    if result.status != 0:
        raise RuntimeError(f"the linear program failed: {result.message}")
    x = result.x
    return float(result.fun), [overhead + tw * x[m] + x[count + m] for m in range(count)]


def case_floor(case: Case) -> Tuple[float, int, List[float]]:
    """The floor of ``case`` over its bound, the count that gives it and that rank's costs."""
    cost = true_cost(case, Assumptions())
    parallel = case.parallel
    pp, vpp, dp = parallel.pp_size, parallel.vpp_size, parallel.dp_size
    lengths = case.samples.lengths
    tokens = sum(lengths) / dp
    attention = sum(cost.attention_weight * length * length for length in lengths) / dp
    work = cost.token_weight * tokens + attention
    ratio = 1.0 + BACKWARD_TO_FORWARD_RATIO
    bound = ratio * work / pp
    multiple = parallel.microbatch_multiple
    count = max(multiple, -(-int(tokens // CAP + 1) // multiple) * multiple)
    best: Tuple[float, int, List[float]] = (float("inf"), 0, [])
    while ratio * (count * cost.overhead + work) / pp < best[0]:
        value, costs = rank_floor(
            count, pp, vpp, parallel.group_size, cost, tokens, attention, max(lengths)
        )
        if value < best[0]:
            best = (value, count, costs)
        count += multiple
    return best[0] / bound, best[1], best[2]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0", help="workload seeds, comma separated")
    parser.add_argument("--shape", action="store_true", help="print the floor's micro-batches")
    args = parser.parse_args(argv)
    try:
        import scipy  # noqa: F401
    except ImportError:
        print("benchmarks.pipeline_floor needs scipy: .venv/bin/pip install scipy", file=sys.stderr)
        return 2
    floors, ours, thorough = [], [], []
    print("| seed | case | floor | M | ours | thorough |")
    print("|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        for case in cases(seed):
            cost = true_cost(case, Assumptions())
            floor, count, costs = case_floor(case)
            mine = _told(case, cost)["step"]
            deep = _told(case, cost, THOROUGH_PLANNER)["step"]
            floors.append(floor)
            ours.append(mine)
            thorough.append(deep)
            print(f"| {seed} | {case.label} | {floor:.3f} | {count} | {mine:.3f} | {deep:.3f} |")
            if args.shape:
                per_stage = case.parallel.pp_size * 1e3
                print("|  |  | " + " ".join(f"{c / per_stage:.0f}" for c in costs) + " |  |  |  |")
    n = len(floors)
    print(
        f"\nmean over {n} cases: floor {sum(floors) / n:.4f}, ours {sum(ours) / n:.4f}, "
        f"thorough {sum(thorough) / n:.4f} (step / bound)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
