"""Packing one step's samples into a fixed number of micro-batches under a hard token cap.

Two layouts, one shape of answer (a list of bins, each a list of sample indices):

* packed: a bin's load is the sum of its samples' padded lengths and must stay <= the cap; the step's
  row length S is the largest load, so for a fixed bin count we minimise the largest load (which is
  also what balances the bins);
* padded: every row is S = the longest sample of the step, so a bin may hold at most ``cap // S``
  samples; we balance the sample count and the cost.

Everything here is deterministic: ties are broken by sample index and bin index.
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence, Tuple

__all__ = [
    "lpt_pack",
    "best_fit_pack",
    "count_best_fit_bins",
    "pack_min_max_load",
    "pack_count_limited",
]

Bins = List[List[int]]

#: The fallback's search for the smallest row length stops within 1/100 of the lower bound: each
#: probe repacks the whole step, and 1% of padding is below the noise of a step's cost.
_ROW_SLACK_DIVISOR = 100


def _order_desc(sizes: Sequence[int], items: Sequence[int]) -> List[int]:
    """Items by decreasing size, ties by index (determinism)."""
    return sorted(items, key=lambda i: (-sizes[i], i))


def lpt_pack(sizes: Sequence[int], items: Sequence[int], num_bins: int) -> Tuple[Bins, List[int]]:
    """Longest-processing-time-first: each item, largest first, into the least-loaded bin.

    O(n log K). With many items small against the average load it is within one item of optimal,
    which is the regime of dynamic batching (tens of samples per micro-batch). Returns bins and loads.
    """
    bins: Bins = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    heap = [(0, b) for b in range(num_bins)]
    for i in _order_desc(sizes, items):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        load += sizes[i]
        loads[b] = load
        heapq.heappush(heap, (load, b))
    return bins, loads


class _LoadIndex:
    """Bins keyed by load in a Fenwick tree over load values ``0..cap``.

    "Fullest bin whose load is <= x" is two O(log cap) walks, whatever the number of bins, so best
    fit costs O(n log cap) even with tens of thousands of bins (a sorted list of bins costs O(K)
    per insertion).
    """

    def __init__(self, cap: int, num_bins: int):
        self.size = cap + 1
        self.tree = [0] * (self.size + 1)
        self.buckets: dict = {0: list(range(num_bins - 1, -1, -1))}  # pop() yields bin 0 first
        self._add(0, num_bins)
        self.top = 1 << self.size.bit_length()

    def _add(self, load: int, delta: int) -> None:
        i = load + 1
        while i <= self.size:
            self.tree[i] += delta
            i += i & -i

    def _prefix(self, load: int) -> int:
        i, total = min(load, self.size - 1) + 1, 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def pop_fullest_at_most(self, limit: int):
        """Remove and return ``(load, bin)`` of a fullest bin with load <= limit, or None."""
        if limit < 0:
            return None
        rank = self._prefix(limit)
        if rank == 0:
            return None
        # Binary lifting: the smallest position whose prefix count reaches ``rank``.
        pos, step = 0, self.top
        while step:
            nxt = pos + step
            if nxt <= self.size and self.tree[nxt] < rank:
                pos = nxt
                rank -= self.tree[nxt]
            step >>= 1
        load = pos  # Fenwick position pos + 1 holds load value pos
        bucket = self.buckets[load]
        b = bucket.pop()
        self._add(load, -1)
        return load, b

    def push(self, load: int, b: int) -> None:
        self.buckets.setdefault(load, []).append(b)
        self._add(load, 1)


def best_fit_pack(
    sizes: Sequence[int], items: Sequence[int], num_bins: int, cap: int
) -> Optional[Tuple[Bins, List[int]]]:
    """Best-fit decreasing into at most ``num_bins`` bins of capacity ``cap``; ``None`` if it fails.

    Each item, largest first, goes to the fullest bin that still has room. Used where LPT overshoots
    the cap (few large items, e.g. 5,5,4,3,3 into two bins of 10: LPT gives 5+4+3 | 5+3 -> 12 > 10
    after the last 3, best fit gives 5+5 | 4+3+3).
    """
    bins: Bins = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    index = _LoadIndex(cap, num_bins)
    for i in _order_desc(sizes, items):
        size = sizes[i]
        found = index.pop_fullest_at_most(cap - size)
        if found is None:
            return None
        load, b = found
        bins[b].append(i)
        loads[b] = load + size
        index.push(load + size, b)
    return bins, loads


def count_best_fit_bins(sizes: Sequence[int], items: Sequence[int], cap: int) -> int:
    """Bins best-fit decreasing needs for ``items`` under ``cap`` (every item must fit alone)."""
    packed = best_fit_pack(sizes, items, len(items), cap)
    assert packed is not None, "an item exceeds the cap"
    return sum(1 for members in packed[0] if members)


def pack_min_max_load(
    sizes: Sequence[int], items: Sequence[int], num_bins: int, cap: int
) -> Optional[Tuple[Bins, List[int]]]:
    """Pack ``items`` into ``num_bins`` bins, every load <= ``cap``, with a small largest load.

    LPT first (balanced, fast). If LPT's largest load breaks the cap, binary-search the smallest
    capacity at which best fit still packs into ``num_bins`` bins, then re-spread that packing
    (best fit leaves bins empty and others full, which would waste micro-batches as placeholders).
    Returns ``None`` when not even best fit at ``cap`` packs them, i.e. more bins are needed.
    """
    if not items:
        return [[] for _ in range(num_bins)], [0] * num_bins
    bins, loads = lpt_pack(sizes, items, num_bins)
    if max(loads) <= cap:
        return bins, loads
    packed = best_fit_pack(sizes, items, num_bins, cap)
    if packed is None:
        return None
    total = sum(sizes[i] for i in items)
    lo = max(-(-total // num_bins), max(sizes[i] for i in items))
    hi = max(packed[1])
    # Each probe is a full best-fit pass: stop once the row length is within 1% of the best bound.
    while lo < hi and (hi - lo) * _ROW_SLACK_DIVISOR > hi:
        mid = (lo + hi) // 2
        trial = best_fit_pack(sizes, items, num_bins, mid)
        if trial is None:
            lo = mid + 1
        else:
            packed, hi = trial, max(trial[1])
    return _spread(sizes, packed[0], packed[1], hi)


def _spread(sizes: Sequence[int], bins: Bins, loads: List[int], cap: int) -> Tuple[Bins, List[int]]:
    """Move single items from the fullest bins into empty ones; no load rises above ``cap``.

    An empty bin costs a whole placeholder row; moving the smallest item of the fullest multi-item bin
    there turns that placeholder into real work and lowers the fullest load.
    """
    empty = [b for b, members in enumerate(bins) if not members]
    donors = [(-loads[b], b) for b, members in enumerate(bins) if len(members) > 1]
    heapq.heapify(donors)
    while empty and donors:
        _, b = heapq.heappop(donors)
        smallest = min(bins[b], key=lambda i: (sizes[i], i))
        target = empty.pop()
        bins[b].remove(smallest)
        bins[target].append(smallest)
        loads[b] -= sizes[smallest]
        loads[target] = sizes[smallest]
        if len(bins[b]) > 1:
            heapq.heappush(donors, (-loads[b], b))
    assert max(loads) <= cap
    return bins, loads


def pack_count_limited(
    costs: Sequence[float], items: Sequence[int], num_bins: int, max_per_bin: int
) -> Bins:
    """Padded layout: at most ``max_per_bin`` samples per bin, costs balanced (LPT with a count cap)."""
    assert len(items) <= num_bins * max_per_bin, "caller sized the bins"
    bins: Bins = [[] for _ in range(num_bins)]
    heap = [(0.0, b) for b in range(num_bins)]
    for i in sorted(items, key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        if len(bins[b]) < max_per_bin:
            heapq.heappush(heap, (load + costs[i], b))
    return bins
