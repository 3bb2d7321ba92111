"""One step's micro-batches over every DP rank when the samples are already sharded over the ranks.

RL trainers (SkyRL, verl) dispatch a mini-batch to the DP ranks before the Megatron worker sees
it, so a sample cannot move to another rank. Every rank then gathers every rank's lengths (lengths
only, never data) and calls :func:`plan_sharded_step` with them, deriving the same plan with no
further collective: each rank's own samples are planned by the config's planner
(:func:`~.registry.run_planner`, the planner by default) for this pipeline (``dp_size=1``: one
rank's samples), then every rank gets the same micro-batch count
``M`` (the largest, rounded up to the interleaved schedule's group) and the same rows per
micro-batch ``B`` (the fullest micro-batch of any rank). A rank with fewer real micro-batches, or
none, runs placeholders after its real ones, so counts are equal by construction.

Example: ranks with lengths ``[[900], [300, 300, 300, 300]]``, a budget of 600 tokens, pp 2 and
vpp 2 (group 2): rank 0 needs one micro-batch, rank 1 two; ``M = 2`` and rank 0 runs one
placeholder after its sample.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from .registry import run_planner
from .samples import SampleSet
from .schedule import ScheduledStep
from .spec import ParallelLayout, PlannerConfig, round_up

__all__ = ["ShardedPlan", "plan_rank_shards", "plan_sharded_step", "sharded_plan"]


@dataclass(frozen=True, kw_only=True)
class ShardedPlan:
    """Every DP rank's micro-batches of one step (local sample indices)."""

    ranks: Tuple[Tuple[Tuple[int, ...], ...], ...]
    """``ranks[r]``: DP rank ``r``'s real micro-batches, in run order; placeholders follow them."""
    num_microbatches: int
    """Micro-batches every rank runs (real + placeholder): what Megatron's schedule is given."""
    rows: int
    """Rows of the fullest micro-batch of any rank (``B`` for trainers that need uniform rows)."""
    oversize: Tuple[Tuple[int, int], ...] = ()
    """``(dp_rank, local index)`` of every sample longer than the budget (each ran alone)."""

    def placeholders(self, dp_rank: int) -> int:
        """Placeholder micro-batches DP rank ``dp_rank`` runs after its real ones."""
        return self.num_microbatches - len(self.ranks[dp_rank])

    def scheduled_steps(self) -> Tuple[ScheduledStep, ...]:
        """The step as the runtime reads it (:class:`~.schedule.Schedule`): each rank's real
        micro-batches then its placeholders (``()``), local indices; rows are left to each rank's
        own samples (``seq_length=None``: the trainer packs a micro-batch's real tokens)."""
        ranks = tuple(
            tuple(rank) + ((),) * (self.num_microbatches - len(rank)) for rank in self.ranks
        )
        return (ScheduledStep(ranks=ranks, seq_length=None, micro_batch_size=self.rows),)

    def fingerprint(self) -> str:
        """A short hash that every rank compares before the pipeline starts."""
        text = json.dumps([self.num_microbatches, self.rows, self.ranks], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_rank_shards(
    lengths_per_rank: Sequence[Sequence[int]], config: PlannerConfig
) -> Tuple[List[Tuple[Tuple[int, ...], ...]], List[Tuple[int, int]]]:
    """Each rank's own real micro-batches (local indices) and the oversize ``(rank, index)``.

    The first half of :func:`plan_sharded_step`, for a host that adjusts the micro-batches before
    the counts are equalised (SkyRL fits its placeholder rows into the budget).
    """
    assert config.parallel.dp_size == 1, "plan each rank's own samples with dp_size=1"
    if config.rollouts_per_step is not None:
        # One call plans one step; rollouts_per_step would split it into several.
        config = dataclasses.replace(config, rollouts_per_step=None)
    ranks: List[Tuple[Tuple[int, ...], ...]] = []
    oversize: List[Tuple[int, int]] = []
    for rank, lengths in enumerate(lengths_per_rank):
        if not lengths:
            ranks.append(())
            continue
        [step] = run_planner(SampleSet.build(list(lengths)), config).steps
        # dp_size=1: rank 0 of the sub-plan is this rank; drop the sub-plan's own placeholders,
        # the count is equalised over all ranks in sharded_plan.
        ranks.append(tuple(tuple(mb) for mb in step.ranks[0] if mb))
        oversize.extend((rank, i) for i in step.oversize_samples)
    return ranks, oversize


def sharded_plan(
    ranks: Sequence[Tuple[Tuple[int, ...], ...]],
    oversize: Sequence[Tuple[int, int]],
    parallel: ParallelLayout,
) -> ShardedPlan:
    """Every rank's real micro-batches with the count every rank runs: the largest, rounded up to
    what Megatron's schedule needs (the interleaved group), at least one."""
    count = max(1, max((len(mbs) for mbs in ranks), default=0))
    count = round_up(count, parallel.microbatch_multiple)
    rows = max([len(mb) for mbs in ranks for mb in mbs] or [1])
    return ShardedPlan(
        ranks=tuple(tuple(mbs) for mbs in ranks),
        num_microbatches=count,
        rows=rows,
        oversize=tuple(oversize),
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
    ranks, oversize = plan_rank_shards(lengths_per_rank, config)
    return sharded_plan(ranks, oversize, config.parallel)
