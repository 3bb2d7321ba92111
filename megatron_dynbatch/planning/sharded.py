"""One step's micro-batches over every DP rank when the samples are already sharded over the ranks.

RL trainers (SkyRL, verl) dispatch a mini-batch to the DP ranks before the Megatron worker sees
it, so a sample cannot move to another rank. Every rank then gathers every rank's lengths (lengths
only, never data) and calls :func:`plan_sharded_step` with them, deriving the same plan with no
further collective: each rank's own samples are planned by the config's planner
(:func:`~.registry.run_planner`, the planner by default) for this pipeline (``dp_size=1``: one
rank's samples), then every rank gets the same micro-batch count
``M`` (the largest, rounded up to the interleaved schedule's group) and the same rows per
micro-batch ``B`` (the fullest micro-batch of any rank). A rank with fewer real micro-batches, or
none, runs placeholders after its real ones, so counts are equal by construction. Since every
rank runs that count, it is chosen for the slowest rank, not by the rank that wants the most
(:func:`fill_the_count`).

Example: ranks with lengths ``[[900], [300, 300, 300, 300]]``, a budget of 600 tokens, pp 2 and
vpp 2 (group 2): rank 0 needs one micro-batch, rank 1 two; ``M = 2`` and rank 0 runs one
placeholder after its sample.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .balance import descent_order, pipeline_order, pipeline_orders
from .candidates import differenced_rows
from .cost import microbatch_cost, sample_costs
from .plan import ShardedPlan
from .planner import sharded_wording
from .registry import run_planner
from .samples import SampleSet, as_sequence
from .simulate import TIE, pipeline_makespan, remembered_makespans
from .spec import (
    ASSUMED_OVERHEAD_CHECKS,
    PEER_TOLERANCE,
    ParallelLayout,
    PlannerConfig,
    ceil_div,
    round_up,
)
from .step_search import variable_rows

__all__ = [
    "FULL_SEARCH_RANKS",
    "FULL_SEARCH_SAMPLES",
    "ShardedPlan",
    "fill_the_count",
    "fullest",
    "plan_rank_shards",
    "plan_sharded_step",
    "rank_step_time",
    "sharded_plan",
]

#: One rank's micro-batches (local sample indices), in run order.
MicroBatches = Tuple[Tuple[int, ...], ...]
Ranks = List[MicroBatches]

#: Ranks the planner's full search plans in a step of variable rows (the heaviest); the others
#: are split by differencing. At dp 512 with 32 samples a rank (pp 4, vpp 2) the full search on
#: every rank took 25 s a step.
FULL_SEARCH_RANKS = 16
#: ... and at most this many samples in all (at least one rank): a rank of 256 samples at pp 4,
#: vpp 2 takes the full search about 0.13 s.
FULL_SEARCH_SAMPLES = 1024
#: Counts a differencing split of one rank tries, from the fewest, before the planner plans it.
_DIFFERENCED_TRIES = 4
#: Times :func:`fill_the_count` tries a lower count (each: the slowest rank's own).
_LOWERINGS = 3
#: ``min_gain`` that keeps a plan at its floor count: more micro-batches would have to be
#: predicted nearly twice as fast.
_ONLY_THE_FLOOR = 0.99


def plan_rank_shards(
    lengths_per_rank: Sequence[Sequence[int]],
    config: PlannerConfig,
    *,
    placeholder_copies_shortest: bool = False,
) -> Tuple[Ranks, List[Tuple[int, int]]]:
    """Each rank's own real micro-batches (local indices) and the oversize ``(rank, index)``.

    The first half of :func:`plan_sharded_step`, for a host that adjusts the micro-batches before
    the counts are equalised (SkyRL fits its placeholder rows into the budget).
    """
    lengths_per_rank = _check_shards(lengths_per_rank, config)
    with sharded_wording():  # each rank's samples train whole, in rows of their own
        return _plan_rank_shards(lengths_per_rank, config, placeholder_copies_shortest)


def _plan_rank_shards(
    lengths_per_rank: Sequence[Sequence[int]],
    config: PlannerConfig,
    placeholder_copies_shortest: bool,
) -> Tuple[Ranks, List[Tuple[int, int]]]:
    if config.rollouts_per_step is not None:
        # One call plans one step; rollouts_per_step would split it into several.
        config = dataclasses.replace(config, rollouts_per_step=None)
    multiple = config.parallel.sample_multiple
    cap = config.token_cap

    def placeholder(lengths: Sequence[int]) -> Optional[int]:
        if not placeholder_copies_shortest or not lengths:
            return None
        return round_up(min(lengths), multiple)

    # Each rank plans every rank's samples (the same plan everywhere, no further collective), so
    # at hundreds of ranks the planner's full search on every shard costs seconds a step. The
    # step is its slowest rank: the full search goes to the heaviest ranks, the others are split
    # by differencing (verl's construction, a fraction of a millisecond), which only needs to
    # keep them under the slowest.
    full = _heaviest(lengths_per_rank, config)

    def plan_at(rank: int, count: Optional[int]) -> MicroBatches:
        lengths = lengths_per_rank[rank]
        if rank not in full:
            quick = _differenced(lengths, config, count)
            if quick is not None:
                return quick
        return _plan_rank(lengths, config, count, placeholder=placeholder(lengths))[0]

    with remembered_makespans():  # every rank's and count's plans share their replays
        ranks: Ranks = []
        oversize: List[Tuple[int, int]] = []
        for rank, lengths in enumerate(lengths_per_rank):
            if not lengths:
                ranks.append(())
                continue
            try:
                if rank in full:
                    mbs, over = _plan_rank(lengths, config, placeholder=placeholder(lengths))
                else:
                    mbs = plan_at(rank, None)
                    over = tuple(
                        i for i in range(len(lengths)) if round_up(lengths[i], multiple) > cap
                    )
            except DynBatchValueError as error:
                # The planner numbers the rank's own samples: say whose (sample 0 of rank 1 is
                # not the step's sample 0).
                if len(error.args) == 1 and not str(error).startswith("DP rank"):
                    error.args = (f"DP rank {rank}: {error}",)
                raise
            ranks.append(mbs)
            oversize.extend((rank, i) for i in over)
        fitted = fill_the_count(ranks, lengths_per_rank, config, placeholder, plan_at, set(full))
        return _peer_guarded(fitted, lengths_per_rank, config, placeholder), oversize


def _check_shards(lengths_per_rank: Any, config: PlannerConfig) -> List[List[Any]]:
    """What a sharded plan cannot take, refused by name (bad lengths are the planner's, per
    rank); the ranks' lengths as lists (a rank given as an array or tensor has an ambiguous truth
    value: a probe's numpy ranks were a bare ValueError, torch ones a RuntimeError)."""
    if not isinstance(config, PlannerConfig):
        raise DynBatchValueError(
            f"config must be a PlannerConfig (dp_size=1), got {type(config).__name__}."
        )
    if config.parallel.dp_size != 1:
        raise DynBatchValueError(
            f"a sharded plan plans each DP rank's own samples: pass a config with dp_size=1 (got "
            f"{config.parallel.dp_size}); the ranks are the outer list of lengths_per_rank."
        )
    what = "one list of sample lengths per DP rank (at least one rank), e.g. [[120, 300], [80]]"
    ranks = as_sequence("lengths_per_rank", lengths_per_rank, what)
    if not ranks:
        raise DynBatchValueError(f"lengths_per_rank is empty; pass {what}.")
    ranks = [
        as_sequence(f"lengths_per_rank[{rank}]", lengths, f"sample lengths: {what}")
        for rank, lengths in enumerate(ranks)
    ]
    if config.oversize_samples == "truncate":
        # Each rank materializes its own samples whole; a cut it never makes would train every
        # token over the budget, reported nowhere.
        raise DynBatchValueError(
            "oversize_samples='truncate' cuts a sample to the cap in a global plan only; a "
            "sharded plan trains each rank's samples whole. Pass oversize_samples='allow' (an "
            "oversize sample runs alone, reported) or 'error', or cut the samples before planning."
        )
    return ranks


