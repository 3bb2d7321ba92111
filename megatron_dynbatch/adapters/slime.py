"""The names slime's patches import; the code lives in ``integrations/slime``.

slime's patched rollout manager does ``from megatron_dynbatch.adapters.slime import
build_dp_schedule``; this module keeps that import working. :func:`build_dp_schedule` is a wrapper,
not a re-export: it runs the schedule under slime's flag names, so an error about the parallel
layout also names slime's (Megatron-LM's) flag, e.g.
``--microbatch-group-size-per-virtual-pipeline-stage``. ``DPSchedule`` and ``DPScheduleError`` are
re-exported as they are. :class:`DynamicBatching` (torch) is loaded only when asked for, so the
rollout side imports no torch through this module.
"""

from typing import Any, Sequence

from megatron_dynbatch.integrations.slime.config import slime_flags
from megatron_dynbatch.integrations.slime.schedule import DPSchedule, DPScheduleError
from megatron_dynbatch.integrations.slime.schedule import build_dp_schedule as _build_dp_schedule

__all__ = [
    "DPSchedule",
    "DPScheduleError",
    "DynamicBatching",  # noqa: F822 (loaded lazily by __getattr__)
    "build_dp_schedule",
]


def build_dp_schedule(
    args: Any,
    train_parallel_config: Any,
    total_lengths: Sequence[int],
    global_batch_size: int = None,  # type: ignore[assignment]
    rollout_indices: Sequence[Any] = None,  # type: ignore[assignment]
) -> DPSchedule:
    """:func:`megatron_dynbatch.integrations.slime.schedule.build_dp_schedule`, whose errors about
    the parallel layout name slime's (Megatron-LM's) flags."""
    with slime_flags():
        return _build_dp_schedule(
            args,
            train_parallel_config,
            total_lengths,
            global_batch_size=global_batch_size,
            rollout_indices=rollout_indices,
        )


def __getattr__(name):
    if name == "DynamicBatching":
        from megatron_dynbatch.integrations.slime.dynamic_batching import DynamicBatching

        return DynamicBatching
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
