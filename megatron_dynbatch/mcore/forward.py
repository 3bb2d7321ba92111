"""The one Megatron ``forward_step_func`` for planned micro-batches, and their attention layout.

The library path (``mcore.step``) and the Megatron-LM entry (``launch/pretrain_gpt_dynbatch.py``,
fixed and planned document micro-batches alike) both use :func:`make_forward_step`.

A micro-batch is a dict of ``[B, S]`` tensors: ``tokens`` and ``labels`` (int64), ``position_ids``
(int64, restarting at 0 for every sample), ``segment_ids`` (int64, ``0..k-1`` for the k samples of
a row, ``k`` and up for the padding tail's segments) and ``loss_mask`` (float32); with
``sample_index`` (-1 on padding and placeholders) a MoE model also gets Megatron's
``padding_mask`` (see :mod:`.moe`).
Attention stays inside a sample through a block-diagonal causal mask. Megatron's local ``DotProductAttention`` applies a passed
mask as is when its ``attn_mask_type`` is ``arbitrary`` (see ``megatron_dynbatch.tools.testing.tiny_gpt.tiny_layer_spec``); with
``causal`` only its unfused fp32 softmax does, the fused fp16/bf16 kernel silently ignores it.
"""

from functools import partial
from typing import Callable, Iterator, Optional

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.mcore.moe import is_moe_model, padding_mask_of, placeholder_routing

__all__ = [
    "MICROBATCH_KEYS",
    "build_attention_mask",
    "make_forward_step",
    "packed_seq_params_from_batch",
    "thd_packed_seq_params",
]

MICROBATCH_KEYS = ("tokens", "position_ids", "segment_ids", "labels", "loss_mask")

LossFn = Callable[[dict, torch.Tensor], tuple]


