"""How far a GPU-regime rank can get when only its large samples are whole (issue 45): an
estimate, not a bound.

One DP rank of a case (``benchmarks.gpu_regime``) holds its share of the step's work (the step's
real work over ``dp``); ``--big`` of the step's largest samples are whole micro-batches side by
side (their true cost, the per-micro-batch overhead included), the rest of its work is
*divisible*: cut into micro-batches of any cost (each paying the overhead, none above a full
row's linear work plus the overhead, the most a row of short samples costs). For every count M
up to three times the fewest and every position of the large samples in the middle half, starting from even loads and from
two geometric tents peaking there, the costs of the divisible micro-batches are improved by a
local search (pairwise transfers, seeded, a few thousand replays each) on the simulated pipeline
(Megatron's order). Printed: the best makespan found over the rank's share of the bound, the
figure comparable with ``step / bound`` when every rank looks alike.

Local search finds a good schedule, not the best, so this is an estimate from above of the
divisible relaxation; and the relaxation lets the rest of the work be cut at will, which whole
samples cannot. It says where a rank shaped like this tops out, not what the step can reach.

Run: ``.venv/bin/python -m benchmarks.gpu_regime_relaxed [--big 1] [--cases dp16]`` (about 10 s
a case).
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import List, Optional, Sequence

from benchmarks.gpu_regime import CAP, Assumptions, Case, cases, true_cost
from megatron_dynbatch.planning.simulate import BACKWARD_TO_FORWARD_RATIO, pipeline_makespan

#: Pairwise transfers tried per (count, position).
STEPS = 1500


def relaxed_rank(case: Case, big: int, seed: int = 0) -> float:
    """The best makespan found for one rank of ``case`` holding ``big`` of the largest samples
    whole and the rest of its share divisible, over its share of the bound."""
    cost = true_cost(case, Assumptions())
    parallel = case.parallel
    pp, vpp, dp = parallel.pp_size, parallel.vpp_size, parallel.dp_size
    lengths = sorted(case.samples.lengths, reverse=True)
    own = [cost.cost(length, 0) for length in lengths]
    share = sum(own) / dp
    whole = [own[k] + cost.overhead for k in range(big)]
    rest = share - sum(own[k] for k in range(big))
    ceiling = cost.token_weight * CAP + cost.overhead
    bound = (1.0 + BACKWARD_TO_FORWARD_RATIO) * share / pp
    step = 1 if vpp == 1 else pp
    fewest = big + max(1, int(rest // (ceiling - cost.overhead)) + 1)
    fewest = -(-fewest // step) * step
    best = float("inf")
    for count in range(fewest, 3 * fewest + 1, step):
        free = count - big
        if free < 1 or rest / free + cost.overhead > ceiling:
            continue
        cut = ceiling - cost.overhead
        for position in range(free // 4, 3 * free // 4 + 1):
            for first in (1.0, 0.3, 0.1):
                loads = _tent(free, position, first, rest, cut)
                if loads is None:
                    continue
                found = _search(loads, whole, position, cost.overhead, ceiling, parallel, seed)
                best = min(best, found)
    return best / bound


def _tent(count: int, peak: int, first: float, total: float, cut: float) -> Optional[List[float]]:
    """``count`` loads rising geometrically from ``first`` of the level to it at ``peak`` and
    falling back to ``first`` at the end (``first`` 1: even), scaled to add up to ``total``,
    none above ``cut``; ``None`` where they cannot."""
    shape = []
    for k in range(count):
        if k <= peak:
            shape.append(first ** ((peak - k) / max(1, peak)))
        else:
            shape.append(first ** ((k - peak) / max(1, count - 1 - peak)))
    if cut * count < total:
        return None
    low, high = 0.0, total / min(shape)
    for _ in range(60):
        middle = (low + high) / 2
        if sum(min(cut, middle * x) for x in shape) < total:
            low = middle
        else:
            high = middle
    loads = [min(cut, high * x) for x in shape]
    scale = total / sum(loads)
    return [x * scale for x in loads]


def _search(
    loads: List[float],
    whole: Sequence[float],
    position: int,
    overhead: float,
    ceiling: float,
    parallel,
    seed: int,
) -> float:
    def span(values: Sequence[float]) -> float:
        costs = [v + overhead for v in values]
        costs[position:position] = whole
        return pipeline_makespan(costs, parallel.pp_size, parallel.vpp_size, parallel.group_size)

    rng = random.Random(seed)
    current = span(loads)
    delta = max(loads) / 4
    for k in range(STEPS):
        i, j = rng.randrange(len(loads)), rng.randrange(len(loads))
        if i == j:
            continue
        moved = min(delta * rng.random(), loads[i])
        if loads[j] + moved + overhead > ceiling:
            continue
        loads[i] -= moved
        loads[j] += moved
        time = span(loads)
        if time < current:
            current = time
        else:
            loads[i] += moved
            loads[j] -= moved
        if k % 500 == 499:
            delta /= 2
    return current


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", type=int, default=1, help="largest samples whole on the rank")
    parser.add_argument("--cases", default="dp16", help="only cases whose label contains this")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    args = parser.parse_args(argv)
    for case in cases(args.seed):
        if args.cases in case.label:
            figure = relaxed_rank(case, args.big)
            print(f"{case.label}: {args.big} whole, the rest divisible: {figure:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
