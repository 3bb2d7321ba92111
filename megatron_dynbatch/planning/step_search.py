"""One step's shape problem, and the searches that pack and score a micro-batch count for it.

:class:`StepProblem` holds a step's samples and everything a search needs; a :class:`StepShape` is
one candidate (M micro-batches per rank, rows ``[B x S]``, every rank's micro-batches in pipeline
order) with its simulated step time. A search (:class:`PackedSearch`, :class:`PaddedSearch`) packs
a count M, balances the micro-batches over the DP ranks, orders them for the pipeline and scores
them by :mod:`.simulate` with the full micro-batch cost (:mod:`.cost`, per-micro-batch overhead
included). Candidates are visited in order of a lower bound on their step time (branch and bound),
so a step whose fewest rows are clearly fastest (no pipeline, or S already at the longest sample)
packs once; a candidate is packed only under the longest row that could still win. Work per
packing is bounded: at most ``_SIMULATED_RANKS`` pipeline replays (all ranks up to
``_REPLAY_BUDGET`` micro-batches) plus the heavy-slot search of :func:`.balance.pipeline_orders`
(17 replays). On small steps a second construction, ranks first
(:meth:`PackedSearch._ranks_first`), is scored too. Which counts are tried and which shape wins
is :func:`.shape.choose_shape`'s.

Layouts:

* ``packed``: ``K = dp * M`` bins (a lone oversize sample keeps its own); LPT for the candidates,
  best fit / next fit where LPT breaks the cap; S is the fullest bin. Where attention pays ``S**2``
  a row whatever it holds (``dense``, ``causal``), micro-batches of ``B > 1`` packed rows are
  searched too: ``dp * M * B`` rows under ``cap // B`` each (the footprint ``B * S`` stays under
  the cap), dealt B to a micro-batch; one row of 1,024 tokens under a dense mask costs four times
  the attention of four rows of 256 holding the same samples. Every ``B`` up to
  ``cap // longest sample`` (at most :data:`_MAX_ROW_COUNTS` of them) is a candidate, and for each
  the count that puts one sample in a row, so fixed micro-batches' own ``[B x S]`` shape at the
  same memory (one sample a row) is always scored, and in the model a plan is never slower than
  it;
* ``padded``: S is the step's longest sample; a micro-batch holds ``B = ceil(n / (dp * M))`` rows,
  at most ``cap // S``.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .balance import RankBalancer, assign_bins_to_ranks, pipeline_orders
from .cost import TAIL_SEGMENT_TOKENS, row_cost, row_costs, tail_cost, tail_units
from .packing import feasible_pack, min_bins
from .simulate import BACKWARD_TO_FORWARD_RATIO, TIE, pipeline_makespan
from .spec import CostModel, ParallelLayout, ceil_div, round_up

__all__ = [
    "MAX_FORCED_PLACEHOLDERS",
    "PackedSearch",
    "PaddedSearch",
    "ShapeSearch",
    "StepProblem",
    "StepShape",
    "check_placeholders",
    "multi_row_counts",
    "pick_shape",
    "rows_floors",
    "variable_rows",
]

#: Candidate counts scored per step at most (a bound on packings and simulations per plan).
_MAX_CANDIDATES = 24
#: Ranks whose pipeline is replayed to score a candidate, at least: the costliest by total work.
_SIMULATED_RANKS = 4
#: Micro-batches replayed per scored candidate, at most: every rank is replayed while the step has
#: no more than this many (a rank whose dominant micro-batch runs first can be the slowest with
#: less total work, so ranking by total alone misses it); above, the costliest ranks that fit.
_REPLAY_BUDGET = 4096
#: Largest step (samples) that also gets the ranks-first construction (~50 ms of CPU at the limit).
_ALTERNATIVE_LIMIT = 8192
#: A swap that gives an idle DP rank a real micro-batch is kept unless the predicted step gets
#: slower by more than this: a placeholder row costs about what a real row of the same length
#: costs in the model (the same linear work; attention over short tail segments against a short
#: sample's), far inside the model's error.
_SPREAD_TOLERANCE = 1e-3
#: Rows per packed micro-batch searched besides 1, at most: every B from 2 up to 8, then spread
#: geometrically up to ``cap // longest sample`` (fixed micro-batch sizes are small).
_MAX_ROW_COUNTS = 8


@dataclass(frozen=True)
class StepProblem:
    """One step's samples and everything the shape search needs."""

    items: Sequence[int]
    """The step's sample indices, ascending."""
    sizes: Sequence[int]
    """Every sample's padded segment (its kept length rounded up to the sample multiple)."""
    sample_costs: Sequence[float]
    """Every sample's share of a micro-batch's cost (:func:`.cost.sample_costs`)."""
    model: CostModel
    layout: str
    cap: int
    parallel: ParallelLayout
    min_gain: float = 0.0
    """More micro-batches per rank must be predicted faster by this fraction to be chosen."""
    row_multiple: Optional[int] = None
    """Variable row lengths: each micro-batch's row is its load rounded up to this (``packed``
    only); ``None``: one row length per step, the longest."""
    memory: Optional[Any] = None
    """A :class:`.memory.MemoryLimit`: micro-batches of B rows are at most ``row_cap(B)`` long
    (``cap`` is already within ``row_cap(1)``); ``None``: the token cap alone."""
    multi_row_cap: Optional[int] = None
    """With ``memory``: the token budget's cap on ``B * S`` for ``B > 1`` (``cap`` is the one-row
    cap, memory included); ``None``: ``cap``."""
    disable_more_candidates: bool = False
    """Score the shape search's own constructions only (the planner before the small-step
    candidates of :mod:`.candidates`): what the tests compare against."""
    thorough: bool = False
    """The thorough planner (``dynbatch-thorough``): also the clustered ranks of :mod:`.cluster`
    on steps of more than :data:`.shape._CLUSTER_DEFAULT_LIMIT` samples, refined tents and a larger
    refinement budget (:mod:`.refine`): a step simulated about 1% faster on the GPU-regime
    steps, for several times the planning CPU."""
    overhead_checks: Tuple[float, ...] = ()
    """Per-micro-batch overheads (cost units) at which the plan must stay within
    :data:`.spec.PEER_TOLERANCE` of the trainers' own schedules (:func:`.shape._peer_guard`): set
    where the overhead is assumed; empty: the model's overhead is trusted."""
    min_count: int = 1
    """The fewest micro-batches per rank a search starts from (``PlannerConfig.min_microbatches``):
    a sharded step's rank that runs another rank's count anyway."""
    row_align: Optional[int] = None
    """Set by :func:`.shape.choose_shape` (from ``row_multiple``) when it scores uniform rows beside
    variable ones: shapes are exchanged, so a uniform row ``S`` of the packed layout is rounded up
    to this while it stays within the cap. On an H100 a ``[3 x 2111]`` micro-batch took 134.6 ms
    and ``[3 x 2112]`` 103.4 ms (``benchmarks/gpu_row_lengths.py``, docs/gpu.md)."""


