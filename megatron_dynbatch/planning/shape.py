"""Choosing a step's micro-batch count M, rows per micro-batch B and row length S by its
simulated step time.

With pipelining a step costs about ``(M + pp - 1)`` rows of S (``M + (pp - 1) / vpp`` interleaved),
so when M is small next to pp, more and shorter rows can be faster than the fewest rows; without
pipelining the fewest rows usually win. So every candidate count M, from the fewest the samples
pack into (``min_microbatches``) up to where S reaches the step's longest sample, is packed,
balanced over the DP ranks, ordered for the pipeline and scored (:mod:`.step_search`); the fastest
wins, ties to the smaller M. Work per step is bounded: at most ``step_search._MAX_CANDIDATES``
counts (spread geometrically over a long range) and at most :data:`_MAX_EVALUATIONS` of them packed
besides the fewest. With B > 1 rows each B adds at most two packings (its fewest count and one
sample a row), each only when a floor on its step time (:func:`.step_search.rows_floors`) beats the
fastest so far; the :data:`_MAX_EVALUATIONS` further counts are shared by all B. With variable rows
under a pipeline the constructions of :mod:`.splits` are scored too (finer splits; on steps of at
most :data:`.splits.RAMP_LIMIT` samples ramps, tents and clustered ranks, the default planner's
clustered ranks only up to :data:`_CLUSTER_DEFAULT_LIMIT` samples); the chosen shape is then
refined rank by rank (:mod:`.refine`; a larger step on a smaller budget,
:data:`_LARGE_REFINE_STEPS`); with rows of their own length and few samples a rank, each rank
packed alone by first fit in decreasing size replaces it where faster (:func:`_decreasing`).
Last, the trainers' own schedules (first fit as slime builds it,
differencing as verl does; :func:`_peer_guard`): on a step of at most :data:`_MORE_COUNTS_LIMIT`
samples they are candidates too; where the per-micro-batch overhead is assumed, the choice of a
step of at most :data:`.splits.RAMP_LIMIT` samples is checked against them at overheads from none
to 5% of a row, and trades for a candidate within 0.5% of the best of them at each where it is not.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Dict, List, Optional, Tuple

from .balance import descent_order
from .candidates import (
    SMALL_STEP_SAMPLES,
    TINY_STEP_SAMPLES,
    decreasing_candidates,
    is_small_step,
    natural_count,
    peer_schedules,
    small_step_candidates,
)
from .cost import row_cost
from .refine import affordable_replays, refine_ranks
from .simulate import BACKWARD_TO_FORWARD_RATIO, TIE, pipeline_makespan, remembered_makespans
from .spec import PEER_TOLERANCE, ceil_div, round_up
from .splits import RAMP_LIMIT, cluster_splits, finer_splits, ramp_splits, tent_splits
from .step_search import (
    PackedSearch,
    PaddedSearch,
    ShapeSearch,
    StepProblem,
    StepShape,
    check_placeholders,
    multi_row_counts,
    pick_shape,
    rows_floors,
    variable_rows,
)

__all__ = ["choose_shape"]

#: Candidate counts packed and scored per step besides the fewest, at most: with the row-length
#: bound each needs at most an LPT and a best-fit pass, so a step costs a few packings.
_MAX_EVALUATIONS = 6
#: Small steps of at most this many samples get the candidates of :mod:`.candidates` at more
#: counts than the chosen one (each count costs a few pipeline replays of every rank).
_MORE_COUNTS_LIMIT = 256
#: The thorough planner refines the fastest tent where it is at most this much slower than the
#: refined choice: refinement took at most 1.5% off a tent on the GPU-regime steps.
_TENT_REACH = 0.02
#: A step of more than :data:`RAMP_LIMIT` samples has its chosen shape refined (:mod:`.refine`)
#: on this many replayed micro-batch steps (about 5-10 ms of CPU), not
#: :data:`.refine.REPLAYED_STEPS`: the slowest rank of a large step often holds a sample that
#: fills its row, and moving its neighbours is what pays (slime as it runs,
#: ``benchmarks.as_run --seed 56`` #64, 1,408 GRPO samples at dp 64, pp 4 x vpp 2: first fit was
#: 0.7% ahead of ours unrefined, ours refined is 4.6% ahead); the full budget cost 40-80 ms there.
_LARGE_REFINE_STEPS = 60_000


def choose_shape(problem: StepProblem) -> Tuple[StepShape, int]:
    """The fastest candidate shape of the step, and the fewest micro-batches per rank it packs into.

    With variable rows, uniform rows stay a candidate wherever they can be faster: when the shape
    exchange has a cost (``CostModel.shape_exchange_overhead``: a host that exchanges shapes only
    for steps whose rows differ, as the Megatron-LM entry does with ``--variable-seq-lengths``),
    and where attention pays ``S**2`` a row (``dense``, ``causal``), since only uniform rows pack
    micro-batches of ``B > 1`` shorter rows. The step runs them when they are predicted faster
    (ties to uniform rows, which exchange nothing). The thorough planner (``problem.thorough``)
    also scores the default planner's choice and keeps the faster, so it is never predicted
    slower than the default.

    Raises:
        ValueError: when the layout forces more placeholder micro-batches than is sane (see
            :func:`check_placeholders`).
    """
    check_placeholders(problem)
    # The step's searches score the same micro-batch costs again and again: one memory of them.
    with remembered_makespans():
        chosen = _choose_rows(problem)
        if problem.thorough:
            # The thorough planner's searches start from other choices than the default's, and
            # its step was once 0.06% slower (496 long-tailed samples at dp 16, pp 2 x vpp 2:
            # the default's choice sorted heaviest first). The default's plan is a candidate too,
            # for about a tenth more of the thorough planner's CPU.
            default = _choose_rows(dataclasses.replace(problem, thorough=False))
            if default[0].step_time < chosen[0].step_time * (1.0 - TIE):
                chosen = default
        return chosen


def _choose_rows(problem: StepProblem) -> Tuple[StepShape, int]:
    """:func:`choose_shape` for one planner: variable rows, and uniform ones beside them."""
    if problem.row_multiple is None:
        return _choose_shape(problem)
    # Uniform rows beside variable ones: shapes are exchanged, so their S is aligned the same
    # way.
    uniform_problem = dataclasses.replace(
        problem, row_multiple=None, row_align=problem.row_multiple
    )
    if problem.model.shape_exchange_overhead <= 0 and not multi_row_counts(uniform_problem):
        # Per-segment attention, free exchange: a row of its own is never slower than the
        # longest.
        return _choose_shape(problem)
    uniform, fewest_uniform = _choose_shape(uniform_problem)
    variable, fewest = _choose_shape(problem)
    if variable.step_time < uniform.step_time * (1.0 - TIE):
        return variable, fewest
    return uniform, fewest_uniform


def _choose_shape(problem: StepProblem) -> Tuple[StepShape, int]:
    """:func:`choose_shape` for the rows ``problem`` says (uniform, or each its own)."""
    # (M, B) -> the candidate; B > 1 only for packed rows under row-wise attention.
    scored: Dict[Tuple[int, int], StepShape] = {}
    fastest = math.inf
    searches: List[ShapeSearch] = []
    # One search per B, the most promising first (by a floor on its step time). Its fewest count
    # is packed only when that floor beats the fastest so far, and so is, for B > 1, the count
    # that gives every sample a row of its own (fixed micro-batches' shape at this B), whatever
    # the cap on evaluations below, so no plan is predicted slower than that shape. Without B > 1
    # candidates the one search is built and packed as always.
    row_counts = multi_row_counts(problem)
    if row_counts:
        order = sorted(
            [(rows_floors(problem, 1)[0], math.inf, 1)]
            + [(*rows_floors(problem, rows), rows) for rows in row_counts]
        )
    else:
        order = [(0.0, math.inf, 1)]
    for fewest_floor, one_floor, rows in order:
        if min(fewest_floor, one_floor) >= fastest * (1.0 - TIE):
            continue
        if problem.layout == "packed":
            search: ShapeSearch = PackedSearch(problem, rows)
        else:
            search = PaddedSearch(problem)
        if fewest_floor < fastest * (1.0 - TIE):
            searches.append(search)
            m = search.min_per_rank
            shape = search.evaluate(m)
            assert shape is not None, "the fewest micro-batches always pack"
            scored[(m, rows)] = shape
            fastest = min(fastest, shape.step_time)
        if rows > 1:
            one = search.one_per_row()
            if (one, rows) not in scored and one_floor < fastest * (1.0 - TIE):
                shape = search.evaluate(one)
                assert shape is not None, "one sample a row always packs"
                scored[(one, rows)] = shape
                fastest = min(fastest, shape.step_time)
    assert searches, "the most promising search is always packed"
    ranked = sorted(
        (s.lower_bound(m), s.rows, m, k)
        for k, s in enumerate(searches)
        for m in s.candidates()
        if (m, s.rows) not in scored
    )
    for bound, rows, m, k in ranked[:_MAX_EVALUATIONS]:
        if bound >= fastest * (1.0 - TIE):
            break
        # Only rows shorter than this can beat the fastest so far: pack under it or not at all.
        shape = searches[k].evaluate(m, searches[k].row_limit(m, fastest))
        if shape is not None and shape.step_time < fastest * (1.0 - TIE):
            scored[(m, rows)] = shape
            fastest = shape.step_time
    clustered: Dict[Tuple[int, int], StepShape] = {}
    tented: Dict[Tuple[int, int], StepShape] = {}
    if problem.row_multiple is not None and problem.layout == "packed":
        finer_splits(problem, searches[0], scored)
        if not problem.disable_more_candidates:
            ramp_splits(problem, searches[0], scored)
            tent_splits(problem, searches[0], pick_shape(scored, problem.min_gain), tented)
            if problem.thorough or len(problem.items) <= _CLUSTER_DEFAULT_LIMIT:
                cluster_splits(
                    problem, searches[0], pick_shape(scored, problem.min_gain), clustered
                )
    # Every candidate is compared without the slots all its ranks spare (constructions of a
    # count can leave bins empty on every rank), so a trimmed shape wins where it is fastest.
    for shapes in (scored, tented, clustered):
        for key, shape in list(shapes.items()):
            shapes[key] = _without_spare_slots(problem, shape)
    if problem.min_count > 1:
        # Counts under the imposed one would run placeholders up to it: not what was scored.
        for shapes in (scored, tented, clustered):
            for key in [key for key in shapes if key[0] < problem.min_count]:
                del shapes[key]
    best = pick_shape(scored, problem.min_gain)
    # The second construction is dearer: only for the winning count (and the fewest), one row.
    for search in searches:
        if search.rows != 1:
            continue
        for m in sorted({best.per_rank, search.min_per_rank}):
            shape = search.alternative(m)
            if shape is None:
                continue
            known = scored.get((m, 1))
            if known is None or shape.step_time < known.step_time * (1.0 - TIE):
                scored[(m, 1)] = shape
    chosen = pick_shape(scored, problem.min_gain)
    if problem.layout == "packed" and not problem.disable_more_candidates:
        chosen = _more_candidates(problem, searches, scored, chosen)
        chosen = _refined(problem, chosen)
        # Constructions kept apart replace the shape search's refined choice only where faster,
        # so the step is never predicted slower for them. Refined first where ``refine``, and
        # within ``reach`` of that choice (``None``: whatever their step). Tents: not by the
        # default planner (refining costs as much as the rest of the search and gained them
        # 0.2% on the GPU-regime steps); by the thorough one, where the simulated step alone
        # decides, where refinement could make up the difference.
        kept_apart = ((tented, problem.thorough, _TENT_REACH), (clustered, True, None))
        for apart, refine, reach in kept_apart:
            if not apart:
                continue
            other = pick_shape(apart, problem.min_gain)
            if refine and (reach is None or other.step_time < chosen.step_time * (1.0 + reach)):
                other = _refined(problem, other)
            gain = problem.min_gain if other.per_rank > chosen.per_rank else 0.0
            if other.step_time < chosen.step_time * (1.0 - max(gain, TIE)):
                chosen = other
        chosen = _less_rounding(problem, searches[0], chosen)
        # Fewer, fuller rows can round up by less than the choice's, which balancing by work
        # hid (rows of 173 and 172 tokens rounded to 256 each, where 217 and 128 round to 384).
        # A larger step: the fewest micro-batches only (each shape costs a rounding pass).
        fewer = list(scored.values())
        if len(problem.items) > RAMP_LIMIT:
            fewer = [min(fewer, key=lambda shape: (shape.per_rank, shape.step_time))]
        for shape in fewer:
            if shape.per_rank < chosen.per_rank and shape.step_time <= chosen.step_time * (
                1.0 + _ROUNDING_REACH
            ):
                other = _less_rounding(problem, searches[0], shape)
                if other.step_time < chosen.step_time * (1.0 - TIE):
                    chosen = other
        chosen = _reordered(problem, searches[0], [chosen, *scored.values()])
        chosen = _decreasing(problem, searches, chosen)
        if problem.min_count <= 1:
            # With a count imposed (a sharded step's other rank sets it) the trainers' own
            # schedules of fewer micro-batches are no comparison: the rank runs that many anyway.
            chosen = _peer_guard(problem, searches, scored, chosen)
    chosen = _without_spare_slots(problem, chosen)
    # A construction may fit fewer micro-batches than the searches' packings did (a rank's own
    # split): then that is the fewest found.
    return chosen, min(chosen.per_rank, *(s.min_per_rank for s in searches))


def _without_spare_slots(problem: StepProblem, shape: StepShape) -> StepShape:
    """``shape`` without the placeholder slots that every DP rank has to spare, where faster.

    A construction of a given count can leave bins empty on every rank (a tent of 14 slots
    filled by 12 micro-batches at dp 1, pp 4); the count Megatron needs is only the fullest
    rank's real micro-batches, rounded up to the micro-batch multiple (and at least an imposed
    count). Each rank drops that many of its placeholders, from the front of its order, the back,
    or both, whichever replays fastest. Before, such steps ran up to 1.4% slower than the same
    micro-batches without the spare slots, by the planner's own cost model.
    """
    parallel = problem.parallel
    bins, orders = shape.bins, shape.rank_orders
    real = [sum(1 for b in order if bins[b]) for order in orders]
    count = round_up(max(1, problem.min_count, *real), parallel.microbatch_multiple)
    spare = shape.per_rank - count
    if spare <= 0 or any(len(order) != shape.per_rank for order in orders):
        return shape
    pp, vpp, group = parallel.pp_size, parallel.vpp_size, parallel.group_size

    def span(order: List[int]) -> float:
        costs = [shape.bin_costs[b] for b in order]
        if pp == 1:
            return (1.0 + BACKWARD_TO_FORWARD_RATIO) * sum(costs)
        return pipeline_makespan(costs, pp, vpp, group)

    kept_orders, spans = [], []
    for order in orders:
        empty = [k for k, b in enumerate(order) if not bins[b]]
        best: Optional[Tuple[float, List[int]]] = None
        for front in range(spare + 1):
            dropped = set(empty[:front]) | set(empty[len(empty) - (spare - front) :])
            kept = [b for k, b in enumerate(order) if k not in dropped]
            time = span(kept)
            if best is None or time < best[0]:
                best = (time, kept)
        assert best is not None
        spans.append(best[0])
        kept_orders.append(best[1])
    if max(spans) >= shape.step_time * (1.0 - TIE):
        return shape
    # Keep only the bins still run, renumbered in order, with everything kept per bin.
    used = sorted({b for order in kept_orders for b in order})
    index = {b: k for k, b in enumerate(used)}

    def kept(values: Optional[List]) -> Optional[List]:
        return None if values is None else [values[b] for b in used]

    return dataclasses.replace(
        shape,
        per_rank=count,
        bins=[bins[b] for b in used],
        rank_orders=[[index[b] for b in order] for order in kept_orders],
        bin_costs=[shape.bin_costs[b] for b in used],
        step_time=max(spans),
        row_lengths=kept(shape.row_lengths),
        packed_rows=kept(shape.packed_rows),
        token_loads=kept(shape.token_loads),
    )


#: Pairs of micro-batches and of samples :func:`_less_rounding` tries at most in a step, and in
#: one rank: about a microsecond each.
_ROUNDING_CHECKS = 25_000
_RANK_ROUNDING_CHECKS = 4_000
#: Scored shapes of fewer micro-batches than the choice, at most this much slower, also get
#: :func:`_less_rounding` and replace the choice where then faster: 241 samples of 1-16 tokens at
#: dp 6, pp 2 x vpp 4, rows of 128 ran four rows of 128 a rank where two of 256 and 128 are 5.6%
#: faster (slime's first fit was 5.8% ahead, ``small_steps --wide`` seed 71). Each such shape
#: costs a rounding pass, so a step of more than :data:`.splits.RAMP_LIMIT` samples tries only
#: its fewest count: 1,536 samples of 448 and 382 tokens at dp 64, pp 4 x vpp 4, rows of 128,
#: packed 12 mixed pairs a rank (rows of 896) and ran 24 single rows; equal pairs at 12 a rank
#: are 5% faster (NeMo-RL's first fit decreasing was that much ahead, seed 184).
_ROUNDING_REACH = 0.1


def _less_rounding(problem: StepProblem, search: "ShapeSearch", shape: StepShape) -> StepShape:
    """Rows of their own length: ``shape``, or ``shape`` with samples swapped between two
    micro-batches of a rank, or moved from one to the other (``concentrated``), wherever that
    rounds the two rows up by fewer tokens (both within the cap), where the step is then faster.

    The searches balance a rank's micro-batches by work and do not look at what rounding each
    row up to the multiple costs. 640 samples of 1,841 and 1,406 tokens at dp 16, no pipeline,
    rows of 128-token multiples: ours paired one of each, 3,247 tokens in a row of 3,328, where
    equal pairs fill rows of 3,712 and 2,816, 81 tokens less a pair (NeMo-RL's packing was 0.95%
    ahead at 5% overhead, ``benchmarks.small_steps --wide --seed 27``). A rank's samples and
    order stay; only a micro-batch's members change. The ranks are taken costliest first (the
    step waits for the slowest) until one has no such swap, within :data:`_ROUNDING_CHECKS` and
    :data:`_RANK_ROUNDING_CHECKS` a rank, on steps of any size: 2,560 samples of 341 tokens at
    dp 64, rows of 128, ran two rows of 682 tokens a rank (768 each) where one of 1,023 and one of
    341 round to 1,024 and 384 (next fit was 0.9% ahead, ``small_steps --wide`` seed 123).
    """
    multiple = problem.row_multiple
    if (
        multiple is None
        or multiple <= 1
        or shape.row_lengths is None
        or shape.micro_batch_size != 1
        or shape.oversize
        or multiple > problem.cap
    ):
        return shape
    sizes, cap, memory = problem.sizes, problem.cap, problem.memory
    rows_of: Dict[int, int] = {}

    def row(load: int) -> int:
        if load not in rows_of:
            rows_of[load] = variable_rows([load], multiple, cap, memory)[0]
        return rows_of[load]

    bins = [list(members) for members in shape.bins]
    if shape.token_loads is not None:
        loads = list(shape.token_loads)
    else:
        loads = [sum(map(sizes.__getitem__, members)) for members in bins]
    changed: Dict[int, None] = {}
    budget = _ROUNDING_CHECKS

    def first_swap(a: int, b: int) -> Optional[Tuple[int, int, int]]:
        """A sample of ``a`` and one of ``b`` whose exchange rounds the two rows up less."""
        nonlocal checks
        checks += 1
        waste = row(loads[a]) + row(loads[b])
        if waste - loads[a] - loads[b] < multiple:
            return None  # rows are multiples: nothing to save below one
        for i in bins[a]:
            for j in bins[b]:
                checks += 1
                shift = sizes[j] - sizes[i]
                load_a, load_b = loads[a] + shift, loads[b] - shift
                if shift and load_a <= cap and load_b <= cap and row(load_a) + row(load_b) < waste:
                    return i, j, shift
        return None

    def concentrated(a: int, b: int) -> bool:
        """Samples moved from the lighter of ``a`` and ``b`` to the other, the largest that fits
        first, while the two rows get no longer, until they get shorter; undone otherwise. One
        swap at a time cannot get there where every sample is small against the multiple: two
        rows of 85 tokens (of 1-16-token samples) stay two rows of 128, where 117 and 53 tokens
        run rows of 128 and 64 (slime's first fit was 3% ahead, ``small_steps --wide`` seed
        47)."""
        nonlocal checks
        light, heavy = (a, b) if (loads[a], a) <= (loads[b], b) else (b, a)
        start = row(loads[a]) + row(loads[b])
        moved = []
        while len(bins[light]) > 1:
            checks += len(bins[light])  # the scan below looks at each of them
            rows_now = row(loads[light]) + row(loads[heavy])
            fits = [
                i
                for i in bins[light]
                if loads[heavy] + sizes[i] <= cap
                and row(loads[heavy] + sizes[i]) + row(loads[light] - sizes[i]) <= rows_now
            ]
            if not fits:
                break
            i = max(fits, key=lambda i: (sizes[i], -i))
            bins[light].remove(i)
            bins[heavy].append(i)
            loads[light] -= sizes[i]
            loads[heavy] += sizes[i]
            moved.append(i)
            if row(loads[light]) + row(loads[heavy]) < start:
                return True
        for i in moved:
            bins[heavy].remove(i)
            bins[light].append(i)
            loads[heavy] -= sizes[i]
            loads[light] += sizes[i]
        return False

    totals = [sum(map(shape.bin_costs.__getitem__, order)) for order in shape.rank_orders]
    for rank in sorted(range(len(totals)), key=lambda r: (-totals[r], r)):
        real = [b for b in shape.rank_orders[rank] if bins[b]]
        checks, swapped = 0, False
        limit = min(_RANK_ROUNDING_CHECKS, budget)
        for a, b in itertools.combinations(real, 2):
            if checks >= limit:
                break  # a rank of many micro-batches has many pairs: stop where the budget does
            while checks < limit:
                swap = first_swap(a, b)
                if swap is None:
                    break
                i, j, shift = swap
                bins[a][bins[a].index(i)], bins[b][bins[b].index(j)] = j, i
                loads[a] += shift
                loads[b] -= shift
                changed[a] = changed[b] = None
                swapped = True
            if checks < limit and concentrated(a, b):
                changed[a] = changed[b] = None
                swapped = True
        budget -= checks
        if not swapped or budget <= 0:
            break  # the step is no faster than this rank
    if not changed:
        return shape
    costs, rows = list(shape.bin_costs), list(shape.row_lengths)
    for b in changed:
        rows[b] = row(loads[b])
        costs[b] = _own_row_cost(problem, bins[b], loads[b])
    time = search._step_time(shape.rank_orders, costs)
    if time >= shape.step_time * (1.0 - TIE):
        return shape
    return dataclasses.replace(
        shape,
        bins=[sorted(members) for members in bins],
        bin_costs=costs,
        step_time=time,
        row_lengths=rows,
        seq_length=max(rows),
        token_loads=loads,
    )


#: Shapes whose step is slower than the choice by more than this are not reordered
#: (``_reordered``). At 10% a count of 16 micro-batches a rank was never sorted: 120 samples (30%
#: at the 1,024 cap) at dp 5, pp 8 x vpp 2, 5% overhead, own rows, its full rows first run 4.6%
#: faster than the 24 chosen (NeMo-RL's packing, 16 a rank with its full rows first, was 3.4%
#: ahead of ours; ``small_steps --wide`` seeds 66 and 76). 30% changed no GPU-regime plan.
_REORDER_REACH = 0.3
#: Steps of at most this many micro-batches (all ranks) try each sorted order on the whole step;
#: larger ones on their costliest rank first.
_REORDER_WHOLE = 1024
#: On such a step with rows of their own length and at most this many samples a rank, the
#: choice is also refined again from each sorted order, on this many replayed steps (the
#: thorough planner: its full budget). Refinement stops where no single change helps, and a
#: rank's light-heavy-light order can be such a place: 11 samples of 727 tokens and 15 of 467 at
#: dp 2, pp 4 x vpp 2, refined from heaviest first, run 1.4% faster (NeMo-RL's packing was 1.2%
#: ahead of ours). On the 512-sample GPU-regime steps (32 and 128 samples a rank) restarts
#: gained nothing for 15% more planning CPU (the thorough planner's: 60% more); 20,000 replayed
#: steps kept 4 of 11 gains on ``small_steps --wide`` seeds 36, 46, 47 and 49.
_RESTART_SAMPLES_PER_RANK = 24
_RESTART_REFINE_STEPS = 60_000


def _reordered(problem: StepProblem, search: "ShapeSearch", shapes: List[StepShape]) -> StepShape:
    """``shapes[0]`` (the choice so far), or one of ``shapes`` with every rank's micro-batches
    sorted heaviest first or lightest first, or in a long descent (:func:`_arranged`), where
    that step is faster (a count above the choice's by ``min_gain``).

    The searches order a rank light-heavy-light and try its heaviest micro-batch in every slot
    (:func:`.balance.pipeline_orders`). Where a rank holds few micro-batches for its pipeline
    (interleaved, ``M`` near ``pp * vpp``: nearly every forward runs before the first backward)
    a sorted order can be faster: 24 ranks of 4 rows at the cap and 2 light ones, pp 2, vpp 4,
    run 4.9% faster heaviest first (NeMo-RL's packing, which starts with its full rows, was as
    much ahead); a sorted order can also make a count win that the searched orders lost. On a
    step of more than :data:`_REORDER_WHOLE` micro-batches each order is tried on the costliest
    rank first, and the whole step is replayed only where that rank gets faster; the bins never
    change, so the step is never predicted slower. Where such a step has rows of their own
    length and few samples a rank (:data:`_RESTART_SAMPLES_PER_RANK`), ``shapes[0]`` sorted each
    way is refined again (:func:`_refined`) and kept where that is faster: the refinement of the
    choice stops where no single change helps, which a sorted start can get past.
    """
    chosen = best = shapes[0]
    if problem.parallel.pp_size == 1:
        return chosen
    # Refinement from a sorted order where a rank's order is most of what is left to decide.
    restart = (
        problem.row_multiple is not None
        and len(problem.items) <= _RESTART_SAMPLES_PER_RANK * problem.parallel.dp_size
    )
    restarts: List[StepShape] = []
    for k, shape in enumerate(shapes):
        if shape.step_time > chosen.step_time * (1.0 + _REORDER_REACH) or any(
            shape is earlier for earlier in shapes[:k]
        ):
            continue
        costs = shape.bin_costs
        gain = problem.min_gain if shape.per_rank > chosen.per_rank else 0.0
        key = functools.partial(_order_key, costs, shape.bins)
        # A small step is replayed whole: its slowest pipeline need not be its costliest rank
        # (ranks of three full rows and three placeholders beside ranks of two and four short
        # micro-batches, pp 3 x vpp 4). A larger one screens each order on that rank first.
        screened = None
        if len(shape.rank_orders) * shape.per_rank > _REORDER_WHOLE:
            totals = [sum(map(costs.__getitem__, order)) for order in shape.rank_orders]
            costliest = shape.rank_orders[max(range(len(totals)), key=lambda r: (totals[r], -r))]
            screened = costliest, search.rank_makespan(costliest, costs)
        for way in _ORDERS:
            if screened is not None:
                lone = _arranged(screened[0], key, way)
                if search.rank_makespan(lone, costs) >= screened[1] * (1.0 - TIE):
                    continue
            orders = [_arranged(order, key, way) for order in shape.rank_orders]
            time = search._step_time(orders, costs)
            if k == 0 and restart and screened is None and way != "descent":
                restarts.append(dataclasses.replace(shape, rank_orders=orders, step_time=time))
            if time < best.step_time * (1.0 - TIE) and time < chosen.step_time * (1.0 - gain):
                best = dataclasses.replace(shape, rank_orders=orders, step_time=time)
    for start in restarts:
        other = _refined(problem, start, None if problem.thorough else _RESTART_REFINE_STEPS)
        if other.step_time < best.step_time * (1.0 - TIE):
            best = other
    return best


#: Steps with rows of their own length and at most this many samples a rank (and at most
#: :data:`.candidates.SMALL_STEP_SAMPLES` in all), or at most :data:`_DECREASING_SAMPLES` in
#: all, also get :func:`.candidates.decreasing_candidates` (at 24 a rank: 120 samples at dp 5,
#: pp 4 x vpp 4, ``small_steps --wide`` seed 113; 193 equal samples at dp 8, pp 2 x vpp 4 run
#: seven full rows and three of one sample a rank, as next fit does, 0.5% faster, seed 137). On
#: the 512-sample GPU-regime steps (32 and 128 samples a rank) it changed no plan for 40% more
#: planning CPU.
_DECREASING_PER_RANK = 24
_DECREASING_SAMPLES = 256
#: ... at the choice's count and at most this many of the fewest below it.
_DECREASING_COUNTS = 3


def _decreasing(
    problem: StepProblem, searches: List["ShapeSearch"], chosen: StepShape
) -> StepShape:
    """``chosen``, or first fit by decreasing size (:func:`.candidates.decreasing_candidates`)
    at a count up to the choice's, where that step is faster.

    Balancing by work leaves rows that round up by more than need be where a step's samples
    come in a few lengths: 80 samples of 295 tokens and 76 of 336 at dp 12 under a cap of 1,024
    (rows rounded to 64) ran six rows a rank, where three alike samples a row fit five (NeMo-RL's
    modified first fit was 1.2% ahead, ``small_steps --wide`` seed 49). And where an interleaved
    pipeline's count needs more micro-batches than full rows, the extra ones nearly empty, after
    the full rows, beat rows balanced by work: 120 long-tailed samples at dp 5, pp 4 x vpp 4, own
    rows, four full rows and four of one short sample a rank (NeMo-RL's first fit decreasing was
    2.7% ahead of our twelve a rank, ``small_steps --wide`` seed 113). Kept apart, after every
    other step, and only where faster, so no step is predicted slower for it.
    """
    search = _arrival_search(searches)
    if (
        search is None
        or problem.row_multiple is None
        or len(problem.items) > SMALL_STEP_SAMPLES
        or len(problem.items) > max(_DECREASING_SAMPLES, _DECREASING_PER_RANK * search.dp)
    ):
        return chosen
    weights = _own_weights(problem, search)
    multiple = search.microbatch_multiple
    floor = _fewest_by_tokens(problem, search)
    best = chosen
    # The fewest counts, where full rows are what first fit makes, and the choice's.
    fewest = range(floor, floor + _DECREASING_COUNTS * multiple, multiple)
    counts = [m for m in fewest if m < chosen.per_rank] + [chosen.per_rank]
    for m, (_name, ranks, keep_order) in decreasing_candidates(
        search.arrival, problem.sizes, weights, search.cap, search.dp, counts
    ):
        for shape in search.score_ranks(ranks, m, keep_order):
            if shape.step_time < best.step_time * (1.0 - TIE):
                best = shape
    return best


#: The orders :func:`_reordered` tries: sorted each way, and a long descent (:func:`_arranged`).
_ORDERS = ("heaviest", "lightest", "descent")


def _arranged(order: List[int], key, way: str) -> List[int]:
    """A rank's micro-batches heaviest first, lightest first, or in a long descent
    (:func:`.balance.descent_order`)."""
    if way == "descent":
        return descent_order(order, key)
    return sorted(order, key=key, reverse=way == "heaviest")


def _order_key(costs: List[float], bins: List[List[int]], b: int) -> Tuple[float, int, int]:
    """A bin's place in a sorted rank: its cost, then its samples (placeholders lightest)."""
    return costs[b], len(bins[b]), b


def _arrival_search(
    searches: List["ShapeSearch"], *, lone_oversize: bool = False
) -> Optional["PackedSearch"]:
    """The one-row packed search, where the step's samples keep their arrival order and none is
    over the cap: what :mod:`.candidates`' constructions (and the trainers' schedules) start
    from; ``None`` otherwise. ``lone_oversize``: also one rank's (``dp`` 1) with rows of their
    own length where some samples are over the cap (each runs alone) and others are not."""
    search = next((s for s in searches if s.rows == 1), None)
    if not isinstance(search, PackedSearch) or not search.arrival:
        return None
    if search.oversize and not (
        lone_oversize and search.dp == 1 and search.problem.row_multiple is not None
    ):
        return None
    return search


def _own_weights(problem: StepProblem, search: "PackedSearch") -> Dict[int, float]:
    """Every sample's own cost in a micro-batch (its linear work and its own attention), by
    sample: what the constructions balance."""
    sizes, weight = problem.sizes, search.model.token_weight
    return {i: weight * sizes[i] + problem.sample_costs[i] for i in search.arrival}


def _peer_guard(
    problem: StepProblem,
    searches: List["ShapeSearch"],
    scored: Dict[Tuple[int, int], StepShape],
    chosen: StepShape,
) -> StepShape:
    """Never behind the trainers' own schedules (:func:`.candidates.peer_schedules`, each as the
    trainer builds and runs it), on a step of at most :data:`RAMP_LIMIT` samples.

    On a step of at most :data:`_MORE_COUNTS_LIMIT` samples the peers' schedules are candidates
    like any other (scored as run and as the search would reorder and balance them), kept where
    faster than ``chosen`` (more micro-batches by ``min_gain``). A step with more samples than
    :func:`.candidates.is_small_step` allows gets no other construction, and verl's differencing
    can be 2.5% ahead there (96 bimodal samples at dp 8, pp 4, vpp 2, four micro-batches each).

    Where the overhead is assumed (``problem.overhead_checks`` set), also a plan never more than
    :data:`.spec.PEER_TOLERANCE` slower than the best peer at any of those overheads. ``chosen`` is
    kept where it passes (nearly always: ahead of the peers at every overhead). Otherwise, of the
    candidates that pass, the fastest at the assumed overhead (fewer micro-batches unless more gain
    ``min_gain``); where none does (one peer best with no overhead, another at 5%), the one whose
    worst ratio to the best peer is least. The candidates are ``scored`` (the fastest packing of
    each count), the peers' schedules and, on a small step, :mod:`.candidates`' constructions at the
    peers' counts and ``chosen``'s (every count searched on a tiny step). A plan is re-timed at
    another overhead by moving every micro-batch's cost (placeholders included) by the difference:
    the overhead is one term of it. Above :data:`_MORE_COUNTS_LIMIT` samples only a plan of more
    micro-batches than the fewest is checked (building the peers' schedules of hundreds of samples
    costs tens of milliseconds, and the fewest bet on no small overhead).
    """
    checks = problem.overhead_checks
    search = _arrival_search(searches)
    many = len(problem.items) > _MORE_COUNTS_LIMIT
    if (
        search is None
        or len(problem.items) > RAMP_LIMIT
        or (many and (not checks or chosen.per_rank <= search.min_per_rank))
    ):
        return chosen
    sizes, cap, dp, multiple = problem.sizes, search.cap, search.dp, search.microbatch_multiple
    weights = _own_weights(problem, search)
    peers = peer_schedules(search.arrival, sizes, weights, cap, dp, multiple)
    if not peers:
        return chosen
    theirs = [search.as_given(ranks, m) for _name, ranks, m in peers]
    # Reordered and balanced by the search (built once: candidates here, the pool below).
    rescored: List[List[StepShape]] = []
    if not many:
        rescored = [search.score_ranks(ranks, m, True) for _name, ranks, m in peers]
        for own, shapes in zip(theirs, rescored, strict=True):
            for other in (own, *shapes):
                gain = problem.min_gain if other.per_rank > chosen.per_rank else 0.0
                if other.step_time < chosen.step_time * (1.0 - max(gain, TIE)):
                    chosen = other
    if not checks:
        return chosen
    base = search.model.overhead

    def times(shape: StepShape) -> List[float]:
        return [
            search._step_time(shape.rank_orders, [c - base + o for c in shape.bin_costs])
            for o in checks
        ]

    best = [min(column) for column in zip(*map(times, theirs), strict=True)]

    def worst_ratio(shape: StepShape) -> float:
        return max(t / b for t, b in zip(times(shape), best, strict=True))

    if worst_ratio(chosen) <= 1.0 + PEER_TOLERANCE:
        return chosen
    if not rescored:
        rescored = [search.score_ranks(ranks, m, True) for _name, ranks, m in peers]
    pool = [chosen, *scored.values(), *theirs, *(shape for shapes in rescored for shape in shapes)]
    if is_small_step(len(problem.items), dp):
        counts = {chosen.per_rank, *(m for _name, _ranks, m in peers)}
        if len(problem.items) <= TINY_STEP_SAMPLES:
            counts.update(search.candidates())
        for m in sorted(counts):
            for _name, ranks, keep_order in small_step_candidates(
                search.arrival, sizes, weights, cap, dp, m, problem.row_multiple
            ):
                pool += search.score_ranks(ranks, m, keep_order)
    ratios = [(worst_ratio(shape), k) for k, shape in enumerate(pool)]
    passing: Dict[Tuple[int, int], StepShape] = {}
    for ratio, k in ratios:
        shape = pool[k]
        known = passing.get((shape.per_rank, 1))
        if ratio <= 1.0 + PEER_TOLERANCE and (
            known is None or shape.step_time < known.step_time * (1.0 - TIE)
        ):
            passing[(shape.per_rank, 1)] = shape
    if passing:
        return pick_shape(passing, problem.min_gain)
    # Ties to the earlier candidate: chosen, then the search's own, then the peers'.
    return pool[min(ratios)[1]]


def _refined(problem: StepProblem, shape: StepShape, budget: Optional[int] = None) -> StepShape:
    """Variable rows under a pipeline: the chosen shape after :func:`.refine.refine_ranks`
    (samples moved within a rank and to faster ranks, micro-batches reordered, while the slowest
    rank's pipeline gets faster); the shape itself otherwise. ``budget``: the replayed steps to
    spend at most; by default a step of more than :data:`RAMP_LIMIT` samples spends
    :data:`_LARGE_REFINE_STEPS` and a smaller one the planner's budget (:mod:`.refine`), none
    where replaying its ranks once would take half of that."""
    parallel, multiple = problem.parallel, problem.row_multiple
    if budget is None and len(problem.items) > RAMP_LIMIT:
        budget = _LARGE_REFINE_STEPS
    if (
        multiple is None
        or parallel.pp_size == 1
        or shape.micro_batch_size != 1
        or shape.oversize
        or multiple > problem.cap
        or affordable_replays(
            len(shape.rank_orders), shape.per_rank, parallel, budget, problem.thorough
        )
        is None
    ):
        return shape
    sizes, cap = problem.sizes, problem.cap
    bin_cost = functools.partial(_own_row_cost, problem)
    bins = [list(members) for members in shape.bins]
    orders = [list(order) for order in shape.rank_orders]
    loads = [sum(map(sizes.__getitem__, members)) for members in bins]
    costs = [bin_cost(members, load) for members, load in zip(bins, loads, strict=True)]
    spans = refine_ranks(
        bins,
        orders,
        loads,
        costs,
        sizes,
        cap,
        bin_cost,
        parallel,
        replayed_steps=budget,
        thorough=problem.thorough,
    )
    if spans is None or max(spans) >= shape.step_time * (1.0 - TIE):
        return shape
    rows = variable_rows(loads, multiple, cap, problem.memory, problem.parallel.sample_multiple)
    refined = dataclasses.replace(
        shape,
        bins=bins,
        rank_orders=orders,
        bin_costs=costs,
        step_time=max(spans),
        row_lengths=rows,
        seq_length=max(rows),
        token_loads=loads,
    )
    # Moving samples out can empty a bin on every rank: those slots go where that is faster.
    return _without_spare_slots(problem, refined)


def _own_row_cost(problem: StepProblem, members: List[int], load: int) -> float:
    """A micro-batch of ``members`` (``load`` padded tokens) in a row of its own length."""
    row = variable_rows([load], problem.row_multiple, problem.cap, problem.memory)[0]
    own = sum(map(problem.sample_costs.__getitem__, members))
    return (
        problem.model.shape_exchange_overhead
        + row_cost(problem.model, "packed", row, 1, load)
        + own
    )


def _fewest_by_tokens(problem: StepProblem, search: "PackedSearch") -> int:
    """The fewest micro-batches a rank the step's tokens allow (its share of them in rows at the
    cap), at least the imposed count, rounded up to the micro-batch multiple."""
    fewest = max(problem.min_count, ceil_div(search.total, search.dp * search.cap))
    return round_up(fewest, search.microbatch_multiple)


def _more_candidates(
    problem: StepProblem,
    searches: List["ShapeSearch"],
    scored: Dict[Tuple[int, int], StepShape],
    chosen: StepShape,
) -> StepShape:
    """On a small step, the other constructions of :mod:`.candidates` scored beside ours.

    For the chosen count (and on steps of at most :data:`_MORE_COUNTS_LIMIT` samples one more and
    the count first fit needs, and on a tiny step every count searched), each construction is scored
    like the search's own candidates (its order as given too, where it has one); the fastest is kept
    only when it beats ``chosen``, so the step is never predicted slower than without them.
    """
    search = _arrival_search(searches, lone_oversize=True)
    if search is None or not is_small_step(len(problem.items), search.dp):
        return chosen
    if chosen.per_rank == 1 and chosen.micro_batch_size == 1 and max(map(len, chosen.bins)) <= 1:
        # One micro-batch of at most one sample a rank: no plan is faster (the longest sample's
        # rank runs it, and at least one micro-batch, in any plan). A step of a rollout or two at
        # a large dp scored every construction for nothing (10x its planning time).
        return chosen
    # One rank's samples over the cap (a sharded rank planned under a budget with room for
    # placeholder rows, a sample at the full budget among them) each run alone: the
    # constructions pack the others into the micro-batches left.
    lone = [[i] for i in search.oversize]
    sizes = problem.sizes
    weights = _own_weights(problem, search)
    multiple = search.microbatch_multiple
    # One more micro-batch a rank gives the split more freedom where its overhead is small.
    counts = {chosen.per_rank}
    if len(problem.items) <= _MORE_COUNTS_LIMIT:
        counts.add(chosen.per_rank + multiple)
        counts.add(round_up(natural_count(search.arrival, sizes, search.cap, search.dp), multiple))
    if len(problem.items) <= TINY_STEP_SAMPLES:
        counts.add(search.min_per_rank)
        counts.update(search.candidates())
    # The fewest counts too, below the global packing's fewest where the token total allows
    # them: a rank's own split (differencing) can fit fewer micro-batches than dealing global
    # bins does, and the fewest rows are what no pipeline wants most (few samples a rank: few
    # counts).
    floor = _fewest_by_tokens(problem, search)
    counts.update(range(floor, search.min_per_rank + 1, multiple))
    more = dict(scored)
    for m in sorted(c for c in counts if c >= problem.min_count):
        if m <= len(lone):
            continue
        for _name, ranks, keep_order in small_step_candidates(
            search.arrival,
            sizes,
            weights,
            search.cap,
            search.dp,
            m - len(lone),
            problem.row_multiple,
        ):
            if lone:
                [rank] = ranks
                ranks = [lone + rank]
            for shape in search.score_ranks(ranks, m, keep_order):
                shape.oversize = list(search.oversize)
                known = more.get((m, 1))
                if known is None or shape.step_time < known.step_time * (1.0 - TIE):
                    more[(m, 1)] = shape
    best = pick_shape(more, problem.min_gain)
    return best if best.step_time < chosen.step_time * (1.0 - TIE) else chosen


#: The default planner builds clustered ranks on steps of at most this many samples (the
#: thorough one on every step up to :data:`RAMP_LIMIT`): a few ms of CPU there, and where one
#: sample fills a row the rank holding it is the step, unless it holds little else. On 84
#: long-tailed samples at dp 4, pp 2 (one of 16,384 tokens, the cap) slime's first fit was 1.3%
#: ahead of the default planner; with clustered ranks ours is 16% ahead (``benchmarks.as_run
#: --seed 40``, #66). On the 512-sample GPU-regime steps clustering tripled the default
#: planner's CPU for 0.2% of step time: not there.
_CLUSTER_DEFAULT_LIMIT = 256
