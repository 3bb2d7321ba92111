"""Reference THD attention: transformer-engine's variable-length attention, in plain torch.

On GPUs, packed micro-batches reach Megatron as THD ``PackedSeqParams`` and transformer-engine's
``DotProductAttention`` attends within each segment. Machines without CUDA cannot run
transformer-engine, and Megatron's local ``DotProductAttention`` refuses ``packed_seq_params``, so
the path every GPU user takes would go untested. :class:`ThdReferenceAttention` is a
``core_attention`` module for Megatron's local layer spec that implements the THD contract as
transformer-engine specifies it (``qkv_format="thd"``, mask type causal / padding-causal):

* ``query`` is ``[t, heads, head_dim]`` (Megatron's attention squeezes the batch dimension of a
  ``[t, 1, ...]`` packed row), ``key`` / ``value`` ``[t, query_groups, head_dim]``;
* segment ``i`` occupies tokens ``[cu_seqlens_q_padded[i], cu_seqlens_q_padded[i + 1])`` of the
  tensor (``cu_seqlens_q`` when no padded boundaries are given); its first
  ``cu_seqlens_q[i + 1] - cu_seqlens_q[i]`` tokens are real, the rest padding;
* a real token attends causally to the real tokens of its own segment only; padding tokens attend
  to nothing and their output is zero;
* ``max_seqlen_q`` / ``max_seqlen_kv`` must be at least the longest real segment (TE sizes its
  kernels from them; a smaller value is an error here rather than a silent truncation).

Without ``packed_seq_params`` (padded ``[s, b, ...]`` rows) it is Megatron's causal attention,
with ``attention_mask`` (True = masked, Megatron's convention) applied on top when one is given.
It is dense (a ``[t, t]`` score matrix per head): a reference for tests and CPU runs, not a kernel.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.mcore.thd_rope import host_boundaries, install_thd_rope

__all__ = [
    "ThdReferenceAttention",
    "segment_mask",
    "self_attention_boundaries",
    "thd_boundaries",
    "with_self_attention",
    "with_thd_reference_attention",
]


def thd_boundaries(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor], total: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The checked real and padded THD boundaries of ``total`` tokens, as int64 CPU tensors.

    Raises:
        DynBatchValueError: Boundaries that are not increasing int sequences starting at 0, a
            real segment longer than its padded one, or padded boundaries not ending at ``total``.
    """
    real = host_boundaries(cu_seqlens)
    padded = real if cu_seqlens_padded is None else host_boundaries(cu_seqlens_padded)
    if real.dim() != 1 or real.shape != padded.shape or real.numel() < 2:
        raise DynBatchValueError(
            f"cu_seqlens {real.tolist()} and cu_seqlens_padded {padded.tolist()} must be 1-D "
            "boundary lists of the same length >= 2 (one more than the segments)."
        )
    real_lengths = real[1:] - real[:-1]
    padded_lengths = padded[1:] - padded[:-1]
    if (
        int(real[0]) != 0
        or int(padded[0]) != 0
        or bool((real_lengths < 0).any())
        or bool((real_lengths > padded_lengths).any())
        or int(padded[-1]) != total
    ):
        raise DynBatchValueError(
            f"THD boundaries cu_seqlens={real.tolist()}, cu_seqlens_padded={padded.tolist()} do "
            f"not describe {total} tokens: both must start at 0 and not decrease, each real "
            "segment must fit its padded one, and the padded boundaries must end at the token "
            "count."
        )
    return real, padded


