"""One checker for every guarantee a plan makes; tests run it over every input family.

It re-derives everything from the inputs, trusting nothing the planner reports, so it also guards a
plan read back from JSON or produced by another scheduler. Each guarantee is one helper that returns
the problems it finds, every message with the values involved.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import Counter
from operator import itemgetter
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from megatron_dynbatch.errors import DynBatchError, DynBatchValueError

from .plan import Plan, ShardedPlan, StepPlan
from .samples import SampleSet
from .schedule import Schedule, ScheduledStep
from .spec import PlannerConfig, ceil_div, require_config, round_up

__all__ = ["PlanInvariantError", "check_plan"]

#: Indices listed in a message before the rest are elided.
_LISTED = 20


class PlanInvariantError(DynBatchError, AssertionError):
    """A plan breaks one of its guarantees (a planner bug, never a user error)."""


def check_plan(
    plan: Union[Plan, ShardedPlan, Schedule],
    samples: Union[SampleSet, Sequence[Sequence[int]]],
    config: PlannerConfig,
    *,
    placeholder_row_tokens: int = 0,
) -> None:
    """Raise :class:`PlanInvariantError` listing every broken guarantee of ``plan``.

    One walk over the :class:`~.schedule.Schedule` view checks what every plan kind guarantees
    (:func:`_walk`: every sample once, one count on every rank aligned to the interleaving group,
    every micro-batch within its row and the cap); a :class:`Plan` then has its own checks
    (:func:`_plan_only`: rollouts, truncation, shapes, statistics), a :class:`ShardedPlan` its
    own (:func:`_sharded_only`: rows, real micro-batches first, oversize reported).

    Args:
        plan: A :class:`Plan` (samples go to any DP rank), a :class:`ShardedPlan` (each DP rank's
            own samples, for trainers that shard before we plan), or any other
            :class:`~.schedule.Schedule` (slime's ``DPSchedule``).
        samples: The plan's samples: a :class:`SampleSet`, or for a :class:`ShardedPlan` every
            rank's lengths (``samples[r][i]``: sample ``i`` of DP rank ``r``).
        config: The planner config it was planned with (``dp_size=1`` for a sharded plan).
        placeholder_row_tokens: Sharded plans only: tokens of one placeholder row that the host
            adds to a micro-batch with fewer than ``plan.rows`` samples (SkyRL: one attended token,
            padded to the sample multiple); 0 when placeholders are whole micro-batches.
    """
    if not isinstance(plan, Schedule):
        raise PlanInvariantError(
            f"{type(plan).__name__} is not a plan: it implements no scheduled_steps()."
        )
    require_config(config, "check_plan")
    if isinstance(plan, Plan) and not isinstance(samples, SampleSet):
        raise DynBatchValueError(
            f"check_plan: samples must be the SampleSet the Plan was planned from, got "
            f"{type(samples).__name__}; pass SampleSet.build(lengths, rollout_ids, prompts)."
        )
    problems: List[str] = []
    try:
        cp = config.parallel.cp_size
        steps = tuple(step.whole_rows(cp) for step in plan.scheduled_steps())
    except AssertionError as error:  # a step of unequal counts, which ScheduledStep refuses
        steps = ()
        problems.append(f"scheduled_steps() refused: {error}")
    sharded = isinstance(plan, ShardedPlan)
    # A Plan's sizes, sample sets and micro-batch tokens are gathered once for both passes.
    facts = _Facts(plan, samples, config) if isinstance(plan, Plan) else None
    problems += _walk(
        steps,
        samples,
        config,
        sharded=sharded,
        row_tokens=placeholder_row_tokens,
        # A Plan's rows are checked in full by _plan_only (its shapes and the planner's rounding).
        row_widths=not isinstance(plan, Plan),
        facts=facts,
    )
    if facts is not None:
        problems += _plan_only(plan, samples, config, facts)
    elif sharded:
        problems += _sharded_only(plan, samples, config)
    if problems:
        name = {Plan: "plan", ShardedPlan: "sharded plan"}.get(type(plan), type(plan).__name__)
        raise PlanInvariantError(f"{name} breaks its guarantees:\n  " + "\n  ".join(problems))


def _plan_only(plan: Plan, samples: SampleSet, config: PlannerConfig, facts: "_Facts") -> List[str]:
    """What a :class:`Plan` guarantees besides :func:`_walk`: whole rollouts in order, truncation
    by the policy only, its reported counts, shapes and oversize samples, its statistics."""
    lengths, sizes, indices = facts.lengths, facts.sizes, facts.members
    longest = max(sizes, default=0)
    in_range, once = facts.in_range, facts.once
    problems: List[str] = []
    problems += _whole_rollouts_in_order(plan, indices, samples, config, once_each=once)
    problems += _truncation(plan, samples, config)
    for s, step in enumerate(plan.steps):
        where = f"step {s}"
        problems += _equal_valid_counts(where, step, config)
        problems += _shape_and_cap(
            where,
            step,
            indices[s],
            plan.layout,
            sizes,
            config,
            in_range=in_range,
            longest=longest,
            tokens=functools.partial(facts.tokens, s) if in_range else None,
        )
        problems += _step_counts(where, step, sizes, config)
        if once:
            # The samples' tokens, whoever counted them: one step of every sample adds them all.
            tokens = (
                sum(lengths) if len(plan.steps) == 1 else sum(map(lengths.__getitem__, indices[s]))
            )
            if step.real_tokens != tokens:
                problems.append(
                    f"{where}: real_tokens={step.real_tokens}, its samples hold {tokens}"
                )
    problems += _stats_add_up(plan, sizes, config)
    return problems


class _Facts:
    """What both passes over a :class:`Plan` read, derived once from the inputs: every sample's
    kept length and padded size, every step's sample indices, whether they are all ints in range
    and name every sample exactly once, and (cached) every micro-batch's padded tokens."""

    def __init__(self, plan: Plan, samples: SampleSet, config: PlannerConfig) -> None:
        kept = plan.kept_lengths()
        lengths = samples.lengths
        if kept:
            lengths = [kept.get(i, length) for i, length in enumerate(lengths)]
        self.lengths = lengths
        self.sizes = _padded(lengths, config.parallel.sample_multiple)
        chain = itertools.chain.from_iterable
        self.members = [list(chain(chain(step.ranks))) for step in plan.steps]
        flat = self.members[0] if len(self.members) == 1 else list(chain(self.members))
        n = len(self.sizes)
        # Plain ints in range (the usual case): the checks may index ``sizes`` directly; any
        # other index makes them take the careful way (the walk reports it).
        self.in_range = _in_range(flat, n)
        # Every sample exactly once (n distinct indices in [0, n)); the walk reports otherwise.
        self.once = self.in_range and len(flat) == n and len(set(flat)) == n
        self._ranks = [step.ranks for step in plan.steps]
        self._tokens: Dict[Tuple[int, int], List[int]] = {}

    def tokens(self, s: int, r: int) -> List[int]:
        """The padded tokens of every micro-batch of rank ``r`` in step ``s`` (indices in range:
        the walk and the shape check both read them, summed once)."""
        key = (s, r)
        found = self._tokens.get(key)
        if found is None:
            found = self._tokens[key] = _mb_tokens(self._ranks[s][r], self.sizes)
        return found


def _mb_tokens(rank: Sequence[Sequence[int]], sizes: Sequence[int]) -> List[int]:
    """Every micro-batch's padded tokens (indices in range): one C-level gather and sum a
    micro-batch, a lone sample read directly."""
    return [
        sum(itemgetter(*mb)(sizes)) if len(mb) > 1 else sizes[mb[0]] if mb else 0 for mb in rank
    ]


def _whole_rollouts_in_order(
    plan: Plan,
    indices: Sequence[Sequence[int]],
    samples: SampleSet,
    config: PlannerConfig,
    once_each: bool = False,
) -> List[str]:
    """Whole rollouts, in order of first appearance, ``rollouts_per_step`` per step.

    ``once_each``: every sample is in the plan exactly once (the caller checked)."""
    if (
        once_each
        and len(plan.steps) == 1
        and (
            not config.rollouts_per_step
            or config.rollouts_per_step >= len(set(samples.rollout_keys))
        )
    ):
        return []  # one step expected, holding every sample once: every rollout whole in it
    rollouts = samples.rollouts()
    per_step = config.rollouts_per_step or len(rollouts)
    expected = ceil_div(len(rollouts), per_step)
    problems = []
    if len(plan.steps) != expected:
        problems.append(
            f"{len(plan.steps)} steps, expected {expected} ({len(rollouts)} rollouts, "
            f"{per_step} per step)"
        )
    if once_each and len(plan.steps) == expected:
        # Each sample once (checked): every rollout is whole and in its step exactly when each
        # step holds the samples of its rollouts (sorted lists compared in C).
        members = [m for _, m in rollouts]
        if all(
            sorted(step_indices)
            == sorted(itertools.chain.from_iterable(members[s * per_step : (s + 1) * per_step]))
            for s, step_indices in enumerate(indices)
        ):
            return problems
    step_of: Dict[int, int] = {}
    for s, step_indices in enumerate(indices):
        step_of.update(dict.fromkeys(step_indices, s))
    lookup = step_of.get
    for r, (rollout, members) in enumerate(rollouts):
        if len(set(map(lookup, members))) == 1 and lookup(members[0]) == r // per_step:
            continue  # the usual case, without the message's string work
        got = sorted({str(step_of.get(i)) for i in members})
        if got != [str(r // per_step)]:
            problems.append(
                f"rollout #{r} (id {rollout!r}, samples {members[:8]}) is in steps {got}, "
                f"expected {r // per_step}"
            )
    return problems


def _truncation(plan: Plan, samples: SampleSet, config: PlannerConfig) -> List[str]:
    """Only the ``truncate`` policy cuts, only oversize samples, to the cap rounded down."""
    kept = plan.kept_lengths()
    if not kept:
        return []
    if config.oversize_samples != "truncate":
        return [
            f"samples {sorted(kept)[:_LISTED]} cut under oversize_samples="
            f"{config.oversize_samples!r}"
        ]
    multiple = config.parallel.sample_multiple
    keep = config.longest_fitting
    return [
        f"sample {i}: kept {k} of {samples.lengths[i]} tokens, expected {keep} (the cap "
        f"{config.token_cap} rounded down to {multiple}) and only for a sample over it"
        for i, k in sorted(kept.items())
        if k != keep or round_up(samples.lengths[i], multiple) <= config.token_cap
    ]


def _equal_valid_counts(where: str, step: StepPlan, config: PlannerConfig) -> List[str]:
    """Every rank the same count, >= 1 and a multiple of the interleaving group."""
    parallel = config.parallel
    m = step.num_microbatches
    problems = []
    if len(step.ranks) != parallel.dp_size:
        problems.append(f"{where}: {len(step.ranks)} ranks, expected dp_size={parallel.dp_size}")
    if m < 1:
        problems.append(f"{where}: num_microbatches={m} < 1")
    if m % parallel.microbatch_multiple:
        problems.append(
            f"{where}: num_microbatches={m} is not a multiple of {parallel.microbatch_multiple} "
            f"(microbatch_group_size_per_vp_stage with vpp_size={parallel.vpp_size})"
        )
    for r, rank in enumerate(step.ranks):
        if len(rank) != m:
            problems.append(f"{where}: rank {r} has {len(rank)} micro-batches, expected {m}")
    return problems


def _shape_and_cap(
    where: str,
    step: StepPlan,
    indices: Sequence[int],
    layout: str,
    sizes: Sequence[int],
    config: PlannerConfig,
    *,
    in_range: bool = False,
    longest: Optional[int] = None,
    tokens: Optional[Callable[[int], List[int]]] = None,
) -> List[str]:
    """Every micro-batch fits the step's shape and the cap; only a lone oversize sample exceeds it.

    ``in_range``: every index of the plan is an int in ``[0, len(sizes))`` (the caller checked).
    ``longest``: the largest of ``sizes``, where the caller has it. ``tokens``: rank -> its
    micro-batches' padded tokens, where the caller has them.
    """
    if longest is None:
        longest = max(sizes, default=0)
    cap, multiple = config.token_cap, config.parallel.sample_multiple
    s, b = step.seq_length, step.micro_batch_size
    n = len(sizes)
    problems = []
    if in_range and (not indices or longest <= cap or max(map(sizes.__getitem__, indices)) <= cap):
        oversize = []
    else:
        oversize = sorted(i for i in indices if 0 <= i < n and sizes[i] > cap)
    if sorted(step.oversize_samples) != oversize:
        problems.append(
            f"{where}: reported oversize {list(step.oversize_samples)}, actual {oversize}"
        )
    if s % multiple:
        problems.append(f"{where}: seq_length={s} is not a multiple of {multiple}")
    if b > 1 and config.memory is not None:
        # A memory budget bounds B > 1 rows by what they hold, within the token budget.
        cap = config.multi_row_cap
        if not config.memory.fits((b, s)):
            problems.append(f"{where}: [{b}x{s}] micro-batches exceed the memory budget")
    if layout == "packed":
        problems += _packed_rows_shape(where, step)
        if b * s > cap and not (oversize and b == 1):
            problems.append(
                f"{where}: packed footprint {b}x{s}={b * s} exceeds the cap {cap}"
                + ("" if b > 1 else " with no oversize sample")
            )
    elif b * s > cap and not (oversize and b == 1):
        problems.append(f"{where}: padded footprint {b}x{s}={b * s} exceeds the cap {cap}")
    if step.row_lengths and [len(rows) for rows in step.row_lengths] != [
        len(rank) for rank in step.ranks
    ]:
        problems.append(f"{where}: row_lengths do not match the micro-batches of every rank")
        return problems
    # Variable rows: a placeholder reuses a real row's length or runs the shortest row the layout
    # allows, one variable-row multiple (the cheapest whole row; shapes are exchanged per
    # micro-batch anyway); where that multiple is over the cap, the shortest real row within it,
    # else the cap rounded down to the sample multiple. Never over the cap.
    real_rows = {
        step.row_lengths[q][j]
        for q, other in enumerate(step.ranks)
        for j, members in enumerate(other)
        if members and step.row_lengths
    }
    if real_rows:
        within = {row for row in real_rows if row <= cap}
        shortest = max(multiple, cap // multiple * multiple)
        if config.variable_row_lengths and config.variable_row_multiple <= cap:
            shortest = config.variable_row_multiple
        elif within:
            shortest = min(within)
        real_rows = within | {shortest}
    size_of = sizes.__getitem__
    if layout == "packed" and in_range and not step.packed_rows:
        if tokens is None:
            tokens = functools.partial(_rank_tokens, step, sizes)
        if _packed_rows_fit(step, tokens, min(s, cap), multiple, real_rows):
            return problems  # nothing the loop below could report
    for r, rank in enumerate(step.ranks):
        for k, mb in enumerate(rank):
            mb_sizes = list(map(size_of, mb)) if in_range else [sizes[i] for i in mb if 0 <= i < n]
            label = _Label(where, r, k, mb)
            if layout == "packed":
                footprint = sum(mb_sizes)
                # One row a micro-batch (no packed_rows): its samples are the row.
                row_list = _row_sizes(step, r, k, mb, sizes) if step.packed_rows else [mb_sizes]
                for row, row_sizes in enumerate(row_list):
                    if sum(row_sizes) > s:
                        problems.append(
                            f"{label} row {row}: {sum(row_sizes)} padded tokens exceed "
                            f"seq_length={s}"
                        )
                if step.row_lengths:
                    row = step.row_lengths[r][k]
                    if not footprint <= row <= s or row % multiple:
                        problems.append(
                            f"{label}: row length {row} is not a multiple of {multiple} between "
                            f"its {footprint} padded tokens and seq_length={s}"
                        )
                    if not mb and real_rows and row not in real_rows:
                        problems.append(
                            f"{label}: placeholder row {row} is neither a real row's length nor "
                            "the shortest row"
                        )
                if footprint > cap and len(mb) != 1:
                    problems.append(f"{label}: {footprint} padded tokens exceed the cap {cap}")
            else:
                if len(mb) > b:
                    problems.append(f"{label}: {len(mb)} samples exceed micro_batch_size={b}")
                if mb_sizes and max(mb_sizes) > s:
                    problems.append(f"{label}: a sample of {max(mb_sizes)} > seq_length={s}")
    return problems


def _packed_rows_fit(
    step: StepPlan,
    tokens: Callable[[int], List[int]],
    limit: int,
    multiple: int,
    real_rows: Set[int],
) -> bool:
    """One packed row a micro-batch, indices in range: whether every micro-batch is within
    ``limit`` (the shape's row and the cap) and every row length valid, as whole-list
    comparisons (C loops). ``tokens``: rank -> its micro-batches' padded tokens. ``False`` says
    only that the per-micro-batch loop must look."""
    for r, rank in enumerate(step.ranks):
        footprints = tokens(r)
        if footprints and max(footprints) > limit:
            return False
        if not step.row_lengths:
            continue
        rows = step.row_lengths[r]
        if rows and (
            max(rows) > step.seq_length
            or any(map(multiple.__rmod__, rows))
            or not all(map(operator.le, footprints, rows))
        ):
            return False
        if real_rows and not real_rows.issuperset(
            itertools.compress(rows, map(operator.not_, rank))
        ):
            return False
    return True


class _Label:
    """``step s rank r micro-batch k [first indices]``, formatted only into a message (a plan
    has hundreds of thousands of micro-batches and usually no problem)."""

    __slots__ = ("where", "r", "k", "mb")

    def __init__(self, where: str, r: int, k: int, mb: Sequence[int]) -> None:
        self.where, self.r, self.k, self.mb = where, r, k, mb

    def __format__(self, spec: str) -> str:
        return format(f"{self.where} rank {self.r} micro-batch {self.k} {list(self.mb)[:8]}", spec)


def _rank_tokens(step: StepPlan, sizes: Sequence[int], r: int) -> List[int]:
    return _mb_tokens(step.ranks[r], sizes)


def _packed_rows_shape(where: str, step: StepPlan) -> List[str]:
    """``packed_rows`` exactly when ``B > 1``: B row counts per micro-batch adding up to it."""
    b, packed = step.micro_batch_size, step.packed_rows
    if b == 1:
        return [f"{where}: packed_rows given with micro_batch_size=1"] if packed else []
    if not packed:
        return [f"{where}: packed layout with micro_batch_size={b} and no packed_rows"]
    if len(packed) != len(step.ranks):
        return [f"{where}: packed_rows has {len(packed)} ranks, the step {len(step.ranks)}"]
    problems = []
    for r, (counts, rank) in enumerate(zip(packed, step.ranks, strict=True)):
        if len(counts) != len(rank):
            problems.append(
                f"{where} rank {r}: {len(counts)} packed_rows, {len(rank)} micro-batches"
            )
            continue
        for k, (row_counts, mb) in enumerate(zip(counts, rank, strict=True)):
            if len(row_counts) != b or sum(row_counts) != len(mb) or min(row_counts) < 0:
                problems.append(
                    f"{where} rank {r} micro-batch {k}: packed_rows {list(row_counts)} do not "
                    f"split its {len(mb)} samples into micro_batch_size={b} rows"
                )
    return problems


def _row_sizes(
    step: StepPlan, r: int, k: int, mb: Sequence[int], sizes: Sequence[int]
) -> List[List[int]]:
    """The padded sizes of every packed row of micro-batch ``k`` of rank ``r`` (one row without
    ``packed_rows``, or where they are malformed: :func:`_packed_rows_shape` reports that)."""
    n = len(sizes)
    counts = (len(mb),)
    if step.packed_rows and r < len(step.packed_rows) and k < len(step.packed_rows[r]):
        if sum(step.packed_rows[r][k]) == len(mb):
            counts = step.packed_rows[r][k]
    rows, start = [], 0
    for count in counts:
        rows.append([sizes[i] for i in mb[start : start + count] if 0 <= i < n])
        start += count
    return rows


def _step_counts(
    where: str, step: StepPlan, sizes: Sequence[int], config: PlannerConfig
) -> List[str]:
    """Placeholders counted right; real micro-batches not below the lower bound."""
    problems = []
    placeholders = sum(1 for rank in step.ranks for mb in rank if not mb)
    if placeholders != step.num_placeholders:
        problems.append(
            f"{where}: num_placeholders={step.num_placeholders}, counted {placeholders}"
        )
    real = config.parallel.dp_size * step.num_microbatches - placeholders
    if real < step.lower_bound_microbatches:
        problems.append(
            f"{where}: {real} real micro-batches, below the lower bound "
            f"{step.lower_bound_microbatches}"
        )
    if step.min_microbatches > step.num_microbatches:
        problems.append(
            f"{where}: min_microbatches={step.min_microbatches} > num_microbatches="
            f"{step.num_microbatches}"
        )
    return problems


def _stats_add_up(plan: Plan, sizes: Sequence[int], config: PlannerConfig) -> List[str]:
    stats, steps = plan.stats, plan.steps
    dp, cap, n = config.parallel.dp_size, config.token_cap, len(sizes)
    problems = []
    if stats.num_samples != n:
        problems.append(f"stats.num_samples={stats.num_samples}, expected {n}")
    placeholders = sum(s.num_placeholders for s in steps)
    if stats.num_placeholders != placeholders:
        problems.append(
            f"stats.num_placeholders={stats.num_placeholders}, steps add to {placeholders}"
        )
    microbatches = sum(dp * s.num_microbatches for s in steps)
    if stats.num_microbatches != microbatches:
        problems.append(f"stats.num_microbatches={stats.num_microbatches}, expected {microbatches}")
    oversize = [] if not sizes or max(sizes) <= cap else [i for i in range(n) if sizes[i] > cap]
    if sorted(stats.oversize_samples) != oversize:
        problems.append(
            f"stats.oversize_samples={list(stats.oversize_samples)[:_LISTED]} is not exactly the "
            f"samples over the cap {oversize[:_LISTED]}"
        )
    if not 0 < stats.fill <= 1:
        problems.append(f"stats.fill={stats.fill} outside (0, 1]")
    return problems


def _sharded_only(
    plan: ShardedPlan, lengths_per_rank: Sequence[Sequence[int]], config: PlannerConfig
) -> List[str]:
    """What a :class:`ShardedPlan` guarantees besides :func:`_walk`: no rank holds more real
    micro-batches than the count, real micro-batches (never empty) come first, ``rows`` is the
    fullest micro-batch, and the oversize samples are reported exactly."""
    cap, multiple = config.token_cap, config.parallel.sample_multiple
    m = plan.num_microbatches
    problems = []
    fullest = max([len(mb) for rank in plan.ranks for mb in rank] or [1])
    if plan.rows != fullest:
        problems.append(f"rows={plan.rows}, the fullest micro-batch holds {fullest}")
    for r, rank in enumerate(plan.ranks):
        if len(rank) > m:
            problems.append(f"rank {r}: {len(rank)} real micro-batches > num_microbatches={m}")
        problems += [
            f"rank {r} micro-batch {k}: empty (placeholders follow the real)"
            for k, mb in enumerate(rank)
            if not mb
        ]
    oversize = [
        (r, i)
        for r, lengths in enumerate(lengths_per_rank)
        for i, n in enumerate(lengths)
        if round_up(n, multiple) > cap
    ]
    if sorted(plan.oversize) != oversize:
        problems.append(
            f"reported oversize {list(plan.oversize)[:_LISTED]}, actual {oversize[:_LISTED]}"
        )
    return problems


def _walk(
    steps: Tuple[ScheduledStep, ...],
    samples: Union[SampleSet, Sequence[Sequence[int]]],
    config: PlannerConfig,
    *,
    sharded: bool,
    row_tokens: int = 0,
    row_widths: bool = True,
    facts: Optional[_Facts] = None,
) -> List[str]:
    """The guarantees every plan kind makes, read through the :class:`~.schedule.Schedule` view.

    Every sample once over all steps (a sharded plan: each rank's own samples, on their rank);
    per step one count on every rank (``dp_size`` ranks, or one a shard; >= 1, a multiple of the
    interleaving group); every micro-batch's padded samples within its row (``B`` rows of it),
    and every micro-batch within the cap, placeholder rows included (``row_tokens`` each, added
    to a sharded micro-batch below ``B`` samples), unless it holds one sample; with
    ``row_widths``, no row wider than the cap or its step's longest sample. ``facts``: a Plan's
    sizes, sample sets and micro-batch tokens, gathered once (:class:`_Facts`).
    """
    token_cap, multiple = config.token_cap, config.parallel.sample_multiple
    group = config.parallel.microbatch_multiple
    if sharded:
        per_rank = [_padded(lengths, multiple) for lengths in samples]
        dp = len(per_rank)
    elif facts is not None:
        per_rank = [facts.sizes]
        dp = config.parallel.dp_size
    else:
        kept = {i: k for step in steps for i, k in step.kept_lengths}
        lengths = samples.lengths
        if kept:
            lengths = [kept.get(i, n) for i, n in enumerate(lengths)]
        per_rank = [_padded(lengths, multiple)]
        dp = config.parallel.dp_size
    # A Plan known to hold every sample once (n distinct indices in range) needs no counting.
    counted = facts is None or not facts.once
    seen: List[Counter] = [Counter() for _ in per_rank]
    problems: List[str] = []
    for s, step in enumerate(steps):
        where = f"step {s}"
        counts = sorted({len(rank) for rank in step.ranks})
        m, b = step.num_microbatches, step.micro_batch_size
        # A memory budget bounds B > 1 planned rows by what they hold, within the token budget.
        cap = token_cap if sharded or b == 1 or config.memory is None else config.multi_row_cap
        if len(step.ranks) != dp:
            problems.append(f"{where}: {len(step.ranks)} ranks, expected {dp}")
        if counts != [m] or m < 1 or m % group:
            problems.append(
                f"{where}: micro-batch counts {counts} are not one positive multiple of {group} "
                "(the interleaving group)"
            )
        widest = 0
        if row_widths and not sharded:
            # A sample over the cap runs alone and may widen every row of its step to its size.
            widest = max([cap] + [per_rank[0][i] for i in _known(step, len(per_rank[0]))])
        if not sharded:
            # One sample set for the whole step: gathered, counted and range-checked once, not
            # once a rank (at 1M samples and dp 512 the per-rank passes cost about a second).
            if facts is not None and s < len(facts.members):
                members = facts.members[s]
                step_fast = facts.in_range
            else:
                chain = itertools.chain.from_iterable
                members = list(chain(chain(step.ranks)))
                step_fast = _in_range(members, len(per_rank[0]))
            if counted:
                seen[0].update(members)
        for r, rank in enumerate(step.ranks):
            q = r if sharded else 0
            if q >= len(per_rank):
                continue  # a rank without lengths (reported above)
            sizes = per_rank[q]
            n = len(sizes)
            if sharded:
                members = list(itertools.chain.from_iterable(rank))
                seen[q].update(members)
                fast = _in_range(members, n)
            else:
                fast = step_fast
            size_of = sizes.__getitem__
            if fast:
                shared = facts is not None and s < len(facts.members)
                tokens = facts.tokens(s, r) if shared else _mb_tokens(rank, sizes)
            if fast and _rank_fits(step, r, rank, tokens, cap, widest, row_tokens):
                continue  # nothing the loop below could report
            for k, mb in enumerate(rank):
                if fast:
                    tokens = sum(map(size_of, mb))
                else:
                    tokens = sum(size_of(i) for i in mb if isinstance(i, int) and 0 <= i < n)
                footprint = tokens + (b - len(mb)) * row_tokens if mb else tokens
                row = _row(step, r, k)
                if row is not None and tokens > row * b:
                    problems.append(
                        f"{where} rank {r} micro-batch {k} {list(mb)[:8]}: {tokens} tokens do "
                        f"not fit its row of {row} x {b}"
                    )
                if (footprint > cap and len(mb) != 1) or (widest and (row or 0) > widest):
                    problems.append(
                        f"{where} rank {r} micro-batch {k} {list(mb)[:8]}: {footprint} tokens "
                        + (f"in a row of {row} " if row is not None else "")
                        + f"exceed the cap {cap}"
                    )
    for q, (sizes, counter) in enumerate(zip(per_rank, seen, strict=True)):
        n = len(sizes)
        if not counted:
            continue  # every sample once (the Plan's facts)
        if len(counter) == n == sum(counter.values()) and _in_range(counter, n):
            continue  # n distinct indices in [0, n), each once
        missing = [i for i in range(n) if i not in counter]
        extra = sorted(
            (i for i, c in counter.items() if c > 1 or not (isinstance(i, int) and 0 <= i < n)),
            key=repr,
        )
        if missing or extra:
            problems.append(
                (f"rank {q}: " if sharded else "")
                + f"samples never scheduled {missing[:_LISTED]} ({len(missing)} in all), "
                f"scheduled more than once or unknown {extra[:_LISTED]}"
            )
    return problems


def _rank_fits(
    step: ScheduledStep,
    r: int,
    rank,
    tokens: List[int],
    cap: int,
    widest: int,
    row_tokens: int,
) -> bool:
    """Indices in range: whether every micro-batch of rank ``r`` (``tokens``: their padded
    tokens, :func:`_mb_tokens`) fits its row, the cap (or holds one sample) and ``widest``, as
    whole-list comparisons (no per-micro-batch call). ``False`` says only that the
    per-micro-batch loop of :func:`_walk` must look."""
    b = step.micro_batch_size
    footprints = tokens
    if row_tokens and b > 1:
        # Placeholder rows a sharded host adds to a micro-batch below B samples count too.
        footprints = [
            t + (b - n) * row_tokens if n else t
            for t, n in zip(tokens, map(len, rank), strict=True)
        ]
    if (
        footprints
        and max(footprints) > cap
        and any(f > cap and len(mb) != 1 for f, mb in zip(footprints, rank, strict=True))
    ):
        return False
    if step.row_lengths:
        if r >= len(step.row_lengths) or len(step.row_lengths[r]) != len(rank):
            return False
        rows = step.row_lengths[r]
    elif step.seq_length is not None:
        rows = [step.seq_length] * len(rank)
    else:
        return True  # rows sized from the samples (a sharded plan)
    if b == 1:
        if not all(map(operator.le, tokens, rows)):
            return False
    elif any(t > row * b for t, row in zip(tokens, rows, strict=True)):
        return False
    return not (widest and max(rows, default=0) > widest)


def _row(step: ScheduledStep, r: int, k: int) -> Optional[int]:
    """The row micro-batch ``k`` of rank ``r`` runs; None where the plan gives none (or gives
    ``row_lengths`` of the wrong shape, which the Plan-only checks report)."""
    if step.row_lengths and not (r < len(step.row_lengths) and k < len(step.row_lengths[r])):
        return None
    return step.row_length(r, k)


def _padded(lengths: Sequence[int], multiple: int) -> List[int]:
    """Every length rounded up to ``multiple``."""
    return list(lengths) if multiple == 1 else [-(-n // multiple) * multiple for n in lengths]


def _in_range(indices, n: int) -> bool:
    """Whether every index is an int in ``[0, n)``."""
    return not indices or (
        set(map(type, indices)) == {int} and min(indices) >= 0 and max(indices) < n
    )


def _known(step: ScheduledStep, n: int) -> List[int]:
    """The step's sample indices that name a sample (ints in ``[0, n)``)."""
    chain = itertools.chain.from_iterable
    return [i for i in chain(chain(step.ranks)) if isinstance(i, int) and 0 <= i < n]
