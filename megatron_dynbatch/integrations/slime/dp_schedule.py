"""What the slime drop-in returns: :class:`DPSchedule` (slime's four-tuple plus row shapes), the
log-prob passes' :class:`ForwardOnlySchedule`, the keys a rank's rollout data carries them in, and
:class:`DPScheduleError`.

Kept apart from the schedule builder (:mod:`.schedule`) because both sides read them: the rollout
side builds a schedule, the trainer (:mod:`.backend`) reads the keys back out of a rank's data.
Standard library and the pure planner only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.slime.memory import StepPeaks
from megatron_dynbatch.integrations.slime.scheduled import dp_schedule_steps
from megatron_dynbatch.planning import Plan
from megatron_dynbatch.planning.memory import MIB
from megatron_dynbatch.planning.schedule import ScheduledStep
from megatron_dynbatch.planning.spec import check_int

__all__ = [
    "DPSchedule",
    "DPScheduleError",
    "ForwardOnlySchedule",
    "LOGPROB_MICRO_BATCHES_KEY",
    "LOGPROB_ROW_LENGTHS_KEY",
    "MEMORY_BUDGET_KEY",
    "PREDICTED_PEAK_KEY",
    "ROW_LENGTHS_KEY",
    "SEQ_LENGTHS_KEY",
    "uniform_row_lengths",
]


class DPScheduleError(DynBatchValueError, AssertionError):
    """A schedule cannot be built from these arguments.

    A ``ValueError`` (a user error, with the value and the fix in the message) that is also an
    ``AssertionError``, because slime's own ``build_dp_schedule`` asserts in the same cases and
    code written against it catches ``AssertionError``.
    """


class DPSchedule(tuple):
    """``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)`` plus row shapes.

    Unpacks into slime's four items. The extra attributes:

    * ``row_lengths[r][m]``: the packed row micro-batch ``m`` of DP rank ``r`` is built with on
      one GPU (per context-parallel rank), placeholders included: what slime's patched
      ``get_batch`` pads it to. With variable rows (slime's default: it runs Megatron with
      ``variable_seq_lengths``) each micro-batch has its own row, its samples rounded up to
      ``tp_size * data_pad_size_multiplier`` where that stays within ``max_tokens_per_gpu``
      (:func:`row_length`); with uniform rows every micro-batch of a step has the step's longest.
      Score a schedule as it runs with these.
    * ``seq_lengths[s]``: the longest row of step ``s`` (with uniform rows, every row's length).
    * ``micro_batch_size``: rows per micro-batch (1: slime packs samples into one THD row).
    * ``rollout_counts[r][m]``: rollouts whose first sample (lowest global index) is in micro-batch
      ``m`` of rank ``r``; over a step they add up to ``global_batch_sizes[s]``, so a trainer that
      normalises per rollout through Megatron's per-token path can count each rollout once.
    * ``plan``: the planner's :class:`~megatron_dynbatch.planning.Plan` (``None`` on the static
      path).
    * ``forward_only``: the log-prob passes' :class:`ForwardOnlySchedule`, planned here from every
      rank's lengths so that every DP rank runs the same number of forward-only micro-batches;
      ``None`` where the log-prob passes run the training micro-batches (the static path, and
      MoE routing replay, which records and replays routing per micro-batch).
    * ``memory``: with ``--max-memory-gib``, every step's predicted peak per DP rank and pipeline
      stage (:class:`~megatron_dynbatch.integrations.slime.memory.StepPeaks`), each within the
      budget; ``None`` without it.
    """

    def __new__(
        cls,
        partitions: List[List[int]],
        micro_batch_indices: List[List[List[int]]],
        num_microbatches: List[int],
        global_batch_sizes: List[int],
        *,
        seq_lengths: Sequence[int],
        rollout_counts: Sequence[Sequence[int]],
        plan: Optional[Plan] = None,
        forward_only: Optional["ForwardOnlySchedule"] = None,
        row_lengths: Optional[Sequence[Sequence[int]]] = None,
        memory: Optional[StepPeaks] = None,
    ) -> "DPSchedule":
        self = super().__new__(
            cls, (partitions, micro_batch_indices, num_microbatches, global_batch_sizes)
        )
        self.seq_lengths = [int(s) for s in seq_lengths]
        if row_lengths is None:
            uniform = uniform_row_lengths(self.seq_lengths, num_microbatches)
            row_lengths = [list(uniform) for _ in partitions]
        self.row_lengths = [list(map(int, rows)) for rows in row_lengths]
        # Internal invariant: one row per micro-batch of every rank.
        assert [len(rows) for rows in self.row_lengths] == [len(mbs) for mbs in micro_batch_indices]
        self.micro_batch_size = 1
        self.rollout_counts = [list(counts) for counts in rollout_counts]
        self.plan = plan
        self.forward_only = forward_only
        self.memory = memory
        return self

    def __reduce__(self):
        fields = (
            tuple(self),
            self.seq_lengths,
            self.rollout_counts,
            self.plan,
            self.forward_only,
            self.row_lengths,
        )
        # Without --max-memory-gib a schedule pickles as it did before the option existed.
        return (_rebuild_schedule, fields if self.memory is None else fields + (self.memory,))

    @property
    def partitions(self) -> List[List[int]]:
        return self[0]

    @property
    def micro_batch_indices(self) -> List[List[List[int]]]:
        return self[1]

    @property
    def num_microbatches(self) -> List[int]:
        return self[2]

    @property
    def global_batch_sizes(self) -> List[int]:
        return self[3]

    @property
    def variable_rows(self) -> bool:
        """Whether micro-batches of one step run rows of different lengths."""
        return any(len(set(rows)) > 1 for rows in self._rows_per_step())

    def _rows_per_step(self) -> List[List[int]]:
        starts = [0]
        for n in self.num_microbatches:
            starts.append(starts[-1] + n)
        return [
            [row for rows in self.row_lengths for row in rows[a:b]]
            for a, b in zip(starts[:-1], starts[1:], strict=True)
        ]

    def scheduled_steps(self) -> Tuple[ScheduledStep, ...]:
        """Every step as the runtime reads it (:class:`~megatron_dynbatch.planning.schedule.
        Schedule`), in global sample indices (:mod:`.scheduled`)."""
        return dp_schedule_steps(self)

    def rank_fields(self, dp_rank: int) -> Dict[str, Any]:
        """What the patched slime ships to DP rank ``dp_rank`` besides slime's own keys.

        The trainer's :func:`~megatron_dynbatch.integrations.slime.backend.data_iterators` takes
        these keys out of the rank's rollout data again (slime would log them as metrics).
        """
        check_int("dp_rank", dp_rank, 0, "pass a data-parallel rank of the schedule.")
        if dp_rank >= len(self.partitions):
            raise DynBatchValueError(
                f"dp_rank={dp_rank} but the schedule has {len(self.partitions)} DP ranks."
            )
        fields: Dict[str, Any] = {
            SEQ_LENGTHS_KEY: list(self.seq_lengths),
            ROW_LENGTHS_KEY: list(self.row_lengths[dp_rank]),
        }
        if self.forward_only is not None:
            fields[LOGPROB_MICRO_BATCHES_KEY] = [
                list(mb) for mb in self.forward_only.micro_batch_indices[dp_rank]
            ]
            fields[LOGPROB_ROW_LENGTHS_KEY] = list(self.forward_only.row_lengths[dp_rank])
        if self.memory is not None:
            fields[PREDICTED_PEAK_KEY] = [
                [peak / MIB for peak in step] for step in self.memory.per_rank[dp_rank]
            ]
            fields[MEMORY_BUDGET_KEY] = self.memory.budget_bytes / MIB
        return fields


def uniform_row_lengths(seq_lengths: Sequence[int], num_microbatches: Sequence[int]) -> List[int]:
    """Uniform rows: every micro-batch of step ``k`` has the step's row ``seq_lengths[k]``."""
    return [int(s) for s, n in zip(seq_lengths, num_microbatches, strict=True) for _ in range(n)]


