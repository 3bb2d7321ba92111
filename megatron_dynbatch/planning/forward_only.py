"""Forward-only (log-prob) passes over samples already assigned to DP ranks: one count for all.

A trainer that runs its log-prob passes on the training partition (slime: each DP rank computes
the log-probs of the samples it trains) needs every rank to run the same number of micro-batches
(with expert parallelism the all-to-all spans DP ranks), and no gradient crosses ranks, so a rank
packs only its own samples. Planning each rank on its own and topping the counts up with
placeholders repeats the planner's whole search once per rank, one after another (0.6 s for
16,384 samples at dp 64, pp 4, vpp 2; 22 s for 1M at dp 512), and the ranks that needed fewer
micro-batches then run placeholders instead of spreading their samples.

Here the count is chosen once for all ranks, and each rank packs its samples into exactly that
many micro-batches (LPT, best fit where LPT breaks the cap), so no rank idles on placeholders
while it has samples to spread. A forward-only pipeline pass of micro-batch costs ``c`` on ``pp``
stages takes about ``(sum(c) + (pp - 1) / vpp * max(c)) / pp`` (a proportionate flow shop: the
order does not matter), so the candidates are the fewest count every rank packs into and, where
the fullest rows are longer than the longest sample, counts up to where they are not; the count
whose slowest rank is fastest wins (ties, and gains under ``min_gain``, to fewer). On a small pass
(few samples per rank, :func:`.candidates.is_small_step`) every rank's packing at that count is
also built the ways :mod:`.candidates` builds a small training step's (differencing, first fit in
arrival and size order, the least rounding of variable rows on a tiny rank), each kept only where
its rank's simulated pass gets faster and no rank's slower.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .candidates import is_small_step, rank_packings
from .cost import row_cost, sample_costs
from .packing import best_fit_pack, feasible_pack, lpt_pack, spread_into_empty
from .simulate import forward_only_makespan
from .spec import PlannerConfig, ceil_div, round_up
from .step_search import variable_rows

__all__ = ["ForwardOnlyPlan", "plan_forward_only"]

#: Counts scored, the fewest included, at most (each packs every rank once).
_MAX_COUNTS = 8
#: Largest ``samples x micro-batches`` of a rank packed by :func:`.packing.feasible_pack` (its
#: differencing and local moves), about a millisecond.
_SMALL = 2048
#: Average fill of a rank's rows above which LPT is not tried (it fails at the last, smallest
#: samples when rows are this full; best fit packs them).
_LPT_MAX_FILL = 0.97


@dataclass(frozen=True)
class ForwardOnlyPlan:
    """Every rank's forward-only micro-batches, one count for all."""

    micro_batches: List[List[List[int]]]
    """Per rank, per micro-batch, indices into that rank's lengths (``[]``: a placeholder)."""
    row_lengths: List[List[int]]
    """Per rank, per micro-batch, its packed row (every CP rank's tokens): its own load rounded
    up to the row multiple with variable rows, else the longest row of all ranks."""

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batches[0])


