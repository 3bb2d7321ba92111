"""Spreading a step's micro-batches over DP ranks, balancing them sample by sample, and ordering them.

Every rank runs the same number of micro-batches of the same shape, so what still differs between
ranks is the real work inside the rows (tokens, attention). Whole-micro-batch assignment gets close;
moving and swapping single samples between the most and least loaded ranks closes the rest, without
ever raising a micro-batch above the step's row length (packed) or row count (padded).
"""

from __future__ import annotations

import bisect
import heapq
from typing import List, Sequence

__all__ = ["assign_bins_to_ranks", "refine_ranks", "pipeline_order"]

Bins = List[List[int]]

#: Stop refining once the costliest rank is within this fraction of the cheapest: below it the
#: remaining difference is smaller than one typical sample and swaps only churn.
_BALANCE_TOLERANCE = 1e-4
#: Refinement rounds per DP rank; each round moves or swaps one sample between the extreme ranks.
_ROUNDS_PER_RANK = 4


def assign_bins_to_ranks(bin_costs: Sequence[float], dp_size: int, per_rank: int) -> List[List[int]]:
    """Give each rank exactly ``per_rank`` bins, costliest bins first to the cheapest open rank."""
    assert len(bin_costs) == dp_size * per_rank
    ranks: List[List[int]] = [[] for _ in range(dp_size)]
    heap = [(0.0, r) for r in range(dp_size)]
    for b in sorted(range(len(bin_costs)), key=lambda b: (-bin_costs[b], b)):
        cost, r = heapq.heappop(heap)
        ranks[r].append(b)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (cost + bin_costs[b], r))
    return ranks


def refine_ranks(
    bins: Bins,
    rank_bins: List[List[int]],
    costs: Sequence[float],
    sizes: Sequence[int],
    capacity: int,
) -> None:
    """Move or swap single samples from the costliest rank to the cheapest, in place.

    A bin's load is the sum of ``sizes`` of its samples and must stay <= ``capacity`` (padded
    tokens for packed rows; 1 per sample and the row count for padded micro-batches). Each round
    picks the transfer that brings the two extreme ranks closest to their mean: a single move of a
    sample of cost ``d`` or a swap whose cost difference is ``d``, with ``d`` nearest to half the gap.
    """
    dp_size = len(rank_bins)
    if dp_size < 2:
        return
    loads = [sum(sizes[i] for i in members) for members in bins]
    rank_cost = [sum(costs[i] for b in rb for i in bins[b]) for rb in rank_bins]
    mean = sum(rank_cost) / dp_size
    if mean <= 0:
        return
    for _ in range(_ROUNDS_PER_RANK * dp_size):
        hi = max(range(dp_size), key=lambda r: (rank_cost[r], -r))
        lo = min(range(dp_size), key=lambda r: (rank_cost[r], r))
        gap = rank_cost[hi] - rank_cost[lo]
        if gap <= _BALANCE_TOLERANCE * mean:
            return
        best = _best_transfer(bins, loads, rank_bins[hi], rank_bins[lo], costs, sizes, capacity, gap)
        if best is None:
            return
        a, x, b, y = best  # sample a leaves bin x (on hi) for bin y (on lo); b goes the other way
        bins[x].remove(a)
        bins[y].append(a)
        loads[x] -= sizes[a]
        loads[y] += sizes[a]
        moved = costs[a]
        if b is not None:
            bins[y].remove(b)
            bins[x].append(b)
            loads[y] -= sizes[b]
            loads[x] += sizes[b]
            moved -= costs[b]
        rank_cost[hi] -= moved
        rank_cost[lo] += moved


def _best_transfer(bins, loads, hi_bins, lo_bins, costs, sizes, capacity, gap):
    """The move or swap with transferred cost closest to gap/2 (strictly inside (0, gap))."""
    target = gap / 2.0
    hi_items = sorted((costs[a], a, x) for x in hi_bins for a in bins[x])
    hi_costs = [c for c, _, _ in hi_items]
    best = None
    best_err = target  # a transfer must beat doing nothing: |d - gap/2| < gap/2
    lo_room = max(lo_bins, key=lambda y: (capacity - loads[y], -y))
    room = capacity - loads[lo_room]
    # Moves: one sample from hi into the roomiest bin of lo.
    pos = bisect.bisect_left(hi_costs, target)
    for k in range(max(0, pos - 2), min(len(hi_items), pos + 2)):
        c, a, x = hi_items[k]
        err = abs(c - target)
        if 0 < c < gap and sizes[a] <= room and err < best_err:
            best, best_err = (a, x, None, lo_room), err
    # Swaps: for each sample b of lo, the hi sample whose cost exceeds b's by about gap/2.
    for y in lo_bins:
        for b in bins[y]:
            want = costs[b] + target
            pos = bisect.bisect_left(hi_costs, want)
            for k in range(max(0, pos - 2), min(len(hi_items), pos + 2)):
                c, a, x = hi_items[k]
                d = c - costs[b]
                err = abs(d - target)
                if not (0 < d < gap) or err >= best_err:
                    continue
                if loads[x] - sizes[a] + sizes[b] > capacity or loads[y] - sizes[b] + sizes[a] > capacity:
                    continue
                best, best_err = (a, x, b, y), err
    return best


def pipeline_order(bin_ids: Sequence[int], bin_costs: Sequence[float]) -> List[int]:
    """Order one rank's micro-batches light-heavy-light ("organ pipe").

    In 1F1B the first micro-batches' forwards fill the pipeline (warm-up) and the last ones'
    backwards drain it (cool-down); only those are on the critical path of every stage, so the
    lightest micro-batches (placeholders first) go to both ends and the heaviest to the steady state.
    Example, costs 1..6: order 1, 3, 5, 6, 4, 2.
    """
    ranked = sorted(bin_ids, key=lambda b: (bin_costs[b], b))
    front = ranked[0::2]
    back = ranked[1::2]
    return front + back[::-1]
