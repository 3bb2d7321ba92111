"""NeMo-RL's training forward with Megatron's ``padding_mask``: placeholder rows are padding to
MoE routers.

NeMo-RL's ``model_forward`` (``nemo_rl/models/megatron/train.py``) passes no padding mask, so every
token it packs reaches the routers' statistics (aux loss, z-loss, expert-bias counts); its own
packing pads do in stock NeMo-RL too. Our placeholder rows (a rank with fewer samples than its
share) must not (a probe: a rank of placeholder rows only counted 12 tokens in every router
layer). Patch ``0005`` enters :func:`router_padding` around that model call where the micro-batch
carries the placeholder marker (:data:`~megatron_dynbatch.runtime.placeholders.MARKER_KEY`, each
row's sample index, written into every shard by :mod:`.shard`); it adds ``padding_mask`` (True on
padding) with every token of a placeholder row marked, in the layout the model gets:

* packed THD rows (``packed_seq_params``; our switch needs NeMo-RL's sequence packing): row ``i``
  is the segment ``[cu_seqlens_q_padded[i], cu_seqlens_q_padded[i + 1])``, which NeMo-RL's
  ``_pack_sequences_for_megatron`` splits over context-parallel ranks segment by segment, so its
  local part is ``1 / cp`` of it, in segment order;
* ``[B, S]`` rows otherwise: a placeholder row from end to end.

NeMo-RL's own pads (alignment, the packed row's tail) are left as stock NeMo-RL leaves them.
A micro-batch without a real token runs with its load-balancing losses off
(:func:`megatron_dynbatch.mcore.moe.placeholder_routing`). Dense models are untouched.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Mapping, Optional

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime.placeholders import MARKER_KEY, is_placeholder

__all__ = ["placeholder_padding_mask", "router_padding"]


def placeholder_padding_mask(
    sample_index: torch.Tensor, input_ids: torch.Tensor, packed_seq_params: Any, cp_size: int
) -> torch.Tensor:
    """``padding_mask`` of ``input_ids``' shape: True on every token of a placeholder row.

    Args:
        sample_index: ``[B]``, each row's sample index (the marker on placeholder rows).
        input_ids: What the model gets: ``[1, T / cp]`` packed, or ``[B, S]``.
        packed_seq_params: NeMo-RL's ``PackedSeqParams`` (``cu_seqlens_q_padded`` over the whole
            packed row), or ``None`` for ``[B, S]`` rows.
        cp_size: Context-parallel size.
    """
    placeholder = is_placeholder(sample_index).to(torch.bool).cpu()
    mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    if packed_seq_params is None:
        if input_ids.shape[0] != placeholder.shape[0]:
            raise DynBatchValueError(
                f"{input_ids.shape[0]} rows in the micro-batch, {placeholder.shape[0]} markers."
            )
        mask[placeholder] = True
        return mask.to(input_ids.device)
    bounds = packed_seq_params.cu_seqlens_q_padded
    if bounds is None:
        bounds = packed_seq_params.cu_seqlens_q
    bounds = [int(b) // cp_size for b in bounds.tolist()]
    if len(bounds) != placeholder.shape[0] + 1 or bounds[-1] > input_ids.shape[-1]:
        raise DynBatchValueError(
            f"the packed row has {len(bounds) - 1} segments ending at token {bounds[-1]} of "
            f"{input_ids.shape[-1]}, the micro-batch {placeholder.shape[0]} marked rows."
        )
    for row in torch.nonzero(placeholder).flatten().tolist():
        mask[..., bounds[row] : bounds[row + 1]] = True
    return mask.to(input_ids.device)


@contextlib.contextmanager
def router_padding(
    model: torch.nn.Module,
    model_kwargs: Dict[str, Any],
    data_dict: Mapping[str, Any],
    input_ids: torch.Tensor,
    packed_seq_params: Any = None,
) -> Iterator[None]:
    """Around NeMo-RL's model call (patch ``0005``): ``padding_mask`` in ``model_kwargs`` for a
    MoE model, its placeholder rows marked; nothing for a dense model or a micro-batch without
    the marker (a shard of NeMo-RL's own)."""
    from megatron.core import parallel_state

    from megatron_dynbatch.mcore.moe import masked_routing

    def mask_of() -> Optional[torch.Tensor]:
        sample_index = data_dict.get(MARKER_KEY) if hasattr(data_dict, "get") else None
        if sample_index is None:
            return None
        return placeholder_padding_mask(
            sample_index,
            input_ids,
            packed_seq_params,
            parallel_state.get_context_parallel_world_size(),
        )

    with masked_routing(model, model_kwargs, mask_of):
        yield