def _footprint_cap(problem: StepProblem) -> int:
    """The most tokens ``B > 1`` rows may hold together: with a memory budget, the token budget
    alone (the memory budget bounds each B by :func:`_rows_cap`), else the cap."""
    if problem.memory is not None and problem.multi_row_cap is not None:
        return problem.multi_row_cap
    return problem.cap


def _rows_cap(problem: StepProblem, rows: int) -> int:
    """The longest row of a micro-batch of ``rows`` rows: its share of the token cap, and what
    the memory budget allows for that many rows (fixed micro-batches' [4 x 256] may fit a budget
    that one row of 1,024 does not, where attention keeps S x S scores)."""
    if rows == 1:
        return problem.cap
    cap = _footprint_cap(problem) // rows
    if problem.memory is not None:
        cap = min(cap, problem.memory.row_cap(rows))
    return cap


@dataclass
class StepShape:
    """A scored candidate schedule of one step."""

    per_rank: int
    """M: micro-batches per DP rank."""
    seq_length: int
    """S: the row length of every micro-batch of the step."""
    micro_batch_size: int
    """B: rows per micro-batch."""
    bins: List[List[int]]
    """Sample indices per micro-batch (``[]`` = placeholder)."""
    rank_orders: List[List[int]]
    """Per DP rank, its bins in schedule order."""
    bin_costs: List[float]
    """Forward cost of every bin as computed (:mod:`.cost`)."""
    step_time: float
    """Simulated step time (cost units, forward + backward): the slowest scored rank."""
    oversize: Sequence[int] = ()
    """Samples over the cap, each alone in its micro-batch."""
    row_lengths: Optional[List[int]] = None
    """Variable row lengths: every bin's own row (``None``: all ``seq_length``)."""
    packed_rows: Optional[List[List[List[int]]]] = None
    """Packed micro-batches of ``B > 1`` rows: every bin's rows, each a list of samples (``bins``
    holds their concatenation); ``None``: one row a bin."""
    token_loads: Optional[List[int]] = None
    """Every bin's padded tokens (the sum of its samples' sizes) as packed, where the packers
    counted them and no sample moved since; ``None`` otherwise (then sum the bins)."""


