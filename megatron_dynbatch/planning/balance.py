"""Spreading a step's micro-batches over DP ranks, balancing them sample by sample, and ordering them.

Every rank runs the same number of micro-batches of the same shape, so what still differs between
ranks is the real work inside the rows (tokens, attention). Whole-micro-batch assignment gets close;
moving and swapping single samples between the most and least loaded ranks closes the rest, without
ever raising a micro-batch above the step's row length (packed) or row count (padded).
"""

from __future__ import annotations

import bisect
import heapq
from typing import Callable, List, Optional, Sequence

__all__ = ["assign_bins_to_ranks", "refine_ranks", "pipeline_order", "pipeline_order_simulated"]

Bins = List[List[int]]

#: Stop refining once the costliest rank is within this fraction of the cheapest: below it the
#: remaining difference is smaller than one typical sample and swaps only churn.
_BALANCE_TOLERANCE = 1e-4
#: Refinement rounds per DP rank; each round moves or swaps one sample between the extreme ranks.
_ROUNDS_PER_RANK = 4


def assign_bins_to_ranks(
    bin_costs: Sequence[float], dp_size: int, per_rank: int
) -> List[List[int]]:
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
    bin_extra: Optional[Callable[[int], float]] = None,
) -> None:
    """Move or swap single samples from the costliest rank to the cheapest, in place.

    A bin's load is the sum of ``sizes`` of its samples and must stay <= ``capacity`` (padded
    tokens for packed rows; 1 per sample and the row count for padded micro-batches). A rank's cost
    is the sum of its samples' costs plus ``bin_extra(load)`` of each of its bins (the attention
    work of a packed row's padding tail, which shrinks as the row fills). Each round shortlists
    transfers whose sample cost is near half the gap between the extreme ranks (a move, or a swap
    with that cost difference), evaluates them exactly, and applies the one that lowers the larger
    of the two ranks' new costs the most.
    """
    dp_size = len(rank_bins)
    if dp_size < 2:
        return
    extra = bin_extra or (lambda load: 0.0)
    loads = [sum(sizes[i] for i in members) for members in bins]
    rank_cost = [
        sum(costs[i] for b in rb for i in bins[b]) + sum(extra(loads[b]) for b in rb)
        for rb in rank_bins
    ]
    mean = sum(rank_cost) / dp_size
    if mean <= 0:
        return
    # Costliest and cheapest rank in O(log dp) per round: heaps with lazy invalidation (an entry
    # is stale once its rank's cost changed). Ties resolve as max/min over (cost, -r) / (cost, r).
    top = [(-c, r) for r, c in enumerate(rank_cost)]
    bottom = [(c, r) for r, c in enumerate(rank_cost)]
    heapq.heapify(top)
    heapq.heapify(bottom)

    def peek(heap, sign):
        while sign * heap[0][0] != rank_cost[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][1]

    for _ in range(_ROUNDS_PER_RANK * dp_size):
        hi = peek(top, -1)
        lo = peek(bottom, 1)
        gap = rank_cost[hi] - rank_cost[lo]
        if gap <= _BALANCE_TOLERANCE * mean:
            return
        best = _best_transfer(
            bins,
            loads,
            rank_bins[hi],
            rank_bins[lo],
            costs,
            sizes,
            capacity,
            extra,
            rank_cost[hi],
            rank_cost[lo],
        )
        if best is None:
            return
        (a, x, b, y), new_hi, new_lo = best  # a: bin x (hi) -> bin y (lo); b the other way
        bins[x].remove(a)
        bins[y].append(a)
        loads[x] -= sizes[a]
        loads[y] += sizes[a]
        if b is not None:
            bins[y].remove(b)
            bins[x].append(b)
            loads[y] -= sizes[b]
            loads[x] += sizes[b]
        rank_cost[hi], rank_cost[lo] = new_hi, new_lo
        for r in (hi, lo):
            heapq.heappush(top, (-rank_cost[r], r))
            heapq.heappush(bottom, (rank_cost[r], r))


#: Candidates taken on each side of the ideal cost in the sorted list of the costly rank's samples.
_SHORTLIST = 2


