"""The one view of a schedule the runtime and the hosts read, whatever plan kind produced it.

Three plan kinds exist because hosts meet us at different points: a :class:`~.plan.Plan` (samples
go to any DP rank: Megatron-LM, NeMo-RL), a :class:`~.sharded.ShardedPlan` (each DP rank keeps
its own samples: verl, SkyRL) and slime's ``DPSchedule`` (slime's four-tuple plus row shapes).
Their public forms stay as they are (``plan_schedule``, ``build_dp_schedule`` and ``plan --json``
keep their signatures and outputs); each also implements :class:`Schedule`: its steps as
:class:`ScheduledStep` s, the few members the materializer
(:func:`megatron_dynbatch.runtime.materialize.materialize_microbatches`) and the plan checker
(:func:`.invariants.check_plan`) read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol, Tuple, runtime_checkable

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["Schedule", "ScheduledStep"]

#: Sample indices of one micro-batch; ``()`` is a placeholder (a loss-masked micro-batch).
MicroBatch = Tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ScheduledStep:
    """One optimizer step (or one forward-only pass) of any plan kind."""

    ranks: Tuple[Tuple[MicroBatch, ...], ...]
    """``ranks[r][m]``: the samples of micro-batch ``m`` on DP rank ``r``, in run order, every rank
    the same count (placeholders included). Indices are the plan kind's: global sample indices for
    a Plan and slime's schedule, the rank's own (local) indices for a sharded plan."""
    seq_length: Optional[int]
    """Tokens of the step's longest row (every row's, without ``row_lengths``); ``None``: the
    plan leaves the row to the samples (a sharded plan: each rank's rows fit its own samples)."""
    row_lengths: Tuple[Tuple[int, ...], ...] = ()
    """``row_lengths[r][m]``: the row micro-batch ``m`` of rank ``r`` runs when rows vary
    (``()``: every row is ``seq_length``)."""
    micro_batch_size: int = 1
    """Rows of every micro-batch (1: one packed row)."""
    kept_lengths: Tuple[Tuple[int, int], ...] = ()
    """``(sample, kept length)`` of every sample the plan cut to the cap."""
    packed_rows: Tuple[Tuple[Tuple[int, ...], ...], ...] = ()
    """``packed_rows[r][m]``: samples in each of the ``micro_batch_size`` packed rows (``()``:
    one row a micro-batch)."""
    rows_per_cp_rank: bool = False
    """``seq_length`` and ``row_lengths`` count one context-parallel rank's share of a row (slime
    ships them so); :meth:`whole_rows` gives the rows before the CP split."""
    planned_lengths: Tuple[Tuple[int, ...], ...] = ()
    """A sharded plan's ``planned_lengths[r][i]``: the tokens local sample ``i`` of rank ``r`` was
    planned with (``()``: not given). Its rows are left to the samples (``seq_length=None``), so
    the materializer checks each sample against it: a longer one would widen a row past the cap
    unseen."""
    sample_lengths: Tuple[Tuple[int, int], ...] = ()
    """A global plan's ``(sample, tokens)`` pairs: the length each sample of the step was planned
    with (:attr:`.plan.StepPlan.sample_lengths`; ``()``: not given), checked the same way."""

    def __post_init__(self) -> None:
        counts = {len(rank) for rank in self.ranks}
        # Internal invariant: every plan kind equalises the counts by construction.
        assert len(counts) <= 1, f"unequal micro-batch counts {sorted(counts)} in one step"

    @property
    def num_microbatches(self) -> int:
        """Micro-batches every DP rank runs (what Megatron's schedule is given)."""
        return len(self.ranks[0]) if self.ranks else 0

    def rank_microbatches(self, dp_rank: int) -> Tuple[MicroBatch, ...]:
        """The ordered micro-batches of one DP rank."""
        if not 0 <= dp_rank < len(self.ranks):
            raise DynBatchValueError(
                f"dp_rank={dp_rank} is outside [0, {len(self.ranks)}) for this schedule."
            )
        return self.ranks[dp_rank]

    def whole_rows(self, cp_size: int) -> "ScheduledStep":
        """The step with rows before the context-parallel split (``cp_size`` shares of a row)."""
        if not self.rows_per_cp_rank:
            return self
        seq = None if self.seq_length is None else self.seq_length * cp_size
        rows = tuple(tuple(n * cp_size for n in rank) for rank in self.row_lengths)
        return dataclasses.replace(self, seq_length=seq, row_lengths=rows, rows_per_cp_rank=False)

    def row_length(self, dp_rank: int, m: int) -> Optional[int]:
        """The row micro-batch ``m`` of ``dp_rank`` runs (``None``: sized from its samples)."""
        if self.row_lengths:
            return self.row_lengths[dp_rank][m]
        return self.seq_length


@runtime_checkable
class Schedule(Protocol):
    """What the runtime consumes of a plan: its steps, each as a :class:`ScheduledStep`.

    Implemented by :class:`~.plan.Plan`, :class:`~.sharded.ShardedPlan` and slime's
    ``DPSchedule``; a host's own plan kind implements it to reach the materializer and the plan
    checker.
    """

    def scheduled_steps(self) -> Tuple[ScheduledStep, ...]:
        """Every step, in training order."""
        ...
