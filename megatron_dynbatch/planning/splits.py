"""Variable rows under a pipeline: constructions that the bound-ordered search does not reach.

With rows of their own length, more micro-batches cost little more work while the pipeline's
warm-up and cool-down run shorter ones, and how the long samples sit in each rank's order and
over the ranks decides the bubble. So :func:`.shape.choose_shape` also scores, each under the same
hard cap and by the same simulated step:

* finer splits (:func:`finer_splits`): counts above the fewest, up to one sample a micro-batch,
  even where a sample fills the cap; a large step searches a proxy of :data:`_FINER_LIMIT`
  samples and packs one count more;
* on steps of at most :data:`RAMP_LIMIT` samples, ramps and tents (:func:`ramp_splits`,
  :func:`tent_splits`: every rank packed to a load profile, :func:`.packing.profile_pack`) and
  clustered ranks (:func:`cluster_splits`: the large samples a few to a rank, the ranks'
  pipelines balanced rather than their work, :mod:`.cluster`).

Each adds its candidates to a dict of shapes by ``(M, B)``; which one is kept is the caller's.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from typing import Dict, List, Sequence, Tuple

from .cluster import RAMPS as CLUSTER_RAMPS
from .cluster import big_samples, ramp_profile, rank_rows, split_by_targets, tent_profile
from .cost import row_cost
from .packing import profile_pack
from .simulate import TIE, pipeline_makespan
from .spec import ceil_div, round_up
from .step_search import (
    PackedSearch,
    ShapeSearch,
    StepProblem,
    StepShape,
    pick_shape,
    variable_rows,
)

__all__ = ["RAMP_LIMIT", "cluster_splits", "finer_splits", "ramp_splits", "tent_splits"]

#: Variable rows: counts above the bound-ordered search's, spread over the range up to one
#: sample a micro-batch, scored first (:func:`finer_splits`) ...
_FINER_SPREAD = 6
#: ... and packings of finer splits in all, the fastest's neighbours included.
_FINER_EVALUATIONS = 10
#: ... on steps of at most this many samples; a larger step searches a proxy of this size.
_FINER_LIMIT = 512
#: Two spread picks in a row slower than the fastest by more than this end the spread.
_FINER_GIVE_UP = 0.03
#: Ramps: steps of at most this many samples get micro-batches packed to a rising and falling
#: profile (:func:`ramp_splits`) ...
RAMP_LIMIT = 1024
#: ... at these multiples of the fastest count so far ...
_RAMP_FACTORS = (1.0, 1.5)
#: ... in these shapes: (the first and last micro-batch's share of a full one, micro-batches
#: rising, micro-batches falling). Of six shapes at four multiples (up to 3x) on the sixteen
#: GPU-regime steps (``python -m benchmarks.gpu_regime``), these two at these two multiples
#: found every fastest step.
_RAMPS = ((0.25, 5, 5), (0.1, 6, 10))
#: Tents (:func:`tent_splits`): at these multiples of the fastest count so far (fewer too: a
#: tent's descent lets fuller micro-batches run without the stalls of a level steady state) ...
_TENT_FACTORS = (0.6, 0.75, 1.0)
#: ... in these shapes: (the first micro-batch's share of the peak, where the peak is as a share
#: of the count, the last one's share, a straight rise rather than a geometric one), and, when
#: interleaved, each over the groups of micro-batches. The linear program's shape
#: (``benchmarks.pipeline_floor``); of five tents at five multiples (0.5-1.5x) on the GPU-regime
#: steps of seeds 0-2, these two at these three multiples kept all but 0.05% of the gain.
_TENTS = ((0.1, 0.2, 0.2, False), (0.05, 0.6, 0.1, True))


def finer_splits(
    problem: StepProblem, search: "ShapeSearch", scored: Dict[Tuple[int, int], StepShape]
) -> None:
    """Variable rows under a pipeline: score counts above those the bound-ordered search reached.

    With rows of their own length, more micro-batches cost little more work (each row shrinks
    with its load; only the per-micro-batch overhead grows), while the pipeline's warm-up and
    cool-down run shorter micro-batches: the bubble shrinks. The lower bound cannot see that (it
    rises with M), and where a sample fills the cap the candidates used to stop at the fewest
    count (S cannot drop below the longest sample, but most rows can). Every candidate packs
    under the same hard cap; the simulated step decides.

    The step time is not monotone in M (how the long samples fall into the interleaving groups
    matters), so a spread of :data:`_FINER_SPREAD` counts up to one sample a micro-batch is
    scored, then the fastest's neighbours while they improve, :data:`_FINER_EVALUATIONS`
    packings in all. A step of more than :data:`_FINER_LIMIT` samples searches a proxy instead:
    every ``k``-th sample by size on ``dp / k`` ranks (the same samples per rank, the same length
    mix), and scores on the whole step only the count the proxy prefers, so a large step pays one
    packing more.
    """
    if problem.parallel.pp_size == 1 or not search.arrival:
        return  # no pipeline, no bubble: the fewest rows win
    n = len(problem.items)
    if n <= _FINER_LIMIT:
        _finer_search(search, scored)
        return
    stride = ceil_div(n, _FINER_LIMIT)
    dp = problem.parallel.dp_size
    if dp < 2 * stride:
        return  # too few ranks to keep whole ranks in the proxy
    by_size = sorted(problem.items, key=lambda i: (-problem.sizes[i], i))
    proxy = dataclasses.replace(
        problem,
        items=sorted(by_size[::stride]),
        parallel=dataclasses.replace(problem.parallel, dp_size=dp // stride),
    )
    proxy_search = PackedSearch(proxy)
    proxy_scored = {
        (proxy_search.min_per_rank, 1): proxy_search.evaluate(proxy_search.min_per_rank)
    }
    _finer_search(proxy_search, proxy_scored)
    chosen = pick_shape(proxy_scored, problem.min_gain).per_rank
    m = search.min_per_rank + chosen - proxy_search.min_per_rank
    if (
        chosen > proxy_search.min_per_rank
        and (m, 1) not in scored
        and m in search.finer_counts(all_counts=True)
    ):
        shape = search.evaluate(m)
        if shape is not None:
            scored[(m, 1)] = shape


def _ramp_targets(profile: Sequence[float], total: float, cap: int) -> List[float]:
    """``profile`` scaled so its loads, each at most ``cap``, add up to ``total``."""
    low, high = 0.0, float(cap) / min(profile)
    if sum(min(cap, high * p) for p in profile) < total:
        return [float(cap)] * len(profile)
    for _ in range(40):
        middle = (low + high) / 2
        if sum(min(cap, middle * p) for p in profile) < total:
            low = middle
        else:
            high = middle
    return [min(float(cap), high * p) for p in profile]


def _profiles_apply(problem: StepProblem, search: "ShapeSearch") -> bool:
    """Ramps and tents: variable rows under a pipeline (checked by the caller), one row a
    micro-batch, no oversize sample, a step of at most :data:`RAMP_LIMIT` samples."""
    return (
        problem.parallel.pp_size > 1
        and isinstance(search, PackedSearch)
        and search.rows == 1
        and not search.oversize
        and bool(search.arrival)
        and len(problem.items) <= RAMP_LIMIT
    )


def _score_profile(
    problem: StepProblem,
    search: "ShapeSearch",
    per_rank: int,
    targets: Sequence[float],
    scored: Dict[Tuple[int, int], StepShape],
) -> None:
    """Every rank packed to the loads ``targets`` (:func:`.packing.profile_pack`), scored in the
    search's pipeline order and in the profile's own; kept in ``scored`` where faster than what
    it holds at ``per_rank``."""
    dp = search.dp
    packing = profile_pack(problem.sizes, search.order, [targets] * dp, search.cap)
    if packing is None:
        return
    bins = packing[0]
    ranks = [bins[r * per_rank : (r + 1) * per_rank] for r in range(dp)]
    for shape in search.score_ranks(ranks, per_rank, keep_order=True):
        known = scored.get((per_rank, 1))
        if known is None or shape.step_time < known.step_time * (1.0 - TIE):
            scored[(per_rank, 1)] = shape


def ramp_splits(
    problem: StepProblem, search: "ShapeSearch", scored: Dict[Tuple[int, int], StepShape]
) -> None:
    """Variable rows under a pipeline: micro-batches that ramp up and down (issue 45).

    The pipeline's warm-up waits for the first micro-batches' forwards and its cool-down for the
    last ones' backwards; with even rows every one of them is a full row's worth. Packed to a
    profile instead (:func:`.packing.profile_pack`: a few small micro-batches rising
    geometrically to a level, and falling again at the end), the fill and drain run short rows
    while the steady state runs full ones: for the same work and a few more micro-batches'
    overhead, less bubble. Two counts (the fastest so far and half as many again) and two ramp
    shapes (:data:`_RAMPS`) are packed, each scored in the pipeline order of the search and
    in the profile's own; the simulated step decides, as for every candidate.
    """
    if not _profiles_apply(problem, search):
        return
    dp, multiple = search.dp, search.microbatch_multiple
    most = len(search.arrival) // dp
    fastest = pick_shape(scored, problem.min_gain).per_rank
    counts = sorted(
        {
            min(most, round_up(max(fastest, math.ceil(fastest * factor)), multiple))
            for factor in _RAMP_FACTORS
        }
    )
    total = float(search.total) / dp
    for m in counts:
        if m < multiple or m % multiple:
            continue
        for first, rising, falling in _RAMPS:
            if rising + falling > m:
                continue
            targets = _ramp_targets(ramp_profile(m, first, rising, falling), total, search.cap)
            _score_profile(problem, search, m, targets, scored)


#: Clustered ranks (:mod:`.cluster`): a sample is large when its weight is at least this share
#: of the heaviest's ...
_CLUSTER_SHARES = (0.6,)
#: ... and this many of them share a rank ...
_CLUSTER_TOGETHER = (2, 3, 4)
#: ... and the work is moved between ranks by their simulated pipelines this many times.
_CLUSTER_ROUNDS = 3
#: ... at these multiples of the fastest count so far.
_CLUSTER_FACTORS = (1.0, 1.25)


def tent_splits(
    problem: StepProblem,
    search: "ShapeSearch",
    fastest_shape: StepShape,
    tented: Dict[Tuple[int, int], StepShape],
) -> None:
    """Variable rows under a pipeline, a step of at most :data:`RAMP_LIMIT` samples: every rank
    packed to a tent (:func:`.cluster.tent_profile`: a short rise, the heaviest micro-batches,
    a long straight descent) at counts around the fastest so far, fewer included, each scored in
    the pipeline order of the search and in the tent's own. The candidates go to ``tented``,
    apart from the search's own: :func:`.shape.choose_shape` keeps the fastest only where it
    beats the search's refined choice (the thorough planner refining it first), so no step is
    predicted slower for them."""
    if not _profiles_apply(problem, search):
        return
    dp, multiple = search.dp, search.microbatch_multiple
    most = len(search.arrival) // dp
    fastest = fastest_shape.per_rank
    counts = sorted(
        {
            min(most, round_up(max(1, math.ceil(fastest * factor)), multiple))
            for factor in _TENT_FACTORS
        }
    )
    total = float(search.total) / dp
    for m in counts:
        if m < max(2, multiple) or m % multiple:
            continue
        # Interleaved, also tents over the groups of micro-batches the schedule walks together.
        spans = (1, multiple) if multiple > 1 and m // multiple > 2 else (1,)
        for (first, peak, end, linear), span in itertools.product(_TENTS, spans):
            tent = tent_profile(m // span, first, peak, end, linear)
            targets = _ramp_targets([v for v in tent for _ in range(span)], total, search.cap)
            _score_profile(problem, search, m, targets, tented)


def cluster_splits(
    problem: StepProblem,
    search: "ShapeSearch",
    fastest_shape: StepShape,
    scored: Dict[Tuple[int, int], StepShape],
) -> None:
    """Variable rows under a pipeline, a step of at most :data:`RAMP_LIMIT` samples (issue 45):
    the step's large samples a few to a rank, the rest split so that the ranks' pipelines, not
    their work, come out even, every rank packed to the ramp its own pipeline runs fastest
    (:mod:`.cluster`). The candidates go to ``scored`` (kept apart from the shape search's own:
    :func:`.shape.choose_shape` refines the fastest of them and keeps it only where it beats the
    search's refined choice), at the count of ``fastest_shape`` and a quarter more."""
    parallel = problem.parallel
    multiple_rows = problem.row_multiple
    if (
        parallel.pp_size == 1
        or multiple_rows is None
        or not isinstance(search, PackedSearch)
        or search.rows != 1
        or search.oversize
        or not search.arrival
        or len(problem.items) > RAMP_LIMIT
        or search.dp < 2
    ):
        return
    dp, multiple = search.dp, search.microbatch_multiple
    sizes, model, cap, memory = problem.sizes, search.model, search.cap, problem.memory
    sample_costs, extra = problem.sample_costs, model.shape_exchange_overhead
    pp, vpp, group = search.pp, search.vpp, search.group
    weights = {i: model.token_weight * sizes[i] + sample_costs[i] for i in search.arrival}
    total = sum(weights.values())
    most = len(search.arrival) // dp
    fastest = fastest_shape.per_rank
    counts = sorted(
        {
            min(most, round_up(max(fastest, math.ceil(fastest * factor)), multiple))
            for factor in _CLUSTER_FACTORS
        }
    )
    counts = [m for m in counts if m >= multiple and m % multiple == 0]

    def cost_of(rows: List[List[int]]) -> List[float]:
        loads = [sum(map(sizes.__getitem__, members)) for members in rows]
        lengths = variable_rows(loads, multiple_rows, cap, memory)
        return [
            extra + row_cost(model, "packed", row, 1, load) + sum(map(sample_costs.__getitem__, m))
            for row, load, m in zip(lengths, loads, rows, strict=True)
        ]

    def best_rows(own_bigs, own_rest, m, ramps):
        """The rank's rows under the ramp (of ``ramps``) its pipeline runs fastest, with that
        makespan and ramp; ``None`` where no ramp fits."""
        best = None
        for ramp in ramps:
            rows = rank_rows(own_bigs, own_rest, sizes, cap, m, ramp)
            if rows is None:
                continue
            span = pipeline_makespan(cost_of(rows), pp, vpp, group)
            if best is None or span < best[0]:
                best = (span, rows, ramp)
        return best

    def schedule(big_ranks, rest_items, targets, ramps, m):
        """Every rank's rows and makespan for one split of the rest (``None``: one does not
        fit); ``ramps[r]`` becomes the ramp rank ``r`` ran fastest."""
        chosen = {i for rank in big_ranks for i in rank}
        members = split_by_targets(rest_items, weights, targets, big_ranks)
        ranks, spans = [], []
        for r in range(dp):
            own_rest = [i for i in members[r] if i not in chosen]
            found = best_rows(big_ranks[r], own_rest, m, ramps[r])
            if found is None and len(ramps[r]) < len(CLUSTER_RAMPS):
                found = best_rows(big_ranks[r], own_rest, m, CLUSTER_RAMPS)
            if found is None:
                return None
            spans.append(found[0])
            ranks.append(found[1])
            ramps[r] = (found[2],)
        return ranks, spans

    for share in _CLUSTER_SHARES:
        bigs = big_samples(search.arrival, weights, share)
        if not bigs:
            continue
        for together in _CLUSTER_TOGETHER:
            # The large samples over as few ranks as hold ``together`` each, heaviest first to
            # the lightest of those ranks.
            holders = min(dp, math.ceil(len(bigs) / together))
            big_ranks: List[List[int]] = [[] for _ in range(dp)]
            heap = [(0.0, r) for r in range(holders)]
            for i in bigs:
                load, r = heap[0]
                big_ranks[r].append(i)
                heapq.heapreplace(heap, (load + weights[i], r))
            held = set(bigs)
            rest_items = [i for i in search.arrival if i not in held]
            for m in counts:
                # Even work first; then each rank's share scaled by how much faster than the
                # mean its pipeline ran (the step waits for the slowest pipeline, not the
                # most loaded rank). Every ramp for each rank at first, then the one it ran
                # fastest.
                targets = [total / dp] * dp
                ramps = [CLUSTER_RAMPS] * dp
                for _round in range(_CLUSTER_ROUNDS):
                    built = schedule(big_ranks, rest_items, targets, ramps, m)
                    if built is None:
                        break
                    ranks, spans = built
                    for shape in search.score_ranks(ranks, m, True):
                        known = scored.get((m, 1))
                        if known is None or shape.step_time < known.step_time * (1.0 - TIE):
                            scored[(m, 1)] = shape
                    mean = sum(spans) / dp
                    targets = [
                        t * mean / s if s > 0 else t for t, s in zip(targets, spans, strict=True)
                    ]
                    scale = total / sum(targets)
                    targets = [t * scale for t in targets]


def _finer_search(search: "ShapeSearch", scored: Dict[Tuple[int, int], StepShape]) -> None:
    """:func:`finer_splits` on a step small enough to pack every count it scores."""
    counts = [m for m in search.finer_counts() if (m, 1) not in scored]
    if not counts:
        return
    spread = min(_FINER_SPREAD, len(counts))
    picks = sorted(
        {counts[round(k * (len(counts) - 1) / max(1, spread - 1))] for k in range(spread)}
    )
    budget = _FINER_EVALUATIONS
    fastest = min(shape.step_time for (m, rows), shape in scored.items() if rows == 1)
    behind = 0
    for m in picks:
        shape = search.evaluate(m)
        budget -= 1
        if shape is not None:
            scored[(m, 1)] = shape
            fastest = min(fastest, shape.step_time)
        # Two picks in a row well behind the fastest: the split has passed its best.
        slow = shape is None or shape.step_time > fastest * (1.0 + _FINER_GIVE_UP)
        behind = behind + 1 if slow else 0
        if behind == 2:
            break
    # From the fastest count, its unscored neighbours, while one of them is the fastest.
    ladder = sorted(set(counts) | {m for m, rows in scored if rows == 1})
    while budget > 0:
        best = min((shape.step_time, m) for (m, rows), shape in scored.items() if rows == 1)[1]
        i = ladder.index(best)
        fresh = [
            ladder[j]
            for j in (i - 1, i + 1)
            if 0 <= j < len(ladder) and (ladder[j], 1) not in scored
        ]
        if not fresh:
            break
        for m in fresh[:budget]:
            shape = search.evaluate(m)
            budget -= 1
            if shape is not None:
                scored[(m, 1)] = shape
