"""k-way largest differencing (Karmarkar-Karp): the one implementation of the package.

Used by the planner (packing rows: :func:`.packing.kk_pack`; dealing micro-batches to DP ranks:
:func:`.balance.assign_bins_to_ranks`), by slime's static ``balance_data`` path
(``integrations/slime/static_schedule.py``) and by the verl / slime baselines of ``benchmarks/``.

The method: every item starts as a *partial partition* of ``k`` sets (the item in one set, the
others empty; with ``equal_size``, ``k`` items at a time, one per set). The two partial partitions
with the largest spread (fullest set - emptiest set) are merged, fullest set of one with the
emptiest of the other, until one is left. Worked example, values ``[8, 7, 6, 5, 4]``, ``k = 2``:
it ends with ``{4, 7, 5}`` and ``{8, 6}`` (16 / 14), where LPT (largest first into the emptiest
set) ends with 17 / 13.

Two tie-breaking rules, both deterministic:

* ``ties="index"`` (the planner's): equal spreads merge in creation order; sets order by sum only.
  Cheap: with every value positive a partial carries only the sets that hold something
  (:func:`merge_sparse`), so a merge sorts those, not all ``k``;
* ``ties="verl"``: exactly verl's ``karmarkar_karp`` (``verl/utils/seqlen_balancing.py``, which
  slime ships): sets order by ``(sum, item count, items)`` and equal spreads by the heaviest set's
  order, so slime's ``balance_data`` and the baselines reproduce verl's and slime's partitions item
  for item (``benchmarks/peers.py`` checks this against the real function when given a checkout).

Pure standard library; no torch, no numpy.
"""

from __future__ import annotations

import heapq
from typing import Any, List, Literal, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["karmarkar_karp", "merge_by_differencing", "merge_sparse"]


