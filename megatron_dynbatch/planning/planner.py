"""The global dynamic-batch planner: sample lengths in, one schedule for every step and DP rank out.

Every rank calls :func:`.registry.plan_schedule` (which runs :func:`plan_samples` unless the config
names another planner) on the same global inputs and derives the same plan with no collective: the
constraints all ranks must share (dp_size, the interleaving group) are arguments.

Per step the planner

1. takes the next ``rollouts_per_step`` rollouts (whole rollouts only, in order of first appearance;
   a short last step is trained, not dropped);
2. applies the oversize policy to samples longer than the cap (run alone, cut, or refuse);
3. chooses the micro-batch count M per rank (a count Megatron accepts: a multiple of
   ``microbatch_group_size_per_vp_stage`` when interleaving), the rows per micro-batch B and the
   row length S together, by the simulated pipeline step time of each candidate (:mod:`.shape`):
   the fewest micro-batches the samples fit under the cap, or more and shorter rows where the
   pipeline bubble makes them faster, or B > 1 packed rows where attention pays S^2 a row;
4. spreads the micro-batches over the ranks and balances the ranks sample by sample on the full
   micro-batch cost (:mod:`.cost`); micro-batches that find no samples become placeholders (never
   dropped, never absent);
5. orders each rank's micro-batches light-heavy-light for the pipeline's warm-up and cool-down.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import warnings
from typing import Dict, Iterator, List, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .cost import check_cost_is_finite, sample_costs
from .plan import Plan, PlanStats, StepPlan, imbalance
from .samples import SampleSet
from .shape import choose_shape
from .spec import (
    ASSUMED_OVERHEAD_CHECKS,
    THOROUGH_PLANNER,
    PlannerConfig,
    ceil_div,
    padded_note,
    require_config,
    round_up,
    tokens_padded,
)
from .step_search import StepProblem

__all__ = ["plan_samples", "OversizeSampleWarning"]

#: Oversize samples named in a message before the rest are counted.
_LISTED = 10


#: Whether the plan is one DP rank's of a sharded step (:mod:`.sharded`): its oversize messages
#: then offer no ``truncate`` (a sharded plan trains each rank's samples whole and refuses it; a
#: probe applied the offered fix and was refused) and speak of that rank, not of every GPU (each
#: rank's rows are its own).
_SHARDED: contextvars.ContextVar = contextvars.ContextVar("sharded", default=False)


@contextlib.contextmanager
def sharded_wording() -> Iterator[None]:
    """Inside, oversize refusals and warnings speak of one rank of a sharded step."""
    token = _SHARDED.set(True)
    try:
        yield
    finally:
        _SHARDED.reset(token)


class OversizeSampleWarning(UserWarning):
    """A sample is longer than the token cap; it runs alone in its micro-batch, over the cap."""


def plan_samples(samples: SampleSet, config: PlannerConfig) -> Plan:
    """This package's planner (``dynbatch``) on an already validated :class:`SampleSet`."""
    if not isinstance(samples, SampleSet):
        raise DynBatchValueError(
            f"samples must be a SampleSet, got {type(samples).__name__}; pass "
            "SampleSet.build(lengths), or plan the lengths with plan_schedule(lengths, config=...)."
        )
    require_config(config, "plan_samples")
    # Planning builds hundreds of thousands of small lists and tuples and no reference cycles;
    # the cyclic garbage collector would re-scan them all at every threshold (a fifth of the time
    # at 1M samples), so it is paused for the call and restored as it was.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _plan_samples(samples, config)
    finally:
        if collecting:
            gc.enable()


