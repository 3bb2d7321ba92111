"""slime's loss-masked sample: the one builder behind placeholder micro-batches and the phantom.

slime ships a rank's data as per-sample lists (``tokens``, ``loss_masks``, ``log_probs``, ...),
and its ``get_batch`` and loss code read them by key. Two things of ours must look like such a
sample and contribute nothing:

* a *placeholder micro-batch* (an empty index list of the schedule): one sample of a whole
  planned row, so every pipeline stage runs the row shape its peers run
  (:class:`~megatron_dynbatch.integrations.slime.backend.SlimeDataIterator`);
* the *phantom sample* of a DP rank that holds no sample of the rollout, so slime's per-sample code
  runs on it in step with the other ranks (:mod:`.empty_rank`).

Both come from :func:`placeholder_sample`, key by key, with the tensors made by
:mod:`megatron_dynbatch.runtime.placeholders`: padding tokens, loss mask 0 on every response
token, every per-token value 0, reward 0, and the placeholder marker as its rollout position
(``partition``: :data:`~megatron_dynbatch.runtime.placeholders.PLACEHOLDER_INDEX`, what
:func:`~megatron_dynbatch.runtime.placeholders.is_placeholder` recognises). Under context parallelism the keys
slime keeps per CP rank are cut the way slime cuts them (:func:`cp_local`), in this one place.

Torch only (no megatron, no slime at import time).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Union

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.slime.config import CP_SLICED_KEYS, RESPONSE_FLOAT_KEYS
from megatron_dynbatch.runtime.placeholders import PLACEHOLDER_INDEX, padding_tensor

__all__ = [
    "NONE_KEYS",
    "cp_local",
    "masked_routed_experts",
    "placeholder_sample",
    "rollout_device",
]

#: Keys whose placeholder value is ``None`` (nothing to carry).
NONE_KEYS = ("multimodal_train_inputs", "packed_seq_params")
#: Per-sample scalars whose placeholder value is 0 (rewards, ids).
SCALAR_KEYS = ("rewards", "raw_reward", "local_raw_reward", "sample_indices", "rollout_ids")
# A placeholder's prompt is one token: slime's get_batch pads the loss mask by prompt_length - 1.
_PROMPT = 1
_PAD_TOKEN = 0
# ``unknown`` default: a key this module has no rule for is an error.
_RAISE = object()


def rollout_device(rollout_data: Mapping[str, Any]) -> torch.device:
    """Where this rank's rollout tensors live (slime moved them to the GPU already)."""
    for tokens in rollout_data.get("tokens") or ():
        if isinstance(tokens, torch.Tensor):
            return tokens.device
    sums = rollout_data.get("rollout_mask_sums")
    if isinstance(sums, torch.Tensor):
        return sums.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cp_local(values: torch.Tensor, total: int, response: int, cp_size: int) -> torch.Tensor:
    """Response values as this context-parallel rank holds them (slime's zigzag slicing)."""
    if cp_size == 1:
        return values
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    return slice_log_prob_with_cp(values, total, response)


def _cp_sliced(rollout_data: Mapping[str, Any], key: str) -> bool:
    """Whether this rank holds ``key`` per context-parallel rank (fewer values than response
    tokens), as slime does under CP for everything its forward pass computes."""
    values = rollout_data.get(key)
    lengths = rollout_data.get("response_lengths")
    if not values or not lengths or not isinstance(values[0], torch.Tensor):
        return False
    return values[0].numel() != int(lengths[0])


