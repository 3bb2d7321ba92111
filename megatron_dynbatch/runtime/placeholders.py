"""Placeholders and padding: every tensor that stands for "no data" is built here.

A placeholder (a whole micro-batch a DP rank runs to keep the count equal, rows that fill a
micro-batch to the planned size, a stand-in sample whose data a stage never reads) must look like
real data to the trainer's forward and loss code and carry nothing: zero loss weight, zero
advantages, padding tokens, a sample index no real sample has. Every path builds those values
here, so a new key or a new rule (say, "an attention mask attends to one token") is written once:

* :func:`placeholder_microbatch`: the materializer's full ``[B, S]`` micro-batch of padding, the
  start of every micro-batch it builds (real samples are then written into its rows);
* :func:`shape_only_sample`: a sample of the right length and dtypes with no data, for pipeline
  stages that never read tokens;
* :func:`placeholder_tensor`: a trainer's own key, shaped and typed like a real value (SkyRL,
  verl);
* :func:`padding_tensor`: one key of a trainer whose placeholder rules depend on the key's
  meaning (slime's per-sample lists, built by ``integrations/slime/placeholders.py``).

    placeholder_tensor(batch["loss_mask"], rows=2)            # [2, *trailing] zeros
    placeholder_tensor(batch["attention_mask"], rows=2, attend_first=True)
    placeholder_tensor(nested_log_probs)                      # same jagged lengths, zeros
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import torch

from megatron_dynbatch.runtime.schema import BatchSchema

__all__ = [
    "IGNORED_LABEL",
    "PADDING_INDEX",
    "padding_tensor",
    "placeholder_microbatch",
    "placeholder_tensor",
    "shape_only_sample",
]

#: Label written where no next token exists (last token of a sample, padding). Any valid id works
#: because the loss mask is zero there; 0 keeps cross-entropy gathers in range.
IGNORED_LABEL = 0
#: ``sample_index`` on padding, so it can never collide with a real (>= 0) global index.
PADDING_INDEX = -1


def padding_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: Optional[Union[str, torch.device]] = None,
    fill: Union[int, float] = 0,
) -> torch.Tensor:
    """``shape`` filled with ``fill`` (a padding id, 0 for masks and per-token values)."""
    return torch.full(tuple(shape), fill, dtype=dtype, device=device)


def placeholder_tensor(
    value: torch.Tensor, *, rows: Optional[int] = None, attend_first: bool = False
) -> torch.Tensor:
    """Zeros with ``value``'s dtype and device: ``rows`` rows of its trailing shape, or (``rows``
    ``None``) exactly its shape; a nested (jagged) tensor keeps its per-row lengths.

    ``attend_first``: the first position of every row is 1 (an attention mask must attend to at
    least one token, or trainers that strip padding drop the row).
    """
    if value.is_nested:
        assert rows is None, "a nested placeholder keeps the rows (and lengths) it copies"
        values = torch.zeros_like(value.values())
        if attend_first:
            values[value.offsets()[:-1]] = 1
        return torch.nested.nested_tensor_from_jagged(values, offsets=value.offsets())
    shape = value.shape if rows is None else (rows, *value.shape[1:])
    out = padding_tensor(shape, value.dtype, value.device)
    if attend_first:
        out[:, 0] = 1
    return out


def placeholder_microbatch(
    schema: BatchSchema, b: int, s: int, device: Optional[Union[str, torch.device]] = None
) -> Dict[str, torch.Tensor]:
    """A full ``[B, S]`` micro-batch of padding with every key of ``schema`` (no ``cu_seqlens``).

    Padding tokens, label :data:`IGNORED_LABEL`, loss mask 0, ``sample_index``
    :data:`PADDING_INDEX`, every declared field at its ``pad_value``. A placeholder micro-batch is
    exactly this (plus ``cu_seqlens``); a real one starts as this and gets its samples written in.
    """
    batch = {
        "tokens": padding_tensor((b, s), torch.int64, device, schema.pad_token_id),
        "labels": padding_tensor((b, s), torch.int64, device, IGNORED_LABEL),
        "loss_mask": padding_tensor((b, s), torch.float32, device),
        "position_ids": padding_tensor((b, s), torch.int64, device),
        "segment_ids": padding_tensor((b, s), torch.int64, device),
        "sample_index": padding_tensor((b, s), torch.int64, device, PADDING_INDEX),
    }
    for spec in schema.fields:
        batch[spec.name] = padding_tensor(
            (b, s, *spec.trailing_shape), spec.dtype, device, spec.pad_value
        )
    return batch


def shape_only_sample(length: int, schema: BatchSchema) -> Dict[str, torch.Tensor]:
    """A sample of ``length`` tokens with every field of ``schema``, all zeros: what a pipeline
    stage that never reads tokens (a middle stage) materializes instead of reading the data."""
    sample: Dict[str, torch.Tensor] = {"tokens": padding_tensor((length,), torch.int64)}
    for spec in schema.fields:
        shape = (length, *spec.trailing_shape) if spec.kind == "token" else spec.trailing_shape
        sample[spec.name] = padding_tensor(shape, spec.dtype)
    return sample