def _plan_samples(samples: SampleSet, config: PlannerConfig) -> Plan:
    parallel = config.parallel
    sample_multiple = parallel.sample_multiple
    cap = config.token_cap
    check_cost_is_finite(config.cost, max(cap, max(samples.lengths)))
    kept = _apply_oversize_policy(samples, config)
    lengths = samples.lengths
    if kept:
        effective = list(lengths)
        for i, k in kept.items():
            effective[i] = k
    else:
        effective = lengths
    sizes = (
        effective
        if sample_multiple == 1
        else [round_up(length, sample_multiple) for length in effective]
    )
    if config.cost.response_weight:
        responses: Sequence[int] = [
            max(0, length - prompt)
            for length, prompt in zip(effective, samples.prompt_lengths, strict=True)
        ]
    else:
        responses = sizes  # unused: no response term

    costs = sample_costs(config.cost, config.layout, sizes, responses)
    # CostModel.cost of every sample, its expression inlined (no method call a sample).
    tw, aw, rw = config.cost.token_weight, config.cost.attention_weight, config.cost.response_weight
    # ``aw * n * n`` is ``aw * float(n) * float(n)`` for int n (exact below 2**53), and without a
    # response term ``+ 0.0`` changes no sum of nonnegative weights: the same floats, faster.
    if rw:
        own_costs = [
            tw * n + aw * n * n + rw * r for n, r in zip(effective, responses, strict=True)
        ]
    else:
        own_costs = [tw * n + aw * n * n for n in effective]
    steps = [
        _plan_step(items, num_rollouts, effective, sizes, costs, own_costs, kept, samples, config)
        for num_rollouts, items in samples.steps(config.rollouts_per_step)
    ]
    oversize = [i for step in steps for i in step.oversize_samples]
    if oversize:
        warnings.warn(
            _oversize_warning(oversize, lengths, steps, config), OversizeSampleWarning, stacklevel=3
        )
    # A sample cut within its prompt keeps no response token: it trains nothing, unseen.
    emptied = sorted(i for i, k in kept.items() if k <= samples.prompt_lengths[i])
    if emptied:
        shown = ", ".join(
            f"{i} (prompt {samples.prompt_lengths[i]} tokens)" for i in emptied[:_LISTED]
        )
        more = f" and {len(emptied) - _LISTED} more" if len(emptied) > _LISTED else ""
        warnings.warn(
            f"--oversize-samples truncate keeps the first {max(kept.values())} tokens of "
            f"{len(emptied)} sample(s) whose prompt is at least that long: {shown}{more}. They "
            f"keep no response token and train nothing; raise {config.cap_flag} above their "
            "prompts, or drop them.",
            OversizeSampleWarning,
            stacklevel=3,
        )
    return Plan(
        steps=tuple(steps),
        stats=PlanStats.from_steps(steps, num_samples=len(samples), dp_size=parallel.dp_size),
        layout=config.layout,
        sample_multiple=sample_multiple,
        token_cap=cap,
        dp_size=parallel.dp_size,
    )


def _apply_oversize_policy(samples: SampleSet, config: PlannerConfig) -> Dict[int, int]:
    """Sample -> kept length under ``truncate``; raises under ``error``; ``{}`` otherwise.

    A sample is oversize when its padded length (rounded up to the sample multiple) exceeds the
    cap. ``truncate`` keeps the longest prefix whose padded length fits: the cap rounded down to
    the sample multiple.
    """
    sample_multiple = config.parallel.sample_multiple
    cap = config.token_cap
    keep = config.longest_fitting
    if config.oversize_samples == "allow" or max(samples.lengths) <= keep:
        return {}
    oversize = [i for i, length in enumerate(samples.lengths) if length > keep]
    if config.oversize_samples == "error":
        shown = ", ".join(
            f"sample {i}: {tokens_padded(samples.lengths[i], sample_multiple)}"
            for i in oversize[:_LISTED]
        )
        more = f" (and {len(oversize) - _LISTED} more)" if len(oversize) > _LISTED else ""
        longest = round_up(max(samples.lengths), sample_multiple)
        raise DynBatchValueError(
            f"{len(oversize)} sample(s) exceed the token cap {cap} ({config.cap_source}): "
            f"{shown}{more}. Raise {config.cap_to_hold(longest)}, "
            + ("drop or shorten them" if config.oversize_flag else "or drop or shorten them")
            + config.oversize_way(
                *(() if _SHARDED.get() else (("truncate", "cut to the cap"),)),
                ("allow", "run alone, over the cap"),
            )
            + "."
        )
    return {i: keep for i in oversize}


