"""The names slime's patches import; the code lives in ``integrations/slime``.

slime's patched rollout manager does ``from megatron_dynbatch.adapters.slime import
build_dp_schedule``; this module keeps that import working (its errors about the parallel layout
name slime's, Megatron-LM's, flags, e.g. ``--microbatch-group-size-per-virtual-pipeline-stage``).
:class:`DynamicBatching` (torch) is loaded only when asked for, so the rollout side imports no
torch through this module.
"""

from megatron_dynbatch.integrations.slime.dp_schedule import DPSchedule, DPScheduleError
from megatron_dynbatch.integrations.slime.schedule import build_dp_schedule

__all__ = [
    "DPSchedule",
    "DPScheduleError",
    "DynamicBatching",  # noqa: F822 (loaded lazily by __getattr__)
    "build_dp_schedule",
]


def __getattr__(name):
    if name == "DynamicBatching":
        from megatron_dynbatch.integrations.slime.dynamic_batching import DynamicBatching

        return DynamicBatching
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