def build_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask for packed rows, in Megatron's convention (True = masked).

    Example: ``segment_ids = [[0, 0, 1, 1, 2]]`` (two samples and one padding token) lets token 3
    see tokens 2 and 3 only; the padding token sees only itself, so no row is fully masked.

    Args:
        segment_ids: ``[B, S]`` int64 sample index of every token within its row.

    Returns:
        ``[B, 1, S, S]`` bool tensor; entry ``[b, 0, q, k]`` is True when query q must not attend
        to key k.
    """
    if segment_ids.dim() != 2:
        raise DynBatchValueError(
            f"segment_ids must be [batch, seq], got shape {tuple(segment_ids.shape)}; "
            "pass one row of segment ids per packed sequence."
        )
    seq_length = segment_ids.shape[1]
    same_segment = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=segment_ids.device).tril()
    return (~(same_segment & causal)).unsqueeze(1)


def packed_seq_params_from_batch(batch: dict, host: Optional[dict] = None):
    """THD ``PackedSeqParams`` of a packed micro-batch (``micro_batch_size`` 1), for TE attention.

    Segments are the materializer's ``cu_seqlens``: each sample rounded up to the TP/CP multiple,
    then the row's padding tail as segments of its own (of at most
    :data:`~megatron_dynbatch.planning.cost.TAIL_SEGMENT_TOKENS`, rounded up to the multiple), so
    ``cu_seqlens[-1]`` equals the row length S on every micro-batch, placeholders included. The
    rounded boundaries serve as both the real and the padded ones: the rounding pad sits after a
    sample's last token, so causal attention never lets a real token see it, and its loss mask is
    zero. ``host``: the same micro-batch before it moved to the device, read instead (no device
    sync).
    """
    tokens = batch["tokens"]
    if tokens.shape[0] != 1:
        raise DynBatchValueError(
            f"THD packing needs micro_batch_size 1, got a [{tokens.shape[0]}, {tokens.shape[1]}] "
            "micro-batch; use --dynamic-batch-layout packed, or the attention mask for padded rows."
        )
    given = (host or batch)["cu_seqlens"]
    max_seqlen = int((given[1:] - given[:-1]).max())
    cu_seqlens = batch["cu_seqlens"].to(device=tokens.device, dtype=torch.int32)
    return thd_packed_seq_params(cu_seqlens, max_seqlen, padded=cu_seqlens)


def thd_packed_seq_params(
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    padded: Optional[torch.Tensor] = None,
    **extra,
):
    """Self-attention THD ``PackedSeqParams``: query and key/value share the boundaries (the
    padded ones where given, as Megatron's stock batches do) and ``max_seqlen``; ``extra``: other
    fields (``tokens_per_sample``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    boundaries = padded if padded is not None else cu_seqlens
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=boundaries,
        cu_seqlens_kv=boundaries,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        **extra,
    )


def _collect_logprobs(batch: dict, per_token_loss: torch.Tensor, non_loss_data: bool = False):
    """Loss function of forward-only log-prob passes.

    The cross entropy GPTModel returns for given labels is ``-log p(label)`` (Megatron's
    vocab-parallel cross entropy: equal to a log-softmax over the full vocabulary, and right
    under tensor parallelism too), so no logits need to leave the model.

    With ``collect_non_loss_data=True`` the schedule stores the returned dict as is; otherwise it
    expects the 3-tuple form and stores its third element, the same dict (the zero loss and token
    count are never back-propagated in a forward-only pass).
    """
    logprobs = {"logprobs": (-per_token_loss).detach()}
    if non_loss_data:
        return logprobs
    zero = per_token_loss.new_zeros(())
    return zero, torch.zeros((), dtype=torch.int, device=batch["tokens"].device), logprobs


def _attention(batch: dict, thd: bool, host: Optional[dict] = None) -> tuple:
    """``(attention_mask, packed_seq_params)`` of a micro-batch.

    Without ``thd``: the block-diagonal causal mask of ``segment_ids``. With ``thd``: THD
    ``PackedSeqParams`` for a packed row (``[1, S]`` with ``cu_seqlens``); rows of one sample each
    (padding at the end) need only the causal mask, which transformer-engine applies itself when
    given none. ``host``: the micro-batch before it moved to the device; its values are read in
    the checks, so no step waits on the device.
    """
    if not thd:
        return build_attention_mask(batch["segment_ids"]), None
    if batch["tokens"].shape[0] == 1 and "cu_seqlens" in batch:
        return None, packed_seq_params_from_batch(batch, host)
    batch = host or batch
    if "cu_seqlens" in batch and int(batch["segment_ids"].max()) > 1:
        # The planner packs B > 1 rows only for row-wise attention (dense, causal); THD costs a
        # row of B * S holding the same samples no more, so it plans one row a micro-batch.
        raise DynBatchValueError(
            f"a packed micro-batch of {batch['tokens'].shape[0]} rows reached THD attention, "
            "which runs one packed row a micro-batch; plan with the cost model's attention kind "
            "'segment' (the default with transformer-engine: drop --dynamic-batch-cost-attention "
            "dense / causal), or use the local transformer implementation (block-diagonal mask)."
        )
    # segment_ids: 0 for a row's only sample, 1 for its padding tail; more means packed samples,
    # which a causal mask would let attend to each other.
    if int(batch["segment_ids"].max()) > 1:
        raise DynBatchValueError(
            "a micro-batch with several samples per row needs 'cu_seqlens' for THD attention; "
            "materialize it with megatron_dynbatch.runtime.materialize_microbatches (which adds "
            "them), or use the local transformer implementation (block-diagonal mask)."
        )
    return None, None


def make_forward_step(
    loss_fn: LossFn | None = None,
    *,
    collect_logprobs: bool = False,
    thd: bool = False,
    to_device: bool = False,
    timers: Optional[Callable] = None,
    on_batch: Optional[Callable[[dict, torch.nn.Module], None]] = None,
) -> Callable[[Iterator[dict], torch.nn.Module], tuple]:
    """Build a Megatron ``forward_step_func`` for micro-batch dicts.

    Args:
        loss_fn: ``loss_fn(batch, per_token_loss [B, S]) -> (loss_sum, num_tokens, logging_dict)``,
            the 3-tuple form Megatron expects with ``calculate_per_token_loss=True``. Required
            unless ``collect_logprobs``.
        collect_logprobs: Forward-only mode: the schedule returns ``{"logprobs": [B, S]}`` per
            micro-batch (log-prob of each label), on the last pipeline stage only. Run it with
            ``forward_only=True`` (``collect_non_loss_data`` either way).
        thd: Transformer-engine attention: packed rows pass ``PackedSeqParams`` (THD,
            ``cu_seqlens``) and padded rows the causal mask, instead of a dense block-diagonal mask
            (which Megatron's local ``DotProductAttention``, the CPU path, needs: it refuses THD).
        to_device: Move the micro-batch to the current CUDA device first (Megatron-LM's entry,
            whose data stays on the CPU until its step); the library path materializes in place.
        timers: Megatron's ``get_timers()``: times reading the micro-batch as ``batch-generator``,
            as ``pretrain_gpt.py`` does.
        on_batch: Called with every micro-batch as read (before it moves to the device) and the
            model chunk, before the forward (the launch's fixed rows report their real lengths).

    Returns:
        ``forward_step(data_iterator, model) -> (output_tensor, loss_func)``. Every stage reads the
        next dict from ``data_iterator``: the first uses ``tokens`` / ``position_ids``, the last
        ``labels`` / ``loss_mask``, every stage the attention layout of the same micro-batch.
    """
    if loss_fn is None and not collect_logprobs:
        raise DynBatchValueError("make_forward_step needs a loss_fn unless collect_logprobs=True.")

    def forward_step(data_iterator: Iterator[dict], model: torch.nn.Module):
        if timers is not None:
            timers("batch-generator", log_level=2).start()
        batch = next(data_iterator)
        missing = [key for key in MICROBATCH_KEYS if key not in batch]
        if missing:
            raise DynBatchValueError(
                f"micro-batch is missing {missing} (has {sorted(batch)}); every micro-batch needs "
                f"{list(MICROBATCH_KEYS)}, with segment_ids marking the samples of packed rows."
            )
        if on_batch is not None:
            on_batch(batch, model)
        host = None
        if to_device and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            host = batch
            batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        if timers is not None:
            timers("batch-generator").stop()
        attention_mask, packed_seq_params = _attention(batch, thd, host)
        # MoE routers get the padding mask (padding tails, rounding pads, placeholders), so that
        # no padding token enters a load-balancing statistic, a z-loss or a token count; a dense
        # model's call stays exactly as before (nothing else in GPTModel reads the mask).
        extra = {}
        padding_mask = padding_mask_of(batch) if is_moe_model(model) else None
        if padding_mask is not None:
            extra["padding_mask"] = padding_mask
        # With labels, GPTModel returns per-token cross entropy [B, S] on the last stage and the
        # hidden states [S, B, H] elsewhere; it reads loss_mask only for MTP losses.
        with placeholder_routing(model, padding_mask):
            output = model(
                batch["tokens"],
                batch["position_ids"],
                attention_mask,
                labels=batch["labels"],
                loss_mask=batch["loss_mask"],
                packed_seq_params=packed_seq_params,
                **extra,
            )
        if collect_logprobs:
            return output, partial(_collect_logprobs, batch)
        return output, partial(loss_fn, batch)

    return forward_step
