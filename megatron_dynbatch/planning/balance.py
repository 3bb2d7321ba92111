"""Spreading a step's micro-batches over DP ranks, balancing them sample by sample, and ordering them.

Every rank runs the same number of micro-batches of the same shape, so the linear work of the rows
(``token_weight * S`` each) and the per-micro-batch overhead are the same on every rank; what still
differs is attention (each sample's segment and each row's padding tail, :mod:`.cost`) and response
work. Whole-micro-batch assignment gets close; moving and swapping single samples between the
costliest rank and a cheap one closes the rest, never raising a row above the step's row length.
"""

from __future__ import annotations

import bisect
import heapq
from operator import itemgetter
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .karmarkar_karp import merge_by_differencing
from .simulate import pipeline_makespan
from .spec import ceil_div

__all__ = [
    "RankBalancer",
    "assign_bins_to_ranks",
    "deal_with_room",
    "descent_order",
    "pipeline_order",
    "pipeline_orders",
]

Bins = List[List[int]]

#: Above this many bins per rank, dealing greedily is as good as differencing (and cheaper).
_DIFFERENCING_MAX_PER_RANK = 16
#: Key of sorted ``(key, sample, bin)`` lists for bisection.
_first = itemgetter(0)
#: Stop refining once the costliest rank is within this fraction of a rank's whole step work of
#: the mean: below it the gain is under the noise of a real step (0.02%).
_BALANCE_TOLERANCE = 2e-4
#: Refinement rounds: this many per DP rank plus a floor for small dp, at most ``_MAX_ROUNDS`` (a
#: round costs ~0.1 ms; at dp 512 the costliest ranks keep improving for a thousand rounds by a
#: fraction of a percent in all, so the budget, not convergence, ends it there).
_ROUNDS_PER_RANK = 2
_MIN_ROUNDS = 32
_MAX_ROUNDS = 128
#: Candidates taken on each side of the ideal cost in a sorted list of samples, and bins with the
#: most room taken per rank.
_SHORTLIST = 2
#: Cheapest ranks tried as the partner of the costliest one in a round.
_PARTNERS = 3
#: Samples of the cheap rank tried as swap partners per round (spread over its cost range).
_SWAP_PARTNERS = 8


def assign_bins_to_ranks(
    bin_costs: Sequence[float], dp_size: int, per_rank: int
) -> List[List[int]]:
    """Give each rank exactly ``per_rank`` bins with near-equal cost sums (differencing).

    Two constructions, the one with the cheaper costliest rank kept (ties: differencing):

    * Karmarkar-Karp with equal counts: the bins, cheapest first, are dealt ``dp_size`` at a time
      into ``per_rank`` partial assignments (one bin per rank each); the two partial assignments
      with the largest spread are merged, costliest rank of one with the cheapest of the other,
      until one is left. Only ``per_rank - 1`` merges of ``dp_size`` ranks: O(K log dp) for K
      bins; the ranks end far closer than dealt greedily when bin costs are alike;
    * LPT with a count limit (:func:`_greedy`), better when a few bins are much costlier, and
      alone from ``_DIFFERENCING_MAX_PER_RANK`` bins per rank on (its granularity, one cheap bin,
      is then a small part of a rank).

    Deterministic: ties by bin index, then by merge order.
    """
    assert len(bin_costs) == dp_size * per_rank
    order = sorted(range(len(bin_costs)), key=bin_costs.__getitem__)  # stable: ties by index
    greedy = _greedy(bin_costs, order, dp_size, per_rank)
    if per_rank > _DIFFERENCING_MAX_PER_RANK:
        return greedy
    differenced = _differenced(bin_costs, order, dp_size)

    def peak(ranks: List[List[int]]) -> float:
        return max(sum(map(bin_costs.__getitem__, rank)) for rank in ranks)

    return greedy if peak(greedy) < peak(differenced) else differenced


def _greedy(
    bin_costs: Sequence[float], order: Sequence[int], dp_size: int, per_rank: int
) -> List[List[int]]:
    """LPT with a count limit: costliest bin first to the cheapest rank that has room.

    Unlike differencing (one bin of every cost quantile per rank) it can give a rank that took
    a very costly bin nothing but the cheapest ones.
    """
    return deal_with_room(reversed(order), bin_costs, dp_size, per_rank)


def deal_with_room(
    order: Iterable[int], costs: Sequence[float], dp_size: int, per_rank: int
) -> List[List[int]]:
    """Each of ``order`` in turn to the rank with the least cost so far that has room (fewer than
    ``per_rank``; ties by rank index): LPT with a count limit when ``order`` runs costliest
    first. Returns every rank's indices in the order dealt."""
    ranks: List[List[int]] = [[] for _ in range(dp_size)]
    heap = [(0.0, r) for r in range(dp_size)]
    for b in order:
        total, r = heap[0]
        ranks[r].append(b)
        if len(ranks[r]) < per_rank:
            heapq.heapreplace(heap, (total + costs[b], r))
        else:
            heapq.heappop(heap)
    return ranks


