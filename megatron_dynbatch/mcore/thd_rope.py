"""Rotary embeddings on packed THD rows in one pass, for the local layer spec without TE.

Megatron's unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``, megatron-core 0.19.2)
reads the row's boundaries to the host twice and then rotates one segment at a time: about ten
small kernels per segment, for the query and the key of every layer, forward and backward. On a
GPU without transformer-engine (whose fused THD RoPE does it in one kernel) a packed row of ~20
documents spent more time there than in its GEMMs: the first H100 run of ``gpu_check`` measured
Megatron's stock packing with document masking at 5.2 s an iteration against 0.88 s without
(docs/gpu.md).

:func:`thd_rotary` computes the same thing at once: every token's position inside its own
segment (``arange - start of its segment``) indexes the frequencies, and the row is rotated by
Megatron's own ``_apply_rotary_pos_emb_bshd`` in one call. Each token meets the same frequency and
the same elementwise operations as in the segment loop, so outputs and gradients are bitwise
equal (``tests/unit/test_thd_rope.py`` compares them with Megatron's function). The boundaries are
read to the host once per micro-batch (the layers share one ``PackedSeqParams``), not per call.

:func:`install_thd_rope` puts it in front of the name ``apply_rotary_pos_emb`` inside
``megatron.core.transformer.attention`` (the only caller on the THD path). The wrapper takes only
the case it computes identically (THD boundaries, no context parallelism, unfused RoPE, the
frequencies of one sequence) and hands every other call to Megatron's function unchanged. It is
installed where our THD core attention is (:func:`~megatron_dynbatch.mcore.thd_attention.
with_thd_reference_attention`), i.e. only with ``--dynamic-batch-attention torch-varlen`` or
``reference``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional, Tuple

import torch

__all__ = ["host_boundaries", "install_thd_rope", "thd_positions", "thd_rotary"]

#: Megatron's ``apply_rotary_pos_emb`` parameters the wrapper is written for (megatron-core
#: 0.19.2); another signature is left alone.
_PARAMETERS = ("t", "freqs", "config", "cu_seqlens", "mscale", "cp_group", "mla_rotary_interleaved")

# The positions of the last boundaries seen (the tensor is kept, so its id cannot be reused).
_LAST: List[Optional[Tuple[torch.Tensor, tuple, Optional[Tuple[torch.Tensor, int]]]]] = [None]


# The host copies of the last boundary tensors read (the tensors are kept, so their ids cannot
# be reused): real and padded boundaries, which are one tensor on our own micro-batches.
_HOST_COPIES: List[tuple] = []
_HOST_COPIES_KEPT = 2


def host_boundaries(boundaries: torch.Tensor) -> torch.Tensor:
    """``boundaries`` as an int64 CPU tensor, read from the device once per tensor: the checks of
    every THD attention layer (``thd_attention.py``) and the RoPE of a micro-batch share one read,
    where each would otherwise wait on the device for it."""
    key = (boundaries.data_ptr(), boundaries._version, boundaries.device, boundaries.dtype)
    for tensor, seen, host in _HOST_COPIES:
        if tensor is boundaries and seen == key:
            return host
    host = boundaries.to(torch.int64).cpu()
    _HOST_COPIES.insert(0, (boundaries, key, host))
    del _HOST_COPIES[_HOST_COPIES_KEPT:]
    return host


def thd_positions(cu_seqlens: torch.Tensor, total: int) -> Optional[Tuple[torch.Tensor, int]]:
    """Each token's position inside its segment (int64, on the boundaries' device) and the longest
    segment, or None where the boundaries do not cover exactly ``total`` tokens (the caller defers
    to Megatron, which raises as it always has)."""
    key = (total, cu_seqlens.data_ptr(), cu_seqlens._version, cu_seqlens.device)
    cached = _LAST[0]
    if cached is not None and cached[0] is cu_seqlens and cached[1] == key:
        return cached[2]
    bounds = host_boundaries(cu_seqlens).tolist()  # shared with the attention's checks
    found = None
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if bounds and bounds[0] == 0 and bounds[-1] == total and min(lengths, default=0) >= 0:
        device = cu_seqlens.device
        starts = torch.tensor(bounds[:-1], dtype=torch.int64, device=device)
        counts = torch.tensor(lengths, dtype=torch.int64, device=device)
        first = torch.repeat_interleave(starts, counts, output_size=total)
        positions = torch.arange(total, dtype=torch.int64, device=device) - first
        found = (positions, max(lengths, default=0))
    _LAST[0] = (cu_seqlens, key, found)
    return found


def thd_rotary(
    bshd: Callable[..., torch.Tensor],
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    *,
    rotary_interleaved: bool,
    mla_rotary_interleaved: bool,
    mscale: float,
) -> Optional[torch.Tensor]:
    """RoPE on a THD row ``t [T, h, d]`` with each segment of ``cu_seqlens`` from position 0, by
    ``bshd`` (Megatron's ``_apply_rotary_pos_emb_bshd``) in one call; None where this is not the
    computation Megatron's unfused THD RoPE makes (the caller defers to it)."""
    total = t.shape[0]
    found = thd_positions(cu_seqlens, total)
    if found is None or freqs.dim() < 1:
        return None
    positions, longest = found
    # Megatron gives frequencies covering the whole packed row another meaning (positions
    # continue across segments); a segment longer than the frequencies is Megatron's to refuse.
    if freqs.size(0) == total or longest > freqs.size(0):
        return None
    return bshd(
        t.unsqueeze(1),
        freqs[positions],
        rotary_interleaved=rotary_interleaved,
        mla_rotary_interleaved=mla_rotary_interleaved,
        mscale=mscale,
    ).squeeze(1)


def _wrap(original: Callable, bshd: Callable) -> Callable:
    def apply_rotary_pos_emb(
        t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, mla_rotary_interleaved=False
    ):
        out = None
        if (
            cu_seqlens is not None
            and cp_group is not None
            and cp_group.size() == 1
            and mla_rotary_interleaved is not None
            and not getattr(config, "apply_rope_fusion", False)
        ):
            out = thd_rotary(
                bshd,
                t,
                cu_seqlens,
                freqs,
                rotary_interleaved=config.rotary_interleaved,
                mla_rotary_interleaved=mla_rotary_interleaved,
                mscale=mscale,
            )
        if out is not None:
            return out
        return original(
            t,
            freqs,
            config,
            cu_seqlens=cu_seqlens,
            mscale=mscale,
            cp_group=cp_group,
            mla_rotary_interleaved=mla_rotary_interleaved,
        )

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.dynbatch_thd_rope = True
    return apply_rotary_pos_emb


def install_thd_rope() -> bool:
    """Route ``megatron.core.transformer.attention``'s THD RoPE through :func:`thd_rotary`
    (idempotent). False, and nothing changed, where Megatron's functions are not the ones this
    was written for."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    current: Any = getattr(attention, "apply_rotary_pos_emb", None)
    if getattr(current, "dynbatch_thd_rope", False):
        return True
    bshd = getattr(rope_utils, "_apply_rotary_pos_emb_bshd", None)
    if current is None or bshd is None:
        return False
    if tuple(inspect.signature(current).parameters) != _PARAMETERS:
        return False
    if "mla_rotary_interleaved" not in inspect.signature(bshd).parameters:
        return False
    attention.apply_rotary_pos_emb = _wrap(current, bshd)
    return True
