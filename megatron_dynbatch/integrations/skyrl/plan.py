"""The micro-batch plan of one SkyRL mini-batch, over every DP rank, from token counts alone.

SkyRL's dispatch shards a mini-batch over the DP ranks before the Megatron worker sees it, so a
sample cannot move to another rank here. Every rank therefore gathers every rank's token counts
(lengths only, never data) and derives the same plan: each rank's own samples are planned by
:func:`megatron_dynbatch.planning.plan_schedule` for this pipeline (``dp_size=1``: one rank's
samples), then every rank gets the same micro-batch count ``M`` (the largest, rounded up to the
interleaved schedule's group) and the same rows per micro-batch ``B`` (the fullest micro-batch of
any rank). A rank with fewer real micro-batches, or none (a step with fewer samples than DP ranks),
runs loss-masked placeholders, so counts are equal by construction, not by a later all-reduce.

The budget keeps SkyRL's meaning of ``max_tokens_per_microbatch``: real tokens of one micro-batch
(its workers strip padding before the model, ``remove_left_padding`` or THD packing), a hard cap
except for a single longer sample, which runs alone and is reported in :attr:`SkyrlPlan.oversize`.
Placeholder rows count: each has one attended token, so a micro-batch of ``k`` samples plus its
``B - k`` placeholder rows stays within the budget (:func:`_fit_placeholder_rows`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megatron_dynbatch.config import config_from_mapping
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import ParallelLayout, round_up
from megatron_dynbatch.planning.sharded import (
    ShardedPlan,
    plan_rank_shards,
    sharded_plan,
)

__all__ = [
    "SKYRL_FIXED",
    "SKYRL_OPTIONS",
    "SkyrlPlan",
    "check_budget",
    "check_lengths",
    "plan_skyrl_minibatch",
]


#: SkyRL's option name (``trainer.*``) of each setting it gives the planner.
SKYRL_OPTIONS = {"max_tokens_per_microbatch": "max_tokens_per_gpu"}
#: What SkyRL decides itself: its padding-free forward packs a micro-batch's real tokens; its
#: budget is a soft cap for a single long sample (it runs alone), as in SkyRL's own batching.
SKYRL_FIXED = {"layout": "packed", "oversize_samples": "allow"}

#: The plan of one SkyRL mini-batch: the host-neutral plan of pre-sharded samples.
SkyrlPlan = ShardedPlan


def check_lengths(lengths_per_rank: Sequence[Sequence[int]]) -> List[List[int]]:
    """The lengths as ints, or ``DynBatchValueError`` naming the rank and sample without tokens."""
    if not lengths_per_rank:
        raise DynBatchValueError("lengths_per_rank is empty; pass one list of lengths per DP rank.")
    checked = []
    for rank, lengths in enumerate(lengths_per_rank):
        row = []
        for i, length in enumerate(lengths):
            if isinstance(length, bool) or int(length) != length or int(length) < 1:
                raise DynBatchValueError(
                    f"DP rank {rank} sample {i} has {length!r} real tokens; every sample needs at "
                    "least one token with attention_mask=1 (drop empty samples before training)."
                )
            row.append(int(length))
        checked.append(row)
    return checked


def check_budget(max_tokens_per_microbatch: int) -> None:
    """Refuse a budget that is not a positive integer (``DynBatchValueError`` naming the fix)."""
    if isinstance(max_tokens_per_microbatch, bool) or not isinstance(
        max_tokens_per_microbatch, int
    ):
        raise DynBatchValueError(
            f"max_tokens_per_microbatch={max_tokens_per_microbatch!r} must be an integer; set "
            "trainer.max_tokens_per_microbatch to the real-token budget of one micro-batch."
        )
    if max_tokens_per_microbatch < 1:
        raise DynBatchValueError(
            f"max_tokens_per_microbatch={max_tokens_per_microbatch} must be > 0 with "
            "trainer.use_dynamic_batch_size=true; set trainer.max_tokens_per_microbatch (e.g. 8192)."
        )


def plan_skyrl_minibatch(
    lengths_per_rank: Sequence[Sequence[int]],
    max_tokens_per_microbatch: int,
    *,
    pp_size: int = 1,
    vpp_size: int = 1,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    tp_size: int = 1,
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

    Returns:
        The :class:`SkyrlPlan`, identical on every rank given the same lengths.

    Raises:
        DynBatchValueError: on a non-positive budget or length, naming them.
    """
    check_budget(max_tokens_per_microbatch)
    lengths_per_rank = check_lengths(lengths_per_rank)
    parallel = ParallelLayout(
        dp_size=1,
        pp_size=pp_size,
        vpp_size=vpp_size,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        tp_size=tp_size,
    )
    config = config_from_mapping(
        {"max_tokens_per_microbatch": max_tokens_per_microbatch},
        table=SKYRL_OPTIONS,
        fixed=SKYRL_FIXED,
        host="SkyRL's trainer config",
    ).planner_config(parallel)
    ranks, oversize = plan_rank_shards(lengths_per_rank, config)
    ranks = _fit_placeholder_rows(ranks, lengths_per_rank, config.token_cap, tp_size)
    return sharded_plan(ranks, oversize, parallel)


def _fit_placeholder_rows(
    ranks: List[Tuple[Tuple[int, ...], ...]],
    lengths_per_rank: List[List[int]],
    cap: int,
    multiple: int,
) -> List[Tuple[Tuple[int, ...], ...]]:
    """Split micro-batches so each stays within ``cap`` once topped up with placeholder rows.

    Every micro-batch runs ``B`` rows (the fullest one's); a shorter one gets ``B - k`` placeholder
    rows of one attended token each (SkyRL cannot run a row with none), padded to ``multiple``
    (tp) like every row. So a micro-batch costs its samples plus ``(B - k) * multiple``, and a sample
    of ``L`` tokens forces ``B <= 1 + (cap - L) // multiple``: with ``cap=40`` a 40-token sample
    leaves room for no placeholder row, so ``B = 1`` (two samples of 20 sharing a micro-batch
    would give the 40-token one a 41-token micro-batch). ``B`` is bounded by the longest sample
    within the cap, then every micro-batch is cut, in order, into pieces that fit at that bound.
    An oversize sample (alone in its micro-batch already) stays over the cap, as reported.
    """

    def size(length: int) -> int:
        return round_up(length, multiple)

    rows = max([len(mb) for mbs in ranks for mb in mbs] or [1])
    fitting = [size(n) for lengths in lengths_per_rank for n in lengths if size(n) <= cap]
    if fitting:
        rows = min(rows, 1 + (cap - max(fitting)) // multiple)
    fitted: List[Tuple[Tuple[int, ...], ...]] = []
    for rank, mbs in enumerate(ranks):
        pieces: List[Tuple[int, ...]] = []
        for mb in mbs:
            piece: List[int] = []
            tokens = 0
            for i in mb:
                grown = tokens + size(lengths_per_rank[rank][i])
                topped_up = grown + (rows - len(piece) - 1) * multiple
                if piece and (len(piece) == rows or topped_up > cap):
                    pieces.append(tuple(piece))
                    piece, grown = [], size(lengths_per_rank[rank][i])
                piece.append(i)
                tokens = grown
            pieces.append(tuple(piece))
        fitted.append(tuple(pieces))
    return fitted