def _differenced(bin_costs: Sequence[float], order: Sequence[int], dp_size: int) -> List[List[int]]:
    """Karmarkar-Karp with equal counts (see :func:`assign_bins_to_ranks`)."""
    # One partial assignment per dp_size consecutive bins: dp_size ranks as [cost sum, bins],
    # costliest first.
    partials = [
        [[bin_costs[b], [b]] for b in reversed(order[start : start + dp_size])]
        for start in range(0, len(order), dp_size)
    ]
    return [sorted(bins) for _, bins in merge_by_differencing(partials)]


class RankBalancer:
    """Moves and swaps single samples between DP ranks to lower the costliest rank.

    A rank's variable cost is the sum over its bins of their samples' costs plus ``tail(load)``,
    the attention of the row's padding tail (which shrinks as the row fills, see :mod:`.cost`).
    Bins may not exceed ``row_length`` (the step's S, in padded tokens). Moving a sample *into* a costly
    rank's row can lower that rank's cost (a fuller row has a smaller tail), so transfers go both
    ways; swaps exchange a sample of each. Each round looks at a bounded shortlist (a handful of
    samples near the cost that would halve the gap, the bins with the most room), so a round costs
    about the same whatever the number of samples per rank.

    Attributes:
        bins: Sample indices per bin (changed in place).
        loads: Padded tokens per bin.
        own: Sum of its samples' costs per bin.
        changed: Bins whose samples changed.
        rank_bins: Bin indices per rank.
        costs: Variable cost per rank.
    """

    def __init__(
        self,
        bins: Bins,
        rank_bins: List[List[int]],
        sample_costs: Sequence[float],
        sizes: Sequence[int],
        row_length: int,
        tail: Callable[[int], float],
        frozen: Sequence[int] = (),
        loads: Optional[Sequence[int]] = None,
        own: Optional[Sequence[float]] = None,
    ) -> None:
        self.bins = bins
        self.rank_bins = rank_bins
        self.sample_costs = sample_costs
        self.sizes = sizes
        self.row_length = row_length
        self.tail = tail
        self.frozen = set(frozen)  # bins that keep their samples (a lone oversize sample)
        if loads is None:
            loads = [sum(map(sizes.__getitem__, members)) for members in bins]
        if own is None:
            own = [sum(map(sample_costs.__getitem__, members)) for members in bins]
        self.loads = list(loads)
        self.own = list(own)
        self.changed: set = set()  # bins whose samples changed
        self.costs = [sum(own[b] + tail(loads[b]) for b in rb) for rb in rank_bins]
        self.rank_of_bin = [0] * len(bins)
        for r, rank in enumerate(rank_bins):
            for b in rank:
                self.rank_of_bin[b] = r
        # rank -> its movable samples as sorted (cost, sample, bin) and (size, sample, bin),
        # built when first needed and kept sorted as samples move.
        self._sorted: Dict[int, Tuple[list, list]] = {}

    def refine(self, base: float, max_rounds: Optional[int] = None) -> int:
        """Lower the costliest rank until it is within tolerance or nothing helps.

        Args:
            base: Cost every rank has besides the variable part (its rows' linear work and
                overhead); the tolerance is relative to a rank's whole cost.
            max_rounds: Round budget (default ``_ROUNDS_PER_RANK * dp + _MIN_ROUNDS``, at most
                ``_MAX_ROUNDS``).

        Returns:
            The rounds that changed something.
        """
        dp = len(self.rank_bins)
        if dp < 2:
            return 0
        if max_rounds is None:
            max_rounds = min(_ROUNDS_PER_RANK * dp + _MIN_ROUNDS, _MAX_ROUNDS)
        rounds = max_rounds
        mean = sum(self.costs) / dp
        tolerance = _BALANCE_TOLERANCE * (base + mean)
        # Extreme ranks in O(log dp) a round: heaps with lazy invalidation (an entry is stale
        # once its rank's cost changed); ties resolve to the lower rank index.
        top = [(-c, r) for r, c in enumerate(self.costs)]
        bottom = [(c, r) for r, c in enumerate(self.costs)]
        heapq.heapify(top)
        heapq.heapify(bottom)
        applied = 0
        for _ in range(rounds):
            while -top[0][0] != self.costs[top[0][1]]:
                heapq.heappop(top)
            hi = top[0][1]
            if self.costs[hi] - mean <= tolerance:
                break
            partners = []
            while bottom and len(partners) < _PARTNERS:
                c, r = heapq.heappop(bottom)
                if c == self.costs[r] and r not in partners:
                    partners.append(r)
            for r in partners:
                heapq.heappush(bottom, (self.costs[r], r))
            for lo in partners:
                if lo != hi and self._improve(hi, lo):
                    for r in (hi, lo):
                        heapq.heappush(top, (-self.costs[r], r))
                        heapq.heappush(bottom, (self.costs[r], r))
                    applied += 1
                    break
            else:
                break
        return applied

    def _improve(self, hi: int, lo: int) -> bool:
        """Apply the best transfer between ``hi`` and ``lo`` that lowers the larger of the two."""
        transfer = self.best_transfer(hi, lo)
        if transfer is None:
            return False
        (a, x, b, y), new_hi, new_lo = transfer
        if a is not None:
            self._move(a, x, y)
        if b is not None:
            self._move(b, y, x)
        self.costs[hi], self.costs[lo] = new_hi, new_lo
        return True

    def _move(self, sample: int, source: int, target: int) -> None:
        cost, size = self.sample_costs[sample], self.sizes[sample]
        for rank, old, new in (
            (self.rank_of_bin[source], (sample, source), None),
            (self.rank_of_bin[target], None, (sample, target)),
        ):
            cached = self._sorted.get(rank)
            if cached is None:
                continue
            for items, key in zip(cached, (cost, size), strict=True):
                if old is not None:
                    del items[bisect.bisect_left(items, (key, *old))]
                if new is not None:
                    bisect.insort(items, (key, *new))
        self.bins[source].remove(sample)
        self.bins[target].append(sample)
        self.loads[source] -= self.sizes[sample]
        self.loads[target] += self.sizes[sample]
        self.own[source] -= self.sample_costs[sample]
        self.own[target] += self.sample_costs[sample]
        self.changed.update((source, target))

    def _items(self, rank: int) -> Tuple[list, list]:
        """The rank's movable samples as ``(key, sample, bin)`` sorted by cost and by size."""
        cached = self._sorted.get(rank)
        if cached is None:
            costs, sizes, bins, frozen = self.sample_costs, self.sizes, self.bins, self.frozen
            rank_bins = [b for b in self.rank_bins[rank] if b not in frozen]
            cached = self._sorted[rank] = (
                sorted([(costs[i], i, b) for b in rank_bins for i in bins[b]]),
                sorted([(sizes[i], i, b) for b in rank_bins for i in bins[b]]),
            )
        return cached

    def _roomiest(self, rank: int) -> List[int]:
        """The rank's movable bins with the most room (at most ``_SHORTLIST``)."""
        bins = [b for b in self.rank_bins[rank] if b not in self.frozen]
        return sorted(bins, key=lambda b: (self.loads[b], b))[:_SHORTLIST]

    def best_transfer(self, hi: int, lo: int) -> Optional[Tuple[tuple, float, float]]:
        """The shortlisted transfer that most lowers max(new hi cost, new lo cost), or None.

        Returns ``((a, x, b, y), new_hi, new_lo)``: sample ``a`` moves from ``hi``'s bin ``x`` to
        ``lo``'s bin ``y`` and ``b`` the other way (either may be None).
        """
        hi_cost, lo_cost = self.costs[hi], self.costs[lo]
        target = (hi_cost - lo_cost) / 2.0
        hi_items, _ = self._items(hi)
        lo_items, lo_by_size = self._items(lo)

        def near(items, want):
            pos = bisect.bisect_left(items, want, key=_first)
            return items[max(0, pos - _SHORTLIST) : pos + _SHORTLIST]

        candidates = []
        lo_room = self._roomiest(lo)
        hi_room = self._roomiest(hi)
        for _, a, x in near(hi_items, target):
            candidates += [(a, x, None, y) for y in lo_room]  # hi -> lo
        for x in hi_room:
            # lo -> hi: a sample of half the room of a costly rank's row cuts its tail the most
            # ((t - s)**2 + s**2 is smallest at s = t / 2).
            room = self.row_length - self.loads[x]
            candidates += [(None, x, b, y) for _, b, y in near(lo_by_size, room // 2)]
        # Swaps: lo's samples spread over its cost range, each with hi's sample about gap/2 dearer.
        stride = max(1, len(lo_items) // _SWAP_PARTNERS)
        for cost_b, b, y in lo_items[::stride]:
            candidates += [(a, x, b, y) for _, a, x in near(hi_items, cost_b + target)]
        # Each candidate's cost change of both bins, written out (tens of candidates a round,
        # hundreds of rounds a step: a method call a bin was a fifth of planning a large step).
        # A bin over the row length rules the candidate out; each bin's tail at its current load
        # is computed once a call.
        sizes, costs, loads, tail = self.sizes, self.sample_costs, self.loads, self.tail
        limit = self.row_length
        now: Dict[int, float] = {}
        best = None
        best_peak = hi_cost * (1.0 - 1e-12)  # a transfer must lower the current maximum
        for a, x, b, y in candidates:
            change = (sizes[b] if b is not None else 0) - (sizes[a] if a is not None else 0)
            load = loads[x] + change
            if load > limit:
                continue
            base = now.get(x)
            if base is None:
                base = now[x] = tail(loads[x])
            dx = tail(load) - base
            if b is not None:
                dx += costs[b]
            if a is not None:
                dx -= costs[a]
            load = loads[y] - change
            if load > limit:
                continue
            base = now.get(y)
            if base is None:
                base = now[y] = tail(loads[y])
            dy = tail(load) - base
            if a is not None:
                dy += costs[a]
            if b is not None:
                dy -= costs[b]
            peak = max(hi_cost + dx, lo_cost + dy)
            if peak < best_peak:
                best, best_peak = ((a, x, b, y), hi_cost + dx, lo_cost + dy), peak
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


def descent_order(bin_ids: Sequence[int], key: Callable[[int], Any]) -> List[int]:
    """Order one rank's micro-batches in a long descent: lightest (by ``key``) last, then one to
    the front for every two to the back, so the order rises over a third of the rank and falls
    over the rest. A 1F1B drain waits on backwards, about twice a forward, so a light
    micro-batch is worth more at the end than at the start: 832 samples of 12,241 tokens and
    pairs of 6,162 at dp 64, pp 8, one row a step (seven full rows and three pairs a rank) ran
    2.1% faster as pair, seven rows, pair, pair than light-heavy-light's pair, pair, seven rows,
    pair (verl's differencing lays them so, ``small_steps --wide`` seed 158).
    Example, costs 1..6: order 3, 6, 5, 4, 2, 1."""
    ranked = sorted(bin_ids, key=key)
    front = ranked[2::3]
    back = [b for i, b in enumerate(ranked) if i % 3 != 2]
    return front + back[::-1]


#: Slots tried for the heaviest micro-batch when simulating a pipeline (spread over the rank).
_MAX_HEAVY_SLOTS = 16


def pipeline_orders(
    rank_bins: List[List[int]],
    order_costs: Sequence[float],
    sim_costs: Sequence[float],
    *,
    pp_size: int,
    vpp_size: int,
    group: int,
) -> List[List[int]]:
    """Order every rank's micro-batches for its pipeline, choosing where the heaviest one goes.

    Light-heavy-light (:func:`pipeline_order`, by ``order_costs``: real work, so placeholders are
    the lightest and go to the ends) is right for the bulk, but one dominant micro-batch (a single
    long sample's attention) stalls the pipeline differently in each slot, and the best slot
    depends on pp, vpp and the interleaving group. So the costliest rank's order is replayed
    (:func:`.simulate.pipeline_makespan`, ``sim_costs`` = what each micro-batch computes) with its
    heaviest micro-batch in each candidate slot, and the best slot is used on every rank. Without
    pipelining order is moot.
    """
    base = [pipeline_order(rb, order_costs) for rb in rank_bins]
    num_microbatches = len(base[0])
    if pp_size < 2 or num_microbatches < 2:
        return base

    def heavy_apart(order: List[int]) -> Tuple[List[int], List[int]]:
        """The heaviest micro-batch (as a list, to be put in a slot) and the rest in order."""
        heavy = max(order, key=lambda b: (sim_costs[b], -b))
        return [heavy], [b for b in order if b != heavy]

    def makespan(order: List[int]) -> float:
        return pipeline_makespan([sim_costs[b] for b in order], pp_size, vpp_size, group)

    costliest = max(range(len(base)), key=lambda r: (sum(map(sim_costs.__getitem__, base[r])), -r))
    step = max(1, ceil_div(num_microbatches, _MAX_HEAVY_SLOTS))
    slots = sorted(set(range(0, num_microbatches, step)) | {num_microbatches - 1})
    best_slot, best_time = None, makespan(base[costliest])
    heavy, rest = heavy_apart(base[costliest])
    for slot in slots:
        time = makespan(rest[:slot] + heavy + rest[slot:])
        if time < best_time * (1 - 1e-9):
            best_slot, best_time = slot, time
    if best_slot is None:
        return base
    placed = [heavy_apart(order) for order in base]
    return [others[:best_slot] + lone + others[best_slot:] for lone, others in placed]
