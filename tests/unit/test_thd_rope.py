"""The one-pass THD RoPE against Megatron's own segment-by-segment function, bitwise.

``mcore/thd_rope.py`` replaces a loop over segments by one gather of the frequencies; each token
meets the same elementwise operations, so forward outputs and gradients must be *equal*, not
close. Every case Megatron gives another meaning (context parallelism, frequencies covering the
whole row, fused RoPE, boundaries that do not cover the row) must reach Megatron's function.
"""

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()  # importing megatron.core needs the triton stand-in on this machine

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.transformer import attention as mcore_attention  # noqa: E402

from megatron_dynbatch.mcore.thd_rope import install_thd_rope, thd_rotary  # noqa: E402

pytestmark = pytest.mark.unit


class _Group:
    """A process group's ``size``/``rank`` as Megatron's RoPE reads them."""

    def __init__(self, size=1):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


class _Config:
    def __init__(self, rotary_interleaved=False, apply_rope_fusion=False):
        self.rotary_interleaved = rotary_interleaved
        self.apply_rope_fusion = apply_rope_fusion
        self.multi_latent_attention = False


def _boundaries(rng, count, longest, empty):
    lengths = [int(rng.integers(0 if empty else 1, longest + 1)) for _ in range(count)]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32), max(lengths)


def _freqs(max_seq, dim, rotary_percent=1.0):
    rot = int(dim * rotary_percent)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _both(t, cu, freqs, **kwargs):
    """(Megatron's output, ours, and each one's gradient of a fixed weighting)."""
    weight = torch.randn(t.shape, generator=torch.Generator().manual_seed(7))
    # Megatron's interleaved rotation cannot reshape an empty segment; without the empty ones
    # its loop computes the same row.
    nonempty = torch.unique_consecutive(cu)
    results = []
    for compute in (
        lambda x: rope_utils._apply_rotary_pos_emb_thd(
            x, nonempty, freqs, cp_group=_Group(), **kwargs
        ),
        lambda x: thd_rotary(rope_utils._apply_rotary_pos_emb_bshd, x, cu, freqs, **kwargs),
    ):
        x = t.detach().clone().requires_grad_(True)
        out = compute(x)
        (out * weight).sum().backward()
        results.append((out.detach(), x.grad))
    return results


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("interleaved", [False, True])
def test_outputs_and_gradients_equal_megatrons_segment_loop(seed, interleaved):
    import numpy

    rng = numpy.random.default_rng(seed)
    cu, longest = _boundaries(rng, int(rng.integers(1, 12)), 40, empty=seed % 2 == 1)
    heads, dim = 3, 16
    rotary_percent = 0.5 if seed % 3 == 2 else 1.0
    freqs = _freqs(longest + int(rng.integers(0, 9)), dim, rotary_percent)
    t = torch.randn(int(cu[-1]), heads, dim, generator=torch.Generator().manual_seed(seed))
    kwargs = dict(
        rotary_interleaved=interleaved, mla_rotary_interleaved=False, mscale=1.0 + seed / 10
    )
    (theirs, their_grad), (ours, our_grad) = _both(t, cu, freqs, **kwargs)
    assert torch.equal(ours, theirs)
    assert torch.equal(our_grad, their_grad)


def test_bfloat16_rows_are_equal_too():
    cu = torch.tensor([0, 5, 5, 17, 30], dtype=torch.int32)
    t = torch.randn(30, 2, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    kwargs = dict(rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0)
    (theirs, their_grad), (ours, our_grad) = _both(t, cu, _freqs(32, 8), **kwargs)
    assert torch.equal(ours, theirs) and torch.equal(our_grad, their_grad)


def test_cases_megatron_reads_otherwise_are_left_to_it():
    kwargs = dict(rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0)
    bshd = rope_utils._apply_rotary_pos_emb_bshd
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    t = torch.randn(10, 2, 8)
    # Frequencies of the whole packed row: positions continue across segments in Megatron.
    assert thd_rotary(bshd, t, cu, _freqs(10, 8), **kwargs) is None
    # Boundaries that do not cover the row, and a segment longer than the frequencies.
    assert (
        thd_rotary(bshd, t, torch.tensor([0, 4, 9], dtype=torch.int32), _freqs(12, 8), **kwargs)
        is None
    )
    assert thd_rotary(bshd, t, cu, _freqs(5, 8), **kwargs) is None
    assert thd_rotary(bshd, t, cu, _freqs(6, 8), **kwargs) is not None


def test_installed_wrapper_computes_megatrons_result_and_defers_what_it_does_not_take():
    current = mcore_attention.apply_rotary_pos_emb
    # Earlier tests in this process may have built a THD model, which installs it.
    original = getattr(current, "__wrapped__", current)
    mcore_attention.apply_rotary_pos_emb = original
    try:
        assert install_thd_rope()
        wrapped = mcore_attention.apply_rotary_pos_emb
        assert wrapped is not original and wrapped.__wrapped__ is original
        assert install_thd_rope() and mcore_attention.apply_rotary_pos_emb is wrapped  # once

        cu = torch.tensor([0, 3, 11, 12, 20], dtype=torch.int32)
        t = torch.randn(20, 2, 8, generator=torch.Generator().manual_seed(1))
        freqs = _freqs(16, 8)
        config = _Config()
        expected = original(t, freqs, config, cu_seqlens=cu, cp_group=_Group())
        assert torch.equal(wrapped(t, freqs, config, cu_seqlens=cu, cp_group=_Group()), expected)

        # Rows without boundaries ([s, b, h, d]) are Megatron's, unchanged.
        rows = torch.randn(12, 2, 2, 8)
        assert torch.equal(
            wrapped(rows, freqs[:12], config, cp_group=_Group()),
            original(rows, freqs[:12], config, cp_group=_Group()),
        )

        calls = []

        def recording(*args, **kwargs):
            calls.append(kwargs)
            return "megatron"

        # What it does not compute identically goes to the function it wraps.
        from megatron_dynbatch.mcore import thd_rope

        probe = thd_rope._wrap(recording, rope_utils._apply_rotary_pos_emb_bshd)
        assert probe(t, freqs, config, cu_seqlens=cu, cp_group=_Group(2)) == "megatron"
        assert (
            probe(t, freqs, _Config(apply_rope_fusion=True), cu_seqlens=cu, cp_group=_Group())
            == "megatron"
        )
        assert probe(t, freqs, config, cu_seqlens=cu, cp_group=None) == "megatron"
        assert (
            probe(t, freqs, config, cu_seqlens=cu, cp_group=_Group(), mla_rotary_interleaved=None)
            == "megatron"
        )
        assert probe(t, _freqs(20, 8), config, cu_seqlens=cu, cp_group=_Group()) == "megatron"
        assert len(calls) == 5
        assert not isinstance(probe(t, freqs, config, cu_seqlens=cu, cp_group=_Group()), str)
    finally:
        mcore_attention.apply_rotary_pos_emb = current


def test_boundaries_are_read_to_the_host_once_until_they_change():
    from megatron_dynbatch.mcore.thd_rope import host_boundaries

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    first = host_boundaries(cu)
    assert first.dtype == torch.int64 and first.tolist() == [0, 3, 8]
    assert host_boundaries(cu) is first  # the attention's checks and the RoPE share one read
    cu[2] = 9  # changed in place: read again
    assert host_boundaries(cu).tolist() == [0, 3, 9]