class _Rank:
    """One rank's samples: sizes, the order LPT takes them in, and those over the cap."""

    def __init__(self, lengths: Sequence[int], config: PlannerConfig) -> None:
        multiple = config.parallel.sample_multiple
        cap = config.token_cap
        if multiple == 1:
            self.sizes = list(lengths)
        else:
            self.sizes = [-(-length // multiple) * multiple for length in lengths]
        # Decreasing size, ties by index (a stable sort keeps equal sizes in index order).
        order = sorted(range(len(lengths)), key=self.sizes.__getitem__, reverse=True)
        over = 0
        while over < len(order) and self.sizes[order[over]] > cap:
            over += 1
        self.oversize = order[:over]
        self.order = order[over:]
        regular = sum(self.sizes) - sum(map(self.sizes.__getitem__, self.oversize))
        half = cap // 2
        halves = 0
        while halves < len(self.order) and self.sizes[self.order[halves]] > half:
            halves += 1
        self.fewest = len(self.oversize) + max(ceil_div(regular, cap), halves)
        self.longest = self.sizes[order[0]] if order else 0
        self.total = regular
        self._own: Optional[List[float]] = None

    def own(self, config: PlannerConfig) -> List[float]:
        """Every sample's own cost (attention, response work), computed once."""
        if self._own is None:
            self._own = sample_costs(config.cost, "packed", self.sizes, self.sizes)
        return self._own

    def pack(
        self, count: int, cap: int, row_multiple: int = 1
    ) -> Tuple[List[List[int]], List[int]]:
        """``count`` micro-batches (oversize samples alone), or raise ``_NoFit``; with variable
        rows (``row_multiple`` > 1) no row rounds up further than it must."""
        bins = count - len(self.oversize)
        if bins < 0:
            raise _NoFit
        if not bins:
            packing = ([], [])
        elif len(self.order) * bins <= _SMALL:
            # Few samples: the training planner's packer (differencing, then single moves and
            # swaps on the fullest bin) balances rows better, and costs little here.
            packing = feasible_pack(self.sizes, self.order, sorted(self.order), bins, cap)
        elif self.total <= _LPT_MAX_FILL * bins * cap:
            packing = lpt_pack(self.sizes, self.order, bins, cap)
        else:
            packing = None  # rows this full: LPT would fail late, after a whole pass
        if packing is None:
            # Rows too full for LPT: best fit once (a forward pass gains little from the
            # balanced rows MULTIFIT's search would add), next fit when even that fails.
            packing = best_fit_pack(self.sizes, self.order, bins, cap)
            if packing is None:
                packing = feasible_pack(self.sizes, self.order, sorted(self.order), bins, cap)
                if packing is None:
                    raise _NoFit
            else:
                packing = spread_into_empty(self.sizes, packing)
        if row_multiple > 1 and self.order and bins > 0:
            packing = self._within_rows(packing, bins, cap, row_multiple)
        members = [[i] for i in self.oversize] + [sorted(b) for b in packing[0]]
        loads = [self.sizes[i] for i in self.oversize] + list(packing[1])
        return members, loads

    def _within_rows(self, packing, bins: int, cap: int, multiple: int):
        """Rows of their own length are rounded up to ``multiple``: a balanced packing whose
        fullest bin is a few tokens over a multiple pays a whole multiple more on that row. Pack
        under the smallest multiple that can hold the mean load and the longest sample (best
        fit, then one multiple more), when that is below what the packing has."""
        target = round_up(max(ceil_div(self.total, bins), self.sizes[self.order[0]]), multiple)
        for limit in (target, target + multiple):
            if limit >= min(cap + 1, round_up(max(packing[1]), multiple)):
                break
            trial = best_fit_pack(self.sizes, self.order, bins, limit)
            if trial is not None:
                return spread_into_empty(self.sizes, trial)
        return packing


class _NoFit(Exception):
    """A rank's samples do not pack into the count (internal: more micro-batches are tried)."""


def plan_forward_only(
    rank_lengths: Sequence[Sequence[int]], config: PlannerConfig, *, more_candidates: bool = True
) -> ForwardOnlyPlan:
    """Plan the forward-only pass of every rank's samples with one micro-batch count.

    Args:
        rank_lengths: Per DP rank, the token lengths of the samples it holds.
        config: The planner config of one rank (``parallel.dp_size`` is not read): the budget,
            the cost model, the pipeline (``pp``, ``vpp``, the interleaving group, whose multiple
            the count keeps) and the rows (variable or uniform). A sample over the cap runs alone.
        more_candidates: On a small pass (:func:`.candidates.is_small_step`), score the
            constructions of :mod:`.candidates` for every rank at the chosen count, each kept
            only where its rank's simulated pass is faster and no rank's is slower; ``False``:
            the count search's own packing (what the tests compare against).
    """
    parallel = config.parallel
    cap, step = config.token_cap, parallel.microbatch_multiple
    ranks = [_Rank(lengths, config) for lengths in rank_lengths]
    rows = config.variable_row_multiple if config.variable_row_lengths else 1
    fewest = round_up(max([1] + [rank.fewest for rank in ranks]), step)
    packed = None
    while packed is None:
        try:
            packed = [rank.pack(fewest, cap, rows) for rank in ranks]
        except _NoFit:
            fewest += step
    # Rows fuller than the longest sample shrink with more micro-batches, and so does the
    # pipeline's fill: counts up to where the fullest rank's mean load reaches its longest sample
    # (spread geometrically when many).
    fullest = max(ranks, key=lambda rank: rank.total)
    most = fewest
    if fullest.longest and not fullest.oversize:
        most = round_up(max(fewest, ceil_div(fullest.total, fullest.longest)), step)
    best = packed
    if most != fewest and parallel.pp_size > 1:
        best_time = _pass_time(packed, ranks, config)
        for count in _counts(fewest, most, step)[1:]:
            try:
                trial = [rank.pack(count, cap, rows) for rank in ranks]
            except _NoFit:  # pragma: no cover - more bins than the fewest always pack
                continue
            time = _pass_time(trial, ranks, config)
            # More micro-batches must be faster by min_gain (as the training plans' counts).
            if time < best_time * (1.0 - max(config.min_gain, 1e-9)):
                best_time, best = time, trial
    if more_candidates and is_small_step(sum(map(len, rank_lengths)), len(rank_lengths)):
        best = _with_candidates(best, ranks, config)
    return _rows(best, config)


def _with_candidates(packed, ranks: Sequence[_Rank], config: PlannerConfig):
    """Every rank's packing replaced by a construction of :mod:`.candidates` at the same count
    where that rank's simulated pass (:func:`.simulate.forward_only_makespan`) gets faster and
    the slowest rank's does not get slower (uniform rows: one rank's fuller row lengthens every
    rank's), so the pass is never predicted slower than the count search's packing."""
    parallel, model, cap = config.parallel, config.cost, config.token_cap
    multiple = config.variable_row_multiple if config.variable_row_lengths else None
    count = len(packed[0][0])

    def times(trial) -> List[float]:
        return [
            forward_only_makespan(costs, parallel.pp_size, parallel.vpp_size, parallel.group_size)
            for costs in _rank_costs(trial, ranks, config)
        ]

    packed = list(packed)
    current = times(packed)
    for r, rank in enumerate(ranks):
        if rank.oversize or not rank.order:
            continue
        own = rank.own(config)
        weights = [model.token_weight * size + o for size, o in zip(rank.sizes, own, strict=True)]
        arrival = sorted(rank.order)
        for _name, rows in rank_packings(arrival, rank.sizes, weights, cap, count, multiple):
            members = [sorted(mb) for mb in rows]
            loads = [sum(map(rank.sizes.__getitem__, mb)) for mb in members]
            trial = packed[:r] + [(members, loads)] + packed[r + 1 :]
            trial_times = times(trial)
            if trial_times[r] < current[r] * (1.0 - 1e-9) and max(trial_times) <= max(current):
                packed, current = trial, trial_times
    return packed


def _counts(first: int, last: int, step: int) -> List[int]:
    """Counts from ``first`` to ``last`` in steps of ``step``, at most ``_MAX_COUNTS``: every
    one when few, else geometric (the last included)."""
    every = list(range(first, last + 1, step))
    if len(every) <= _MAX_COUNTS:
        return every
    counts = {first, every[-1]}
    ratio = (every[-1] / first) ** (1.0 / (_MAX_COUNTS - 1))
    for k in range(1, _MAX_COUNTS - 1):
        counts.add(min(every[-1], round_up(round(first * ratio**k), step)))
    return sorted(counts)


def _rows(packed, config: PlannerConfig) -> ForwardOnlyPlan:
    cap = config.token_cap
    if config.variable_row_lengths:
        multiple = config.variable_row_multiple
        floor = config.parallel.sample_multiple
        rows = [variable_rows(loads, multiple, cap, config.memory, floor) for _, loads in packed]
    else:
        longest = max([1] + [load for _, loads in packed for load in loads])
        rows = [[longest] * len(loads) for _, loads in packed]
    return ForwardOnlyPlan(micro_batches=[members for members, _ in packed], row_lengths=rows)


def _rank_costs(packed, ranks: Sequence[_Rank], config: PlannerConfig) -> List[List[float]]:
    """Every rank's micro-batch costs (rows as :func:`_rows` gives them)."""
    model = config.cost
    plan = _rows(packed, config)
    result = []
    for (members, loads), rows, rank in zip(packed, plan.row_lengths, ranks, strict=True):
        own = rank.own(config)
        costs = [
            row_cost(model, "packed", row, 1, load) + sum(map(own.__getitem__, mb))
            for mb, load, row in zip(members, loads, rows, strict=True)
        ]
        if config.variable_row_lengths:
            costs = [c + model.shape_exchange_overhead for c in costs]
        result.append(costs)
    return result


def _pass_time(packed, ranks: Sequence[_Rank], config: PlannerConfig) -> float:
    """The slowest rank's forward-only pass: ``(sum(c) + (pp - 1) / vpp * max(c)) / pp``."""
    pp, vpp = config.parallel.pp_size, config.parallel.vpp_size
    return max(
        (sum(costs) + (pp - 1) / vpp * max(costs)) / pp
        for costs in _rank_costs(packed, ranks, config)
    )
