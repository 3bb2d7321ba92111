"""The micro-batch plan of one SkyRL mini-batch, over every DP rank, from token counts alone.

SkyRL's dispatch shards a mini-batch over the DP ranks before the Megatron worker sees it, so a
sample cannot move to another rank here. Every rank therefore gathers every rank's token counts
(lengths only, never data) and derives the same plan: each rank's own samples are planned by
:func:`megatron_dynbatch.planning.plan_schedule` for this pipeline (``dp_size=1``: one rank's
samples), then every rank gets the same micro-batch count ``M`` (the largest, rounded up to the
interleaved schedule's group) and the same rows per micro-batch ``B`` (the fullest micro-batch of
any rank). A rank with fewer real micro-batches, or none (a step with fewer samples than DP ranks),
runs loss-masked placeholders, so counts are equal by construction, not by a later all-reduce.

The budget keeps SkyRL's meaning of ``max_tokens_per_microbatch`` (:data:`~megatron_dynbatch.
integrations.hosts.SKYRL`): real tokens of one micro-batch, whatever the context-parallel size
(its workers strip padding before the model, ``remove_left_padding`` or THD packing), each sample
counted at its THD alignment (``tp``, or ``tp x cp x 2`` with context parallelism); a hard cap
except for a single longer sample, which runs alone and is reported in :attr:`SkyrlPlan.oversize`.
Placeholder rows count: each has one attended token (padded to the alignment), so a micro-batch of
``k`` samples plus its ``B - k`` placeholder rows stays within the budget
(:func:`fit_placeholder_rows`), except a sample alone in its micro-batch, which SkyRL accepts at
the budget and which then carries its ``B - 1`` one-token rows over it, as SkyRL's own padding rows
do (at most ``(B - 1) x`` the alignment; no cliff in the micro-batch count near the budget).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import List, Optional, Sequence, Tuple

from megatron_dynbatch.integrations.hosts import (
    SKYRL,
    check_host_lengths,
    check_overhead,
    host_config,
    plan_host_step,
)
from megatron_dynbatch.planning import (
    OversizeSampleWarning,
    ParallelLayout,
    PlannerConfig,
    check_plan,
    round_up,
)
from megatron_dynbatch.planning.sharded import (
    Ranks,
    ShardedPlan,
    fullest,
    plan_rank_shards,
    rank_step_time,
    sharded_plan,
)
from megatron_dynbatch.planning.simulate import remembered_makespans
from megatron_dynbatch.planning.spec import ceil_div

__all__ = ["SkyrlPlan", "fit_placeholder_rows", "plan_skyrl_minibatch"]

#: The plan of one SkyRL mini-batch: the host-neutral plan of pre-sharded samples.
SkyrlPlan = ShardedPlan


def plan_skyrl_minibatch(
    lengths_per_rank: Sequence[Sequence[int]],
    max_tokens_per_microbatch: int,
    *,
    pp_size: int = 1,
    vpp_size: int = 1,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    tp_size: int = 1,
    cp_size: int = 1,
    planner: Optional[str] = None,
    microbatch_overhead: Optional[float] = None,
) -> SkyrlPlan:
    """Plan one mini-batch whose samples are already sharded over the DP ranks.

    Args:
        lengths_per_rank: ``lengths_per_rank[r][i]``: real tokens (``attention_mask.sum()``) of
            sample ``i`` on DP rank ``r``; a rank may hold no sample.
        max_tokens_per_microbatch: SkyRL's ``trainer.max_tokens_per_microbatch`` (> 0).
        pp_size: Pipeline stages.
        vpp_size: Virtual pipeline chunks per stage (> 1: interleaved schedule).
        microbatch_group_size_per_vp_stage: Megatron's interleaving group (default ``pp_size``).
        tp_size: Tensor-parallel size (the planner pads each sample to a multiple of it).
        cp_size: Context-parallel size: each sample is padded to ``tp x cp x 2`` (SkyRL's THD
            alignment), and the budget still caps the whole micro-batch.
        planner: ``trainer.dynamic_batch_planner``: the planner registered by this name plans
            each rank's samples (:func:`~megatron_dynbatch.planning.registry.run_planner`);
            ``None``: ours.
        microbatch_overhead: ``trainer.dynamic_batch_cost_microbatch_overhead``: one
            micro-batch's fixed cost in tokens of one GPU's linear work; ``None``: assumed (2% of
            a full micro-batch, plans kept within 0.5% of the trainers' own schedules).

    Returns:
        The :class:`SkyrlPlan`, identical on every rank given the same lengths.

    Raises:
        DynBatchValueError: on a non-positive budget or length, or an overhead that is not a
            finite number >= 0, naming them and SkyRL's keys.
    """
    parallel = ParallelLayout(
        dp_size=1,
        pp_size=pp_size,
        vpp_size=vpp_size,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        tp_size=tp_size,
        cp_size=cp_size,
    )
    # Checked at config time too (validate.py, from validate_cfg); here for a call made otherwise.
    key = SKYRL.key("cost_microbatch_overhead")
    overhead = check_overhead(microbatch_overhead, f"{key}={microbatch_overhead!r}", f"{key}=330")
    with SKYRL.flags():
        config = host_config(
            SKYRL,
            {
                "max_tokens_per_microbatch": max_tokens_per_microbatch,
                "dynamic_batch_planner": planner,
            },
            parallel,
            fixed={"cost_microbatch_overhead": overhead} if overhead is not None else None,
            # SkyRL's padding-free forward runs each micro-batch at its own length (its samples
            # at the THD alignment): costed at the cap, every micro-batch looked alike and a
            # rank's order and balance went unseen (up to 24% slower than SkyRL's own,
            # benchmarks/skyrl_as_run.py).
            row_multiple=1,
        )
    multiple = parallel.sample_multiple
    cap = config.token_cap
    planned: List[Ranks] = []

    def adjust(ranks: Ranks, lengths: List[List[int]]) -> Ranks:
        planned.append(ranks)
        return fit_placeholder_rows(ranks, lengths, cap, multiple)

    # Planned again with room for the rows, a rank often plans as before: one memory of replays.
    with remembered_makespans():
        plan = plan_host_step(
            SKYRL, lengths_per_rank, config, adjust=adjust, placeholder_row_tokens=multiple
        )
        plan = _within_the_rows(plan, planned[0], lengths_per_rank, config)
    _report_topped_up_over_the_budget(plan, lengths_per_rank, config)
    return plan


def _report_topped_up_over_the_budget(
    plan: ShardedPlan, lengths_per_rank: Sequence[Sequence[int]], config: PlannerConfig
) -> None:
    """Warn about each sample within the budget that runs alone with its ``B - 1`` one-token
    placeholder rows over it (:func:`fit_placeholder_rows` never cuts a sample): the budget is
    a hard cap but for a longer sample, reported; these were over it unreported (a probe)."""
    multiple = config.parallel.sample_multiple
    cap = config.token_cap
    over = [
        (rank, mb[0], round_up(lengths_per_rank[rank][mb[0]], multiple))
        for rank, mbs in enumerate(plan.ranks)
        for mb in mbs
        if len(mb) == 1 and (rank, mb[0]) not in plan.oversize
    ]
    topped = (plan.rows - 1) * multiple
    over = [(rank, i, size) for rank, i, size in over if size + topped > cap]
    if not over:
        return
    key = SKYRL.key("max_tokens_per_gpu")
    shown = ", ".join(f"rank {r} sample {i}: {size} tokens" for r, i, size in over[:8])
    more = f" (and {len(over) - 8} more)" if len(over) > 8 else ""
    most = max(size for _, _, size in over) + topped
    # Within it for any rows the plan may then pick: B is at most the fullest rank's samples, and
    # no sample is longer than the longest (raising it by the rows of this plan alone let the
    # next plan pick more rows: 8,208 of a sample at 8,192 and 17 rows was over again at 18).
    longest = max(round_up(n, multiple) for lengths in lengths_per_rank for n in lengths)
    safe = longest + (max(len(lengths) for lengths in lengths_per_rank) - 1) * multiple
    warnings.warn(
        f"{len(over)} sample(s) within {key}={cap} run alone in their micro-batch with "
        f"{plan.rows - 1} one-token placeholder row(s) of {multiple} token(s) each (every "
        f"micro-batch of this mini-batch has {plan.rows} rows), up to {most} tokens, over the "
        f"budget, as SkyRL's own padding rows would take them: {shown}{more}. Raise {key} to "
        f"at least {safe} (a row for every sample of the fullest rank beside the longest) to "
        "stay within it, or shorten those samples.",
        OversizeSampleWarning,
        stacklevel=2,
    )


#: Plans of a step with room for its placeholder rows, at most (:func:`_within_the_rows`): the
#: second with room for the rows the first packed, where it packed more.
_ROOMY_PLANS = 2


def _within_the_rows(
    plan: ShardedPlan,
    planned: Ranks,
    lengths_per_rank: Sequence[Sequence[int]],
    config: PlannerConfig,
) -> ShardedPlan:
    """``plan`` (``planned`` cut to fit its rows), ``planned`` with samples moved to where the
    rows leave room instead, or the plan of each rank's samples under a budget that leaves room
    for the ``B - 1`` placeholder rows: whichever the planner's model says is faster as SkyRL
    runs it.

    ``B`` is the fullest micro-batch of any rank, known only once every rank is planned; a rank
    whose micro-batches were packed to the budget then has them cut (:func:`fit_placeholder_rows`)
    into an extra, nearly empty micro-batch in the middle of its order (seen at 10% slower than
    SkyRL's own on ``benchmarks/skyrl_as_run.py``). Where one sample moved to another micro-batch
    of the rank avoids the cut, the rank keeps its count and shape (:func:`_moved_into_room`).
    Planned again under the budget less ``(B - 1)`` rows of the alignment, its micro-batches fit
    their rows as planned; where that packs a micro-batch of more samples than ``B``, once more
    with room for those. Samples over the budget are those of ``plan`` (the same lengths and
    budget).
    """
    multiple = config.parallel.sample_multiple
    cap = config.token_cap
    lengths = check_host_lengths(SKYRL, lengths_per_rank)
    # ``plan``'s step is simulated only once another plan is scored against it.
    best, best_step = plan, None

    def consider(ranks: Sequence[Tuple[Tuple[int, ...], ...]]) -> None:
        """Keep ``ranks``, cut to fit their rows, where the step is faster than the best."""
        nonlocal best, best_step
        if best_step is None:
            best_step = _step(plan, lengths, config)
        fitted = fit_placeholder_rows(ranks, lengths, cap, multiple)
        other = sharded_plan(fitted, plan.oversize, config.parallel)
        step = _step(other, lengths, config)
        if step < best_step:
            best, best_step = other, step

    moved = _moved_into_room(planned, lengths, cap, multiple)
    if moved != [tuple(mbs) for mbs in planned]:
        consider(moved)

    def roomy_config(rows: int) -> Optional[PlannerConfig]:
        """The config whose budget leaves room for ``rows - 1`` placeholder rows; ``None``
        where there is nothing to leave room for, or too little budget would be left."""
        room = cap - (rows - 1) * multiple
        roomy = dataclasses.replace(config, max_tokens_per_gpu=room // config.parallel.cp_size)
        if rows == 1 or room < cap // 2 or roomy.token_cap >= cap:
            return None
        return roomy

    rows = plan.rows
    roomy = roomy_config(rows)
    if roomy is None:
        return _checked(best, plan, lengths, config)
    for _ in range(_ROOMY_PLANS):
        with SKYRL.flags(), warnings.catch_warnings():
            # Samples between the two budgets are not oversize for SkyRL: plan.oversize says
            # which are.
            warnings.simplefilter("ignore", OversizeSampleWarning)
            ranks, _ = plan_rank_shards(lengths, roomy)
        # The room is for ``rows`` rows, and packed anew a micro-batch may hold more samples
        # (short ones). Where the others have room, more rows cost little; where they are full,
        # every full one is cut in two (1,197 samples on a rank at pp 4: room left for 75 rows,
        # a micro-batch of 96, and 100 full ones cut: 258 micro-batches against SkyRL's 158, 41%
        # slower). So that micro-batch split by count, to at most ``rows``, is scored too, and
        # the step planned again with room for the rows it packed.
        consider(ranks)
        consider(_at_most_rows(ranks, rows))
        packed = fullest(ranks)
        roomy = roomy_config(packed) if packed > rows else None
        if roomy is None:
            break
        rows = packed
    return _checked(best, plan, lengths, config)


def _checked(
    best: ShardedPlan, plan: ShardedPlan, lengths: Sequence[Sequence[int]], config: PlannerConfig
) -> ShardedPlan:
    """``best``, checked where it is not ``plan`` (which plan_host_step checked)."""
    if best is not plan:
        check_plan(best, lengths, config, placeholder_row_tokens=config.parallel.sample_multiple)
    return best


def _moved_into_room(
    ranks: Ranks, lengths_per_rank: Sequence[Sequence[int]], cap: int, multiple: int
) -> List[Tuple[Tuple[int, ...], ...]]:
    """``ranks`` with each micro-batch of several samples that is over ``cap`` once topped up to
    ``B`` rows (the fullest micro-batch's, :func:`fit_placeholder_rows`) giving samples to other
    micro-batches of its rank that stay within ``cap`` topped up and below ``B`` samples.

    The sample given is the smallest that brings it within ``cap`` (else its largest, and again),
    to the micro-batch with the least room that takes it (the light ones, which fill and drain
    the pipeline, stay light). What no micro-batch can take stays, for
    :func:`fit_placeholder_rows` to cut. A rank planned to the budget (an even packing at 8,176-
    8,192 of 8,192 tokens, B = 11) had one micro-batch at 8,191 cut in two, and the step planned
    anew with room for the rows lost its light last micro-batch: 0.8% behind SkyRL's own.
    """
    rows = fullest(ranks)
    out = []
    for rank, mbs in enumerate(ranks):
        sizes = [round_up(n, multiple) for n in lengths_per_rank[rank]]
        moved = [list(mb) for mb in mbs]
        topped = [sum(sizes[i] for i in mb) + (rows - len(mb)) * multiple for mb in moved]
        for k, mb in enumerate(moved):
            while len(mb) > 1 and topped[k] > cap:
                # Giving a sample away takes its tokens out and a placeholder row in.
                excess = topped[k] - cap
                enough = [i for i in mb if sizes[i] - multiple >= excess]
                give = (
                    min(enough, key=lambda i: (sizes[i], i))
                    if enough
                    else max(mb, key=lambda i: (sizes[i], -i))
                )
                gain = sizes[give] - multiple
                takers = [
                    j
                    for j, other in enumerate(moved)
                    if j != k and len(other) < rows and topped[j] + gain <= cap
                ]
                if not takers:
                    break
                to = max(takers, key=lambda j: (topped[j], -j))
                mb.remove(give)
                moved[to].append(give)
                topped[k] -= gain
                topped[to] += gain
        out.append(tuple(tuple(mb) for mb in moved))
    return out


def _at_most_rows(
    ranks: Sequence[Tuple[Tuple[int, ...], ...]], rows: int
) -> List[Tuple[Tuple[int, ...], ...]]:
    """Every micro-batch of more than ``rows`` samples split, in order, into the fewest pieces
    of at most ``rows`` (as even as they go), in its place."""
    out = []
    for mbs in ranks:
        pieces: List[Tuple[int, ...]] = []
        for mb in mbs:
            if len(mb) <= rows:
                pieces.append(tuple(mb))
                continue
            size = ceil_div(len(mb), ceil_div(len(mb), rows))
            pieces.extend(tuple(mb[k : k + size]) for k in range(0, len(mb), size))
        out.append(tuple(pieces))
    return out


def _step(plan: ShardedPlan, lengths: Sequence[Sequence[int]], config: PlannerConfig) -> float:
    """The planner's simulated step of ``plan`` as SkyRL runs it: every micro-batch its samples
    and ``B - k`` one-token rows (at the alignment), a row of its own length; the slowest rank."""
    return max(
        rank_step_time(mbs, plan.num_microbatches, lengths[rank], config, rows=plan.rows)
        for rank, mbs in enumerate(plan.ranks)
    )


def fit_placeholder_rows(
    ranks: Sequence[Tuple[Tuple[int, ...], ...]],
    lengths_per_rank: Sequence[Sequence[int]],
    cap: int,
    multiple: int,
) -> List[Tuple[Tuple[int, ...], ...]]:
    """Split micro-batches so each stays within ``cap`` once topped up with placeholder rows.

    Every micro-batch runs ``B`` rows (the fullest one's); one with ``k`` samples gets ``B - k``
    placeholder rows of one attended token each (SkyRL cannot run a row with none), padded to
    ``multiple`` like every row, so it costs its samples plus ``(B - k) * multiple``. A micro-batch
    over ``cap`` once topped up is cut, in order, into pieces that fit; a single sample is never
    cut further (it is within the budget as SkyRL counts it, or oversize and reported), so its
    rows may take it over by ``(B - 1) * multiple``. Cutting can only lower ``B``, so this repeats
    until ``B`` is stable. Example (``cap=40``, ``multiple=1``): micro-batches ``[20, 19]`` and
    ``[40]`` give ``B = 2``: ``[20, 19]`` fits (39), ``[40]`` runs alone with one placeholder row
    (41 attended tokens, as SkyRL's own padding would give it), and the count stays 2, where
    limiting ``B`` by the 40-token sample (``B = 1``) would give 3.
    """

    def size(rank: int, i: int) -> int:
        return round_up(lengths_per_rank[rank][i], multiple)

    fitted = [tuple(mbs) for mbs in ranks]
    while True:
        rows = fullest(fitted)
        cut: List[Tuple[Tuple[int, ...], ...]] = []
        for rank, mbs in enumerate(fitted):
            pieces: List[Tuple[int, ...]] = []
            for mb in mbs:
                piece: List[int] = []
                tokens = 0
                for i in mb:
                    grown = tokens + size(rank, i)
                    topped_up = grown + (rows - len(piece) - 1) * multiple
                    if piece and topped_up > cap:
                        pieces.append(tuple(piece))
                        piece, grown = [], size(rank, i)
                    piece.append(i)
                    tokens = grown
                pieces.append(tuple(piece))
            cut.append(tuple(pieces))
        if fullest(cut) == rows:
            return cut
        fitted = cut
