"""slime's ``DPSchedule`` as the steps the runtime reads (:class:`~megatron_dynbatch.planning.
schedule.Schedule`): its four-tuple's local indices turned back into global samples, per step.

Kept beside the schedule builder rather than in it: the conversion reads only the tuple's public
members (``partitions``, ``micro_batch_indices``, ``num_microbatches``, ``row_lengths``,
``seq_lengths``), so it holds for any schedule of that shape. Standard library and the pure
planner only.
"""

from __future__ import annotations

from typing import Any, Tuple

from megatron_dynbatch.planning.schedule import ScheduledStep

__all__ = ["dp_schedule_steps"]


def dp_schedule_steps(schedule: Any) -> Tuple[ScheduledStep, ...]:
    """Every step of a ``DPSchedule``: ``ranks[r][m]`` in global sample indices (``()`` a
    placeholder), each micro-batch's own row (slime runs one packed row per micro-batch), as
    slime ships them: one context-parallel rank's share (``rows_per_cp_rank``)."""
    steps = []
    start = 0
    for s, count in enumerate(schedule.num_microbatches):
        ranks = tuple(
            tuple(tuple(partition[j] for j in mb) for mb in micro_batches[start : start + count])
            for partition, micro_batches in zip(
                schedule.partitions, schedule.micro_batch_indices, strict=True
            )
        )
        rows = tuple(tuple(rows[start : start + count]) for rows in schedule.row_lengths)
        steps.append(
            ScheduledStep(
                ranks=ranks,
                seq_length=schedule.seq_lengths[s],
                row_lengths=rows,
                micro_batch_size=schedule.micro_batch_size,
                rows_per_cp_rank=True,
            )
        )
        start += count
    return tuple(steps)