def self_attention_boundaries(
    packed_seq_params: Any, total: int, attention: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The checked real and padded boundaries of a self-attention THD ``PackedSeqParams`` of
    ``total`` tokens (:func:`thd_boundaries`), as every THD ``core_attention`` here reads them.

    ``attention`` names the module in messages.

    Raises:
        DynBatchValueError: ``qkv_format`` other than ``thd``; bad boundaries; query and
            key/value boundaries that differ; a ``max_seqlen_*`` below the longest real segment.
    """
    if packed_seq_params.qkv_format != "thd":
        raise DynBatchValueError(
            f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}; the {attention} "
            "implements 'thd' only."
        )
    real, padded = thd_boundaries(
        packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded, total
    )
    kv = thd_boundaries(
        packed_seq_params.cu_seqlens_kv, packed_seq_params.cu_seqlens_kv_padded, total
    )
    if not (torch.equal(real, kv[0]) and torch.equal(padded, kv[1])):
        raise DynBatchValueError(
            "self-attention needs equal query and key/value THD boundaries; got "
            f"cu_seqlens_q={real.tolist()}, cu_seqlens_kv={kv[0].tolist()}."
        )
    longest = int((real[1:] - real[:-1]).max())
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        given = getattr(packed_seq_params, name)
        if given is None or int(given) < longest:
            raise DynBatchValueError(
                f"packed_seq_params.{name}={given} is smaller than the longest segment "
                f"({longest} tokens); set it to at least that length."
            )
    return real, padded


def segment_mask(real: torch.Tensor, padded: torch.Tensor, total: int) -> torch.Tensor:
    """``[t, t]`` bool: may query token ``q`` attend to key token ``k`` (THD, causal), from the
    checked boundaries :func:`thd_boundaries` returns."""
    real_lengths = real[1:] - real[:-1]
    padded_lengths = padded[1:] - padded[:-1]
    segment = torch.repeat_interleave(torch.arange(padded_lengths.numel()), padded_lengths)
    within = torch.arange(total) - padded[:-1][segment]
    valid = within < real_lengths[segment]
    same = segment[:, None] == segment[None, :]
    causal = within[None, :] <= within[:, None]
    return same & causal & valid[:, None] & valid[None, :]


class ThdReferenceAttention(MegatronModule):
    """``core_attention`` for the local layer spec: THD variable-length attention in torch.

    The constructor takes what Megatron's ``DotProductAttention`` takes (it is built from the same
    ``ModuleSpec``); see the module docstring for the contract.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        del layer_number, attn_mask_type, attention_type, cp_comm_type
        if config.context_parallel_size != 1:
            raise DynBatchValueError(
                f"the reference THD attention runs with --context-parallel-size 1, got "
                f"{config.context_parallel_size}; use transformer-engine for context parallelism."
            )
        if getattr(config, "window_size", None) is not None or (
            getattr(config, "softmax_type", "vanilla") != "vanilla"
        ):
            raise DynBatchValueError(
                f"the reference THD attention implements full causal softmax attention; "
                f"window_size={config.window_size}, softmax_type={config.softmax_type!r} are not "
                "supported: drop those options or use transformer-engine."
            )
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        projection = config.kv_channels * config.num_attention_heads
        self.head_dim = divide(projection, config.num_attention_heads)
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_groups = divide(config.num_query_groups, tp_size)
        # DotProductAttention divides by the layer number for query-key layer scaling and its
        # softmax multiplies it back in fp32: the product is this scale either way.
        self.softmax_scale = (
            1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        )
        self.dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def _attend(self, query, key, value, allowed: torch.Tensor) -> torch.Tensor:
        """``query`` ``[b, h, q, d]``, ``key`` / ``value`` ``[b, g, k, d]``, ``allowed`` ``[b|1, q, k]``."""
        if self.num_groups != self.num_heads:
            repeat = self.num_heads // self.num_groups
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * self.softmax_scale
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # A row with no allowed key (padding) is all -inf: its output is zero, as in TE.
        probs = torch.nan_to_num(probs, nan=0.0).to(value.dtype)
        if self.training and self.dropout.p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        return torch.matmul(probs, value)

    #: How messages name this module.
    attention_name = "reference THD attention"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """THD ``[t, h, d] -> [t, h * d]``; padded ``[s, b, h, d] -> [s, b, h * d]``."""
        del attn_mask_type
        if attention_bias is not None:
            raise DynBatchValueError(f"the {self.attention_name} takes no attention_bias.")
        if packed_seq_params is not None:
            total = query.shape[0]
            return self._thd(query, key, value, packed_seq_params).reshape(total, -1)
        seq, batch = query.shape[0], query.shape[1]
        return self._padded(query, key, value, attention_mask).reshape(seq, batch, -1)

    def _thd(self, query, key, value, packed_seq_params: Any) -> torch.Tensor:
        """THD ``[t, h, d] -> [t, h, d]``, dense over the row's ``[t, t]`` segment mask."""
        total = query.shape[0]
        real, padded = self_attention_boundaries(packed_seq_params, total, self.attention_name)
        allowed = segment_mask(real, padded, total).to(query.device)
        _announce_once(packed_seq_params, total)
        # [t, h, d] -> [1, h, t, d]
        out = self._attend(
            query.permute(1, 0, 2)[None],
            key.permute(1, 0, 2)[None],
            value.permute(1, 0, 2)[None],
            allowed[None],
        )
        return out[0].permute(1, 0, 2)

    def _padded(self, query, key, value, attention_mask) -> torch.Tensor:
        """``[s, b, h, d] -> [s, b, h, d]``: each row one causal sequence, ``attention_mask``
        (True = masked) on top when given."""
        seq = query.shape[0]
        allowed = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()[None]
        if attention_mask is not None:
            # Megatron's masks are [b|1, 1, s, s] with True where attention is not allowed.
            allowed = allowed & ~attention_mask.to(torch.bool).reshape(-1, seq, seq)
        out = self._attend(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), allowed
        )  # [b, h, s, d]
        return out.permute(2, 0, 1, 3)