def merge_by_differencing(
    partials: List[List[list]], ties: Literal["index", "verl"] = "index"
) -> Optional[List[list]]:
    """Merge partial partitions by largest differencing (the core of Karmarkar-Karp).

    Each partial partition is a list of ``k`` sets ``[total, items]``, fullest first; the two with
    the largest spread merge, the fullest set of one with the emptiest of the other (extended in
    place, no copies), until one is left.

    Args:
        partials: The partial partitions (consumed).
        ties: ``index``: equal spreads merge in the order the partials were given, sets are
            ordered by total. ``verl``: sets order by ``(total, len(items), items)`` and equal
            spreads by the fullest set's order, as verl's ``State.__lt__``; ``items`` must then be
            comparable (verl's are ``(index, value)`` pairs).

    Returns:
        The final partition, fullest first, or ``None`` when ``partials`` is empty.
    """
    if ties == "verl":
        return _merge_verl(partials)
    heap = [(p[-1][0] - p[0][0], k, p) for k, p in enumerate(partials)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        for a, b in zip(first, reversed(second), strict=True):
            a[0] += b[0]
            a[1].extend(b[1])
        first.sort(key=lambda entry: -entry[0])
        heapq.heappush(heap, (first[-1][0] - first[0][0], counter, first))
        counter += 1
    return heap[0][2] if heap else None


def merge_sparse(partials: List[List[list]], k: int) -> List[list]:
    """:func:`merge_by_differencing` (``ties="index"``) on partials that list only their
    non-empty sets, each of a positive total, fullest first (the rest of the ``k`` sets are
    empty): the same merges and the same partition (the empty sets appended), in time that
    grows with the sets that hold something rather than with ``k``.

    A step's micro-batches split by differencing (``k`` in the hundreds on a rank of a thousand
    samples) would otherwise carry ``k`` sets through every merge, most of them empty: 16 s
    of CPU for one SkyRL mini-batch of 4,265 samples at dp 4.

    Why it is the same: in the dense merge, set ``j`` of the first partial takes set ``k-1-j``
    of the second, so only the last ``len(second)`` positions take anything; the stable sort by
    total then keeps every non-empty set (positive total) ahead of the empty ones, in position
    order among equal totals, and the spread is the fullest set's total while any set is empty.
    """

    def key(sets: List[list]) -> float:
        """Minus the spread (the heap pops the largest first)."""
        return (sets[-1][0] if len(sets) == k else 0) - sets[0][0]

    heap = [(key(p), n, p) for n, p in enumerate(partials)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        a, b = len(first), len(second)
        taking = k - b  # positions from here on take a set of the second
        merged = first[: min(a, taking)]
        for j in range(taking, k):
            other = second[k - 1 - j]
            if j < a:
                entry = first[j]
                entry[0] += other[0]
                entry[1].extend(other[1])
                merged.append(entry)
            else:
                merged.append(other)
        merged.sort(key=lambda entry: -entry[0])
        heapq.heappush(heap, (key(merged), counter, merged))
        counter += 1
    if not heap:
        return [[0, []] for _ in range(k)]
    sets = heap[0][2]
    return sets + [[0, []] for _ in range(k - len(sets))]


def _set_key(entry: list) -> Tuple[Any, int, list]:
    """verl's ``Set`` order: (sum, item count, items)."""
    return (entry[0], len(entry[1]), entry[1])


class _VerlState:
    """A partial partition in verl's heap order: the largest spread first, then the partial whose
    fullest set orders highest."""

    __slots__ = ("sets",)

    def __init__(self, sets: List[list]) -> None:
        self.sets = sorted(sets, key=_set_key, reverse=True)

    def spread(self):
        return self.sets[0][0] - self.sets[-1][0]

    def __lt__(self, other: "_VerlState") -> bool:
        mine, theirs = self.spread(), other.spread()
        if mine != theirs:
            return mine > theirs
        return _set_key(other.sets[0]) < _set_key(self.sets[0])


def _merge_verl(partials: List[List[list]]) -> Optional[List[list]]:
    heap = [_VerlState(p) for p in partials]
    if not heap:
        return None
    # verl pushes the partials one by one; heapify reaches the same heap property, and every pop
    # is decided by __lt__, which never ties (the items differ), so the merge order is the same.
    heapq.heapify(heap)
    while len(heap) > 1:
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        for a, b in zip(first.sets, reversed(second.sets), strict=True):
            a[0] += b[0]
            a[1].extend(b[1])
        first.sets.sort(key=_set_key, reverse=True)
        heapq.heappush(heap, first)
    return heap[0].sets


def karmarkar_karp(
    values: Sequence[Any],
    k: int,
    equal_size: bool,
    ties: Literal["index", "verl"] = "verl",
) -> List[List[int]]:
    """k-way largest differencing: indices of ``values`` in ``k`` sets, heaviest set first.

    Items are taken in ascending ``(value, index)`` order. With ``equal_size`` they are taken ``k``
    at a time, one per set, so every set ends with ``len(values) / k`` items.

    Args:
        values: Non-negative weights (ints or floats).
        k: Number of sets.
        equal_size: Give every set the same number of items (``len(values)`` must divide by ``k``).
        ties: See :func:`merge_by_differencing`; the default reproduces verl and slime.

    Returns:
        ``k`` lists of indices, in the order the items joined each set; a set may be empty when
        ``len(values) < k``.

    Raises:
        ValueError: ``k < 1``, or ``equal_size`` with a count that ``k`` does not divide.
    """
    if k < 1:
        raise DynBatchValueError(f"k={k} must be >= 1.")
    if equal_size and len(values) % k:
        raise DynBatchValueError(
            f"equal_size needs len(values)={len(values)} to be a multiple of k={k}."
        )
    ordered = sorted((value, i) for i, value in enumerate(values))
    step = k if equal_size else 1
    if ties == "index" and (not ordered or ordered[0][0] > 0):
        # Only the sets that hold something (every value positive): see merge_sparse.
        sparse = []
        for start in range(0, len(ordered), step):
            sets = [[value, [i]] for value, i in ordered[start : start + step]]
            sets.sort(key=lambda entry: -entry[0])
            sparse.append(sets)
        return [list(entry[1]) for entry in merge_sparse(sparse, k)]
    partials = []
    for start in range(0, len(ordered), step):
        sets: List[list] = [[0, []] for _ in range(k)]
        # One item per set (equal_size: k items into k sets), or one item into the first set.
        for j, (value, i) in enumerate(ordered[start : start + step]):
            target = sets[j]
            target[0] += value
            target[1].append((i, value))
        if ties == "index":
            sets.sort(key=lambda entry: -entry[0])
        partials.append(sets)
    merged = merge_by_differencing(partials, ties)
    if merged is None:
        return [[] for _ in range(k)]
    return [[i for i, _ in entry[1]] for entry in merged]
