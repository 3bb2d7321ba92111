"""Torch runtime: the input batch types, materialize planned micro-batches, the exact loss, reorder.

Imports torch, never megatron; ``megatron_dynbatch.mcore`` builds on it. The names below load their
module on first use, so ``runtime.aggregation`` (standard library only) can be imported by the CLI
without torch.
"""

import importlib

_HOMES = {
    "AGGREGATIONS": "aggregation",
    "check_aggregation": "aggregation",
    "LazyRolloutBatch": "batches",
    "RolloutBatch": "batches",
    "coerce_batch": "batches",
    "detach_masked_positions": "loss",
    "finalize_loss": "loss",
    "microbatch_loss": "loss",
    "reference_loss": "loss",
    "BUILTIN_KEYS": "materialize",
    "materialize_microbatches": "materialize",
    "microbatch_shapes": "materialize",
    "placeholder_tensor": "placeholders",
    "restore_order": "reorder",
    "split_outputs": "reorder",
    "FIELD_KINDS": "schema",
    "RESERVED_KEYS": "schema",
    "SAMPLE_INPUT_KEYS": "schema",
    "BatchSchema": "schema",
    "CheckedSample": "schema",
    "FieldSpec": "schema",
}

__all__ = sorted(_HOMES)


def __getattr__(name):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
