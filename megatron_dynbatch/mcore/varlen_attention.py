"""THD core attention on torch's own flash kernels, for Megatron's local layer spec on CUDA.

GPU machines without transformer-engine cannot attend packed THD rows with Megatron's local
``DotProductAttention`` (it refuses ``packed_seq_params``), and its unfused attention builds an
``S x S`` score matrix for every row. torch ships flash attention for both cases:

* rows with ``PackedSeqParams`` (``qkv_format="thd"``) go to
  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10), one causal sequence per segment;
* rows without (``[s, b, h, d]``: padded rows, stock windows) go to
  ``F.scaled_dot_product_attention`` with ``is_causal`` under the flash backend (the
  memory-efficient backend is allowed beside it for what flash does not take: fp32, an explicit
  ``attention_mask``).

:class:`TorchVarlenAttention` honours the contract of :class:`ThdReferenceAttention` (see
``thd_attention.py``): a real token attends causally to the real tokens of its own segment; the
padding between ``cu_seqlens_q[i + 1] - cu_seqlens_q[i]`` and the padded segment's end outputs
zero. Flash kernels need no padding inside their input, so the real tokens are gathered into one
stream (:func:`varlen_plan`), attended, and scattered back into a zero tensor.

The kernel call is one function (:class:`VarlenKernel`), so the index, boundary and GQA logic
around it is tested on CPU with :func:`segment_sdpa_kernel`, which runs torch's SDPA segment by
segment: a real computation of the same attention, not torch's flash kernel.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.mcore.thd_attention import ThdReferenceAttention, self_attention_boundaries

__all__ = [
    "TorchVarlenAttention",
    "VarlenKernel",
    "VarlenPlan",
    "segment_sdpa_kernel",
    "torch_varlen_kernel",
    "varlen_available",
    "varlen_plan",
    "varlen_thd_attention",
]


@dataclass(frozen=True)
class VarlenKernel:
    """One variable-length causal attention kernel.

    ``fn(query [T, H, D], key [T, G, D], value [T, G, D], cu_seqlens int32 [N + 1],
    max_seqlen, scale) -> [T, H, D]``: each segment of ``cu_seqlens`` one causal sequence, no
    padding inside. ``G == H`` unless ``supports_gqa`` (the caller expands key / value).
    """

    fn: Callable[..., torch.Tensor]
    supports_gqa: bool
    name: str


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def torch_varlen_kernel(varlen_attn: Optional[Callable] = None) -> VarlenKernel:
    """``varlen_attn`` called as the installed torch release takes it (read from its signature).

    torch 2.10: ``is_causal=`` and no ``scale`` (the kernel's own ``1/sqrt(D)``); 2.11:
    ``window_size=(-1, 0)`` for causal and ``scale=``; 2.12 on: also ``enable_gqa=``. A scale
    the kernel cannot take is folded into the query (``q * scale * sqrt(D)`` under ``1/sqrt(D)``).

    Args:
        varlen_attn: The function to adapt (default: torch's); given, it is read the same way.
    """
    if varlen_attn is None:
        from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        raise DynBatchValueError(
            "torch.nn.attention.varlen.varlen_attn takes neither window_size nor is_causal in "
            f"this torch ({torch.__version__}); use --dynamic-batch-attention reference."
        )
    takes_scale = "scale" in params
    gqa = "enable_gqa" in params

    def fn(query, key, value, cu_seqlens, max_seqlen, scale):
        kwargs = dict(causal)
        if takes_scale:
            kwargs["scale"] = scale
        elif not math.isclose(scale, 1.0 / math.sqrt(query.shape[-1]), rel_tol=1e-6):
            query = query * (scale * math.sqrt(query.shape[-1]))
        if gqa and key.shape[1] != query.shape[1]:
            kwargs["enable_gqa"] = True
        return varlen_attn(
            query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs
        )

    return VarlenKernel(fn=fn, supports_gqa=gqa, name="torch varlen_attn")


def segment_sdpa_kernel(*, supports_gqa: bool = False) -> VarlenKernel:
    """A :class:`VarlenKernel` of torch's SDPA, one segment at a time (CPU tests).

    It computes the same attention as the flash kernel (causal softmax within each segment) with
    another implementation, so the logic around the kernel is checked against the reference on
    machines without CUDA. ``supports_gqa``: take fewer key / value heads (SDPA's
    ``enable_gqa``), as torch >= 2.12's ``varlen_attn`` does.
    """

    def fn(query, key, value, cu_seqlens, max_seqlen, scale):
        if not supports_gqa and key.shape[1] != query.shape[1]:
            raise AssertionError("the caller expands key/value for a kernel without GQA")
        bounds = cu_seqlens.tolist()
        if max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)) > max_seqlen:
            raise AssertionError(f"max_seqlen {max_seqlen} below a segment of {bounds}")
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            q, k, v = (x[start:end].transpose(0, 1)[None] for x in (query, key, value))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs, dim=0)

    return VarlenKernel(fn=fn, supports_gqa=supports_gqa, name="SDPA per segment")


@dataclass(frozen=True)
class VarlenPlan:
    """Where a THD row's real tokens are and how the kernel sees them.

    ``index``: positions of the real tokens in the row (``None``: every token is real, the row
    goes to the kernel as it is); ``cu_seqlens``: the kernel's boundaries over those tokens
    (int32, on the row's device; empty segments dropped); ``max_seqlen``: the longest segment.
    """

    index: Optional[torch.Tensor]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    total: int


def varlen_plan(packed_seq_params: Any, total: int, device: torch.device) -> VarlenPlan:
    """The :class:`VarlenPlan` of a THD ``PackedSeqParams`` over ``total`` tokens.

    Worked example: ``cu_seqlens_q = [0, 2, 3]``, ``cu_seqlens_q_padded = [0, 3, 5]``: tokens
    0, 1 (segment 0) and 3 (segment 1) are real, 2 and 4 padding; ``index = [0, 1, 3]``, the
    kernel's ``cu_seqlens = [0, 2, 3]``.

    Raises:
        DynBatchValueError: As
            :func:`~megatron_dynbatch.mcore.thd_attention.self_attention_boundaries`.
    """
    real, padded = self_attention_boundaries(
        packed_seq_params, total, TorchVarlenAttention.attention_name
    )
    lengths = (real[1:] - real[:-1]).tolist()
    longest = max(lengths)
    kept = [n for n in lengths if n > 0]
    bounds: List[int] = [0]
    for n in kept:
        bounds.append(bounds[-1] + n)
    index = None
    if bounds[-1] != total:
        starts = padded[:-1].tolist()
        index = torch.cat(
            [torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True) if n > 0]
            or [torch.zeros(0, dtype=torch.int64)]
        ).to(device)
    return VarlenPlan(
        index=index,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
        max_seqlen=longest,
        total=total,
    )


def _expand_groups(key: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Repeat each key/value group for its query heads (Megatron's order: head ``i`` uses group
    ``i // (heads // groups)``)."""
    groups = key.shape[dim]
    if groups == heads:
        return key
    return key.repeat_interleave(heads // groups, dim=dim)


def varlen_thd_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: VarlenPlan,
    scale: float,
    kernel: VarlenKernel,
) -> torch.Tensor:
    """THD attention ``[t, h, d] -> [t, h, d]`` through ``kernel``; padding tokens output zero."""
    heads = query.shape[1]
    if not kernel.supports_gqa:
        key, value = _expand_groups(key, heads, 1), _expand_groups(value, heads, 1)
    if plan.index is None:
        return kernel.fn(
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            plan.cu_seqlens,
            plan.max_seqlen,
            scale,
        )
    gathered = [x.index_select(0, plan.index).contiguous() for x in (query, key, value)]
    out = kernel.fn(*gathered, plan.cu_seqlens, plan.max_seqlen, scale)
    # Padding tokens attend to nothing: zero output, and no gradient reaches them.
    return query.new_zeros(query.shape).index_copy(0, plan.index, out.to(query.dtype))


class TorchVarlenAttention(ThdReferenceAttention):
    """``core_attention`` for the local layer spec on CUDA: THD rows on torch's flash varlen
    kernel, other rows on SDPA's flash backend (see the module docstring for the contract).

    ``kernel``: the varlen kernel (default: torch's, adapted to its release when first used);
    CPU tests set :func:`segment_sdpa_kernel`.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if self.dropout.p > 0:
            raise DynBatchValueError(
                f"--dynamic-batch-attention torch-varlen: torch's varlen flash kernel has no "
                f"attention dropout, but --attention-dropout is {self.dropout.p}; pass "
                "--attention-dropout 0, or use --dynamic-batch-attention reference."
            )
        self.kernel: Optional[VarlenKernel] = None
        self._plan_of: Optional[tuple] = None

    def _varlen_kernel(self) -> VarlenKernel:
        if self.kernel is None:
            self.kernel = torch_varlen_kernel()
        return self.kernel

    def _plan(self, packed_seq_params: Any, total: int, device: torch.device) -> VarlenPlan:
        # Every layer of a micro-batch gets the same PackedSeqParams object: its boundaries are
        # read to the host (a device sync) once per micro-batch and layer stack, not per layer.
        cu = packed_seq_params.cu_seqlens_q
        key = (total, cu.data_ptr(), cu._version, device)
        cached = _LAST_PLAN[0]
        if cached is not None and cached[0] is packed_seq_params and cached[1] == key:
            return cached[2]
        plan = varlen_plan(packed_seq_params, total, device)
        _LAST_PLAN[0] = (packed_seq_params, key, plan)
        return plan

    attention_name = "torch-varlen attention"

    def _thd(self, query, key, value, packed_seq_params: Any) -> torch.Tensor:
        plan = self._plan(packed_seq_params, query.shape[0], query.device)
        return varlen_thd_attention(
            query, key, value, plan, self.softmax_scale, self._varlen_kernel()
        )

    def _padded(self, query, key, value, attention_mask) -> torch.Tensor:
        """``[s, b, h, d]`` rows, each one causal sequence (``attention_mask``, True = masked, on
        top when given: then the memory-efficient backend, as flash takes no mask)."""
        seq = query.shape[0]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        k = _expand_groups(k, self.num_heads, 1)
        v = _expand_groups(v, self.num_heads, 1)
        mask, causal = None, True
        if attention_mask is not None:
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
            mask = (allowed & ~attention_mask.to(torch.bool).reshape(-1, seq, seq))[:, None]
            causal = False
        with _flash_backends(query):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale
            )
        return out.permute(2, 0, 1, 3)


# The plan of the last PackedSeqParams seen (the object is kept, so its id cannot be reused).
_LAST_PLAN: List[Optional[tuple]] = [None]


def _flash_backends(query: torch.Tensor):
    """SDPA on CUDA: flash first, memory-efficient where flash cannot run (fp32, a mask); never
    the math backend, which materialises the scores. Elsewhere: torch's choice."""
    import contextlib

    if query.device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
