"""megatron_dynbatch: dynamic, token-budget micro-batching for Megatron-Core pipelines.

``import megatron_dynbatch`` gives the pure planner (standard library only) and the error classes;
the torch runtime names (``materialize_microbatches``, ``microbatch_loss``, ...) load torch on first
use. Folders follow the data flow: ``planning`` -> ``runtime`` -> ``mcore`` -> ``integrations``
-> ``tools`` (docs/api.md lists the stable entry points).
"""

from megatron_dynbatch.errors import DynBatchError, DynBatchValueError
from megatron_dynbatch.planning import (
    CostModel,
    OversizeSampleWarning,
    ParallelLayout,
    Plan,
    PlanInvariantError,
    PlannerConfig,
    PlanStats,
    SampleSet,
    StepPlan,
    check_plan,
    parse_samples_json,
    plan_samples,
    plan_schedule,
)

__version__ = "0.1.0"

_RUNTIME = (
    "BatchSchema",
    "FieldSpec",
    "materialize_microbatches",
    "microbatch_loss",
    "reference_loss",
    "restore_order",
    "split_outputs",
)

__all__ = [
    "CostModel",
    "DynBatchError",
    "DynBatchValueError",
    "OversizeSampleWarning",
    "ParallelLayout",
    "Plan",
    "PlanInvariantError",
    "PlanStats",
    "PlannerConfig",
    "SampleSet",
    "StepPlan",
    "__version__",
    "check_plan",
    "parse_samples_json",
    "plan_samples",
    "plan_schedule",
    *_RUNTIME,
]


def __getattr__(name):
    if name in _RUNTIME:
        from megatron_dynbatch import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