def _best_transfer(bins, loads, hi_bins, lo_bins, costs, sizes, capacity, extra, hi_cost, lo_cost):
    """The shortlisted move or swap that most lowers max(new hi cost, new lo cost), or None."""
    target = (hi_cost - lo_cost) / 2.0
    hi_items = sorted((costs[a], a, x) for x in hi_bins for a in bins[x])
    hi_costs = [c for c, _, _ in hi_items]
    best = None
    best_peak = hi_cost  # a transfer must lower the current maximum

    def consider(a, x, b, y):
        nonlocal best, best_peak
        moved_size = sizes[a] - (sizes[b] if b is not None else 0)
        new_x, new_y = loads[x] - moved_size, loads[y] + moved_size
        if new_y > capacity or new_x > capacity:
            return
        moved_cost = costs[a] - (costs[b] if b is not None else 0.0)
        new_hi = hi_cost - moved_cost + extra(new_x) - extra(loads[x])
        new_lo = lo_cost + moved_cost + extra(new_y) - extra(loads[y])
        peak = max(new_hi, new_lo)
        if peak < best_peak - 1e-12 * abs(best_peak):
            best, best_peak = ((a, x, b, y), new_hi, new_lo), peak

    def shortlist(want):
        pos = bisect.bisect_left(hi_costs, want)
        return hi_items[max(0, pos - _SHORTLIST) : pos + _SHORTLIST]

    # Moves: a sample of about half the gap into any bin of the cheap rank.
    for _, a, x in shortlist(target):
        for y in lo_bins:
            consider(a, x, None, y)
    # Swaps: for each sample b of the cheap rank, the costly rank's sample about gap/2 dearer.
    for y in lo_bins:
        for b in bins[y]:
            for _, a, x in shortlist(costs[b] + target):
                consider(a, x, b, y)
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


#: Slots tried for the heaviest micro-batch when simulating a pipeline (spread over the rank).
_MAX_HEAVY_SLOTS = 16


def pipeline_order_simulated(
    rank_bins: List[List[int]],
    bin_costs: Sequence[float],
    *,
    pp_size: int,
    vpp_size: int,
    group: int,
    sim_costs: Optional[Sequence[float]] = None,
) -> List[List[int]]:
    """Order every rank's micro-batches for its pipeline, choosing where the heaviest one goes.

    Light-heavy-light (:func:`pipeline_order`) is right for the bulk, but one dominant micro-batch
    (a single long sample's attention) stalls the pipeline differently in each slot, and the best
    slot depends on pp, vpp and the interleaving group. So the costliest rank's order is simulated
    (Megatron's 1F1B or interleaved order, :mod:`.simulate`) with its heaviest micro-batch in each
    candidate slot, and the best slot is used on every rank. Without pipelining order is moot.
    ``bin_costs`` rank micro-batches light to heavy (real work, so placeholders are the lightest
    and go to the ends); ``sim_costs`` (default ``bin_costs``) is what each micro-batch computes,
    padding included, for the simulation.
    """
    from .simulate import simulate_1f1b, simulate_interleaved

    base = [pipeline_order(rb, bin_costs) for rb in rank_bins]
    sim_costs = bin_costs if sim_costs is None else sim_costs
    num_microbatches = len(base[0])
    if pp_size < 2 or num_microbatches < 2:
        return base

    def with_heavy_at(order: List[int], slot: int) -> List[int]:
        heavy = max(order, key=lambda b: (sim_costs[b], -b))
        rest = [b for b in order if b != heavy]
        return rest[:slot] + [heavy] + rest[slot:]

    def makespan(order: List[int]) -> float:
        fwd = [sim_costs[b] for b in order]
        bwd = [2.0 * c for c in fwd]
        if vpp_size > 1:
            return simulate_interleaved(fwd, bwd, pp_size, vpp_size, group).makespan
        return simulate_1f1b(fwd, bwd, pp_size).makespan

    costliest = max(range(len(base)), key=lambda r: (sum(sim_costs[b] for b in base[r]), -r))
    step = max(1, -(-num_microbatches // _MAX_HEAVY_SLOTS))
    slots = sorted(set(range(0, num_microbatches, step)) | {num_microbatches - 1})
    best_slot, best_time = None, makespan(base[costliest])
    for slot in slots:
        time = makespan(with_heavy_at(base[costliest], slot))
        if time < best_time * (1 - 1e-9):
            best_slot, best_time = slot, time
    if best_slot is None:
        return base
    return [with_heavy_at(order, best_slot) for order in base]