def _heaviest(lengths_per_rank: Sequence[Sequence[int]], config: PlannerConfig) -> Set[int]:
    """The ranks the planner's full search plans: every rank, unless rows are variable and there
    are more than :data:`FULL_SEARCH_RANKS` or :data:`FULL_SEARCH_SAMPLES`: then the heaviest by
    their samples' cost, within both."""
    ranks = [r for r, lengths in enumerate(lengths_per_rank) if lengths]
    samples = sum(len(lengths_per_rank[r]) for r in ranks)
    if not config.variable_row_lengths or (
        len(ranks) <= FULL_SEARCH_RANKS and samples <= FULL_SEARCH_SAMPLES
    ):
        return set(ranks)
    multiple = config.parallel.sample_multiple

    def work(rank: int) -> float:
        sizes = [round_up(n, multiple) for n in lengths_per_rank[rank]]
        return sum(_own_costs(config, sizes))

    full: Set[int] = set()
    searched = 0
    for rank in sorted(ranks, key=lambda r: (-work(r), r))[:FULL_SEARCH_RANKS]:
        searched += len(lengths_per_rank[rank])
        if full and searched > FULL_SEARCH_SAMPLES:
            break
        full.add(rank)
    return full


def _differenced(
    lengths: Sequence[int], config: PlannerConfig, count: Optional[int]
) -> Optional[MicroBatches]:
    """One rank's samples split by differencing on their cost into ``count`` micro-batches laid
    light-heavy-light (``None``: the fewest that keep the budget, trying a few counts), or
    ``None`` where no such split keeps the budget."""
    if count is not None:
        tries = [count]
    else:
        group = config.parallel.microbatch_multiple
        first = round_up(_fewest(lengths, config), group)
        tries = list(range(first, len(lengths) + 1, group))[:_DIFFERENCED_TRIES]
    for k in tries:
        split = _split(lengths, config, min(k, len(lengths)))
        if split is not None:
            return _best_order(split, lengths, config, k)
    return None


