"""slime's training forward with Megatron's ``padding_mask``: MoE routers see real tokens only.

slime's ``get_batch`` packs a micro-batch's samples into one THD row ``[1, T]`` (each sample cut
into its context-parallel chunks, the row padded to the step's row length by the patched
``get_batch``). Padding in that row: the row's tail, each sample's context-parallel rounding pad,
every token of a placeholder micro-batch and of the phantom sample of a rank without samples
(:mod:`.empty_rank`). :func:`padding_mask` marks exactly those positions, by putting a "real"
indicator through slime's own slicing (``slice_with_cp``), so it follows slime's layout by
construction; :func:`model_forward` passes it to the model (patch ``0009``) inside
:func:`megatron_dynbatch.mcore.moe.placeholder_routing`.

Torch only at import time (slime and megatron are imported inside the functions).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch
import torch.nn.functional as F

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime.placeholders import is_placeholder

__all__ = ["padding_mask", "model_forward"]


def _last_is_padding(data_iterator: Any) -> bool:
    """Whether the micro-batch ``data_iterator`` last returned holds no real sample: every sample
    it names has the placeholder marker as its rollout position (the phantom), or it names none
    (a placeholder micro-batch)."""
    indices = data_iterator.micro_batch_indices[data_iterator.offset - 1]
    positions = (getattr(data_iterator, "rollout_data", None) or {}).get("partition")
    return is_placeholder(list(indices) if positions is None else [positions[i] for i in indices])


def padding_mask(data_iterator: Any, batch: Mapping[str, Any], allgather_cp: bool) -> torch.Tensor:
    """``[1, T]`` bool, True on padding, for the row slime's ``get_batch`` just built.

    Args:
        data_iterator: The :class:`~megatron_dynbatch.integrations.slime.backend.SlimeDataIterator`
            the batch came from (it says whether the micro-batch is a placeholder).
        batch: ``get_batch``'s result (``tokens`` ``[1, T]``, ``unconcat_tokens`` per sample).
        allgather_cp: slime's ``--allgather-cp`` (one concatenated stream cut into CP chunks).
    """
    from megatron.core import mpu
    from slime.backends.megatron_utils.cp_utils import slice_with_cp

    tokens = batch["tokens"]
    row = tokens.shape[-1]
    device = tokens.device
    if _last_is_padding(data_iterator):
        return torch.ones((1, row), dtype=torch.bool, device=device)
    real = [torch.ones(len(t), dtype=torch.bool, device=device) for t in batch["unconcat_tokens"]]
    if allgather_cp:
        cp_size = mpu.get_context_parallel_world_size()
        stream = torch.cat(real)
        stream = F.pad(stream, (0, row * cp_size - stream.numel()), value=False)
        local = stream.chunk(cp_size)[mpu.get_context_parallel_rank()]
    else:
        local = torch.cat([slice_with_cp(r, False) for r in real])
        local = F.pad(local, (0, row - local.numel()), value=False)
    if local.numel() != row:
        raise DynBatchValueError(
            f"the padding mask has {local.numel()} positions for a row of {row} tokens; slime's "
            "get_batch and megatron_dynbatch's row layout disagree (a slime version other than "
            "the one patches/slime pins?)."
        )
    return ~local.unsqueeze(0)


def model_forward(
    model: torch.nn.Module,
    forward_kwargs: Dict[str, Any],
    data_iterator: Any,
    batch: Mapping[str, Any],
    args: Any,
) -> Any:
    """``model(**forward_kwargs)`` with the padding mask for a MoE model (patch ``0009``).

    A dense model is called exactly as slime calls it.
    """
    from megatron_dynbatch.mcore.moe import is_moe_model, placeholder_routing

    if not is_moe_model(model):
        return model(**forward_kwargs)
    mask = padding_mask(data_iterator, batch, bool(getattr(args, "allgather_cp", False)))
    with placeholder_routing(model, mask):
        return model(**forward_kwargs, padding_mask=mask)
