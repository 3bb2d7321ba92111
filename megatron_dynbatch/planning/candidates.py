"""More constructions of a small step's schedule, each scored beside the shape search's own.

On a step with few samples per DP rank, the shape search's one construction (a global packing,
balanced by sample moves) has little room to work with, and another construction can land a few
tenths of a percent ahead: a differencing split of the samples over the ranks (verl's
Karmarkar-Karp), first fit in arrival order (slime's), or, for a tiny step, the exact best split.
:func:`small_step_candidates` builds them for a micro-batch count; :mod:`.shape` scores each with
the same simulated step as its own candidates and keeps the fastest, so adding a construction can
only make the chosen step faster in the model, never slower.

Everything is deterministic (ties by sample index; the exact search is bounded by a node count,
never by time), so every rank derives the same plan.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator, List, Optional, Sequence, Tuple

from .balance import deal_with_room
from .karmarkar_karp import karmarkar_karp
from .packing import best_fit_pack, feasible_pack
from .spec import ceil_div, round_up

__all__ = [
    "SMALL_STEP_PER_RANK",
    "SMALL_STEP_SAMPLES",
    "TINY_STEP_SAMPLES",
    "balanced_rows",
    "decreasing_candidates",
    "differenced_rows",
    "exact_rows_affordable",
    "exact_split",
    "first_fit",
    "first_fit_bins",
    "is_small_step",
    "least_rounding",
    "modified_first_fit",
    "natural_count",
    "peeled_bins",
    "peer_schedules",
    "rank_packings",
    "small_step_candidates",
]

#: A step is small when it has at most this many samples per DP rank ...
SMALL_STEP_PER_RANK = 8
#: ... and at most this many samples in all (the constructions cost a few packings each), or when
#: it has at most :data:`TINY_STEP_SAMPLES`.
SMALL_STEP_SAMPLES = 1024
#: Steps of at most this many samples are tiny: every count is worth a construction, and the
#: exact split over the ranks is searched.
TINY_STEP_SAMPLES = 64
#: Samples up to which the exact split over the ranks is searched ...
EXACT_SAMPLES = 16
#: ... visiting at most this many nodes (the best split found so far is kept when it runs out).
EXACT_NODES = 20000

#: Steps of at most this many samples also get modified first fit (its fill pass scans the rest).
MFFD_SAMPLES = 256

#: Ranks of at most this many samples get the packing with the least rounding of their rows ...
EXACT_ROWS_SAMPLES = 6
#: ... and so do ranks of up to this many where the searches of a split together visit at most
#: :data:`EXACT_ROWS_WORK` subsets (``rows x 3**samples`` a rank: one rank of 8 samples in 4 rows,
#: about 1.5 ms). On one rank of 8 samples in 4 own rows, differencing and first fit left 64 tokens
#: more rounding than SkyRL's balancing (0.43% of the step, ``benchmarks.small_steps`` seed 75).
#: Twice this budget found 31 faster steps of 2,100 where this finds 24, for more planning CPU
#: (60 tiny steps of 7-8 samples a rank, median: 13-16 ms without these ranks, 16-18 ms with this
#: budget, 21-23 ms with twice it).
EXACT_ROWS_MAX_SAMPLES = 8
EXACT_ROWS_WORK = 4 * 3**8
#: Largest ``samples x ranks`` for which the free differencing split is built (a few ms of CPU).
KK_LIMIT = 20000

#: One construction: ``(name, ranks, keep_order)``; ``ranks[r][m]`` lists the samples of
#: micro-batch ``m`` on rank ``r`` (``[]``: a placeholder); ``keep_order``: score the ranks in the
#: order given as well as reordered for the pipeline.
Construction = Tuple[str, List[List[List[int]]], bool]


def is_small_step(num_samples: int, dp_size: int) -> bool:
    """Few samples per rank (or a tiny step): where more constructions are worth their time."""
    if num_samples <= TINY_STEP_SAMPLES:
        return True
    return num_samples <= SMALL_STEP_SAMPLES and num_samples <= SMALL_STEP_PER_RANK * dp_size


def _differencing_splits(
    items: Sequence[int], weights: Sequence[float], dp_size: int
) -> List[Tuple[str, List[List[int]]]]:
    """``items`` split over the ranks by differencing on their ``weights``: free (``"kk"``,
    where :data:`KK_LIMIT` allows) and with equal counts (``"kk-equal"``, where the samples
    divide), each as ``(name, samples of each rank)``."""
    values = [weights[i] for i in items]
    splits = []
    if len(items) * dp_size <= KK_LIMIT:
        # Free differencing merges one partial of dp sets per sample: O(n * dp log dp).
        parts = karmarkar_karp(values, dp_size, False, ties="index")
        splits.append(("kk", [[items[j] for j in part] for part in parts]))
    if len(items) % dp_size == 0:
        parts = karmarkar_karp(values, dp_size, True, ties="index")
        splits.append(("kk-equal", [[items[j] for j in part] for part in parts]))
    return splits


def small_step_candidates(
    items: Sequence[int],
    sizes: Sequence[int],
    weights: Sequence[float],
    cap: int,
    dp_size: int,
    per_rank: int,
    row_multiple: Optional[int] = None,
) -> Iterator[Construction]:
    """Schedules of ``per_rank`` micro-batches a rank under ``cap`` padded tokens a row.

    Args:
        items: The step's samples (all at most ``cap``), in arrival order.
        sizes: Every sample's padded size (indexed by sample).
        weights: Every sample's own cost (indexed by sample): what a rank's share adds up to.
        cap: The most padded tokens a micro-batch may hold.
        dp_size: DP ranks.
        per_rank: Micro-batches every rank runs.
        row_multiple: Rows of their own length, rounded up to this: on a tiny step, small ranks
            (:func:`exact_rows_affordable`) are also packed with the least rounding.

    Yields:
        Constructions (see :data:`Construction`) that fit: ranks split by differencing (free and
        equal counts) and, for a tiny step, exactly, each rank packed into its rows; first fit in
        arrival order, split to the count and dealt strided and by weight.
    """
    items = list(items)
    if not items:
        return
    splits = _differencing_splits(items, weights, dp_size)
    if len(items) <= EXACT_SAMPLES and dp_size > 1:
        splits.append(("exact", exact_split(items, weights, dp_size)))
    for k, (name, split) in enumerate(splits):
        if any(split == earlier for _, earlier in splits[:k]):
            # On one rank every split is the same one (and free and equal differencing often
            # agree): its constructions would only be built and scored again.
            continue
        ranks = _pack_ranks(split, sizes, cap, per_rank)
        if ranks is not None:
            yield name, ranks, False
        ranks = _differenced_ranks(split, sizes, weights, cap, per_rank)
        if ranks is not None:
            yield name + "-differenced", ranks, True
        if row_multiple is None:
            # One row a step: every row is as long as the step's fullest, so the fullest row,
            # not the rank's work, sets what every micro-batch costs.
            both = [balanced_rows(part, sizes, cap, per_rank) for part in split]
            ranks = [plain for plain, _ in both]
            if all(rank is not None for rank in ranks):
                yield name + "-balanced-rows", ranks, False
            # Beside it, not instead: the rank's shorter fullest row need not be the step's.
            multifit = [fitted for _, fitted in both]
            if all(rank is not None for rank in multifit) and multifit != ranks:
                yield name + "-multifit-rows", multifit, False
        if (
            row_multiple is not None
            and len(items) <= TINY_STEP_SAMPLES
            and exact_rows_affordable(list(map(len, split)), per_rank)
        ):
            ranks = [least_rounding(part, sizes, cap, per_rank, row_multiple) for part in split]
            if all(rank is not None for rank in ranks):
                yield name + "-least-rounding", ranks, False
    orders = [("first-fit", items)]
    if len(items) <= TINY_STEP_SAMPLES:
        orders.append(("first-fit-decreasing", sorted(items, key=lambda i: (-sizes[i], i))))
    packings = [
        (name, first_fit_bins(order, sizes, cap, dp_size * per_rank)) for name, order in orders
    ]
    if len(items) <= MFFD_SAMPLES:
        bins = _to_count(modified_first_fit(items, sizes, cap), sizes, dp_size * per_rank)
        packings.append(("modified-first-fit", bins))
    for name, bins in packings:
        if bins is None:
            continue
        strided = [[bins[b] for b in range(r, len(bins), dp_size)] for r in range(dp_size)]
        yield name + "-strided", strided, True
        yield name + "-balanced", _deal_by_weight(bins, weights, dp_size, per_rank), False


def decreasing_candidates(
    items: Sequence[int],
    sizes: Sequence[int],
    weights: Sequence[float],
    cap: int,
    dp_size: int,
    counts: Sequence[int],
) -> Iterator[Tuple[int, Construction]]:
    """First fit by decreasing size, where alike samples share a row and rows of their own
    length round up least (two lengths at dp 12: five rows a rank where the balanced packings
    need six), at each of ``counts`` micro-batches a rank: ``(count, construction)``.

    Each rank of a split by differencing (free, and equal counts where the samples divide) is
    packed alone, brought to the count by splitting its fullest rows (:func:`first_fit_bins`)
    and, apart, by peeling its smallest samples into rows of their own (:func:`peeled_bins`),
    which keeps the full rows whole and makes the extra micro-batches nearly empty: what an
    interleaved pipeline's count asks for. And the whole step packed at once, peeled to the
    count and dealt round robin in packing order, full rows first, as NeMo-RL packs. The splits
    and packings are made once for all counts.
    """
    items = list(items)

    def decreasing(members):
        return sorted(members, key=lambda i: (-sizes[i], i))

    packings = []
    for _name, split in _differencing_splits(items, weights, dp_size):
        packed = [first_fit(decreasing(part), sizes, cap) for part in split]
        if packed not in packings:
            packings.append(packed)
    whole = first_fit(decreasing(items), sizes, cap)
    for per_rank in counts:
        seen: List[List[List[List[int]]]] = []
        for packed in packings:
            if any(len(bins) > per_rank for bins in packed):
                continue
            for name, to_count, keep_order in (
                ("decreasing", _to_count, False),
                ("decreasing-peeled", peeled_bins, True),
            ):
                ranks = [to_count([list(b) for b in bins], sizes, per_rank) for bins in packed]
                if ranks not in seen:
                    seen.append(ranks)
                    yield per_rank, (name, ranks, keep_order)
        bins = peeled_bins(whole, sizes, dp_size * per_rank)
        if bins is not None:
            yield per_rank, ("decreasing-dealt", [bins[r::dp_size] for r in range(dp_size)], True)


def peeled_bins(
    bins: List[List[int]], sizes: Sequence[int], num_bins: int
) -> Optional[List[List[int]]]:
    """``bins`` brought to ``num_bins`` by moving the smallest sample of a bin of two or more
    into a bin of its own (ties to the later bin), then placeholders; ``None`` if more."""
    if len(bins) > num_bins:
        return None
    bins = [list(b) for b in bins]
    # (size, -bin, sample) of every bin's smallest sample, for bins of two or more.
    heap = []
    for b, members in enumerate(bins):
        members.sort(key=lambda i: (-sizes[i], i))
        if len(members) > 1:
            heap.append((sizes[members[-1]], -b, members[-1]))
    heapq.heapify(heap)
    while len(bins) < num_bins and heap:
        _, negative, i = heapq.heappop(heap)
        members = bins[-negative]
        members.pop()
        bins.append([i])
        if len(members) > 1:
            heapq.heappush(heap, (sizes[members[-1]], negative, members[-1]))
    return bins + [[] for _ in range(num_bins - len(bins))]


def _pack_ranks(
    split: List[List[int]], sizes: Sequence[int], cap: int, per_rank: int
) -> Optional[List[List[List[int]]]]:
    """Every rank's samples into ``per_rank`` rows under ``cap``; ``None`` where one does not fit."""
    ranks = []
    for members in split:
        order = sorted(members, key=lambda i: (-sizes[i], i))
        packing = feasible_pack(sizes, order, sorted(members), per_rank, cap)
        if packing is None:
            return None
        ranks.append([list(b) for b in packing[0]])
    return ranks


