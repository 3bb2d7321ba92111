"""verl's forward step with Megatron's ``padding_mask`` on placeholders: routers see real tokens.

A verl placeholder micro-batch (:func:`~.engine.placeholder_micro_batch`) is a copy of the rank's
shortest sample with every weight zeroed: its tokens are real token ids, so without a mask a MoE
model's routers count them in the z-loss and every load-balancing statistic, and aux-loss
gradients flow from them. It is known by its marker, never by its content: the non-tensor
:data:`~megatron_dynbatch.runtime.placeholders.MARKER_KEY` holds the placeholder's sample index
(:func:`~megatron_dynbatch.runtime.placeholders.is_placeholder`); a real micro-batch has none. Patch ``0002`` calls :func:`mask_placeholder_routing` in
``MegatronEngine.forward_step`` (with ``use_dynamic_batch_size`` on) before verl's model forward.
For a placeholder micro-batch of a MoE model it adds ``padding_mask``, True on every position, to
the next forward of ``model`` (a pre-hook: the mask takes the shape of what verl hands the model,
``[1, T]`` of its THD row, ``T`` from ``packed_seq_params`` and this rank's context-parallel share,
or the ``[B, S]`` of its padded rows) and runs that forward with the load-balancing losses off
(:func:`megatron_dynbatch.mcore.moe.placeholder_routing`: Megatron would divide 0 by 0). Real
micro-batches are called as verl calls them (their THD alignment pads are counted as in stock
verl). A dense model, or a real micro-batch, is left untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_dynbatch.runtime.placeholders import MARKER_KEY, is_placeholder

__all__ = ["is_placeholder_batch", "mask_placeholder_routing"]


def is_placeholder_batch(batch: Any, tu: Any) -> bool:
    """Whether verl micro-batch ``batch`` is a placeholder: its non-tensor
    :data:`~megatron_dynbatch.runtime.placeholders.MARKER_KEY` (only placeholders carry one) is
    the marker. ``tu``: ``verl.utils.tensordict_utils``."""
    index = tu.get_non_tensor_data(batch, MARKER_KEY, None)
    return index is not None and bool(is_placeholder(index))


def _all_padding(kwargs: dict, cp_size: int) -> torch.Tensor:
    params = kwargs.get("packed_seq_params")
    if params is not None:
        total = int(params.cu_seqlens_q_padded[-1])
        device = params.cu_seqlens_q_padded.device
        return torch.ones((1, total // cp_size), dtype=torch.bool, device=device)
    ids = kwargs["input_ids"]
    return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)


def mask_placeholder_routing(model: torch.nn.Module, batch: Any) -> None:
    """Make ``model``'s next forward see ``batch`` (a placeholder micro-batch) as padding only.

    Does nothing for a real micro-batch or a dense model, and when verl already passes a mask.
    """
    from megatron.core import parallel_state
    from verl.utils import tensordict_utils as tu

    from megatron_dynbatch.mcore.moe import is_moe_model, placeholder_routing

    if not is_placeholder_batch(batch, tu) or not is_moe_model(model):
        return
    cp_size = parallel_state.get_context_parallel_world_size()
    routing = placeholder_routing(model, torch.ones((1, 1), dtype=torch.bool))
    handles = []

    def before(module, args, kwargs):
        handles.pop(0).remove()
        if kwargs.get("padding_mask") is None:
            kwargs["padding_mask"] = _all_padding(kwargs, cp_size)
        routing.__enter__()
        return args, kwargs

    def after(module, args, output):
        handles.pop(0).remove()
        routing.__exit__(None, None, None)

    handles.append(model.register_forward_pre_hook(before, with_kwargs=True))
    handles.append(model.register_forward_hook(after))
