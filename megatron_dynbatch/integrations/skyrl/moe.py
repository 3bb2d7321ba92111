"""SkyRL's training forward with Megatron's ``padding_mask``: MoE routers see real tokens only.

SkyRL's model wrapper (``forward_backward_mini_batch``) strips each row's left padding
(``remove_left_padding``: the row's attended tokens first, then zeros) and passes a router
padding mask to the model only under router replay. Patch ``0004`` enters :func:`router_padding`
around its model call; with ``trainer.use_dynamic_batch_size`` and a MoE model it adds
``padding_mask`` (True on padding) to the call's keyword arguments:

* the positions after each row's attended tokens;
* every position of a placeholder row. A placeholder row is known by its marker, never by its
  content: the micro-batch dict carries every row's sample index under
  :data:`~megatron_dynbatch.runtime.placeholders.MARKER_KEY` (written by
  :meth:`~.iterator.PlannedBatchIterator.mark_rows`, patch ``0002``), and
  :func:`~megatron_dynbatch.runtime.placeholders.is_placeholder` says which rows hold no sample.

With sample packing (``trainer.remove_microbatch_padding``, SkyRL's default) the same positions
are marked in the THD row of ``preprocess_packed_seqs`` (alignment pads, context-parallel chunks).
A micro-batch without a real token then runs with its load-balancing losses off
(:func:`megatron_dynbatch.mcore.moe.placeholder_routing`). Under router replay SkyRL's own mask
is kept.

Torch only at import time (megatron is imported inside the functions).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Mapping, Optional

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime.placeholders import MARKER_KEY, is_placeholder

__all__ = ["packed_padding_mask", "padding_mask", "router_padding"]


def padding_mask(sample_index: torch.Tensor, new_attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S']`` bool, True on padding, in the layout of ``remove_left_padding``'s output.

    Args:
        sample_index: ``[B]``: each row's sample index (the placeholder marker on placeholder rows).
        new_attention_mask: ``remove_left_padding``'s ``[B, S']`` mask (attended tokens first).
    """
    mask = ~new_attention_mask.to(torch.bool)
    mask[is_placeholder(sample_index).to(mask.device)] = True
    return mask


def packed_padding_mask(
    attention_mask: torch.Tensor,
    sample_index: torch.Tensor,
    packed_seq_params: Any,
    cp_rank: int,
    cp_size: int,
) -> torch.Tensor:
    """``[1, T]`` bool, True on padding, in the layout of SkyRL's ``preprocess_packed_seqs``.

    Row ``i`` (one THD segment, rows not packed by the controller) holds its attended tokens,
    then its alignment pad up to ``cu_seqlens_q_padded``; with context parallelism each segment is
    cut into ``2 * cp_size`` chunks and this rank holds chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank``, as ``preprocess_packed_seqs`` lays them out. ``sample_index``
    (``[B]``) marks the placeholder rows.
    """
    lengths = attention_mask.to(torch.int64).sum(dim=1).tolist()
    bounds = packed_seq_params.cu_seqlens_q_padded.tolist()
    placeholder = is_placeholder(sample_index).tolist()
    pieces = []
    for i, length in enumerate(lengths):
        padded = bounds[i + 1] - bounds[i]
        real = torch.zeros(padded, dtype=torch.bool, device=attention_mask.device)
        if not placeholder[i]:
            real[:length] = True
        if cp_size > 1:
            half = padded // cp_size // 2
            real = torch.cat(
                [
                    real[half * cp_rank : half * (cp_rank + 1)],
                    real[padded - half * (cp_rank + 1) : padded - half * cp_rank],
                ]
            )
        pieces.append(real)
    return ~torch.cat(pieces).unsqueeze(0)


@contextlib.contextmanager
def router_padding(
    model: torch.nn.Module,
    model_kwargs: Dict[str, Any],
    batch: Mapping[str, Any],
    attention_mask: torch.Tensor,
    new_attention_mask: Optional[torch.Tensor],
    packed_seq_params: Any = None,
) -> Iterator[None]:
    """Around SkyRL's model call: add ``padding_mask`` to ``model_kwargs`` (patch ``0004``, entered
    only with ``trainer.use_dynamic_batch_size``).

    ``batch``: the micro-batch dict of SkyRL's ``forward_step`` (its
    :data:`~megatron_dynbatch.runtime.placeholders.MARKER_KEY` marks the placeholder rows).
    ``new_attention_mask``: ``remove_left_padding``'s mask (padded rows), or None with sample
    packing, where ``packed_seq_params`` gives the THD layout. Does nothing for a dense model and
    under router replay (the kwargs already hold SkyRL's mask).

    Raises:
        DynBatchValueError: for a MoE model when ``batch`` carries no marker (a micro-batch that
            did not come from :meth:`~.iterator.PlannedBatchIterator.mark_rows`).
    """
    from megatron.core import parallel_state

    from megatron_dynbatch.mcore.moe import masked_routing

    def mask_of() -> torch.Tensor:
        sample_index = batch.get(MARKER_KEY)
        if sample_index is None:
            raise DynBatchValueError(
                f"SkyRL's micro-batch carries no {MARKER_KEY!r}: with "
                "trainer.use_dynamic_batch_size its micro-batches must come from "
                "megatron_dynbatch's iterator (patch 0002 marks them); re-apply patches/skyrl or "
                "set trainer.use_dynamic_batch_size=false."
            )
        if new_attention_mask is not None:
            return padding_mask(sample_index, new_attention_mask)
        return packed_padding_mask(
            attention_mask,
            sample_index,
            packed_seq_params,
            parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_world_size(),
        )

    with masked_routing(model, model_kwargs, mask_of):
        yield