#: The way out an oversize warning names where rows can be each micro-batch's own (packed).
VARIABLE_ROWS_NOTE = " (variable rows, --variable-seq-lengths, keep the others within the cap)"


def _oversize_warning(
    oversize: List[int], lengths: Sequence[int], steps: Sequence[StepPlan], config: PlannerConfig
) -> str:
    cap = config.token_cap
    multiple = config.parallel.sample_multiple
    notes = [(i, padded_note(lengths[i], multiple)) for i in oversize[:_LISTED]]
    shown = ", ".join(
        f"{i} ({lengths[i]} tokens{', ' + note if note else ''})" for i, note in notes
    )
    more = f" and {len(oversize) - _LISTED} more" if len(oversize) > _LISTED else ""
    worst = max((s for s in steps if s.oversize_samples), key=lambda s: s.seq_length)
    footprint = worst.micro_batch_size * worst.seq_length
    longest = round_up(max(lengths[i] for i in oversize), multiple)
    policies = (() if _SHARDED.get() else (("truncate", "cut them to the cap"),)) + (
        ("error", "refuse them"),
    )
    flag = config.oversize_flag
    if flag is None:  # the host decides its policy: only the budget is a way out
        advice = f"Raise {config.cap_to_hold(longest)} to keep them within it."
    elif flag.startswith("-"):
        ways = ", ".join(f"{value} to {what}" for value, what in policies)
        advice = f"Pass {flag} {ways}, or raise {config.cap_to_hold(longest)}."
    else:
        ways = ", ".join(f"{flag}={value!r} to {what}" for value, what in policies)
        advice = f"Set {ways}, or raise {config.cap_to_hold(longest)}."
    head = f"{len(oversize)} sample(s) exceed the token cap {cap} ({config.cap_source}): {shown}{more}."
    # Packed rows can vary per micro-batch (where shapes are exchanged), which keeps the others
    # within the cap; padded [B, S] rows cannot.
    variable = VARIABLE_ROWS_NOTE if config.layout == "packed" else ""
    if worst.row_lengths:
        # Variable rows: only the oversize sample's own micro-batch runs its long row.
        return (
            f"{head} Each runs alone in its micro-batch, in a row of its own length over the "
            "cap; the step's other micro-batches keep rows within it (variable rows). The "
            f"longest such row is {worst.seq_length} tokens, {worst.seq_length / cap:.2f}x the "
            f"budget. {advice}"
        )
    where = (
        ("its DP rank's step", "on that rank") if _SHARDED.get() else ("its step", "on every GPU")
    )
    return (
        f"{head} Each runs alone in its micro-batch, over the cap, and every micro-batch of "
        f"{where[0]}, placeholders included, gets that row length: Megatron needs one [B, S] per "
        f"step for its pipeline buffers{variable}. The longest such step runs {footprint} tokens "
        f"per micro-batch, {footprint / cap:.2f}x the budget, {where[1]}. {advice}"
    )


def _overhead_checks(config: PlannerConfig) -> Tuple[float, ...]:
    """The overheads (cost units) a step's plan is checked at against the trainers' own
    schedules (:func:`.shape._peer_guard`): where the overhead is assumed,
    :data:`.spec.ASSUMED_OVERHEAD_CHECKS` of a full row at the cap; none where it is told or
    calibrated."""
    if not config.overhead_assumed:
        return ()
    full_row = config.cost.full_row_cost(config.token_cap, config.layout)
    return tuple(fraction * full_row for fraction in ASSUMED_OVERHEAD_CHECKS)


