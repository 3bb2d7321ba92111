"""Forward-only outputs back to samples: cut them out of micro-batch rows, restore sample order.

Both steps are strict. Placeholders and padding are dropped by ``sample_index`` (never by
position or count), and :func:`restore_order` fails on any missing, duplicated or unexpected
sample instead of pairing outputs with indices by ``zip``, which silently drops whatever is left
over when the two lists differ in length.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Union

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning.spec import as_int
from megatron_dynbatch.runtime.placeholders import is_placeholder

__all__ = ["split_outputs", "restore_order"]

# How many indices an error message lists before eliding the rest.
_MAX_LISTED = 10


def _listed(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:_MAX_LISTED])
    return f"[{shown}{', ...' if len(indices) > _MAX_LISTED else ''}] ({len(indices)} in all)"


def split_outputs(
    batch: Mapping[str, torch.Tensor], output: torch.Tensor
) -> Dict[int, torch.Tensor]:
    """Cut each real sample's per-token outputs out of a micro-batch.

    Args:
        batch: The micro-batch dict the output was computed from (its ``sample_index`` is used).
        output: ``[B, S, ...]`` per-token model output (log-probs, values, hidden states...).

    Returns:
        Global sample index -> ``[L_i, ...]`` view of the sample's real tokens in token order
        (position ``j`` is the output computed at token ``j``, so for next-token log-probs the last
        entry has no target). Padding, rounding pad and placeholder rows are dropped; a placeholder
        micro-batch gives ``{}``.

    Raises:
        ValueError: If ``output`` does not start with ``[B, S]`` or a sample is not one contiguous
            run of tokens (a batch that did not come from the materializer).
    """
    if not isinstance(batch, Mapping) or "sample_index" not in batch:
        raise DynBatchValueError(
            "batch has no 'sample_index': pass the micro-batch dict materialize_microbatches "
            "built (its sample_index maps every token to its sample)."
        )
    sample_index = batch["sample_index"]
    b, s = sample_index.shape
    if tuple(output.shape[:2]) != (b, s):
        raise DynBatchValueError(
            f"output has shape {tuple(output.shape)}; it must start with the micro-batch's [B, S] "
            f"= [{b}, {s}]. Transpose Megatron's [S, B, ...] outputs first."
        )
    flat_index = sample_index.reshape(-1).to("cpu")
    flat_output = output.reshape(b * s, *output.shape[2:])
    # Start of every run of equal sample_index values over the row-major flattening.
    changes = torch.nonzero(flat_index[1:] != flat_index[:-1]).reshape(-1) + 1
    starts = [0] + changes.tolist()
    ends = starts[1:] + [b * s]
    result: Dict[int, torch.Tensor] = {}
    for start, end in zip(starts, ends, strict=True):
        index = int(flat_index[start])
        if is_placeholder(index):
            continue
        if index in result:
            raise DynBatchValueError(
                f"sample {index} occupies two separate runs of this micro-batch; its tokens must "
                "be contiguous in one row (build batches with materialize_microbatches)."
            )
        if start // s != (end - 1) // s:
            raise DynBatchValueError(
                f"sample {index} spans rows {start // s} and {(end - 1) // s}; a sample must lie "
                "in one row."
            )
        result[index] = flat_output[start:end]
    return result


def restore_order(
    per_sample: Union[Mapping[int, torch.Tensor], Sequence[Mapping[int, torch.Tensor]]],
    expected: Union[int, Sequence[int]],
) -> List[torch.Tensor]:
    """Merge per-sample outputs (from one or many ranks) and return them in sample order.

    Args:
        per_sample: One mapping of global sample index -> output, or a sequence of them (for
            instance one per micro-batch, or one per DP rank after an all-gather).
        expected: ``num_samples`` (the indices are ``0 .. num_samples - 1``) or the expected global
            indices in the order to return them.

    Returns:
        ``[per_sample[i] for i in expected]``.

    Raises:
        ValueError: If an expected sample is missing, a sample is given more than once, a sample is
            not expected, or ``expected`` itself repeats an index.
    """
    count = as_int(expected)  # a count: Python, numpy or 0-d torch integer (never a bool)
    if count is not None:
        if count < 0:
            raise DynBatchValueError(f"num_samples={count} must be >= 0.")
        order = list(range(count))
    else:
        order = _indices(expected)
        repeated = sorted(i for i, count in Counter(order).items() if count > 1)
        if repeated:
            raise DynBatchValueError(
                f"expected indices repeat {_listed(repeated)}; list each sample once."
            )
    if not isinstance(per_sample, Mapping) and not isinstance(per_sample, Iterable):
        raise DynBatchValueError(
            "per_sample must be a mapping or a sequence of mappings of sample index -> tensor, "
            f"got {type(per_sample).__name__}."
        )
    parts = [per_sample] if isinstance(per_sample, Mapping) else list(per_sample)
    merged: Dict[int, torch.Tensor] = {}
    duplicated: List[int] = []
    for part in parts:
        if not isinstance(part, Mapping):
            raise DynBatchValueError(
                "per_sample must be a mapping or a sequence of mappings of sample index -> "
                f"tensor, got an element of type {type(part).__name__}."
            )
        for index, value in part.items():
            # A 0-d tensor or numpy index is its int (a tensor key hashes by identity).
            index = _indices([index], "per_sample's keys")[0]
            if index in merged:
                duplicated.append(index)
            merged[index] = value
    if duplicated:
        raise DynBatchValueError(
            f"samples {_listed(sorted(set(duplicated)))} were returned more than once; each sample "
            "must be computed by exactly one micro-batch on one rank."
        )
    wanted = set(order)
    missing = [i for i in order if i not in merged]
    unexpected = sorted(i for i in merged if i not in wanted)
    if missing or unexpected:
        raise DynBatchValueError(
            f"got outputs for {len(merged)} samples, expected {len(order)}: missing "
            f"{_listed(missing)}, unexpected {_listed(unexpected)}; every planned sample must be "
            "gathered from every rank exactly once."
        )
    return [merged[i] for i in order]


def _indices(values: Any, what: str = "expected") -> List[int]:
    """Sample indices as ints (Python, numpy or 0-d tensor integers), or a DynBatchValueError."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise DynBatchValueError(
            f"{what}={values!r} must be the number of samples or a list of sample indices."
        )
    indices = []
    for value in values:
        index = as_int(value)
        if index is None or index < 0:
            raise DynBatchValueError(
                f"{what} holds {value!r}; sample indices are integers >= 0 (the plan's)."
            )
        indices.append(index)
    return indices