def masked_routed_experts(
    total: int, layers: int, topk: int, *, like: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """R3's routed experts of a sample without loss: ``[total - 1, layers, topk]``, every token
    routed to experts ``0..topk-1`` (distinct, as a router's top-k is), with ``like``'s dtype and
    device (default: long, CPU)."""
    dtype = torch.long if like is None else like.dtype
    device = None if like is None else like.device
    experts = torch.arange(topk, dtype=dtype, device=device)
    return experts.expand(total - 1, layers, topk).clone()


def _routed_experts(real: Sequence[Any], total: int) -> torch.Tensor:
    """R3's routed experts of a placeholder: the ``[layers, topk]`` of the rank's first sample,
    or, on a rank without samples, of the model (Megatron's ``--num-layers`` and
    ``--moe-router-topk``, in slime's global args)."""
    if real:
        like = torch.as_tensor(real[0])
        _, layers, topk = like.shape
        return masked_routed_experts(total, layers, topk, like=like)
    from megatron.training.global_vars import get_args

    args = get_args()
    layers = getattr(args, "num_layers", None)
    topk = getattr(args, "moe_router_topk", None)
    if not layers or not topk:
        raise DynBatchValueError(
            f"--use-rollout-routing-replay on a DP rank without samples needs the model's "
            f"num_layers ({layers}) and moe_router_topk ({topk}) in Megatron's args to shape "
            "the placeholder's routed experts; launch through slime's argument parser."
        )
    return masked_routed_experts(total, int(layers), int(topk))


def placeholder_sample(
    rollout_data: Mapping[str, Any],
    keys: Sequence[str],
    total_length: int,
    *,
    cp_size: int = 1,
    device: Optional[Union[str, torch.device]] = None,
    unknown: Any = _RAISE,
) -> Dict[str, Any]:
    """One loss-masked sample of ``total_length`` tokens carrying every requested key.

    Its tokens are padding, its loss mask is zero on every response token, every per-token value is
    0 and ``rollout_mask_sums`` is 0, so slime's forward and loss code run on it like on real data
    and it contributes exactly 0 to the loss and to every reported metric.

    Args:
        rollout_data: This rank's per-sample lists; a key it holds as ``None`` stays ``None``, and
            its real samples give R3's expert shape and the context-parallel layout of a key.
        keys: The keys to build (what ``get_batch`` asks for, or every per-sample list).
        total_length: Prompt (one token) plus response, over all context-parallel ranks.
        cp_size: Context-parallel size: keys slime keeps per CP rank are cut to this rank's chunks.
        device: Where the tensors go (default: where ``rollout_data``'s tensors are).
        unknown: The value of a key without a rule here; by default such a key is an error.

    Raises:
        ValueError: for a requested key whose placeholder value is not known (a new slime key).
    """
    device = rollout_device(rollout_data) if device is None else torch.device(device)
    response = total_length - _PROMPT
    sample: Dict[str, Any] = {}
    for key in keys:
        if rollout_data.get(key) is None or key in NONE_KEYS:
            sample[key] = None
        elif key == "tokens":
            sample[key] = padding_tensor((total_length,), torch.long, device, _PAD_TOKEN)
        elif key == "total_lengths":
            sample[key] = total_length
        elif key == "response_lengths":
            sample[key] = response
        elif key == "loss_masks":
            sample[key] = padding_tensor((response,), torch.int, device)
        elif key in RESPONSE_FLOAT_KEYS:
            values = padding_tensor((response,), torch.float32, device)
            if cp_size > 1 and (key in CP_SLICED_KEYS or _cp_sliced(rollout_data, key)):
                # Context parallelism: slime keeps these per CP rank (its forward pass computes
                # log-probs and values on this rank's chunks); the placeholder's match.
                values = cp_local(values, total_length, response, cp_size)
            sample[key] = values
        elif key == "rollout_mask_sums":
            sample[key] = padding_tensor((), torch.float32, device)
        elif key == "partition":
            sample[key] = PLACEHOLDER_INDEX  # the marker: no position in the rollout
        elif key == "rollout_top_p_token_offsets":
            sample[key] = padding_tensor((response + 1,), torch.long, device)
        elif key == "rollout_top_p_token_ids":
            sample[key] = padding_tensor((0,), torch.long, device)
        elif key == "rollout_routed_experts":
            sample[key] = _routed_experts(rollout_data[key], total_length)
        elif key in SCALAR_KEYS:
            sample[key] = 0
        elif unknown is not _RAISE:
            sample[key] = unknown
        else:
            raise DynBatchValueError(
                f"slime requested key {key!r} for a placeholder micro-batch, and megatron_dynbatch "
                "does not know its placeholder value; add it to "
                "megatron_dynbatch/integrations/slime/placeholders.py:placeholder_sample."
            )
    return sample
