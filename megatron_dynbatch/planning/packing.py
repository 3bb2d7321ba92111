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

import bisect
import heapq
from typing import List, Optional, Sequence, Tuple

__all__ = ["lpt_pack", "best_fit_pack", "pack_min_max_load", "pack_count_limited"]

Bins = List[List[int]]


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


def best_fit_pack(
    sizes: Sequence[int], items: Sequence[int], num_bins: int, cap: int
) -> Optional[Tuple[Bins, List[int]]]:
    """Best-fit decreasing into at most ``num_bins`` bins of capacity ``cap``; ``None`` if it fails.

    Each item, largest first, goes to the fullest bin that still has room. Used where LPT overshoots
    the cap (few large items, e.g. 5,5,4,3,3 into two bins of 10: LPT gives 5+4+3 | 5+3 -> 12 > 10
    after the last 3, best fit gives 5+5 | 4+3+3). The sorted (load, bin) list makes the fullest-fitting
    bin a bisect away.
    """
    bins: Bins = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    order = [(0, b) for b in range(num_bins)]  # sorted by (load, bin)
    for i in _order_desc(sizes, items):
        size = sizes[i]
        if size > cap:
            return None
        # Fullest bin with load <= cap - size: the last entry below (cap - size, +inf).
        pos = bisect.bisect_right(order, (cap - size, num_bins)) - 1
        if pos < 0:
            return None
        load, b = order.pop(pos)
        load += size
        bins[b].append(i)
        loads[b] = load
        bisect.insort(order, (load, b))
    return bins, loads


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
    while lo < hi:
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
