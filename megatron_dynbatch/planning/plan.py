"""The planner's output: per optimizer step, per DP rank, an ordered list of micro-batches
(:class:`Plan`; :class:`ShardedPlan` for one step of samples already sharded over the ranks,
which :mod:`.sharded` plans).

A micro-batch is a tuple of global sample indices; an empty tuple is a placeholder micro-batch (a
full-shape, loss-masked row the runtime fabricates so every rank runs the same schedule).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .schedule import ScheduledStep
from .spec import ceil_div

__all__ = ["StepPlan", "PlanStats", "Plan", "ShardedPlan", "imbalance", "plain_fields"]


def imbalance(per_rank: Sequence[float]) -> float:
    """max / mean of a per-rank load (a step's ``dp_imbalance``); 1.0 when nothing is there to
    balance."""
    total = sum(per_rank)
    return max(per_rank) * len(per_rank) / total if total > 0 else 1.0


MicroBatch = Tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """The schedule of one optimizer step."""

    num_microbatches: int
    """Micro-batches per DP rank (what Megatron's ``get_forward_backward_func()`` is given)."""
    seq_length: int
    """Uniform row length S of every micro-batch of the step, placeholders included."""
    micro_batch_size: int
    """Rows per micro-batch, B: ``padded`` one sample a row; ``packed`` rows of concatenated samples
    (B > 1 only with ``packed_rows``)."""
    ranks: Tuple[Tuple[MicroBatch, ...], ...]
    """``ranks[r][m]``: global sample indices of micro-batch ``m`` on DP rank ``r``; ``()`` = placeholder."""
    num_rollouts: int
    """Rollouts (prompt groups / trajectories) trained in this step."""
    num_placeholders: int
    """Placeholder micro-batches in this step, over all ranks."""
    real_tokens: int
    """Sum of the (unpadded) lengths of the step's samples."""
    fill: float
    """real_tokens / computed tokens: the share of computed tokens that are real. Computed tokens
    are ``dp * M * B * S``, or with variable rows the sum of :attr:`row_lengths`."""
    dp_imbalance: float
    """max / mean over ranks of real tokens."""
    dp_imbalance_cost: float
    """max / mean over ranks of their samples' own cost (:meth:`.spec.CostModel.cost`)."""
    oversize_samples: Tuple[int, ...]
    """Samples longer than the cap, each alone in its micro-batch."""
    lower_bound_microbatches: int
    """A lower bound on the real (non-placeholder) micro-batches of the step, all ranks."""
    min_microbatches: int = 0
    """The fewest micro-batches per rank the planner packs the step into; ``num_microbatches`` is
    larger when more, shorter rows make a faster pipeline step (0: not reported)."""
    truncated_samples: Tuple[int, ...] = ()
    """Samples cut to the cap by the ``truncate`` oversize policy."""
    truncated_tokens: int = 0
    """Tokens cut from them (not trained)."""
    kept_lengths: Tuple[Tuple[int, int], ...] = ()
    """``(sample, kept length)`` of every truncated sample: the materializer keeps that many of its
    first tokens."""
    dp_imbalance_computed: float = 1.0
    """max / mean over ranks of what they compute: the cost of their micro-batches, padding,
    placeholders and overhead included (:mod:`.cost`), which sets the step time."""
    row_lengths: Tuple[Tuple[int, ...], ...] = ()
    """Variable row lengths (``PlannerConfig.variable_row_lengths``): ``row_lengths[r][m]`` is the
    row of micro-batch ``m`` of rank ``r``, at most ``seq_length``; ``()``: every row is
    ``seq_length``."""
    packed_rows: Tuple[Tuple[Tuple[int, ...], ...], ...] = ()
    """Packed micro-batches of ``B > 1`` rows: ``packed_rows[r][m]`` is how many samples each of
    the B rows of micro-batch ``m`` of rank ``r`` holds; ``ranks[r][m]`` lists row 0's samples,
    then row 1's, and so on. ``()``: one row a micro-batch (packed) or one sample a row (padded)."""

    idle_ranks: int = 0
    """DP ranks with no real sample in this step (only placeholders). 0 whenever the step has at
    least ``dp_size`` samples, unless the cost model predicted the step faster with the idle rank
    (the planner gives every rank a real micro-batch otherwise)."""
    sample_lengths: Tuple[Tuple[int, int], ...] = ()
    """``(sample, tokens)`` of every sample of the step, in index order: the length it was planned
    with (before any cut). The materializer checks each sample against it, so a sample shorter or
    longer than its plan (another sample, or a trainer's cut after planning) is refused rather
    than trained in a row planned for another. ``()``: not kept (a hand-built plan). Not in
    ``plan --json``, whose reader holds the lengths it passed."""

    def rank_microbatches(self, dp_rank: int) -> Tuple[MicroBatch, ...]:
        """The ordered micro-batches of one DP rank."""
        if not 0 <= dp_rank < len(self.ranks):
            raise DynBatchValueError(
                f"dp_rank={dp_rank} is outside [0, {len(self.ranks)}) for this plan."
            )
        return self.ranks[dp_rank]

    def sample_indices(self) -> Tuple[int, ...]:
        """Every sample of the step, sorted."""
        return tuple(sorted(i for rank in self.ranks for mb in rank for i in mb))

    def to_dict(self) -> Dict[str, Any]:
        return {
            "num_microbatches": self.num_microbatches,
            "seq_length": self.seq_length,
            "micro_batch_size": self.micro_batch_size,
            "ranks": [[list(mb) for mb in rank] for rank in self.ranks],
            "num_rollouts": self.num_rollouts,
            "num_placeholders": self.num_placeholders,
            "real_tokens": self.real_tokens,
            "fill": self.fill,
            "dp_imbalance": self.dp_imbalance,
            "dp_imbalance_cost": self.dp_imbalance_cost,
            "oversize_samples": list(self.oversize_samples),
            # num_microbatches counts per DP rank; the bound is given per rank too (a rank runs
            # at least ceil(bound / dp) micro-batches) and, named so, over all ranks (issue 29).
            "lower_bound_microbatches_per_rank": ceil_div(
                self.lower_bound_microbatches, max(1, len(self.ranks))
            ),
            "lower_bound_microbatches_all_ranks": self.lower_bound_microbatches,
            # The earlier name of the all-ranks bound, kept: readers of plan --json rely on it.
            "lower_bound_microbatches": self.lower_bound_microbatches,
            "min_microbatches": self.min_microbatches,
            "truncated_samples": list(self.truncated_samples),
            "truncated_tokens": self.truncated_tokens,
            "kept_lengths": [list(pair) for pair in self.kept_lengths],
            "dp_imbalance_computed": self.dp_imbalance_computed,
            "row_lengths": [list(rows) for rows in self.row_lengths],
            "packed_rows": [[list(counts) for counts in rank] for rank in self.packed_rows],
            "idle_ranks": self.idle_ranks,
        }


@dataclass(frozen=True)
class PlanStats:
    """Whole-plan statistics (the ``stats`` object of ``plan --json``)."""

    num_samples: int
    num_steps: int
    num_placeholders: int
    num_microbatches: int
    """All micro-batches the plan runs: sum over steps of dp_size * num_microbatches."""
    num_real_microbatches: int
    """Micro-batches holding at least one sample."""
    lower_bound_microbatches: int
    """Sum over steps of: oversize samples + ceil(padded tokens of the others / cap); with a memory
    budget the cap here is the token budget times cp, which rows of ``B > 1`` may share
    (:attr:`.spec.PlannerConfig.multi_row_cap`)."""
    fill: float
    """Real tokens / computed tokens (dp * M * B * S, or the row lengths, summed over steps)."""
    dp_imbalance: float
    """Worst step's max/mean real tokens over DP ranks."""
    dp_imbalance_cost: float
    """Worst step's max/mean cost over DP ranks."""
    oversize_samples: Tuple[int, ...]
    max_microbatch_tokens: int
    """Largest padded footprint of any micro-batch (B*S for padded, S for packed)."""
    truncated_samples: Tuple[int, ...] = ()
    """Samples cut to the cap (``truncate`` oversize policy)."""
    truncated_tokens: int = 0
    """Tokens cut from them, all steps."""
    dp_imbalance_computed: float = 1.0
    """Worst step's max/mean computed cost over DP ranks (padding and placeholders included)."""
    idle_ranks: int = 0
    """Sum over steps of the DP ranks without a real sample (:attr:`StepPlan.idle_ranks`)."""

    @classmethod
    def from_steps(
        cls, steps: Sequence[StepPlan], *, num_samples: int, dp_size: int
    ) -> "PlanStats":
        """Whole-plan statistics of the steps (one home for the planner and fixed batching)."""
        computed = sum(
            (
                sum(map(sum, s.row_lengths))
                if s.row_lengths
                else dp_size * s.num_microbatches * s.micro_batch_size * s.seq_length
            )
            for s in steps
        )
        return cls(
            num_samples=num_samples,
            num_steps=len(steps),
            num_placeholders=sum(s.num_placeholders for s in steps),
            num_microbatches=sum(dp_size * s.num_microbatches for s in steps),
            num_real_microbatches=sum(
                dp_size * s.num_microbatches - s.num_placeholders for s in steps
            ),
            lower_bound_microbatches=sum(s.lower_bound_microbatches for s in steps),
            fill=sum(s.real_tokens for s in steps) / computed,
            dp_imbalance=max(s.dp_imbalance for s in steps),
            dp_imbalance_cost=max(s.dp_imbalance_cost for s in steps),
            oversize_samples=tuple(i for s in steps for i in s.oversize_samples),
            max_microbatch_tokens=max(s.micro_batch_size * s.seq_length for s in steps),
            truncated_samples=tuple(i for s in steps for i in s.truncated_samples),
            truncated_tokens=sum(s.truncated_tokens for s in steps),
            dp_imbalance_computed=max(s.dp_imbalance_computed for s in steps),
            idle_ranks=sum(s.idle_ranks for s in steps),
        )

    def to_dict(self) -> Dict[str, Any]:
        return plain_fields(self)


@dataclass(frozen=True)
class Plan:
    """A whole schedule: every step, every DP rank. Identical on every rank for the same input."""

    steps: Tuple[StepPlan, ...]
    stats: PlanStats
    layout: str
    """``packed`` or ``padded``."""
    sample_multiple: int
    """Each sample of a packed row is padded to a multiple of this (TP/CP needs)."""
    token_cap: int
    """max_tokens_per_gpu * cp_size."""
    dp_size: int

    def scheduled_steps(self) -> Tuple[ScheduledStep, ...]:
        """Every step as the runtime reads it (:class:`~.schedule.Schedule`)."""
        return tuple(
            ScheduledStep(
                ranks=step.ranks,
                seq_length=step.seq_length,
                row_lengths=step.row_lengths,
                micro_batch_size=step.micro_batch_size,
                kept_lengths=step.kept_lengths,
                packed_rows=step.packed_rows,
                sample_lengths=step.sample_lengths,
            )
            for step in self.steps
        )

    def kept_lengths(self) -> Dict[int, int]:
        """Sample -> kept length of every sample the ``truncate`` policy cut, all steps."""
        return {i: k for step in self.steps for i, k in step.kept_lengths}

    def to_dict(self) -> Dict[str, Any]:
        """The public ``plan --json`` object (see README, "plan --json")."""
        return {
            "layout": self.layout,
            "sample_multiple": self.sample_multiple,
            "token_cap": self.token_cap,
            "dp_size": self.dp_size,
            "steps": [step.to_dict() for step in self.steps],
            "stats": self.stats.to_dict(),
        }

    def fingerprint(self) -> str:
        """A short hash of the schedule; ranks compare it before running a step."""
        canon: List[Any] = [
            self.layout,
            self.sample_multiple,
            [[s.num_microbatches, s.seq_length, s.micro_batch_size, s.ranks] for s in self.steps],
        ]
        kept = [s.kept_lengths for s in self.steps if s.kept_lengths]
        if kept:
            # Only when something was cut, so untruncated plans keep their fingerprints.
            canon.append(kept)
        rows = [s.row_lengths for s in self.steps if s.row_lengths]
        if rows:
            # Only with variable rows, so uniform plans keep their fingerprints.
            canon.append(["rows", rows])
        packed = [s.packed_rows for s in self.steps if s.packed_rows]
        if packed:
            # Only with B > 1 packed rows, so other plans keep their fingerprints.
            canon.append(["packed_rows", packed])
        text = json.dumps(canon, separators=(",", ":"), default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def plain_fields(record: Any) -> Dict[str, Any]:
    """A dataclass record's fields by name, tuples (nested ones too) as lists and mappings as
    dicts: the JSON-ready dict of a plan's statistics, a measured step or a calibration."""
    return {f.name: _plain(getattr(record, f.name)) for f in dataclasses.fields(record)}


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return dict(value)
    return value


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
    lengths: Tuple[Tuple[int, ...], ...] = ()
    """``lengths[r][i]``: the tokens each sample was planned with (``()``: not kept); the
    materializer checks the samples against them."""

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
        return (
            ScheduledStep(
                ranks=ranks,
                seq_length=None,
                micro_batch_size=self.rows,
                planned_lengths=self.lengths,
            ),
        )

    def fingerprint(self) -> str:
        """A short hash that every rank compares before the pipeline starts."""
        text = json.dumps([self.num_microbatches, self.rows, self.ranks], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