def exact_rows_affordable(rank_sizes: Sequence[int], per_rank: int) -> bool:
    """Whether ranks of ``rank_sizes`` samples get :func:`least_rounding` (see
    :data:`EXACT_ROWS_SAMPLES`)."""
    if max(rank_sizes, default=0) <= EXACT_ROWS_SAMPLES:
        return True
    if max(rank_sizes) > EXACT_ROWS_MAX_SAMPLES:
        return False
    return per_rank * sum(3**n for n in rank_sizes) <= EXACT_ROWS_WORK


def least_rounding(
    members: Sequence[int], sizes: Sequence[int], cap: int, per_rank: int, multiple: int
) -> Optional[List[List[int]]]:
    """``members`` into ``per_rank`` rows (empty ones: placeholders, one ``multiple`` long) with
    the fewest padded tokens when every row is its load rounded up to ``multiple``; ``None`` when
    they do not fit. Exact (a search over subsets, O(per_rank * 3**n)): tiny ranks only."""
    n = len(members)
    full = (1 << n) - 1
    load = [0] * (1 << n)
    for mask in range(1, 1 << n):
        low = mask & -mask
        load[mask] = load[mask ^ low] + sizes[members[low.bit_length() - 1]]
    # A real row costs its rounded length beyond the placeholder it replaces.
    row = [
        (-(-load[mask] // multiple)) * multiple - multiple if load[mask] <= cap else None
        for mask in range(1 << n)
    ]
    if n == 1 and load[1] > cap:
        row[1] = 0  # a lone oversize sample runs alone whatever it costs
    inf = float("inf")
    best = [inf] * (1 << n)
    best[0] = 0.0
    choice: List[List[int]] = [[0] * (1 << n) for _ in range(per_rank + 1)]
    layers = [best]
    for k in range(1, per_rank + 1):
        prev, cur = layers[-1], [inf] * (1 << n)
        cur[0] = 0.0
        for mask in range(1, 1 << n):
            low = mask & -mask
            rest = mask ^ low
            sub = rest
            while True:
                part = sub | low
                cost = row[part]
                if cost is not None and prev[mask ^ part] + cost < cur[mask]:
                    cur[mask] = prev[mask ^ part] + cost
                    choice[k][mask] = part
                if sub == 0:
                    break
                sub = (sub - 1) & rest
        layers.append(cur)
    if layers[-1][full] == inf:
        return None
    rows: List[List[int]] = []
    mask = full
    for k in range(per_rank, 0, -1):
        if mask == 0:
            rows.append([])
            continue
        part = choice[k][mask]
        rows.append([members[j] for j in range(n) if part >> j & 1])
        mask ^= part
    return rows


def _differenced_ranks(
    split: List[List[int]],
    sizes: Sequence[int],
    weights: Sequence[float],
    cap: int,
    per_rank: int,
) -> Optional[List[List[List[int]]]]:
    """Every rank's samples into ``per_rank`` micro-batches by differencing on their weights (as
    verl splits a rank), laid light-heavy-light; ``None`` where a micro-batch breaks the cap."""
    ranks = []
    for members in split:
        rows = differenced_rows(members, sizes, weights, cap, per_rank)
        if rows is None:
            return None
        ranks.append(rows)
    return ranks


def balanced_rows(
    members: Sequence[int], sizes: Sequence[int], cap: int, per_rank: int
) -> Tuple[Optional[List[List[int]]], Optional[List[List[int]]]]:
    """One rank's samples in ``per_rank`` rows with the fullest row as short as a local search
    finds, twice: from differencing on the sizes, and from MULTIFIT (:func:`_multifit_rows`)
    where its fullest row is shorter than differencing's (else the second is the first). The
    search: while it shortens the fullest row, one of its samples moved to another row, or one
    or two of them swapped against one or two of another row's (the first change found, rows and
    samples in a fixed order). ``None`` (each) where there are fewer samples than rows or a row
    of several samples breaks the cap."""
    if len(members) < per_rank:
        return None, None
    rows, loads = _differenced_rows(members, sizes, per_rank)
    # Differencing and the moves below can both stop short where the rows are nearly full (a
    # 16-sample rank in 10 rows: 8,170 tokens where best fit decreasing packs 7,912).
    packed = _multifit_rows(members, sizes, per_rank, max(loads) - 1)
    plain = _shortened_rows(rows, loads, sizes, cap)
    return plain, plain if packed is None else _shortened_rows(*packed, sizes, cap)


def _differenced_rows(
    members: Sequence[int], sizes: Sequence[int], per_rank: int
) -> Tuple[List[List[int]], List[int]]:
    """``members`` in ``per_rank`` rows by differencing on their sizes, ``(rows, loads)``."""
    parts = karmarkar_karp([sizes[i] for i in members], per_rank, False, ties="index")
    rows = [sorted(members[j] for j in part) for part in parts]
    return rows, [sum(sizes[i] for i in row) for row in rows]


def _shortened_rows(
    rows: List[List[int]], loads: List[int], sizes: Sequence[int], cap: int
) -> Optional[List[List[int]]]:
    """:func:`balanced_rows`' local search from ``rows`` (``loads`` their sizes, both changed in
    place); ``None`` where a row of several samples ends over the cap."""
    per_rank = len(rows)

    def groups(row: List[int]) -> List[Tuple[int, List[int]]]:
        """The row's single samples and pairs, with their sizes (and nothing: a move)."""
        found = [(0, [])] + [(sizes[i], [i]) for i in row]
        found += [(sizes[a] + sizes[b], [a, b]) for a, b in itertools.combinations(row, 2)]
        return found

    def first_change() -> Optional[Tuple[int, int, List[int], List[int], int]]:
        """``(full, other, taken, given, gain)``: the first exchange that shortens the fullest
        row without making ``other`` as full, keeping the cap; ``None`` where none does."""
        full = max(range(per_rank), key=lambda k: (loads[k], -k))
        outs = groups(rows[full])
        for other in sorted(range(per_rank), key=lambda k: (loads[k], k)):
            if other == full:
                continue
            backs = groups(rows[other])
            for out, taken in outs:
                for back, given in backs:
                    gain = out - back
                    if gain <= 0 or loads[other] + gain >= loads[full]:
                        continue
                    if loads[other] + gain > cap and len(rows[other]) - len(given) + len(taken) > 1:
                        continue
                    return full, other, taken, given, gain
        return None

    for _ in range(4 * sum(map(len, rows))):
        change = first_change()
        if change is None:
            break
        full, other, taken, given, gain = change
        rows[full] = sorted([i for i in rows[full] if i not in taken] + given)
        rows[other] = sorted([i for i in rows[other] if i not in given] + taken)
        loads[full] -= gain
        loads[other] += gain
    if any(len(row) > 1 and load > cap for row, load in zip(rows, loads, strict=True)):
        return None
    return rows


def _multifit_rows(
    members: Sequence[int], sizes: Sequence[int], per_rank: int, high: int
) -> Optional[Tuple[List[List[int]], List[int]]]:
    """``members`` in ``per_rank`` rows of at most ``high`` tokens each with the least capacity
    at which best fit decreasing packs them (MULTIFIT: a binary search over the capacity),
    ``(rows, loads)``; ``None`` where best fit does not pack them within ``high``."""
    order = sorted(members, key=lambda i: (-sizes[i], i))
    low = max(ceil_div(sum(sizes[i] for i in members), per_rank), sizes[order[0]])
    best = None
    while low <= high:
        middle = (low + high) // 2
        packed = best_fit_pack(sizes, order, per_rank, middle)
        if packed is None:
            low = middle + 1
        else:
            best, high = packed, max(packed[1]) - 1
    if best is None:
        return None
    return [sorted(row) for row in best[0]], list(best[1])


def differenced_rows(
    members: Sequence[int],
    sizes: Sequence[int],
    weights: Sequence[float],
    cap: int,
    per_rank: int,
) -> Optional[List[List[int]]]:
    """One rank's samples into ``per_rank`` micro-batches by differencing on their weights (as
    verl splits a rank), laid light-heavy-light; ``None`` where there are fewer samples than
    micro-batches or a micro-batch breaks the cap."""
    if len(members) < per_rank:
        return None
    parts = karmarkar_karp([weights[i] for i in members], per_rank, False, ties="index")
    mbs = [sorted(members[j] for j in part) for part in parts]
    if any(len(mb) > 1 and sum(sizes[i] for i in mb) > cap for mb in mbs):
        return None
    totals = [sum(weights[i] for i in mb) for mb in mbs]
    ranked = sorted(range(per_rank), key=lambda m: (-totals[m], m))
    laid = ranked[::2][::-1] + ranked[1::2]
    return [mbs[m] for m in laid]


def rank_packings(
    members: Sequence[int],
    sizes: Sequence[int],
    weights: Sequence[float],
    cap: int,
    per_rank: int,
    row_multiple: Optional[int] = None,
) -> Iterator[Tuple[str, List[List[int]]]]:
    """The constructions above for one rank whose samples are given (a forward-only pass over
    the training partition): ``(name, rows)`` of ``per_rank`` micro-batches under ``cap``, each
    that fits: differencing on the weights, first fit in arrival order and by decreasing size
    (split to the count), and with variable rows on a small rank (:func:`exact_rows_affordable`)
    the packing with the least rounding."""
    members = list(members)
    if not members:
        return
    rows = differenced_rows(members, sizes, weights, cap, per_rank)
    if rows is not None:
        yield "differenced", rows
    by_size = sorted(members, key=lambda i: (-sizes[i], i))
    for name, order in (("first-fit", members), ("first-fit-decreasing", by_size)):
        bins = first_fit_bins(order, sizes, cap, per_rank)
        if bins is not None:
            yield name, bins
    if (
        row_multiple is not None
        and row_multiple > 1
        and exact_rows_affordable([len(members)], per_rank)
    ):
        rows = least_rounding(members, sizes, cap, per_rank, row_multiple)
        if rows is not None:
            yield "least-rounding", rows


def first_fit_bins(
    order: Sequence[int], sizes: Sequence[int], cap: int, num_bins: int
) -> Optional[List[List[int]]]:
    """First fit in ``order`` under ``cap``, then the fullest bin of two or more samples split in
    two (largest first into the lighter half) until there are ``num_bins``; ``None`` when first
    fit needs more bins. Where every sample already has a bin of its own, placeholders (``[]``)
    fill the rest."""
    return _to_count(first_fit(order, sizes, cap), sizes, num_bins)


def _to_count(
    bins: List[List[int]], sizes: Sequence[int], num_bins: int
) -> Optional[List[List[int]]]:
    """``bins`` split to ``num_bins`` as :func:`first_fit_bins` does; ``None`` if more."""
    if len(bins) > num_bins:
        return None
    loads = [sum(sizes[i] for i in members) for members in bins]
    # The fullest splittable bin first, ties to the lower index, as a heap of (-load, bin).
    heap = [(-loads[b], b) for b in range(len(bins)) if len(bins[b]) > 1]
    heapq.heapify(heap)
    while len(bins) < num_bins:
        if not heap:
            bins += [[] for _ in range(num_bins - len(bins))]
            break
        _, b = heapq.heappop(heap)
        halves: Tuple[List[int], List[int]] = ([], [])
        sums = [0, 0]
        for i in sorted(bins[b], key=lambda i: (-sizes[i], i)):
            side = 0 if sums[0] <= sums[1] else 1
            halves[side].append(i)
            sums[side] += sizes[i]
        bins[b], loads[b] = halves[0], sums[0]
        bins.append(halves[1])
        loads.append(sums[1])
        for k in (b, len(bins) - 1):
            if len(bins[k]) > 1:
                heapq.heappush(heap, (-loads[k], k))
    return bins


def modified_first_fit(items: Sequence[int], sizes: Sequence[int], cap: int) -> List[List[int]]:
    """Johnson and Garey's modified first fit decreasing, in the variant NeMo-RL's shipped configs
    pack with, so that its rows dealt round-robin are among the constructions.

    By size against the cap: every sample over a half opens a bin (largest first); forwards, each
    such bin takes the largest sample over a third that fits; backwards, each bin still without
    one takes the smallest sample over a sixth and the largest that fits beside it, where both
    do; forwards, each bin is filled with the largest remaining samples that fit; what is left
    goes, largest first, into the least loaded of the extra bins, or a new one. On 64 GRPO
    samples at dp 8 (``benchmarks.small_steps --cases 300 --seed 14``) its two rows a rank were
    0.99% faster than any construction of ours (which ran three).
    """

    def by_size(members: List[int], descending: bool) -> List[int]:
        key = (lambda i: (-sizes[i], i)) if descending else (lambda i: (sizes[i], i))
        return sorted(members, key=key)

    large = by_size([i for i in items if 2 * sizes[i] > cap], True)
    medium = by_size([i for i in items if 3 * sizes[i] > cap >= 2 * sizes[i]], True)
    small = by_size([i for i in items if 6 * sizes[i] > cap >= 3 * sizes[i]], False)
    tiny = [i for i in items if 6 * sizes[i] <= cap]
    bins = [[i] for i in large]
    room = [cap - sizes[i] for i in large]
    with_medium = [False] * len(bins)
    for b in range(len(bins)):
        k = next((k for k, i in enumerate(medium) if sizes[i] <= room[b]), None)
        if k is not None:
            i = medium.pop(k)
            bins[b].append(i)
            room[b] -= sizes[i]
            with_medium[b] = True
    for b in reversed(range(len(bins))):
        if with_medium[b] or len(small) < 2 or sizes[small[0]] + sizes[small[1]] > room[b]:
            continue
        first = small.pop(0)
        # The largest that fits beside it (the next smallest does, as just checked).
        k = max(k for k, j in enumerate(small) if sizes[j] <= room[b] - sizes[first])
        second = small.pop(k)
        bins[b] += [first, second]
        room[b] -= sizes[first] + sizes[second]
    rest = by_size(medium + small + tiny, True)
    for b in range(len(bins)):
        while rest and room[b] >= sizes[rest[-1]]:
            k = next(k for k, i in enumerate(rest) if sizes[i] <= room[b])
            i = rest.pop(k)
            bins[b].append(i)
            room[b] -= sizes[i]
    extra: List[Tuple[int, int, List[int]]] = []  # (load, order opened, members)
    for i in rest:
        if extra and extra[0][0] + sizes[i] <= cap:
            load, opened, members = heapq.heappop(extra)
        else:
            load, opened, members = 0, len(bins) + len(extra), []
        members.append(i)
        heapq.heappush(extra, (load + sizes[i], opened, members))
    return bins + [members for _, _, members in sorted(extra, key=lambda e: (e[0], e[1]))]


def first_fit(order: Sequence[int], sizes: Sequence[int], cap: int) -> List[List[int]]:
    """Each sample into the first bin with room (a new one when none has), in ``order``.

    The bins' free room is kept in a tree of maxima over bin positions, so finding the first bin
    with room costs O(log bins), not a scan of every open bin."""
    n = len(order)
    width = 1
    while width < max(1, n):
        width *= 2
    room = [-1] * (2 * width)  # leaf width + b: free room of bin b (-1: not opened)
    bins: List[List[int]] = []
    for i in order:
        size = sizes[i]
        if room[1] >= size:
            node = 1
            while node < width:
                node = 2 * node if room[2 * node] >= size else 2 * node + 1
            b = node - width
            bins[b].append(i)
        else:
            b = len(bins)
            bins.append([i])
            node = width + b
            room[node] = cap
        node = width + b
        room[node] -= size
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


def _deal_by_weight(
    bins: List[List[int]], weights: Sequence[float], dp_size: int, per_rank: int
) -> List[List[List[int]]]:
    """Bins to ranks, heaviest first to the lightest rank with room (ties by index)."""
    totals = [sum(weights[i] for i in members) for members in bins]
    order = sorted(range(len(bins)), key=lambda b: (-totals[b], b))
    dealt = deal_with_room(order, totals, dp_size, per_rank)
    return [[bins[b] for b in rank] for rank in dealt]


def exact_split(items: Sequence[int], weights: Sequence[float], dp_size: int) -> List[List[int]]:
    """The split of ``items`` over ``dp_size`` ranks with the lightest heaviest rank.

    Depth-first, heaviest sample first, into each rank in turn (one empty rank tried, not all:
    they are alike), pruned when a rank reaches the best maximum so far; bounded by
    :data:`EXACT_NODES` (then the best split found, which starts from the greedy one)."""
    order = sorted(items, key=lambda i: (-weights[i], i))
    values = [weights[i] for i in order]
    # Greedy start: heaviest first to the lightest rank.
    loads = [0.0] * dp_size
    best_assign = []
    for v in values:
        r = min(range(dp_size), key=lambda r: (loads[r], r))
        loads[r] += v
        best_assign.append(r)
    best = [max(loads)]
    lower = max(sum(values) / dp_size, values[0] if values else 0.0)
    assign = [0] * len(values)
    loads = [0.0] * dp_size
    nodes = [0]

    def visit(k: int) -> bool:
        """True when the search may stop (a split at the lower bound, or out of nodes)."""
        if k == len(values):
            peak = max(loads)
            if peak < best[0]:
                best[0] = peak
                best_assign[:] = assign
            return best[0] <= lower * (1 + 1e-12)
        nodes[0] += 1
        if nodes[0] > EXACT_NODES:
            return True
        tried_empty = False
        for r in range(dp_size):
            if loads[r] == 0.0:
                if tried_empty:
                    continue
                tried_empty = True
            if loads[r] + values[k] >= best[0]:
                continue
            loads[r] += values[k]
            assign[k] = r
            stop = visit(k + 1)
            loads[r] -= values[k]
            if stop:
                return True
        return False

    visit(0)
    split: List[List[int]] = [[] for _ in range(dp_size)]
    for i, r in zip(order, best_assign, strict=True):
        split[r].append(i)
    return [sorted(part) for part in split]


def peer_schedules(
    items: Sequence[int],
    sizes: Sequence[int],
    weights: Sequence[float],
    cap: int,
    dp_size: int,
    multiple: int,
) -> List[Tuple[str, List[List[List[int]]], int]]:
    """The trainers' own schedules of a step, as they build them, each kept within ``cap``:
    ``(name, ranks, per_rank)``, every rank's micro-batches in the order the trainer runs them.

    * ``first-fit``: first fit in arrival order, split to a multiple of ``dp * multiple`` bins
      and dealt strided (slime's ``build_dp_schedule``; Megatron-Core's sequence packing);
    * ``differencing``: where the sample count is a multiple of ``dp_size``, equal-count
      differencing over the ranks, then each rank's samples by differencing into the most
      micro-batches any rank's tokens need (``ceil(tokens / cap)``, rounded up to ``multiple``),
      one more multiple at a time while a micro-batch of several samples breaks the cap (verl's
      ``rearrange_micro_batches``, with the cap kept as a user would keep it).
    """
    items = list(items)
    schedules: List[Tuple[str, List[List[List[int]]], int]] = []
    if not items:
        return schedules
    # natural_count's first fit, run once: its bins are split to the count.
    fitted = first_fit(items, sizes, cap)
    count = round_up(max(1, ceil_div(len(fitted), dp_size)), multiple)
    bins = _to_count(fitted, sizes, dp_size * count)
    if bins is not None:
        strided = [[bins[b] for b in range(r, len(bins), dp_size)] for r in range(dp_size)]
        schedules.append(("first-fit", strided, count))
    if len(items) % dp_size == 0 and len(items) * dp_size <= KK_LIMIT:
        parts = karmarkar_karp([weights[i] for i in items], dp_size, True, ties="index")
        split = [[items[j] for j in part] for part in parts]
        count = max(min(len(part), ceil_div(sum(sizes[i] for i in part), cap)) for part in split)
        count = round_up(count, multiple)
        while count <= min(map(len, split)):
            ranks = _differenced_ranks(split, sizes, weights, cap, count)
            if ranks is not None:
                schedules.append(("differencing", ranks, count))
                break
            count += multiple
    return schedules


def natural_count(items: Sequence[int], sizes: Sequence[int], cap: int, dp_size: int) -> int:
    """Micro-batches a rank needs for first fit's bins in arrival order (before alignment)."""
    return max(1, ceil_div(len(first_fit(items, sizes, cap)), dp_size))
