"""Torch runtime: materialize planned micro-batches, normalise their loss, restore output order.

Imports torch, never megatron; the Megatron integration (``megatron_dynbatch.megatron``) builds
on it.
"""

from megatron_dynbatch.runtime.loss import (
    AGGREGATIONS,
    detach_masked_positions,
    finalize_loss,
    microbatch_loss,
    reference_loss,
)
from megatron_dynbatch.runtime.materialize import (
    BUILTIN_KEYS,
    materialize_microbatches,
    microbatch_shapes,
)
from megatron_dynbatch.runtime.reorder import restore_order, split_outputs
from megatron_dynbatch.runtime.schema import (
    FIELD_KINDS,
    RESERVED_KEYS,
    SAMPLE_INPUT_KEYS,
    BatchSchema,
    CheckedSample,
    FieldSpec,
)

__all__ = [
    "AGGREGATIONS",
    "BUILTIN_KEYS",
    "FIELD_KINDS",
    "RESERVED_KEYS",
    "SAMPLE_INPUT_KEYS",
    "BatchSchema",
    "CheckedSample",
    "FieldSpec",
    "detach_masked_positions",
    "finalize_loss",
    "materialize_microbatches",
    "microbatch_loss",
    "microbatch_shapes",
    "reference_loss",
    "restore_order",
    "split_outputs",
]
