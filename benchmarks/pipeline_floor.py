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

**With whole samples** (``--whole CASES``, :func:`whole_floor`): a higher floor that keeps the
samples longer than half the cap whole. No two of them fit one row, so each sits in a micro-batch
of its own among them; in bands (at the cap, from three quarters of it, the rest), a micro-batch
holding one has at least that band's shortest tokens and their attention, and the other samples'
attention is at most the longest short sample's per token.

5. For a limit ``T`` and a count M, the holdings ``(tokens, attention, long samples per band)`` a
   rank can have with its makespan within ``T`` are those of a mixed-integer program (the linear
   program of (2) with a binary per micro-batch and band). Every rank of a plan ending by ``T``
   holds such a point, so the mean rank's share lies in their convex hull.
6. A direction ``d`` with ``d . share`` above the program's largest ``d . holding`` (the
   solver's bound, valid when it stops early) proves the share outside the hull: no plan of M
   micro-batches ends by ``T``. Directions are searched by cutting planes over the holdings
   found; when none separates (or the rounds run out) the count is taken to fit, which only
   lowers the floor.
7. The floor is the largest ``T`` (bisection, to 0.004 of the bound) at which every count up to
   the overhead limit of (4) is separated (counts whose divisible floor is already above ``T``
   need no program).

Needs scipy (``.venv/bin/pip install scipy``; not a dependency of the project).
Run: ``.venv/bin/python -m benchmarks.pipeline_floor [--seeds 0] [--shape] [--whole CASES]``
(about 15 s a seed; the whole-sample floor minutes to an hour a case).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from benchmarks.gpu_regime import CAP, Assumptions, Case, _told, cases, true_cost
from megatron_dynbatch.planning.simulate import BACKWARD_TO_FORWARD_RATIO, _replay_order
from megatron_dynbatch.planning.spec import THOROUGH_PLANNER, CostModel


def _pipeline_rows(
    order, count: int, share: float, cost: CostModel, starts: int, makespan: int
) -> Tuple[List[int], List[int], List[float], List[float]]:
    """Megatron's order as ``A x <= b`` rows over ``t_m`` (column ``m``), ``a_m``
    (``count + m``), a start per step (``starts + k``) and the makespan: each step starts after
    its stage predecessor and its dependency end, and the makespan after every stage's last."""
    tw, overhead = cost.token_weight, cost.overhead
    rows: List[int] = []
    cols: List[int] = []
    values: List[float] = []
    bounds_ub: List[float] = []

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
    return rows, cols, values, bounds_ub


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
    aw = cost.attention_weight
    # Variables: t_m, a_m (m < count), a start time per step, the makespan.
    starts = 2 * count
    makespan = starts + len(order)
    rows, cols, values, bounds_ub = _pipeline_rows(
        order, count, float(pp * vpp), cost, starts, makespan
    )
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
    tw, overhead = cost.token_weight, cost.overhead
    return float(result.fun), [overhead + tw * x[m] + x[count + m] for m in range(count)]


