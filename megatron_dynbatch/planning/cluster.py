"""Ranks that hold the step's whole-row samples together, and less work to make up for it
(issue 45).

Under a pipeline a micro-batch much larger than its neighbours stalls the first stage: its
backward crosses the ``pp - 1`` later stages and back while the first stage runs only the
``pp - 1`` micro-batches on either side of it, so unless those are as large the stage idles. A
rank of a few rows of work that holds one sample filling a whole row (a long-tailed GRPO step at
dp 16: every rank gets one) cannot surround it with enough work, whatever its order, and every
rank idles alike. Two or three such samples side by side on one rank cover each other (each is
the others' large neighbour), so their rank idles about as much as with one, and the ranks left
without one idle only through their ramps. So this construction puts the large samples on as few
ranks as keep a few together, gives those ranks less of the other work (the step waits for the
slowest pipeline, not the most loaded rank) and packs every rank to a ramp (small micro-batches
at the pipeline's fill and drain, the large ones in the middle).

:func:`clustered_ranks` builds such a schedule for one grouping and one split of the work; the
shape search (:func:`.splits.cluster_splits`) scores a few groupings, moves work between ranks
by their simulated pipelines and keeps a schedule only where the simulated step is faster than
its own. Pure and deterministic: ties by sample index and rank.
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence, Tuple

from .packing import profile_pack

__all__ = ["RAMPS", "big_samples", "ramp_profile", "rank_rows", "split_by_targets", "tent_profile"]

#: Ramps ``(first, rising, falling)`` each rank is packed to, the fastest kept per rank.
#: ``rising`` and ``falling`` below 1 are shares of the rank's micro-batches (a tent).
RAMPS = (
    (0.25, 5, 5),
    (0.1, 6, 10),
    (0.3, 2, 2),
    (0.5, 1, 1),
    (0.15, 5, 8),
    (0.1, 0.5, 0.5),
    (0.05, 0.4, 0.6),
)


def big_samples(items: Sequence[int], weights: Sequence[float], share: float) -> List[int]:
    """The samples whose weight is at least ``share`` of the heaviest's, heaviest first (ties
    by index)."""
    if not items:
        return []
    heaviest = max(weights[i] for i in items)
    big = [i for i in items if weights[i] >= share * heaviest]
    return sorted(big, key=lambda i: (-weights[i], i))


def split_by_targets(
    items: Sequence[int],
    weights: Sequence[float],
    targets: Sequence[float],
    start: Sequence[List[int]],
) -> List[List[int]]:
    """``items`` over the ranks, heaviest first, each to the rank furthest below its target
    (``targets[r]``: the weight rank ``r`` should end with; ``start[r]``: what it holds
    already). Ties by rank."""
    members = [list(rank) for rank in start]
    loads = [sum(weights[i] for i in rank) for rank in members]
    heap = [(loads[r] - targets[r], r) for r in range(len(targets))]
    heapq.heapify(heap)
    for i in sorted(items, key=lambda i: (-weights[i], i)):
        gap, r = heap[0]
        members[r].append(i)
        heapq.heapreplace(heap, (gap + weights[i], r))
    return members


def ramp_profile(count: int, first: float, rising: int, falling: int) -> List[float]:
    """Relative loads of ``count`` micro-batches: from ``first`` of a full one up to 1 over
    ``rising`` micro-batches, level, and down to ``first`` over the last ``falling``
    (geometrically). The shape search's ramps (``splits.ramp_splits``) use it too."""
    profile = [1.0] * count
    for k in range(min(rising, count)):
        profile[k] = first ** ((rising - k) / rising)
    for j in range(min(falling, count)):
        profile[count - 1 - j] = min(profile[count - 1 - j], first ** ((falling - j) / falling))
    return profile


def tent_profile(count: int, first: float, peak: float, end: float, linear: bool) -> List[float]:
    """Relative loads of ``count`` micro-batches rising from ``first`` of a full one to 1 at the
    micro-batch ``round(peak * count)`` (geometrically, or in a straight line where ``linear``),
    then falling in a straight line to ``end`` at the last one.

    The shape the linear program of ``benchmarks.pipeline_floor`` gives a rank whose work is
    divisible, and a local search over whole samples finds too: a short rise, the heaviest
    micro-batches next, then a long descent. In 1F1B's steady state a stage runs the forward of
    micro-batch ``k + pp - 1 - stage`` between the backwards of ``k - 1`` and ``k``: with later
    micro-batches lighter, those forwards fit the backwards' gaps instead of stalling the next
    stage, and the drain starts light.
    """
    top = min(count - 1, max(1, round(peak * count)))
    profile = [1.0] * count
    for k in range(top):
        profile[k] = first + (1.0 - first) * k / top if linear else first ** ((top - k) / top)
    tail = max(1, count - 1 - top)
    for k in range(top, count):
        profile[k] = 1.0 - (1.0 - end) * (k - top) / tail
    return profile


def _scaled(profile: Sequence[float], total: float, cap: int) -> List[float]:
    """``profile`` scaled so its loads, each at most ``cap``, add up to ``total`` (all ``cap``
    where even that is short): the largest shares are cut to the cap one by one while the rest,
    scaled up to make the total, would exceed it."""
    if total >= cap * len(profile):
        return [float(cap)] * len(profile)
    order = sorted(range(len(profile)), key=lambda k: (-profile[k], k))
    rest = float(sum(profile))
    clipped = 0
    scale = total / rest if rest > 0 else 0.0
    while clipped < len(order) and scale * profile[order[clipped]] > cap:
        rest -= profile[order[clipped]]
        clipped += 1
        scale = (total - clipped * cap) / rest if rest > 0 else 0.0
    return [min(float(cap), scale * p) for p in profile]


def rank_rows(
    own_bigs: Sequence[int],
    own_rest: Sequence[int],
    sizes: Sequence[int],
    cap: int,
    per_rank: int,
    ramp: Tuple[float, int, int],
) -> Optional[List[List[int]]]:
    """One rank's micro-batches in run order: its large samples (``own_bigs``) one a
    micro-batch, side by side where the ramp peaks, and its other samples (``own_rest``) packed
    into the remaining micro-batches to the ramp ``(first, rising, falling)`` (see
    :func:`_ramp`); ``None`` where they do not fit ``per_rank`` micro-batches under ``cap``."""
    first, rising, falling = ramp
    free = per_rank - len(own_bigs)
    if free < 0 or (free == 0 and own_rest):
        return None
    rows: List[List[int]] = []
    peak = 0
    if free:
        order = sorted(own_rest, key=lambda i: (-sizes[i], i))
        total = float(sum(sizes[i] for i in order))
        up = min(round(rising * free) if rising < 1 else rising, free)
        down = min(round(falling * free) if falling < 1 else falling, free - up)
        targets = _scaled(ramp_profile(free, first, up, down), total, cap)
        packing = profile_pack(sizes, order, [targets], cap)
        if packing is None:
            return None
        rows = [sorted(b) for b in packing[0]]
        peak = min(range(free), key=lambda k: (-targets[k], k))
    return rows[:peak] + [[i] for i in own_bigs] + rows[peak:]
