"""megatron_dynbatch: dynamic, token-budget micro-batching for Megatron-Core pipelines.

``import megatron_dynbatch`` gives the pure planner's API (standard library only: every name of
``planning.__all__``) and the error classes; the torch runtime names (``materialize_microbatches``,
``microbatch_loss``, ...) load torch on first use. Folders follow the data flow: ``planning`` -> ``runtime`` -> ``mcore`` -> ``integrations``
-> ``tools`` (docs/api.md lists the stable entry points).
"""

from megatron_dynbatch import planning as _planning
from megatron_dynbatch.errors import DynBatchError, DynBatchValueError
from megatron_dynbatch.planning import *  # noqa: F403 - the pure planner's API, planning.__all__

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

__all__ = ["DynBatchError", "DynBatchValueError", "__version__", *_planning.__all__, *_RUNTIME]


def __getattr__(name):
    if name in _RUNTIME:
        from megatron_dynbatch import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