def _fewest(lengths: Sequence[int], config: PlannerConfig) -> int:
    """The fewest micro-batches one rank's samples may fit: their padded tokens over the budget,
    and one each for the samples over half of it (no two of those share one)."""
    cap = config.token_cap
    sizes = [round_up(n, config.parallel.sample_multiple) for n in lengths]
    halves = sum(1 for size in sizes if size > cap // 2)
    return max(1, ceil_div(sum(sizes), cap), halves)


def _split(lengths: Sequence[int], config: PlannerConfig, count: int) -> Optional[MicroBatches]:
    """:func:`.candidates.differenced_rows` of one rank's samples on their cost (verl's split of
    a rank) into ``count`` micro-batches, as it lays them; ``None`` where one breaks the cap."""
    sizes = [round_up(n, config.parallel.sample_multiple) for n in lengths]
    weights = _own_costs(config, sizes)
    split = differenced_rows(range(len(sizes)), sizes, weights, config.token_cap, count)
    return None if split is None else tuple(tuple(mb) for mb in split)


def _own_costs(config: PlannerConfig, sizes: Sequence[int]) -> List[float]:
    """Every sample's own cost in a micro-batch: its linear work and its attention (what verl's
    workload, ``24576 * L + L**2``, stands for). :func:`.cost.sample_costs` alone is only the
    part besides the row (the attention): balanced on it, a rank of 16 samples was split into
    micro-batches of 4,364 to 7,429 tokens besides one of 7,937, 1% slower than verl's own."""
    weight = config.cost.token_weight
    own = sample_costs(config.cost, config.layout, sizes, sizes)
    return [weight * size + cost for size, cost in zip(sizes, own, strict=True)]


def _best_order(
    mbs: Sequence[Sequence[int]], lengths: Sequence[int], config: PlannerConfig, count: int
) -> MicroBatches:
    """``mbs`` in the order of those below whose simulated step is fastest: as given, light-
    heavy-light, light-heavy-light with the heaviest in its best slot (:mod:`.balance`), sorted
    heaviest first and lightest first (few micro-batches in an interleaved pipeline:
    ``shape._reordered``), and in a long descent (:func:`.balance.descent_order`)."""
    multiple = config.parallel.sample_multiple
    parallel = config.parallel
    costs = [
        microbatch_cost(config.cost, config.layout, row, 1, sizes, sizes)
        for sizes in ([round_up(lengths[i], multiple) for i in mb] for mb in mbs)
        for row in [sum(sizes)]
    ]
    bins = list(range(len(mbs)))
    orders = [
        bins,
        pipeline_order(bins, costs),
        pipeline_orders(
            [bins],
            costs,
            costs,
            pp_size=parallel.pp_size,
            vpp_size=parallel.vpp_size,
            group=parallel.group_size,
        )[0],
        sorted(bins, key=lambda b: (costs[b], b), reverse=True),
        sorted(bins, key=lambda b: (costs[b], b)),
        descent_order(bins, lambda b: (costs[b], b)),
    ]
    laid = [tuple(tuple(mbs[b]) for b in order) for order in orders]
    return min(laid, key=lambda plan: rank_step_time(plan, count, lengths, config))


def _plan_rank(
    lengths: Sequence[int],
    config: PlannerConfig,
    count: Optional[int] = None,
    *,
    placeholder: Optional[int] = None,
) -> Tuple[MicroBatches, Tuple[int, ...]]:
    """One rank's real micro-batches (placeholders dropped: :func:`sharded_plan` appends them)
    and its oversize samples; ``count``: for exactly that many micro-batches (``None``: the count
    the planner prefers). Fewer are returned where the samples do not fill them. ``placeholder``:
    as :func:`rank_step_time`."""
    if count is not None:
        config = dataclasses.replace(
            config, min_microbatches=min(count, len(lengths)), min_gain=_ONLY_THE_FLOOR
        )
    [step] = run_planner(SampleSet.build(list(lengths)), config).steps
    # dp_size=1: rank 0 of the sub-plan is this rank.
    mbs = tuple(tuple(mb) for mb in step.ranks[0] if mb)
    oversize = tuple(step.oversize_samples)
    if not config.variable_row_lengths:
        return mbs, oversize
    multiple = config.parallel.microbatch_multiple
    planned = len(step.ranks[0])
    target = planned if count is None else count
    candidates = [mbs]
    if count is None and len(mbs) < planned and planned - multiple >= config.min_microbatches:
        # The sub-plan scored its placeholders where its pipeline order put them (a light one
        # first, say); a sharded rank runs them after its real micro-batches, which can make
        # that count slower than the next lower one (seen at 3% slower than verl's own).
        fewer = _plan_rank(lengths, config, planned - multiple, placeholder=placeholder)
        candidates.append(fewer[0])
    if len(mbs) < target <= len(lengths):
        # Every micro-batch real, where the planner's own packing left some empty.
        split = _split(lengths, config, target)
        if split is not None:
            candidates.append(split)

    def runs(mbs: MicroBatches) -> float:
        # Samples that do not fit in ``count`` come back in more (the callers refuse that plan):
        # score it at the count it needs, never at one under its micro-batches (at pp 4, vpp 4
        # five micro-batches in a count of 4 are no schedule Megatron runs, and the replay hung).
        total = round_up(len(mbs), multiple)
        return rank_step_time(
            mbs, total if count is None else max(count, total), lengths, config, placeholder
        )

    # The fastest as the rank runs it; ties to the planner's own (the first).
    best = min(range(len(candidates)), key=lambda k: (runs(candidates[k]), k))
    return candidates[best], oversize


def rank_step_time(
    mbs: Sequence[Sequence[int]],
    count: int,
    lengths: Sequence[int],
    config: PlannerConfig,
    placeholder: Optional[int] = None,
    *,
    rows: int = 0,
) -> float:
    """The planner's simulated step of one rank running ``mbs`` then placeholders up to
    ``count``, each micro-batch a row of its own (``config.variable_row_lengths``).
    ``placeholder``: tokens of the one sample a placeholder copies (verl's: the rank's shortest,
    padded), computed like a sample; ``None``: the shortest row the layout allows, no sample.
    ``rows``: every micro-batch topped up to that many samples with one-token rows, each padded
    to the alignment (SkyRL's placeholder rows; a placeholder micro-batch is ``rows`` of them)."""
    multiple = config.parallel.sample_multiple
    sizes = [[round_up(lengths[i], multiple) for i in mb] for mb in mbs]
    filler = [] if placeholder is None else [placeholder]
    sizes += [list(filler) for _ in range(count - len(mbs))]
    sizes = [mb + [multiple] * (rows - len(mb)) for mb in sizes]
    rows = variable_rows(
        [sum(mb) for mb in sizes],
        config.variable_row_multiple,
        config.token_cap,
        config.memory,
        config.parallel.sample_multiple,
    )
    costs = [
        microbatch_cost(config.cost, config.layout, row, 1, mb, mb)
        for row, mb in zip(rows, sizes, strict=True)
    ]
    parallel = config.parallel
    return pipeline_makespan(costs, parallel.pp_size, parallel.vpp_size, parallel.group_size)


def fill_the_count(
    ranks: Sequence[MicroBatches],
    lengths_per_rank: Sequence[Sequence[int]],
    config: PlannerConfig,
    placeholder: Callable[[Sequence[int]], Optional[int]] = lambda lengths: None,
    plan_at: Optional[Callable[[int, Optional[int]], MicroBatches]] = None,
    searched: Optional[Set[int]] = None,
) -> Ranks:
    """Every rank's micro-batches for one count the whole step runs, chosen for the slowest rank.

    Planned alone, each rank picks the count its own step runs fastest at, and every rank then
    runs the largest: a rank that wanted fewer pays placeholders (their fixed costs, and a
    pipeline bubble its samples could have filled), and where that rank is the slowest, the
    step waits for it (one rank of long samples at pp 4 running eight placeholders after its four
    micro-batches because the others split finer: 6.7% slower than verl's own,
    ``benchmarks/verl_as_run.py``). So, by the planner's simulated step of each rank (the
    slowest rank is the step):

    1. the count is lowered to the slowest rank's own while that makes the step faster, the
       ranks that wanted more planned again for exactly that many;
    2. a rank with fewer micro-batches than the count is planned again for the count
       (``min_microbatches``) and keeps that plan where its simulated step is faster (both run
       the same number of micro-batches, so the per-micro-batch overhead, assumed or told,
       weighs the same on both).

    Variable rows only: with one row length for the step, a rank's rows are not its own.
    ``placeholder(lengths)``: what one placeholder of the rank holding ``lengths`` computes
    (:func:`rank_step_time`); ``plan_at(rank, count)``: that rank's plan for ``count``
    micro-batches (default: the planner's, :func:`_plan_rank`); ``searched``: the ranks
    ``plan_at`` plans by the planner's full search (``None``: all); while the slowest rank is
    another, it is planned so too (at most :data:`FULL_SEARCH_RANKS` more).
    """
    fitted = list(ranks)
    if not config.variable_row_lengths:
        return fitted
    multiple = config.parallel.microbatch_multiple
    exact: Dict[Tuple[int, int], Optional[MicroBatches]] = {}

    def planned(rank: int, count: int) -> Optional[MicroBatches]:
        """Rank ``rank``'s plan of exactly ``count`` micro-batches (``None``: they do not fit)."""
        key = (rank, count)
        if key not in exact:
            if plan_at is None:
                lengths = lengths_per_rank[rank]
                other, _ = _plan_rank(lengths, config, count, placeholder=placeholder(lengths))
            else:
                other = plan_at(rank, count)
            exact[key] = other if len(other) <= count else None
        return exact[key]

    def times(plan: Sequence[MicroBatches], count: int) -> List[float]:
        return [
            rank_step_time(mbs, count, lengths, config, placeholder(lengths)) if mbs else 0.0
            for mbs, lengths in zip(plan, lengths_per_rank, strict=True)
        ]

    count = _step_count(fitted, multiple)
    step = times(fitted, count)
    for _ in range(_LOWERINGS):
        slowest = max(range(len(step)), key=lambda r: (step[r], -r))
        lower = round_up(max(1, len(fitted[slowest])), multiple)
        if lower >= count:
            break
        trial = list(fitted)
        for rank, mbs in enumerate(fitted):
            if len(mbs) > lower:
                other = planned(rank, lower)
                if other is None:
                    break
                trial[rank] = other
        else:
            trial_step = times(trial, lower)
            if max(trial_step) < max(step) * (1.0 - TIE):
                fitted, count, step = trial, lower, trial_step
                continue
        break
    for rank, mbs in enumerate(fitted):
        lengths = lengths_per_rank[rank]
        if not mbs or len(mbs) >= min(count, len(lengths)):
            continue
        other = planned(rank, count)
        faster = step[rank] * (1.0 - TIE)
        if (
            other is not None
            and rank_step_time(other, count, lengths, config, placeholder(lengths)) < faster
        ):
            fitted[rank] = other
    if searched is None:
        return fitted
    # Ranks split by differencing were planned to stay under the slowest; where one is the
    # slowest, the planner's full search plans it for the count, while the budget lasts.
    step = times(fitted, count)
    for _ in range(FULL_SEARCH_RANKS):
        slowest = max(range(len(step)), key=lambda r: (step[r], -r))
        if slowest in searched or not fitted[slowest]:
            break  # searched already, or no rank holds a sample
        searched.add(slowest)
        lengths = lengths_per_rank[slowest]
        other, _ = _plan_rank(lengths, config, count, placeholder=placeholder(lengths))
        if len(other) <= count:
            time = rank_step_time(other, count, lengths, config, placeholder(lengths))
            if time < step[slowest] * (1.0 - TIE):
                fitted[slowest], step[slowest] = other, time
    return fitted


def _peer_guarded(
    fitted: Ranks,
    lengths_per_rank: Sequence[Sequence[int]],
    config: PlannerConfig,
    placeholder: Callable[[Sequence[int]], Optional[int]],
) -> Ranks:
    """``fitted``, or verl's own schedule of the step where the overhead is assumed and ``fitted``
    is more than :data:`.spec.PEER_TOLERANCE` slower than it at one of the overheads a plan is
    checked at (:data:`.spec.ASSUMED_OVERHEAD_CHECKS` of a full row), whichever is the fewer
    percent behind the faster of the two at its worst overhead.

    verl's own: every rank split by differencing into the fewest micro-batches that keep the
    budget (the most any rank needs, rounded up to the group), laid for the pipeline. The global
    planner keeps this promise per step (:func:`.shape._peer_guard`); a sharded step's count is
    chosen on the assumed overhead alone, and at 5% of a row a count of seven (three of them
    placeholders on the slowest rank) ran 3% behind verl's two (``benchmarks/verl_as_run.py``,
    seed 5). Variable rows only, as :func:`fill_the_count`.
    """
    if not config.variable_row_lengths or not config.overhead_assumed or not any(fitted):
        return fitted
    ranks = [r for r, lengths in enumerate(lengths_per_rank) if lengths]
    multiple = config.parallel.microbatch_multiple
    count = round_up(max(_fewest(lengths_per_rank[r], config) for r in ranks), multiple)
    if count == _step_count(fitted, multiple):
        # The same count as verl's: the overhead weighs alike on both, and the planner's own
        # candidates (differencing among them) already chose.
        return fitted
    peer: Ranks = [() for _ in lengths_per_rank]
    for r in ranks:
        split = _differenced(lengths_per_rank[r], config, count)
        if split is None:
            return fitted
        peer[r] = split
    full_row = config.cost.full_row_cost(config.token_cap, config.layout)
    checks = [
        dataclasses.replace(
            config, cost=dataclasses.replace(config.cost, microbatch_overhead=fraction * full_row)
        )
        for fraction in ASSUMED_OVERHEAD_CHECKS
    ]

    def steps(plan: Ranks) -> List[float]:
        total = _step_count(plan, multiple)
        out = []
        for checked in checks:
            out.append(
                max(
                    rank_step_time(
                        plan[r],
                        total,
                        lengths_per_rank[r],
                        checked,
                        placeholder(lengths_per_rank[r]),
                    )
                    for r in ranks
                )
            )
        return out

    ours, theirs = steps(fitted), steps(peer)
    worst = max(o / t for o, t in zip(ours, theirs, strict=True))
    if worst <= 1.0 + PEER_TOLERANCE:
        return fitted
    best = [min(o, t) for o, t in zip(ours, theirs, strict=True)]
    peer_worst = max(t / b for t, b in zip(theirs, best, strict=True))
    ours_worst = max(o / b for o, b in zip(ours, best, strict=True))
    return peer if peer_worst < ours_worst else fitted


def _step_count(ranks: Sequence[MicroBatches], multiple: int) -> int:
    """The micro-batches every rank runs: the most any rank has, at least one, rounded up to
    what Megatron's schedule needs (the interleaved group)."""
    return round_up(max([1] + [len(mbs) for mbs in ranks]), multiple)


def fullest(ranks: Sequence[Sequence[Sequence[int]]]) -> int:
    """The most samples any micro-batch of any rank holds, at least 1: the rows ``B`` a host
    that runs every micro-batch at one row count (SkyRL) gives each."""
    return max([len(mb) for mbs in ranks for mb in mbs] or [1])


def sharded_plan(
    ranks: Sequence[MicroBatches],
    oversize: Sequence[Tuple[int, int]],
    parallel: ParallelLayout,
    lengths: Optional[Sequence[Sequence[int]]] = None,
) -> ShardedPlan:
    """Every rank's real micro-batches with the count every rank runs: the largest, rounded up to
    what Megatron's schedule needs (the interleaved group), at least one. ``lengths``: what the
    samples were planned with, kept for the materializer's check."""
    count = _step_count(ranks, parallel.microbatch_multiple)
    rows = fullest(ranks)
    return ShardedPlan(
        ranks=tuple(tuple(mbs) for mbs in ranks),
        num_microbatches=count,
        rows=rows,
        oversize=tuple(oversize),
        lengths=() if lengths is None else tuple(tuple(map(int, rank)) for rank in lengths),
    )


def plan_sharded_step(
    lengths_per_rank: Sequence[Sequence[int]], config: PlannerConfig
) -> ShardedPlan:
    """Plan one step whose samples are already sharded over the DP ranks.

    Args:
        lengths_per_rank: ``lengths_per_rank[r][i]``: tokens of sample ``i`` on DP rank ``r``
            (checked positive integers); a rank may hold no sample.
        config: The planner config of one rank's samples; ``config.parallel.dp_size`` must be 1
            (the ranks are the outer list here).

    Returns:
        The :class:`ShardedPlan`, identical on every rank given the same lengths.
    """
    lengths_per_rank = _check_shards(lengths_per_rank, config)
    ranks, oversize = plan_rank_shards(lengths_per_rank, config)
    return sharded_plan(ranks, oversize, config.parallel, lengths_per_rank)