_ANNOUNCED = []


def _announce_once(packed_seq_params: Any, total: int) -> None:
    """One line at the first row packing several segments (first rank), so a log shows the path."""
    segments = packed_seq_params.cu_seqlens_q.numel() - 1
    if _ANNOUNCED or segments < 2:
        return
    _ANNOUNCED.append(True)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(
        f"> reference THD attention: a packed row of {total} tokens, {segments} segments, "
        f"cu_seqlens {packed_seq_params.cu_seqlens_q.tolist()}",
        flush=True,
    )


def with_thd_reference_attention(
    base_spec_fn: Callable, core_attention: Optional[type] = None
) -> Callable:
    """A layer-spec function whose self-attention core is :class:`ThdReferenceAttention`
    (or ``core_attention``, a module of the same contract such as
    :class:`~megatron_dynbatch.mcore.varlen_attention.TorchVarlenAttention`).

    ``base_spec_fn(config, vp_stage)`` returns Megatron's local layer spec (a ``ModuleSpec`` or a
    block spec of them); every layer's ``self_attention.submodules.core_attention`` is replaced and
    its mask type set to causal (TE's THD mask: causal within each segment). THD RoPE goes
    through :func:`~megatron_dynbatch.mcore.thd_rope.install_thd_rope` (one pass, not a loop over
    segments), which TE's fused RoPE would otherwise do.
    """
    import dataclasses

    from megatron.core.transformer.enums import AttnMaskType

    install_thd_rope()

    core = ThdReferenceAttention if core_attention is None else core_attention

    def _set(attention):
        # Replaced, not mutated: the base spec's objects may be shared between calls.
        if getattr(attention, "submodules", None) is None:
            return attention
        submodules = dataclasses.replace(attention.submodules, core_attention=core)
        params = dict(getattr(attention, "params", {}) or {})
        if "attn_mask_type" in params:
            params["attn_mask_type"] = AttnMaskType.causal
        return dataclasses.replace(attention, submodules=submodules, params=params)

    return with_self_attention(base_spec_fn, _set)


def with_self_attention(base_spec_fn: Callable, change: Callable[[Any], Any]) -> Callable:
    """A layer-spec function whose every layer's self-attention spec is ``change(spec)``.

    ``base_spec_fn(config, vp_stage)`` returns Megatron's local layer spec (a ``ModuleSpec`` or a
    block spec of them); a layer without self-attention is left as it is.
    """

    def spec(config, vp_stage=None):
        layer_spec = base_spec_fn(config, vp_stage)
        for one in getattr(layer_spec, "layer_specs", None) or [layer_spec]:
            attention = getattr(getattr(one, "submodules", None), "self_attention", None)
            if attention is not None:
                one.submodules.self_attention = change(attention)
        return layer_spec

    return spec
