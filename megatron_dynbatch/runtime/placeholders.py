"""Placeholder tensors: a real key's dtype, device and per-row shape, with no data in it.

A placeholder (a whole micro-batch a DP rank runs to keep the count equal, or rows that fill a
micro-batch to the planned size) must look like real data to the trainer's forward and loss code
and carry nothing: zero loss weight, zero advantages, padding tokens. Every trainer integration
builds its placeholder values here, key by key, so a new key gets the same treatment everywhere.

    placeholder_tensor(batch["loss_mask"], rows=2)            # [2, *trailing] zeros
    placeholder_tensor(batch["attention_mask"], rows=2, attend_first=True)
    placeholder_tensor(nested_log_probs)                      # same jagged lengths, zeros
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["placeholder_tensor"]


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
    out = torch.zeros(shape, dtype=value.dtype, device=value.device)
    if attend_first:
        out[:, 0] = 1
    return out
