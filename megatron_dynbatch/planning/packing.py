"""Packing one step's samples into a fixed number of micro-batches under a hard token cap.

A bin is a list of sample indices; its load is the sum of its samples' padded sizes. The step's
row length S is the largest load, so for a fixed bin count the packers aim at a small largest
load, and must never exceed the cap.

* :func:`lpt_pack`: longest-processing-time first, a level of bins at a time (fast, balanced; the
  first choice);
* :func:`best_fit_pack`: best-fit decreasing, for samples that pair badly (LPT can break the cap
  where a tighter packing exists), with memory independent of the cap;
* :func:`next_fit_count`: next fit in arrival order, which packs some regular patterns tighter
  than either;
* :func:`feasible_pack` tries them in that order, :func:`min_bins` says how few bins they need.

Everything here is deterministic: ties are broken by sample index and bin index. Inputs ``order``
are the step's samples by decreasing size, ties by index (``sorted(items, key=sizes.__getitem__,
reverse=True)`` on ascending items: Python's sort is stable).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import DynBatchValueError
from .karmarkar_karp import merge_sparse
from .spec import ceil_div

__all__ = [
    "Packing",
    "best_fit_pack",
    "feasible_pack",
    "kk_pack",
    "lower_max_load",
    "lpt_pack",
    "min_bins",
    "next_fit_count",
    "profile_pack",
    "spread_into_empty",
]

Bins = List[List[int]]
#: ``(bins, loads)``: the sample indices of every bin and the sum of their sizes.
Packing = Tuple[Bins, List[int]]


def lpt_pack(
    sizes: Sequence[int],
    order: Sequence[int],
    num_bins: int,
    cap: Optional[int] = None,
    ordered: Optional[Sequence[int]] = None,
) -> Optional[Packing]:
    """Longest-processing-time first: each sample, largest first, into the least-loaded bin.

    With many samples small against the average load it is within one sample of optimal, which
    is the regime of dynamic batching (tens of samples per micro-batch). Example, sizes 5, 5, 4, 3,
    3 into 2 bins: 5 | 5, then 4 to bin 0 (tie, lower index) -> 9 | 5, 3 to bin 1 -> 9 | 8, 3 to
    bin 1 -> 9 | 11. Ties go to the lower bin index. With ``cap``, returns None as soon as a sample
    does not fit the least-loaded bin (then it fits no bin: LPT cannot pack under the cap).

    Bins are keyed ``load * num_bins + bin`` (one int orders by load, then index) and kept in
    levels of width ``w``, the smallest size to place: every key of the lowest level is below any
    key a placement can produce (a sample adds at least ``w``), so the samples one at a time would
    take that level's bins in key order. A whole level is therefore placed at once: one sort and
    whole-list operations per level, not a heap operation per sample (1M samples: 0.3 s, not 1 s).

    ``ordered``: ``sizes`` of ``order``, in order, where the caller has them (read in sequence, not
    gathered from all over ``sizes``: at 1M samples most of the time is memory access).
    """
    bins: Bins = [[] for _ in range(num_bins)]
    # The first num_bins samples go to bins 0, 1, ... in order (all loads 0: ties by index).
    first = order[:num_bins]
    for b, i in enumerate(first):
        bins[b].append(i)
    keys = [sizes[i] * num_bins + b for b, i in enumerate(first)]
    keys += range(len(first), num_bins)
    rest = order[num_bins:]
    limit = None if cap is None else (cap + 1) * num_bins  # a key >= limit: a load over the cap
    if rest:
        if ordered is None:
            scaled = [sizes[i] * num_bins for i in rest]
        else:
            scaled = [size * num_bins for size in itertools.islice(ordered, num_bins, None)]
        width = min(scaled) // num_bins
        if width <= 0:
            raise DynBatchValueError(f"sample sizes must be positive, got {width}")
        span = width * num_bins  # keys per level
        levels: Dict[int, List[int]] = {}
        for key in keys:
            levels.setdefault(key // span, []).append(key)
        pending = list(levels)
        heapq.heapify(pending)
        start, total = 0, len(rest)
        # Each level's keys in the order they take samples: bins are filled only once the whole
        # pass stayed under the cap (a pass that breaks it, at high fill, costs half as much).
        taken: List[List[int]] = []
        while start < total:
            level = heapq.heappop(pending)
            group = levels.pop(level)
            group.sort()
            if len(group) > total - start:  # the last samples: the lowest keys take them
                levels[level] = group[total - start :]
                group = group[: total - start]
            stop = start + len(group)
            taken.append(group)
            placed = list(map(operator.add, group, scaled[start:stop]))
            placed.sort()
            if limit is not None and placed[-1] >= limit:
                return None
            # Every placed key is in a higher level; file them, one slice per level.
            lo = 0
            while lo < len(placed):
                target = placed[lo] // span
                hi = bisect.bisect_left(placed, (target + 1) * span, lo)
                bucket = levels.get(target)
                if bucket is None:
                    levels[target] = placed[lo:hi]
                    heapq.heappush(pending, target)
                else:
                    bucket += placed[lo:hi]
                lo = hi
            start = stop
        for key, i in zip(itertools.chain.from_iterable(taken), rest, strict=True):
            bins[key % num_bins].append(i)
        keys = [key for bucket in levels.values() for key in bucket]
    loads = [0] * num_bins
    for key in keys:
        loads[key % num_bins] = key // num_bins
    return bins, loads


class _SortedLoads:
    """The distinct loads of the bins, sorted, in blocks: floor / add / remove in O(sqrt(K)).

    Best fit asks for the fullest bin that still fits a sample: the largest load <= cap - size.
    A plain sorted list costs a memmove of every bin per insertion, a Fenwick tree over load values
    costs memory per token of the cap; blocks of at most ``2 * _BLOCK`` loads cost neither.
    """

    _BLOCK = 512

    def __init__(self, values: Sequence[int]) -> None:
        ordered = sorted(values)
        self.blocks = [ordered[k : k + self._BLOCK] for k in range(0, len(ordered), self._BLOCK)]
        self.maxes = [block[-1] for block in self.blocks]

    def floor(self, limit: int) -> Optional[int]:
        """The largest load <= ``limit``, or None."""
        k = bisect.bisect_right(self.maxes, limit)
        if k < len(self.blocks):
            block = self.blocks[k]
            j = bisect.bisect_right(block, limit)
            if j:
                return block[j - 1]
        return self.maxes[k - 1] if k else None

    def add(self, value: int) -> None:
        if not self.blocks:
            self.blocks, self.maxes = [[value]], [value]
            return
        k = min(bisect.bisect_left(self.maxes, value), len(self.blocks) - 1)
        block = self.blocks[k]
        bisect.insort(block, value)
        self.maxes[k] = block[-1]
        if len(block) > 2 * self._BLOCK:
            self.blocks[k : k + 1] = [block[: self._BLOCK], block[self._BLOCK :]]
            self.maxes[k : k + 1] = [block[self._BLOCK - 1], block[-1]]

    def remove(self, value: int) -> None:
        k = bisect.bisect_left(self.maxes, value)
        block = self.blocks[k]
        del block[bisect.bisect_left(block, value)]
        if block:
            self.maxes[k] = block[-1]
        else:
            del self.blocks[k], self.maxes[k]


def best_fit_pack(
    sizes: Sequence[int],
    order: Sequence[int],
    num_bins: int,
    cap: int,
    ordered: Optional[Sequence[int]] = None,
) -> Optional[Packing]:
    """Best-fit decreasing into at most ``num_bins`` bins of ``cap``; ``None`` if it fails.

    Each sample, largest first, goes to the fullest bin that still has room (lowest bin index
    among equally full ones). Samples of equal size are placed as a run: once a bin of load ``l``
    is the fullest that fits size ``s``, it takes ``(cap - l) // s`` of them in a row (after each
    it is still the fullest that fits), and so does every other bin of load ``l``. A regular
    workload (131k samples in a repeating pattern of a few sizes) thus costs a handful of
    operations per distinct (size, load) pair, not per sample. ``ordered``: as :func:`lpt_pack`.
    """
    bins: Bins = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    # Bins by load; each list holds bin indices in decreasing order so pop() yields the lowest.
    by_load = {0: list(range(num_bins - 1, -1, -1))}
    get_group = by_load.get
    distinct = _SortedLoads([0])
    start = 0
    for size, run in itertools.groupby(
        map(sizes.__getitem__, order) if ordered is None else ordered
    ):
        end = start + len(list(run))
        while start < end:
            load = distinct.floor(cap - size)
            if load is None:
                return None
            group = by_load[load]
            pop = group.pop
            per_bin = (cap - load) // size
            while group and start < end:
                b = pop()
                take = end - start
                if take > per_bin:
                    take = per_bin
                stop = start + take
                bins[b] += order[start:stop]
                start = stop
                new_load = load + take * size
                loads[b] = new_load
                target = get_group(new_load)
                if target is None:
                    by_load[new_load] = [b]
                    distinct.add(new_load)
                else:
                    # Which of several equally full bins comes first does not change the
                    # packing's quality; last in, first out keeps it deterministic and O(1).
                    target.append(b)
            if not group:
                del by_load[load]
                distinct.remove(load)
    return bins, loads


def next_fit_count(sizes: Sequence[int], arrival: Sequence[int], cap: int) -> Packing:
    """Next fit in arrival order: close the current bin when the next sample does not fit.

    Returns every bin it opened (the count is ``len(bins)``). Cheap, and on workloads that arrive
    in a regular pattern (sizes 5, 5, 4, 3, 3 under a cap of 10) tighter than best-fit decreasing,
    which pairs the 4s.
    """
    bins: Bins = []
    loads: List[int] = []
    current: List[int] = []
    load = 0
    for i in arrival:
        size = sizes[i]
        if current and load + size > cap:
            bins.append(current)
            loads.append(load)
            current, load = [], 0
        current.append(i)
        load += size
    if current:
        bins.append(current)
        loads.append(load)
    return bins, loads


def spread_into_empty(sizes: Sequence[int], packing: Packing) -> Packing:
    """Move single samples from the fullest multi-sample bins into empty bins, in place.

    An empty bin costs a whole placeholder row; moving the smallest sample of the fullest bin
    there turns that placeholder into real work and never raises a load.
    """
    bins, loads = packing
    empty = [b for b, members in enumerate(bins) if not members]
    if not empty:
        return packing
    empty.reverse()  # pop() yields the lowest empty bin
    # Only as many donors as empty bins can ever be needed: the fullest multi-sample bins.
    heap = heapq.nsmallest(
        len(empty), ((-loads[b], b) for b, members in enumerate(bins) if len(members) > 1)
    )
    heapq.heapify(heap)
    while empty and heap:
        _, b = heapq.heappop(heap)
        smallest = min(bins[b], key=lambda i: (sizes[i], i))
        target = empty.pop()
        bins[b].remove(smallest)
        bins[target].append(smallest)
        loads[b] -= sizes[smallest]
        loads[target] = sizes[smallest]
        if len(bins[b]) > 1:
            heapq.heappush(heap, (-loads[b], b))
    return bins, loads


def kk_pack(sizes: Sequence[int], order: Sequence[int], num_bins: int) -> Packing:
    """k-way largest differencing (Karmarkar-Karp) into ``num_bins`` bins.

    Every sample starts as a partial packing of ``num_bins`` bins (the sample in one, the others
    empty); the two partial packings with the largest spread (fullest - emptiest bin) are merged,
    fullest bin of one with the emptiest of the other, until one is left. With few samples per
    bin it balances far better than LPT (3 samples per bin: 7,209 against LPT's 7,417 tokens in a
    step of 160 uniform samples), but each merge sorts the bins that hold something (up to K),
    so the planner uses it only on small steps (:data:`KK_LIMIT`).
    """
    # Ascending sizes: ties merge as in LDM's reference order. Only the bins that hold something
    # are carried (every size is positive): see merge_sparse.
    sets = merge_sparse([[[sizes[i], [i]]] for i in reversed(order)], num_bins)
    return [entry[1] for entry in sets], [entry[0] for entry in sets]


#: Largest ``samples x bins`` for which :func:`kk_pack` is tried (about 10 ms of CPU).
KK_LIMIT = 20000
#: Rounds of :func:`lower_max_load` per bin (each round lowers the fullest bin or stops).
_IMPROVE_ROUNDS_PER_BIN = 2
#: Emptiest bins tried as the partner of the fullest one in a round.
_IMPROVE_PARTNERS = 4


def lower_max_load(sizes: Sequence[int], packing: Packing, cap: int) -> Packing:
    """Lower the largest load by moving or swapping single samples with the emptiest bins.

    Each round takes the fullest bin and looks, among the emptiest bins, for the move or swap that
    brings both below its load (the lower the larger of the two, the better); it stops when none
    exists or after ``_IMPROVE_ROUNDS_PER_BIN`` rounds per bin. In place; loads stay <= ``cap``.
    """
    bins, loads = packing
    num_bins = len(bins)
    if num_bins < 2:
        return packing
    for _ in range(_IMPROVE_ROUNDS_PER_BIN * num_bins):
        x = max(range(num_bins), key=lambda b: (loads[b], -b))
        top = loads[x]
        partners = sorted(range(num_bins), key=lambda b: (loads[b], b))[:_IMPROVE_PARTNERS]
        best = None
        best_peak = top
        for y in partners:
            if y == x:
                continue
            for a in bins[x]:
                for b in [None, *bins[y]]:
                    d = sizes[a] - (sizes[b] if b is not None else 0)
                    if d <= 0:
                        continue
                    peak = max(top - d, loads[y] + d)
                    if peak < best_peak and loads[y] + d <= cap:
                        best, best_peak = (a, b, y, d), peak
        if best is None:
            break
        a, b, y, d = best
        bins[x].remove(a)
        bins[y].append(a)
        if b is not None:
            bins[y].remove(b)
            bins[x].append(b)
        loads[x] -= d
        loads[y] += d
    return packing


#: Average fill of the rows above which LPT is not tried (see :func:`feasible_pack`).
_LPT_MAX_FILL = 0.995
#: When LPT breaks the cap, the search for the smallest row length best fit still packs stops
#: within 1/500 of it: each probe repacks the step, and 0.2% of a row is below a step's noise.
_ROW_SLACK_DIVISOR = 500


def feasible_pack(
    sizes: Sequence[int],
    order: Sequence[int],
    arrival: Sequence[int],
    num_bins: int,
    cap: int,
    next_fit: bool = True,
    ordered: Optional[Sequence[int]] = None,
) -> Optional[Packing]:
    """``order`` into ``num_bins`` bins, every load <= ``cap``, with a small largest load.

    LPT first (balanced, fast). Where LPT breaks the cap (samples that pair badly), best fit at the
    cap, or else next fit in arrival order; then binary search of the smallest capacity at which
    best fit still packs (MULTIFIT), and single samples spread into the bins left empty. ``None``
    when nothing fits: more bins are needed (``next_fit=False`` skips next fit, which only helps
    to reach the fewest bins). ``ordered``: the sizes of ``order`` in order, where the caller has
    them (see :func:`lpt_pack`).
    """
    if not order:
        return [[] for _ in range(num_bins)], [0] * num_bins
    total = sum(map(sizes.__getitem__, order) if ordered is None else ordered)
    if num_bins >= len(order):
        # One sample per bin: nothing can pack tighter than its own row.
        bins: Bins = [[i] for i in order] + [[] for _ in range(num_bins - len(order))]
        return bins, [sizes[i] for i in order] + [0] * (num_bins - len(order))
    if len(order) * num_bins <= KK_LIMIT:
        # Few samples per bin: differencing often balances better; keep the lower largest load,
        # then try single moves and swaps on the fullest bin.
        packing = lpt_pack(sizes, order, num_bins)
        differenced = kk_pack(sizes, order, num_bins)
        if max(differenced[1]) < max(packing[1]):
            packing = differenced
        packing = lower_max_load(sizes, packing, cap)
        if max(packing[1]) <= cap:
            return packing
    elif total <= _LPT_MAX_FILL * num_bins * cap:
        # Rows fuller than that on average leave LPT's last, smallest samples no room: it would
        # fail late (a whole pass) where best fit packs.
        packing = lpt_pack(sizes, order, num_bins, cap, ordered)
        if packing is not None:
            return packing
    best = best_fit_pack(sizes, order, num_bins, cap, ordered)
    if best is None:
        if not next_fit:
            return None
        bins, loads = next_fit_count(sizes, arrival, cap)
        if len(bins) > num_bins:
            return None
        extra = num_bins - len(bins)
        return spread_into_empty(sizes, (bins + [[] for _ in range(extra)], loads + [0] * extra))
    low = max(ceil_div(total, num_bins), sizes[order[0]])
    high = max(best[1])
    while low < high and (high - low) * _ROW_SLACK_DIVISOR > high:
        middle = (low + high) // 2
        trial = best_fit_pack(sizes, order, num_bins, middle, ordered)
        if trial is None:
            low = middle + 1
        else:
            best, high = trial, max(trial[1])
    return spread_into_empty(sizes, best)


def min_bins(
    sizes: Sequence[int],
    order: Sequence[int],
    arrival: Sequence[int],
    cap: int,
    ordered: Optional[Sequence[int]] = None,
) -> int:
    """The fewest bins :func:`feasible_pack` is sure to fit the samples into.

    The smaller of best fit's and next fit's counts; both pack into that many bins again (best
    fit makes the same choices with any number of bins it does not run out of).
    """
    packed = best_fit_pack(sizes, order, len(order), cap, ordered)
    assert packed is not None, "every sample fits the cap alone"
    best_fit = sum(1 for members in packed[0] if members)
    return min(best_fit, len(next_fit_count(sizes, arrival, cap)[0]))


def profile_pack(
    sizes: Sequence[int],
    order: Sequence[int],
    targets: Sequence[Sequence[float]],
    cap: int,
) -> Optional[Packing]:
    """``order`` (decreasing size) into bins of uneven target loads, every load <= ``cap``.

    ``targets[r][k]`` is the load wanted of bin ``k`` of group ``r`` (a DP rank); bin ``r * K +
    k`` of the result is that bin. Each sample goes to the group with the most room left under
    its total target (so the groups stay even), and there to the bin with the most room left
    under its own target (so the loads follow the targets' profile) among those it fits under
    the cap: a sample longer than its bin's target fills it alone. ``None`` when a sample fits
    no bin of any group. Ties by group, then bin index.
    """
    groups = len(targets)
    per_group = len(targets[0]) if groups else 0
    bins: Bins = [[] for _ in range(groups * per_group)]
    loads = [0] * (groups * per_group)
    room = [float(sum(row)) for row in targets]
    bin_room = [float(t) for row in targets for t in row]
    heap = [(-room[r], r) for r in range(groups)]
    heapq.heapify(heap)
    # Each group's bins by most room under their targets, ties by index: the bin a sample takes
    # is the first of its group's that fits under the cap (a scan of the group's bins per sample
    # was most of a packing's time with a rank of 40-50 micro-batches; the same choices).
    ranked = []
    for r in range(groups):
        ranked.append([(-bin_room[k], k) for k in range(r * per_group, (r + 1) * per_group)])
        heapq.heapify(ranked[r])
    pop, push = heapq.heappop, heapq.heappush
    for i in order:
        size = sizes[i]
        skipped = []
        while heap:
            entry = pop(heap)
            r = entry[1]
            group_bins = ranked[r]
            held = []
            b = -1
            while group_bins:
                top = pop(group_bins)
                if loads[top[1]] + size <= cap:
                    b = top[1]
                    break
                held.append(top)
            for top in held:
                push(group_bins, top)
            if b < 0:
                skipped.append(entry)
                continue
            bins[b].append(i)
            loads[b] += size
            bin_room[b] -= size
            push(group_bins, (-bin_room[b], b))
            room[r] -= size
            push(heap, (-room[r], r))
            break
        else:
            return None
        for entry in skipped:
            push(heap, entry)
    return bins, loads