def _mean_share(case: Case, cost: CostModel) -> Tuple[float, float, float, float, int]:
    """The mean rank's tokens, attention and work (in ``cost``'s units), the bound (a stage's
    share of that work, backward included) and the fewest micro-batches that hold the tokens."""
    parallel = case.parallel
    lengths = case.samples.lengths
    tokens = sum(lengths) / parallel.dp_size
    attention = sum(cost.attention_weight * n * n for n in lengths) / parallel.dp_size
    work = cost.token_weight * tokens + attention
    bound = (1.0 + BACKWARD_TO_FORWARD_RATIO) * work / parallel.pp_size
    multiple = parallel.microbatch_multiple
    first = max(multiple, -(-int(tokens // CAP + 1) // multiple) * multiple)
    return tokens, attention, work, bound, first


def case_floor(case: Case) -> Tuple[float, int, List[float]]:
    """The floor of ``case`` over its bound, the count that gives it and that rank's costs."""
    cost = true_cost(case, Assumptions())
    parallel = case.parallel
    pp, vpp = parallel.pp_size, parallel.vpp_size
    lengths = case.samples.lengths
    tokens, attention, work, bound, count = _mean_share(case, cost)
    ratio = 1.0 + BACKWARD_TO_FORWARD_RATIO
    multiple = parallel.microbatch_multiple
    best: Tuple[float, int, List[float]] = (float("inf"), 0, [])
    while ratio * (count * cost.overhead + work) / pp < best[0]:
        value, costs = rank_floor(
            count, pp, vpp, parallel.group_size, cost, tokens, attention, max(lengths)
        )
        if value < best[0]:
            best = (value, count, costs)
        count += multiple
    return best[0] / bound, best[1], best[2]


def _bands(lengths: Sequence[int]) -> List[Tuple[int, int, int]]:
    """The samples longer than half the cap, in bands: ``(shortest, longest, count)`` of those at
    the cap, of those from three quarters of it, of the rest above half of it (empty ones left
    out). No two of them fit one row, so each holds a micro-batch of its own among them."""
    half, three_quarters = CAP // 2, 3 * CAP // 4
    groups = (
        [n for n in lengths if n >= CAP],
        [n for n in lengths if three_quarters <= n < CAP],
        [n for n in lengths if half < n < three_quarters],
    )
    return [(min(g), max(g), len(g)) for g in groups if g]


@contextlib.contextmanager
def _quiet():
    """HiGHS's MIP solver prints debugging lines from C++ on the process's own stdout: drop them."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


class _WholeRank:
    """One rank of ``count`` micro-batches as a mixed-integer program (module docstring, "With
    whole samples"): per micro-batch its tokens ``t``, attention ``a`` and, per band, whether it
    holds one of the band's samples (binary); a start per step; the makespan. Costs in ms."""

    def __init__(self, case: Case, count: int) -> None:
        import numpy as np
        from scipy.sparse import coo_matrix

        parallel = case.parallel
        pp, vpp = parallel.pp_size, parallel.vpp_size
        us = true_cost(case, Assumptions())
        cost = replace(
            us,
            token_weight=us.token_weight / 1e3,
            attention_weight=us.attention_weight / 1e3,
            microbatch_overhead=us.overhead / 1e3,
        )
        lengths = case.samples.lengths
        if max(lengths) > CAP:
            raise ValueError("the whole-sample floor assumes no sample is longer than the cap")
        aw = cost.attention_weight
        self.bands = _bands(lengths)
        # The longest sample not in a band: what every other sample's attention is within.
        short = max([n for n in lengths if 2 * n <= CAP] or [0])
        order = _replay_order(count, pp, vpp, parallel.group_size if vpp > 1 else 1)
        bands, j = self.bands, len(self.bands)
        self.count, self.j = count, j
        self.band_at = 2 * count
        starts = self.band_at + count * j
        self.makespan = starts + len(order)
        width = self.makespan + 1
        rows, cols, values, ub = _pipeline_rows(
            order, count, float(pp * vpp), cost, starts, self.makespan
        )
        lb = [-np.inf] * len(ub)

        def add(terms, low, high):
            row = len(ub)
            for col, value in terms:
                rows.append(row)
                cols.append(col)
                values.append(value)
            lb.append(low)
            ub.append(high)

        for m in range(count):
            held = [self.band_at + m * j + b for b in range(j)]
            # At most one band sample; at least its tokens and attention; the others' attention
            # within ``short`` per token, the band sample's within its longest.
            add([(c, 1.0) for c in held], 0.0, 1.0)
            add([(m, 1.0)] + [(c, -float(bands[b][0])) for b, c in enumerate(held)], 0.0, np.inf)
            add(
                [(count + m, 1.0)] + [(c, -aw * bands[b][0] ** 2) for b, c in enumerate(held)],
                0.0,
                np.inf,
            )
            add(
                [(count + m, 1.0), (m, -aw * short)]
                + [(c, -aw * (bands[b][1] ** 2 - short * bands[b][1])) for b, c in enumerate(held)],
                -np.inf,
                0.0,
            )
        self.matrix = coo_matrix((values, (rows, cols)), shape=(len(ub), width)).tocsr()
        self.lb, self.ub = np.array(lb), np.array(ub)
        self.integrality = np.zeros(width)
        self.integrality[self.band_at : starts] = 1
        self.upper = np.full(width, np.inf)
        self.upper[:count] = CAP
        self.upper[self.band_at : starts] = 1.0
        self.width = width
        # The mean rank's share, scaled to about 1 a coordinate: tokens, attention, band counts.
        tokens, attention, _, self.bound, _ = _mean_share(case, cost)
        share = [tokens, attention] + [k / parallel.dp_size for _, _, k in bands]
        self.scale = np.array([max(v, 1e-9) for v in share[:2]] + [1.0] * j)
        self.target = np.array(share) / self.scale

    def support(self, direction, limit: float):
        """An upper bound on ``direction . x`` over what one rank holds within ``limit`` ms
        (the solver's bound, so valid when it stops early), and the holding it found (``None``
        when nothing fits)."""
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp

        count, j = self.count, self.j
        weights = np.asarray(direction) / self.scale
        objective = np.zeros(self.width)
        objective[:count] = -weights[0]
        objective[count : 2 * count] = -weights[1]
        for b in range(j):
            objective[self.band_at + b : self.band_at + count * j : j] = -weights[2 + b]
        upper = self.upper.copy()
        upper[self.makespan] = limit
        with _quiet():
            result = milp(
                objective,
                constraints=LinearConstraint(self.matrix, self.lb, self.ub),
                integrality=self.integrality,
                bounds=Bounds(np.zeros(self.width), upper),
                options={"time_limit": 60.0, "mip_rel_gap": 1e-5},
            )
        if result.x is None:
            if result.status == 2:  # infeasible: no holding fits within the limit
                return -np.inf, None
            raise RuntimeError(f"the mixed-integer program failed: {result.message}")
        bound = result.mip_dual_bound if result.mip_dual_bound is not None else result.fun
        x = result.x
        held = [x[:count].sum(), x[count : 2 * count].sum()]
        held += [x[self.band_at + b : self.band_at + count * j : j].sum() for b in range(j)]
        return -bound, np.array(held) / self.scale

    def separated(self, limit: float, start=None):
        """A direction in which the mean rank's share lies beyond everything one rank can hold
        within ``limit`` ms (then no plan of this count ends by ``limit``), or ``None`` when the
        share is in the convex hull of holdings found (cutting planes over the directions)."""
        import numpy as np
        from scipy.optimize import linprog

        n = 2 + self.j
        if start is None:
            # More tokens and attention, fewer long samples: what a rank within a limit lacks.
            start = np.concatenate([np.ones(2), -np.ones(self.j)])
        direction, cuts = np.asarray(start, dtype=float), []
        for _ in range(_SEPARATION_ROUNDS):
            value, held = self.support(direction, limit)
            if held is None or value < direction @ self.target - 1e-9:
                return direction
            cuts.append(np.concatenate([held - self.target, [-1.0]]))
            # The direction the holdings found so far leave most room in.
            result = linprog(
                np.concatenate([np.zeros(n), [1.0]]),
                A_ub=np.array(cuts),
                b_ub=np.zeros(len(cuts)),
                bounds=[(-1.0, 1.0)] * n + [(None, None)],
                method="highs",
            )
            if result.fun > -1e-9:
                return None
            direction = result.x[:n]
        return None


#: Directions tried per count and limit before the floor gives up on separating (conservative:
#: giving up only lowers the floor).
_SEPARATION_ROUNDS = 60


def whole_floor(case: Case, low: float, high: float, tolerance: float = 0.004) -> float:
    """The floor with whole long samples (module docstring), over the bound: the largest limit
    between ``low`` (a floor already shown) and ``high`` found by bisection at which every
    count is separated (to within ``tolerance``)."""
    parallel = case.parallel
    cost = true_cost(case, Assumptions())
    longest = max(case.samples.lengths)
    pp, vpp = parallel.pp_size, parallel.vpp_size
    tokens, attention, work, bound, first = _mean_share(case, cost)
    multiple = parallel.microbatch_multiple
    ranks: dict = {}
    directions: dict = {}
    divisible: dict = {}

    def divisible_floor(count: int) -> float:
        """The count's divisible floor (the same at every limit: solved once)."""
        if count not in divisible:
            try:
                divisible[count] = rank_floor(
                    count, pp, vpp, parallel.group_size, cost, tokens, attention, longest
                )[0]
            except RuntimeError:
                divisible[count] = math.inf  # the count cannot hold the rank's share under the cap
        return divisible[count]

    def beyond(limit: float) -> bool:
        """Every count separated at ``limit`` (over the bound)."""
        count, last = first, None
        # A stage runs 3 * (M * overhead + work) / pp whatever the order: counts past that lose.
        while (1.0 + BACKWARD_TO_FORWARD_RATIO) * (count * cost.overhead + work) / pp < (
            limit * bound
        ):
            if divisible_floor(count) < limit * bound:
                if count not in ranks:
                    ranks[count] = _WholeRank(case, count)
                rank = ranks[count]
                found = rank.separated(limit * rank.bound, directions.get(count, last))
                if found is None:
                    return False
                directions[count] = last = found
            count += multiple
        return True

    while high - low > tolerance:
        middle = (low + high) / 2
        if beyond(middle):
            low = middle
        else:
            high = middle
    return low


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0", help="workload seeds, comma separated")
    parser.add_argument("--shape", action="store_true", help="print the floor's micro-batches")
    parser.add_argument(
        "--whole",
        metavar="CASES",
        help="also the floor with whole long samples for the cases whose label contains CASES "
        "('dp16', '7b grpo', 'all'; minutes a case)",
    )
    args = parser.parse_args(argv)
    try:
        import scipy  # noqa: F401
    except ImportError:
        print("benchmarks.pipeline_floor needs scipy: .venv/bin/pip install scipy", file=sys.stderr)
        return 2
    floors, ours, thorough = [], [], []
    whole = "" if args.whole == "all" else args.whole
    print(
        "| seed | case | floor | M | ours | thorough |"
        + (" whole samples |" if whole is not None else "")
    )
    print("|---|---|---|---|---|---|" + ("---|" if whole is not None else ""))
    for seed in (int(s) for s in args.seeds.split(",")):
        for case in cases(seed):
            cost = true_cost(case, Assumptions())
            floor, count, costs = case_floor(case)
            mine = _told(case, cost)["step"]
            deep = _told(case, cost, THOROUGH_PLANNER)["step"]
            floors.append(floor)
            ours.append(mine)
            thorough.append(deep)
            row = f"| {seed} | {case.label} | {floor:.3f} | {count} | {mine:.3f} | {deep:.3f} |"
            if whole is not None:
                shown = whole_floor(case, floor, deep) if whole in case.label else None
                row += f" {shown:.3f} |" if shown is not None else " |"
            print(row, flush=True)
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
