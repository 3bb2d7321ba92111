"""The loss aggregations dynamic batching normalises exactly, and their one check.

Standard library only, so the CLI's argument parser and the config can name them without torch;
:mod:`megatron_dynbatch.runtime.loss` implements them.
"""

from __future__ import annotations

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["AGGREGATIONS", "check_aggregation"]

#: ``token-mean``: masked token losses over masked tokens (Megatron's per-token loss);
#: ``seq-mean-token-mean`` / ``seq-mean-token-sum``: per-sequence token mean / sum, averaged over
#: sequences; ``sum``: masked token losses, never divided.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum")


def check_aggregation(aggregation: str) -> None:
    """Raise ``ValueError`` unless ``aggregation`` is one of :data:`AGGREGATIONS`."""
    if aggregation not in AGGREGATIONS:
        raise DynBatchValueError(
            f"aggregation={aggregation!r} is not one of {AGGREGATIONS}; pick one of them "
            "(token-mean is Megatron's per-token loss)."
        )