def _plan_step(
    items: List[int],
    num_rollouts: int,
    lengths: Sequence[int],
    sizes: Sequence[int],
    costs: Sequence[float],
    own_costs: Sequence[float],
    kept: Dict[int, int],
    samples: SampleSet,
    config: PlannerConfig,
) -> StepPlan:
    """Choose the step's shape (:mod:`.shape`) and describe it as a :class:`StepPlan`."""
    parallel = config.parallel
    dp = parallel.dp_size
    cap = config.token_cap
    problem = StepProblem(
        items=items,
        sizes=sizes,
        sample_costs=costs,
        model=config.cost,
        layout=config.layout,
        cap=cap,
        parallel=parallel,
        min_gain=config.min_gain,
        row_multiple=config.variable_row_multiple if config.variable_row_lengths else None,
        memory=config.memory,
        multi_row_cap=config.multi_row_cap,
        thorough=config.planner == THOROUGH_PLANNER,
        overhead_checks=_overhead_checks(config),
        min_count=config.min_microbatches,
    )
    shape, fewest = choose_shape(problem)
    bins = shape.bins
    packed_rows: Tuple[Tuple[Tuple[int, ...], ...], ...] = ()
    if shape.packed_rows is not None:
        # B > 1 packed rows: the micro-batch lists its rows' samples row after row (each row
        # sorted), and packed_rows says how many each row holds.
        rows = [tuple(members) for members in bins]
        counts = [tuple(len(row) for row in mb) for mb in shape.packed_rows]
        packed_rows = tuple(tuple(counts[b] for b in order) for order in shape.rank_orders)
    else:
        rows = [tuple(sorted(members)) if len(members) > 1 else tuple(members) for members in bins]
    ranks = tuple(tuple(rows[b] for b in order) for order in shape.rank_orders)
    if shape.token_loads is not None and sizes is lengths:
        bin_tokens = shape.token_loads  # sizes are the lengths: the packers' loads are the tokens
    else:
        bin_tokens = [sum(map(lengths.__getitem__, members)) for members in bins]
    rank_tokens = [sum(map(bin_tokens.__getitem__, order)) for order in shape.rank_orders]
    computed = [sum(map(shape.bin_costs.__getitem__, order)) for order in shape.rank_orders]
    # The samples' own cost per rank (CostModel.cost), what dp_imbalance_cost always reported.
    bin_own = [sum(map(own_costs.__getitem__, members)) for members in bins]
    own = [sum(map(bin_own.__getitem__, order)) for order in shape.rank_orders]
    real_tokens = sum(rank_tokens)
    row_lengths: Tuple[Tuple[int, ...], ...] = ()
    if shape.row_lengths is not None:
        row_lengths = tuple(
            tuple(shape.row_lengths[b] for b in order) for order in shape.rank_orders
        )
        computed_tokens = sum(shape.row_lengths)
    else:
        computed_tokens = dp * shape.per_rank * shape.micro_batch_size * shape.seq_length
    # Internal invariant (check_plan re-derives it from the inputs): every sample exactly once.
    assert sum(map(len, bins)) == len(items), "lost or duplicated sample"
    oversize = tuple(shape.oversize)
    truncated = tuple(i for i in items if i in kept) if kept else ()
    regular_tokens = sum(map(sizes.__getitem__, items)) - sum(map(sizes.__getitem__, oversize))
    return StepPlan(
        num_microbatches=shape.per_rank,
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        ranks=ranks,
        num_rollouts=num_rollouts,
        num_placeholders=sum(1 for members in bins if not members),
        real_tokens=real_tokens,
        fill=real_tokens / computed_tokens,
        dp_imbalance=imbalance(rank_tokens),
        dp_imbalance_cost=imbalance(own),
        oversize_samples=oversize,
        # With a memory budget, B > 1 rows may hold up to the token budget together.
        lower_bound_microbatches=len(oversize)
        + ceil_div(regular_tokens, cap if config.memory is None else config.multi_row_cap),
        min_microbatches=fewest,
        truncated_samples=truncated,
        truncated_tokens=sum(samples.lengths[i] - kept[i] for i in truncated),
        kept_lengths=tuple((i, kept[i]) for i in truncated),
        sample_lengths=tuple((i, samples.lengths[i]) for i in sorted(items)),
        dp_imbalance_computed=imbalance(computed),
        row_lengths=row_lengths,
        packed_rows=packed_rows,
        idle_ranks=sum(1 for rank in ranks if not any(rank)),
    )