#: The keys :meth:`DPSchedule.rank_fields` ships (the patched ``get_data_iterator`` recognises
#: the schedule by the first).
SEQ_LENGTHS_KEY = "dynbatch_seq_lengths"
ROW_LENGTHS_KEY = "dynbatch_row_lengths"
LOGPROB_MICRO_BATCHES_KEY = "dynbatch_logprob_micro_batch_indices"
LOGPROB_ROW_LENGTHS_KEY = "dynbatch_logprob_row_lengths"
#: With --max-memory-gib: per step, per pipeline stage, the rank's predicted peak (MiB), and the
#: budget (MiB); the trainer logs them beside the measured peak (backend.StepPeakLog).
PREDICTED_PEAK_KEY = "dynbatch_predicted_peak_mib"
MEMORY_BUDGET_KEY = "dynbatch_memory_budget_mib"


@dataclass(frozen=True, kw_only=True)
class ForwardOnlySchedule:
    """The log-prob passes of one rollout, for every DP rank.

    Each rank's micro-batches hold only its own (training) samples, as local indices into its
    partition; ranks with fewer micro-batches are topped up with placeholders (empty lists) so every
    rank runs the same count: with expert parallelism the MoE all-to-all spans DP ranks, and unequal
    counts would leave a rank waiting in it. Every micro-batch is one packed row of
    ``row_lengths[r][m]`` tokens per GPU (one length on every rank where rows are uniform).
    """

    micro_batch_indices: List[List[List[int]]]
    """Per DP rank, per micro-batch, local sample indices (``[]``: a placeholder)."""
    row_lengths: List[List[int]]
    """Per DP rank, per micro-batch, the packed row on one GPU (per CP rank)."""

    def __post_init__(self) -> None:
        counts = {len(rank) for rank in self.micro_batch_indices}
        assert len(counts) == 1, f"forward-only micro-batch counts differ across DP ranks: {counts}"
        assert [len(r) for r in self.row_lengths] == [len(r) for r in self.micro_batch_indices]

    @property
    def row_length(self) -> int:
        """The longest forward-only row (every row's length when rows are uniform)."""
        return max(max(rows) for rows in self.row_lengths)

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batch_indices[0])


def _rebuild_schedule(
    items, seq_lengths, rollout_counts, plan, forward_only=None, row_lengths=None, memory=None
) -> DPSchedule:
    return DPSchedule(
        *items,
        seq_lengths=seq_lengths,
        rollout_counts=rollout_counts,
        plan=plan,
        forward_only=forward_only,
        row_lengths=row_lengths,
        memory=memory,
    )