def variable_rows(
    loads: Sequence[int],
    multiple: int,
    cap: int,
    memory: Optional[Any] = None,
    sample_multiple: int = 1,
) -> List[int]:
    """Every micro-batch's own row: its padded load rounded up to ``multiple``.

    The rounding is kept only while the row stays within the cap (a cap of 1,000 with rows of
    multiples of 128 would otherwise give a row of 1,024: the cap is hard on the padded row); a row
    holding a lone oversize sample is over the cap anyway and keeps it, unless a memory budget
    (``memory``, a :class:`.memory.MemoryLimit`) does not fit the rounded row: then it runs its
    padded load. A placeholder (load 0) runs the shortest row the layout allows, one
    ``multiple``: under interleaving the micro-batches added to reach a multiple of the group then
    cost as little as they can, and a row of ``multiple`` tokens is still a whole row (every key,
    loss mask zero), never a stub. Where ``multiple`` is over the cap (a tiny budget), it runs
    the shortest real row within the cap, or, where every real row holds a lone oversize sample,
    the cap rounded down to ``sample_multiple`` (what every row must divide by: tp, 2 x cp): a
    placeholder is never over the cap.
    """
    real = {}
    for load in loads:
        if load > 0 and load not in real:
            row = round_up(load, multiple)
            if load > cap:
                real[load] = row if memory is None or memory.fits((1, row)) else load
            else:
                real[load] = row if row <= cap else load
    placeholder = multiple
    if multiple > cap:
        within = [row for row in real.values() if row <= cap]
        placeholder = (
            min(within)
            if within
            else max(sample_multiple, cap // sample_multiple * sample_multiple)
        )
    return [real[load] if load > 0 else placeholder for load in loads]


def pick_shape(scored: Dict[Tuple[int, int], StepShape], min_gain: float) -> StepShape:
    """The fewest micro-batches, unless more are faster by ``min_gain`` (relative), in turn.

    Walking the counts upwards, a larger count replaces the current choice only when its step is
    faster by more than ``min_gain`` (and by more than a float tie): an uncalibrated model's
    predicted gain of 1% is within its error, while the added micro-batches' launches are real.
    Among candidates of one count (several B), the fastest; ties to the fewer rows.
    """
    by_count: Dict[int, StepShape] = {}
    for (m, _rows), shape in sorted(scored.items()):
        known = by_count.get(m)
        if known is None or shape.step_time < known.step_time * (1.0 - TIE):
            by_count[m] = shape
    counts = sorted(by_count)
    best = by_count[counts[0]]
    for m in counts[1:]:
        if by_count[m].step_time < best.step_time * (1.0 - max(min_gain, TIE)):
            best = by_count[m]
    return best


def multi_row_counts(problem: StepProblem) -> List[int]:
    """The B > 1 searched for packed micro-batches of B rows: none unless a row's attention costs
    its whole ``S**2`` whatever it holds (``dense``, ``causal``: with per-segment attention a row
    of ``B * S`` holding the same samples computes the same), rows are uniform, and the longest
    sample fits ``cap // B``."""
    model = problem.model
    if (
        problem.layout != "packed"
        or problem.row_multiple is not None
        or model.attention_kind("packed") == "segment"
        or not problem.items
    ):
        return []
    longest = max(map(problem.sizes.__getitem__, problem.items))
    most = _footprint_cap(problem) // longest if longest else 0
    if problem.memory is not None and most > 1:
        most = problem.memory.most_rows(longest, most)
    counts = list(range(2, min(most, _MAX_ROW_COUNTS) + 1))
    if most > _MAX_ROW_COUNTS:
        # Beyond 8, spread the rest geometrically, the largest B included.
        counts = counts[: _MAX_ROW_COUNTS // 2]
        b = counts[-1]
        while len(counts) < _MAX_ROW_COUNTS - 1:
            b = max(b + 1, round(b * (most / b) ** (1.0 / (_MAX_ROW_COUNTS - len(counts)))))
            if b >= most:
                break
            counts.append(b)
        counts.append(most)
    return counts


def rows_floors(problem: StepProblem, rows: int) -> Tuple[float, float]:
    """Floors on the step time of ``rows`` rows per micro-batch, before any packing: at its fewest
    count, and with one sample a row.

    The fewest count is at least ``ceil(tokens / (cap // rows))`` rows over ``dp * rows`` a rank,
    each of at least the longest sample and the mean load (a floor of that count, the one packed);
    one sample a row takes ``ceil(n / (dp * rows))`` micro-batches of rows of exactly the longest
    sample (a true lower bound). The costliest rank does at least the average of the samples' own
    cost, and the last stage waits ``pp - 1`` first forwards.
    """
    parallel = problem.parallel
    dp, pp, vpp = parallel.dp_size, parallel.pp_size, parallel.vpp_size
    sizes, multiple = problem.sizes, parallel.microbatch_multiple
    total = sum(map(sizes.__getitem__, problem.items))
    longest = max(map(sizes.__getitem__, problem.items))
    work = sum(map(problem.sample_costs.__getitem__, problem.items))
    ratio = 1.0 + BACKWARD_TO_FORWARD_RATIO

    def floor(per_rank: int, s: int) -> float:
        row = row_cost(problem.model, "packed", s, rows, rows * s)
        return ratio * (per_rank * row + work / dp) / pp + row * (pp - 1) / (pp * vpp)

    fewest = round_up(
        max(1, ceil_div(ceil_div(total, _rows_cap(problem, rows)), dp * rows)), multiple
    )
    one = round_up(max(1, ceil_div(len(problem.items), dp * rows)), multiple)
    return (
        floor(fewest, max(longest, ceil_div(total, dp * fewest * rows))),
        floor(one, longest),
    )


#: Placeholder micro-batches a step may need before the layout is deemed a misconfiguration.
MAX_FORCED_PLACEHOLDERS = 1 << 16


def check_placeholders(problem: StepProblem) -> None:
    """Refuse layouts that force an absurd number of placeholder micro-batches.

    Every DP rank runs at least ``microbatch_multiple`` micro-batches (one without interleaving), so
    a step of n samples has at least ``dp * multiple - n`` placeholders. A placeholder is a full
    row of padding; more than 65,536 of them and more of them than samples is a mistyped
    ``--dp-size`` or interleaving group (dp 10,000,000 for 10 samples; a group of 100,000 at dp 8
    planned 800,000 placeholders), so it fails here instead of planning for minutes.
    """
    parallel = problem.parallel
    forced = parallel.dp_size * parallel.microbatch_multiple
    n = len(problem.items)
    if forced - n > MAX_FORCED_PLACEHOLDERS and forced > 2 * n:
        if parallel.microbatch_multiple > 1:
            why = (
                f"dp_size={parallel.dp_size} x microbatch_group_size_per_vp_stage="
                f"{parallel.microbatch_multiple} (interleaving, vpp_size={parallel.vpp_size})"
            )
        else:
            why = f"dp_size={parallel.dp_size} (one micro-batch per rank at least)"
        raise DynBatchValueError(
            f"{why} needs {forced} micro-batches per step, but the step has {n} "
            f"sample{'s' if n != 1 else ''}: "
            f"{forced - n} would be placeholders (limit {MAX_FORCED_PLACEHOLDERS}). Check "
            "dp_size and microbatch_group_size_per_vp_stage, or put more rollouts in a step."
        )


def _candidate_counts(first: int, last: int, multiple: int) -> List[int]:
    """Counts from ``first`` to ``last`` in steps of ``multiple``; geometric when too many."""
    if last <= first:
        return [first]
    every = list(range(first, last + 1, multiple))
    if len(every) <= _MAX_CANDIDATES:
        return every
    counts = {first, every[-1]}
    m = first
    while m < last and len(counts) < _MAX_CANDIDATES:
        m = round_up(max(m + multiple, int(m * 1.2)), multiple)
        counts.add(min(m, every[-1]))
    return sorted(counts)


class ShapeSearch:
    """What both layouts share: scoring a packing by its simulated step."""

    def __init__(self, problem: StepProblem) -> None:
        self.problem = problem
        parallel = problem.parallel
        self.dp = parallel.dp_size
        self.pp = parallel.pp_size
        self.vpp = parallel.vpp_size
        self.group = parallel.group_size
        self.microbatch_multiple = parallel.microbatch_multiple
        self.model = problem.model
        self.work = sum(map(problem.sample_costs.__getitem__, problem.items))
        #: Packed rows per micro-batch (B), and the most padded tokens one row may hold.
        self.rows = 1
        self.cap = problem.cap
        # Micro-batches of one shape cost the same unless segment attention or response work
        # varies with what they hold.
        segments = self.model.attention_kind(problem.layout) == "segment"
        self.varies = bool((segments and self.model.attention_weight) or self.model.response_weight)

    def lower_bound(self, per_rank: int) -> float:
        """No candidate of ``per_rank`` micro-batches can run faster than this.

        The costliest rank does at least the average work: ``per_rank`` rows of at least the
        shortest possible S plus its share of the samples' own cost; the last stage waits for the
        first forward to cross ``pp - 1`` stages before any of it.
        """
        row = self.min_row_cost(per_rank)
        ratio = 1.0 + BACKWARD_TO_FORWARD_RATIO
        rank = ratio * (per_rank * row + self.work / self.dp)
        # Variable rows: the first micro-batch may be far shorter than the mean row.
        first = self.model.overhead if self.problem.row_multiple is not None else row
        return rank / self.pp + first * (self.pp - 1) / (self.pp * self.vpp)

    def min_row_cost(self, per_rank: int) -> float:
        raise NotImplementedError

    def row_limit(self, per_rank: int, step_time: float) -> int:
        """The longest row a candidate of ``per_rank`` micro-batches may have and still beat a
        step of ``step_time``: :meth:`lower_bound` with that row's cost, solved for S."""
        ratio = 1.0 + BACKWARD_TO_FORWARD_RATIO
        slope = ratio * per_rank / self.pp + (self.pp - 1) / (self.pp * self.vpp)
        row = (step_time - ratio * self.work / (self.dp * self.pp)) / slope
        model = self.model
        if model.token_weight <= 0 or self.problem.row_multiple is not None:
            return self.cap
        return max(0, int((row - model.overhead) / (model.token_weight * self.rows)))

    def _bin_costs(
        self, loads: Sequence[int], own: Sequence[float], seq_length: int, rows: int
    ) -> Tuple[List[float], Optional[List[int]], int]:
        """Every bin's cost from its padded load and its samples' own cost: ``(bin_costs,
        row_lengths, seq_length)`` (variable rows: every bin's own row, S the longest; else the
        rows of ``seq_length``, aligned where the packed rows are)."""
        problem = self.problem
        layout = problem.layout
        row_lengths = None
        if problem.row_multiple is not None:
            row_lengths = variable_rows(
                loads,
                problem.row_multiple,
                problem.cap,
                problem.memory,
                problem.parallel.sample_multiple,
            )
            model = self.model
            extra = model.shape_exchange_overhead
            if model.attention_kind(layout) == "segment":
                # row_cost(model, layout, row, 1, load) inlined, the same operations in the same
                # order (a function call a micro-batch is a tenth of the step's scoring at 1M).
                # A tail within one segment (a variable row of multiple <= 128) squares in line.
                ov, tw, aw = model.overhead, model.token_weight, model.attention_weight
                short = TAIL_SEGMENT_TOKENS
                bin_costs = [
                    extra
                    + (ov + tw * s + aw * (t * t if (t := s - load) <= short else tail_units(t)))
                    + o
                    for s, load, o in zip(map(float, row_lengths), loads, own, strict=True)
                ]
            else:
                bin_costs = [
                    extra + row_cost(model, layout, row, 1, load) + o
                    for row, load, o in zip(row_lengths, loads, own, strict=True)
                ]
            seq_length = max(row_lengths)
        else:
            if layout == "packed":
                seq_length = self._aligned(seq_length)
            bin_costs = row_costs(self.model, layout, seq_length, rows, loads, own)
        return bin_costs, row_lengths, seq_length

    def as_given(self, ranks: List[List[List[int]]], per_rank: int) -> StepShape:
        """A trainer's own schedule (``ranks[r][m]``, one row a bin) as it runs it: its bins'
        costs in its own order, no sample moved (S the fullest bin's row)."""
        sizes, costs = self.problem.sizes, self.problem.sample_costs
        bins = [list(mb) for rank in ranks for mb in rank]
        loads = [sum(map(sizes.__getitem__, mb)) for mb in bins]
        own = [sum(map(costs.__getitem__, mb)) for mb in bins]
        bin_costs, row_lengths, seq_length = self._bin_costs(loads, own, max(loads), 1)
        orders = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(len(ranks))]
        return StepShape(
            per_rank=per_rank,
            seq_length=seq_length,
            micro_batch_size=1,
            bins=bins,
            rank_orders=orders,
            bin_costs=bin_costs,
            step_time=self._step_time(orders, bin_costs),
            row_lengths=row_lengths,
            token_loads=loads,
        )

    def score(
        self,
        bins: List[List[int]],
        loads: Sequence[int],
        per_rank: int,
        seq_length: int,
        rows: int,
        rank_bins: Optional[List[List[int]]] = None,
        token_loads: bool = False,
        keep_order: bool = False,
    ) -> StepShape:
        """Assign bins to ranks (unless given), balance, order for the pipeline, and simulate.

        ``token_loads``: ``loads`` are the bins' padded tokens (packed searches), kept on the
        shape unless sample moves change the bins. ``keep_order``: run each rank's bins in the
        order ``rank_bins`` gives (a construction's own order), not reordered for the pipeline."""
        problem = self.problem
        layout = problem.layout
        own = [sum(map(problem.sample_costs.__getitem__, members)) for members in bins]
        bin_costs, row_lengths, seq_length = self._bin_costs(loads, own, seq_length, rows)
        varies = self.varies or row_lengths is not None
        # Rows of one shape cost the same unless attention or response work varies with what they
        # hold; then balance the cost, else balance real tokens (free, and what logs show).
        given = rank_bins is not None
        if rank_bins is None:
            rank_bins = assign_bins_to_ranks(bin_costs if varies else loads, self.dp, per_rank)
        unbalanced = None
        final_loads = loads
        # Sample moves between bins know one row a bin: not for B > 1 rows.
        if layout == "packed" and self.varies and row_lengths is None and rows == 1:
            if given:
                # A construction's own split is kept where the moves make its step slower: they
                # even the ranks' work, and the construction may have split for the pipeline.
                unbalanced = ([list(members) for members in bins], list(bin_costs), seq_length)
            bin_costs, moved_loads, moved_own = self._balance(
                bins, loads, own, rank_bins, seq_length, per_rank, bin_costs
            )
            # Samples may have moved between bins; the balancer kept each bin's padded tokens.
            final_loads = moved_loads
            seq_length, bin_costs = self._shortened(
                seq_length, rows, bin_costs, moved_loads, moved_own
            )

        def ordered(bins: List[List[int]], bin_costs: List[float]) -> List[List[int]]:
            if keep_order:
                return [list(rank) for rank in rank_bins]
            return self._orders(rank_bins, bins, bin_costs)

        orders = ordered(bins, bin_costs)
        step_time = self._step_time(orders, bin_costs)
        if unbalanced is not None:
            own_bins, own_costs, own_length = unbalanced
            own_orders = ordered(own_bins, own_costs)
            own_time = self._step_time(own_orders, own_costs)
            if own_time < step_time * (1.0 - TIE):
                bins, bin_costs, orders, step_time = own_bins, own_costs, own_orders, own_time
                seq_length, final_loads = own_length, loads
        if any(not any(map(bins.__getitem__, rank)) for rank in rank_bins):
            orders, step_time = self._spread(rank_bins, bins, bin_costs, orders, step_time)
        return StepShape(
            per_rank=per_rank,
            seq_length=seq_length,
            micro_batch_size=rows,
            bins=bins,
            rank_orders=orders,
            bin_costs=bin_costs,
            step_time=step_time,
            row_lengths=row_lengths,
            token_loads=list(final_loads) if token_loads else None,
        )

    def _orders(
        self, rank_bins: List[List[int]], bins: List[List[int]], bin_costs: Sequence[float]
    ) -> List[List[int]]:
        if self.pp == 1:
            return rank_bins  # no pipeline: the order of a rank's micro-batches is moot
        # Light-heavy-light by computed cost; among equals, less real work (placeholders) first.
        keys = [(c, len(members)) for c, members in zip(bin_costs, bins, strict=True)]
        return pipeline_orders(
            rank_bins, keys, bin_costs, pp_size=self.pp, vpp_size=self.vpp, group=self.group
        )

    def _spread(
        self,
        rank_bins: List[List[int]],
        bins: List[List[int]],
        bin_costs: Sequence[float],
        orders: List[List[int]],
        step_time: float,
    ) -> Tuple[List[List[int]], float]:
        """Give every DP rank a real micro-batch where the step has one for each.

        Balancing by cost may leave a rank with only placeholders while another holds several
        micro-batches of samples, when both cost the same (a short sample's row is as long as a
        placeholder's): a GPU then idles through the step. Each idle rank swaps a placeholder for
        the cheapest real micro-batch of the rank holding the most; a swap stays unless the
        simulated step gets slower by more than :data:`_SPREAD_TOLERANCE` (the cost model must
        show an idle rank faster to keep one; ``StepPlan.idle_ranks`` reports those kept).
        """
        real = sum(1 for members in bins if members)
        if real < self.dp:
            return orders, step_time
        rank_bins = [list(rank) for rank in rank_bins]
        for idle in range(len(rank_bins)):
            if any(bins[b] for b in rank_bins[idle]):
                continue
            donor = max(
                range(len(rank_bins)), key=lambda r: (sum(1 for b in rank_bins[r] if bins[b]), -r)
            )
            given = min((b for b in rank_bins[donor] if bins[b]), key=lambda b: (bin_costs[b], b))
            taken = rank_bins[idle][0]
            trial = [list(rank) for rank in rank_bins]
            trial[donor][trial[donor].index(given)] = taken
            trial[idle][0] = given
            trial_orders = self._orders(trial, bins, bin_costs)
            trial_time = self._step_time(trial_orders, bin_costs)
            if trial_time <= step_time * (1.0 + _SPREAD_TOLERANCE):
                rank_bins, orders, step_time = trial, trial_orders, trial_time
        return orders, step_time

    def _balance(
        self,
        bins: List[List[int]],
        loads: Sequence[int],
        own: Sequence[float],
        rank_bins: List[List[int]],
        seq_length: int,
        per_rank: int,
        bin_costs: List[float],
    ) -> Tuple[List[float], List[int], List[float]]:
        """Sample moves between ranks (:class:`.balance.RankBalancer`); returns the bins' new
        costs, padded tokens and own costs."""
        problem = self.problem
        tail = tail_cost(self.model, seq_length)
        cap, sizes = problem.cap, problem.sizes
        frozen = [b for b, m in enumerate(bins) if len(m) == 1 and sizes[m[0]] > cap]
        # A lone oversize sample makes S exceed the cap; the other rows still hold at most the cap.
        balancer = RankBalancer(
            bins,
            rank_bins,
            problem.sample_costs,
            sizes,
            min(seq_length, cap),
            tail,
            frozen,
            loads,
            own,
        )
        # Every rank runs per_rank full rows of linear work and overhead besides the variable part.
        full_row = row_cost(self.model, "packed", seq_length, 1, seq_length)
        balancer.refine(base=per_rank * full_row)
        bin_costs = list(bin_costs)
        for b in balancer.changed:
            bin_costs[b] = full_row + tail(balancer.loads[b]) + balancer.own[b]
        return bin_costs, balancer.loads, balancer.own

    def _shortened(
        self,
        seq_length: int,
        rows: int,
        bin_costs: List[float],
        loads: Sequence[int],
        own: Sequence[float],
    ) -> Tuple[int, List[float]]:
        """The row length after sample moves: the fullest bin now (``loads``, aligned as
        before), and the bins' costs at it where it is shorter (rows only as long as the step
        needs, the plan's ``seq_length`` the same as the one scored)."""
        fullest = self._aligned(max(loads, default=0))
        if fullest >= seq_length or fullest < 1:
            return seq_length, bin_costs
        return fullest, row_costs(self.model, self.problem.layout, fullest, rows, loads, own)

    def _aligned(self, length: int) -> int:
        """A packed row of ``length`` rounded up to ``row_align`` where that stays within this
        B's cap (token and memory budgets): the same samples fit."""
        align = self.problem.row_align
        if align and length <= self.cap and round_up(length, align) <= self.cap:
            return round_up(length, align)
        return length

    def rank_makespan(self, order: Sequence[int], bin_costs: Sequence[float]) -> float:
        """One rank's pipeline makespan (``pp`` > 1) with its micro-batches in ``order``."""
        return pipeline_makespan([bin_costs[b] for b in order], self.pp, self.vpp, self.group)

    def _step_time(self, orders: List[List[int]], bin_costs: Sequence[float]) -> float:
        totals = [sum(map(bin_costs.__getitem__, order)) for order in orders]
        if self.pp == 1:
            return (1.0 + BACKWARD_TO_FORWARD_RATIO) * max(totals)
        per_rank = max(1, max(map(len, orders)))
        replayed = max(_SIMULATED_RANKS, _REPLAY_BUDGET // per_rank)
        costliest = sorted(range(len(orders)), key=lambda r: (-totals[r], r))[:replayed]
        return max(self.rank_makespan(orders[r], bin_costs) for r in costliest)


class PackedSearch(ShapeSearch):
    def __init__(self, problem: StepProblem, rows: int = 1) -> None:
        super().__init__(problem)
        # B > 1: rows of at most cap // B, so a micro-batch's footprint B * S stays under the cap
        # (sizes are multiples of the sample multiple, so S, the fullest row, is one too).
        self.rows = rows
        self.cap = _rows_cap(problem, rows)
        sizes, cap = problem.sizes, self.cap
        items = problem.items
        self.longest = max(map(sizes.__getitem__, items))
        assert rows == 1 or self.longest <= cap, "see multi_row_counts"
        if self.longest <= cap:
            self.oversize, self.arrival = [], list(items)
        else:
            self.oversize = [i for i in items if sizes[i] > cap]
            self.arrival = [i for i in items if sizes[i] <= cap]
        # Decreasing size, ties by index (the sort is stable on ascending items).
        self.order = sorted(self.arrival, key=sizes.__getitem__, reverse=True)
        # Their sizes in that order, gathered once: the packers then read them in sequence.
        self.ordered = list(map(sizes.__getitem__, self.order))
        self.total = sum(self.ordered)
        self.longest_regular = self.ordered[0] if self.order else 0
        self._packings = {}
        # B > 1: packed only when asked for (one sample a row needs no fewest count).
        self._min_per_rank = self._fewest() if rows == 1 else None

    @property
    def min_per_rank(self) -> int:
        """The fewest micro-batches per rank the samples pack into (:meth:`_fewest`, cached)."""
        if self._min_per_rank is None:
            self._min_per_rank = self._fewest()
        return self._min_per_rank

    def _bins(self, per_rank: int) -> int:
        return self.dp * per_rank * self.rows - len(self.oversize)

    def _fewest(self) -> int:
        """The fewest micro-batches per rank the samples fit, and their packing (cached)."""
        cap = self.cap
        slots = self.dp * self.rows  # rows per micro-batch count per rank
        # Samples over half the cap cannot share a row: a second, often tighter bound. The order
        # is by decreasing size, so they are its first ``halves`` entries.
        half = cap // 2
        halves = bisect.bisect_left(self.ordered, True, key=half.__ge__)
        bound = len(self.oversize) + max(ceil_div(self.total, cap), halves)
        floor = self.problem.min_count
        per_rank = round_up(max(floor, ceil_div(bound, slots)), self.microbatch_multiple)
        packing = self._pack(per_rank)
        if packing is None:
            need = len(self.oversize) + min_bins(
                self.problem.sizes, self.order, self.arrival, cap, self.ordered
            )
            per_rank = round_up(max(floor, ceil_div(need, slots)), self.microbatch_multiple)
            packing = self._pack(per_rank)
            assert packing is not None, "best fit / next fit pack into the bins they counted"
        return per_rank

    def _pack(self, per_rank: int, limit: Optional[int] = None):
        """The packing of ``per_rank`` micro-batches per rank (cached); with ``limit``, only one
        whose rows stay under it (no next fit, which exists to find the fewest rows)."""
        cap = self.cap
        if limit is not None and limit < cap:
            return feasible_pack(
                self.problem.sizes,
                self.order,
                self.arrival,
                self._bins(per_rank),
                limit,
                False,
                self.ordered,
            )
        if per_rank not in self._packings:
            self._packings[per_rank] = feasible_pack(
                self.problem.sizes,
                self.order,
                self.arrival,
                self._bins(per_rank),
                cap,
                ordered=self.ordered,
            )
        return self._packings[per_rank]

    def candidates(self) -> List[int]:
        first = self.min_per_rank
        if self.oversize or not self.arrival:
            return [first]  # S is the oversize sample's length whatever M is
        last = first
        # Up to where S could reach the longest sample, and no more bins than samples. With one
        # row a step, one count more: whole samples seldom pack to the mean, so S may first
        # reach the longest sample there (174 samples of 11,975 tokens and 138 of 3,291 at dp
        # 24, pp 4, cap 16,384: rows of 13,164 at 9 micro-batches a rank, the longest sample at
        # 10, 2.3% faster; verl's differencing was 1.0% ahead of ours).
        reached = False
        while True:
            nxt = last + self.microbatch_multiple
            if self._bins(nxt) > len(self.arrival):
                break
            if ceil_div(self.total, self._bins(last)) <= self.longest_regular:
                if reached or self.problem.row_multiple is not None:
                    break
                reached = True
            last = nxt
        return _candidate_counts(first, last, self.microbatch_multiple)

    def finer_counts(self, all_counts: bool = False) -> List[int]:
        """Variable rows: the counts from the fewest up to one sample a micro-batch (spread
        geometrically when many, unless ``all_counts``), each a multiple Megatron accepts."""
        first = self.min_per_rank
        multiple = self.microbatch_multiple
        # The most micro-batches per rank that still give each at least one sample.
        most = (len(self.arrival) + len(self.oversize)) // (self.dp * self.rows)
        last = first + max(0, (most - first) // multiple) * multiple
        if all_counts:
            return list(range(first, last + 1, multiple))
        return _candidate_counts(first, last, multiple)

    def one_per_row(self) -> int:
        """The fewest micro-batches per rank that give every sample a row of its own: fixed
        micro-batches' count at this B (their shape, or a shorter S)."""
        return round_up(
            max(1, ceil_div(len(self.arrival), self.dp * self.rows)), self.microbatch_multiple
        )

    def min_row_cost(self, per_rank: int) -> float:
        bins = max(1, self._bins(per_rank))
        if self.problem.row_multiple is not None:
            # Rows of their own length: on average no longer than the mean load.
            s = ceil_div(self.total, bins)
            return row_cost(self.model, "packed", s, 1, s) + self.model.shape_exchange_overhead
        s = max(self.longest, ceil_div(self.total, bins))
        return row_cost(self.model, "packed", s, self.rows, self.rows * s)

    def evaluate(self, per_rank: int, limit: Optional[int] = None) -> Optional[StepShape]:
        packing = self._pack(per_rank, limit)
        if packing is None:
            return None
        if self.rows > 1:
            return self._micro_batches_of_rows(per_rank, packing)
        bins = [[i] for i in self.oversize] + [list(members) for members in packing[0]]
        loads = [self.problem.sizes[i] for i in self.oversize] + list(packing[1])
        shape = self.score(bins, loads, per_rank, max(loads), 1, token_loads=True)
        shape.oversize = self.oversize
        return shape

    def _micro_batches_of_rows(self, per_rank: int, packing) -> StepShape:
        """Deal ``dp * M * B`` packed rows B to a micro-batch, fullest first in rounds, so the
        micro-batches' loads come out even (and empty rows gather in the last ones)."""
        rows, row_loads = packing
        num_bins = self.dp * per_rank
        order = sorted(range(len(rows)), key=lambda r: (-row_loads[r], r))
        packed: List[List[List[int]]] = [[] for _ in range(num_bins)]
        for k, r in enumerate(order):
            packed[k % num_bins].append(sorted(rows[r]))
        bins = [[i for row in mb for i in row] for mb in packed]
        loads = [sum(row_loads[r] for r in order[b::num_bins]) for b in range(num_bins)]
        shape = self.score(bins, loads, per_rank, max(row_loads), self.rows, token_loads=True)
        shape.packed_rows = packed
        return shape

    def score_ranks(
        self, ranks: List[List[List[int]]], per_rank: int, keep_order: bool
    ) -> List[StepShape]:
        """A construction's ``ranks[r][m]`` (one row a bin) scored: reordered for the pipeline,
        and as given where ``keep_order`` (with a pipeline only: without one order is moot)."""
        sizes = self.problem.sizes
        bins = [list(mb) for rank in ranks for mb in rank]
        loads = [sum(map(sizes.__getitem__, mb)) for mb in bins]
        rank_bins = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(len(ranks))]
        shapes = []
        for keep in (False, True) if keep_order and self.pp > 1 else (False,):
            shape = self.score(
                [list(mb) for mb in bins],
                loads,
                per_rank,
                max(loads),
                1,
                [list(rank) for rank in rank_bins],
                token_loads=True,
                keep_order=keep,
            )
            shapes.append(shape)
        return shapes

    def alternative(self, per_rank: int) -> Optional[StepShape]:
        """Ranks-first packing where attention or response work makes ranks differ, on steps
        small enough that a second construction is cheap (where sample moves have few samples per
        rank to work with, it matters most). Not at dp 1 with variable rows: one rank has no
        peer to balance against and each micro-batch has its own row, so re-packing the rank's
        samples never gave a faster step (1,000 random dp-1 steps, pp 1-4: not one), and it was
        half the planning time of a 316-document step. With one row a step it may still find a
        shorter row."""
        if self.dp == 1 and self.problem.row_multiple is not None:
            return None
        if self.varies and len(self.problem.items) <= _ALTERNATIVE_LIMIT:
            return self._ranks_first(per_rank)
        return None

    def _ranks_first(self, per_rank: int) -> Optional[StepShape]:
        """The other way round: samples to ranks by their own cost, then each rank into rows.

        Global packing fixes S first and leaves the ranks' attention to sample moves, which cannot
        trade one long sample for several short ones; splitting the samples over the ranks by
        their whole cost (LPT) and packing each rank's into ``per_rank`` rows (LPT, or
        differencing when small) balances attention by construction, at the price of a slightly
        longer S. Scored like the global packing; ``None`` if a rank breaks the cap.
        """
        problem = self.problem
        if self.oversize or not self.arrival or self.rows > 1:
            return None
        sizes, model = problem.sizes, self.model
        own = [model.token_weight * sizes[i] + problem.sample_costs[i] for i in self.order]
        heap = [(0.0, r) for r in range(self.dp)]
        members: List[List[int]] = [[] for _ in range(self.dp)]
        for i, weight in sorted(zip(self.order, own, strict=True), key=lambda pair: -pair[1]):
            total, r = heap[0]
            members[r].append(i)
            heapq.heapreplace(heap, (total + weight, r))
        bins: List[List[int]] = []
        loads: List[int] = []
        rank_bins: List[List[int]] = []
        for rank in members:
            rank.sort(key=lambda i: (-sizes[i], i))
            packing = feasible_pack(sizes, rank, sorted(rank), per_rank, problem.cap)
            if packing is None:
                return None
            rank_bins.append(list(range(len(bins), len(bins) + per_rank)))
            bins += packing[0]
            loads += packing[1]
        return self.score(bins, loads, per_rank, max(loads), 1, rank_bins, token_loads=True)


class PaddedSearch(ShapeSearch):
    def __init__(self, problem: StepProblem) -> None:
        super().__init__(problem)
        sizes = problem.sizes
        self.n = len(problem.items)
        self.seq_length = max(sizes[i] for i in problem.items)
        self.rows_max = max(1, _footprint_cap(problem) // self.seq_length)
        if problem.memory is not None and self.rows_max > 1:
            # As many rows as the memory budget holds at this S (at least one: a longer sample
            # is an oversize sample, alone).
            self.rows_max = max(1, problem.memory.most_rows(self.seq_length, self.rows_max))
        self.min_per_rank = self._per_rank_for_rows(self.rows_max)
        key = problem.sample_costs if problem.model.response_weight else sizes
        self.order = sorted(problem.items, key=lambda i: (-key[i], i))

    def _per_rank_for_rows(self, rows: int) -> int:
        per_rank = max(self.problem.min_count, ceil_div(ceil_div(self.n, rows), self.dp))
        return round_up(per_rank, self.microbatch_multiple)

    def _rows(self, per_rank: int) -> int:
        return max(1, ceil_div(self.n, self.dp * per_rank))

    def alternative(self, per_rank: int) -> Optional[StepShape]:
        return None

    def candidates(self) -> List[int]:
        counts = sorted({self._per_rank_for_rows(rows) for rows in range(1, self.rows_max + 1)})
        counts = [m for m in counts if m >= self.min_per_rank]
        if len(counts) > _MAX_CANDIDATES:
            step = len(counts) / _MAX_CANDIDATES
            counts = sorted({counts[int(k * step)] for k in range(_MAX_CANDIDATES)} | {counts[-1]})
        return counts

    def min_row_cost(self, per_rank: int) -> float:
        return row_cost(self.model, "padded", self.seq_length, self._rows(per_rank), 0)

    def evaluate(self, per_rank: int, limit: Optional[int] = None) -> Optional[StepShape]:
        rows = self._rows(per_rank)
        num_bins = self.dp * per_rank
        bins: List[List[int]] = [[] for _ in range(num_bins)]
        # Rows dealt in rounds, the costliest samples first, so every bin holds at most `rows`
        # and the response work spreads evenly.
        for k, i in enumerate(self.order):
            bins[k % num_bins].append(i)
        loads = [len(members) for members in bins]
        shape = self.score(bins, loads, per_rank, self.seq_length, rows)
        # An oversize sample makes S exceed the cap, so B is 1 and it is alone in its row.
        shape.oversize = [i for i in self.problem.items if self.problem.sizes[i] > self.problem.cap]
        return shape
