"""The torch-varlen THD attention against the reference module, on CPU.

torch's flash kernels run only on CUDA. What these tests check is everything around the kernel
call (THD boundaries with and without ``cu_seqlens_*_padded``, gathering the real tokens and
scattering them back, zero output for padding, GQA expansion, the softmax scale, each torch
release's ``varlen_attn`` signature, the SDPA path of rows without ``PackedSeqParams``), with
the kernel replaced by ``segment_sdpa_kernel``: torch's SDPA run segment by segment, a real
computation of the same attention. Whether torch's flash kernel itself matches is checked on a
GPU by ``benchmarks/gpu_check.py`` (its kernel check).
"""

import inspect
import math
import types

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()  # importing megatron.core needs the triton stand-in on this machine

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_dynbatch.errors import DynBatchValueError  # noqa: E402
from megatron_dynbatch.mcore.thd_attention import ThdReferenceAttention  # noqa: E402
from megatron_dynbatch.mcore.varlen_attention import (  # noqa: E402
    TorchVarlenAttention,
    segment_sdpa_kernel,
    torch_varlen_kernel,
    varlen_available,
    varlen_plan,
)

pytestmark = pytest.mark.unit

_TP1 = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))


def _config(heads=4, groups=2, head_dim=8, dropout=0.0):
    return TransformerConfig(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
        num_query_groups=groups, attention_dropout=dropout, use_cpu_initialization=True,
        masked_softmax_fusion=False,
    )  # fmt: skip


def _modules(config, *, supports_gqa=False, softmax_scale=None):
    kwargs = dict(
        layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=_TP1, softmax_scale=softmax_scale,
    )  # fmt: skip
    varlen = TorchVarlenAttention(config, **kwargs)
    varlen.kernel = segment_sdpa_kernel(supports_gqa=supports_gqa)
    return varlen.eval(), ThdReferenceAttention(config, **kwargs).eval()


def _params(real, padded, longest=None):
    cu = torch.tensor(real, dtype=torch.int32)
    cu_padded = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    longest = longest or int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest,
    )  # fmt: skip


def _random_segments(rng, count, longest, with_padding):
    real, padded = [0], [0]
    for _ in range(count):
        n = int(rng.integers(0 if with_padding else 1, longest + 1))
        pad = int(rng.integers(0, 4)) if with_padding else 0
        real.append(real[-1] + n)
        padded.append(padded[-1] + n + pad)
    if padded[-1] == 0:
        real[-1], padded[-1] = 1, 1
    return real, (padded if with_padding else None)


def _grads(module, q, k, v, params, weight):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = module(q, k, v, None, packed_seq_params=params)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("groups, supports_gqa", [(4, False), (2, False), (1, True), (2, True)])
@pytest.mark.parametrize("with_padding", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_and_gradients_equal_the_reference(groups, supports_gqa, with_padding, seed):
    """Random packed rows (segments of 0-17 real tokens, 0-3 padding each), fp32 (the reference
    computes in fp32): output and the
    gradients of query, key and value equal the reference module's."""
    import numpy

    rng = numpy.random.default_rng(seed)
    torch.manual_seed(seed)
    real, padded = _random_segments(rng, int(rng.integers(1, 7)), 17, with_padding)
    config = _config(heads=4, groups=groups)
    varlen, reference = _modules(config, supports_gqa=supports_gqa)
    total = (padded or real)[-1]
    q = torch.randn(total, 4, 8, dtype=torch.float32)
    k, v = (torch.randn(total, groups, 8, dtype=torch.float32) for _ in range(2))
    weight = torch.randn(total, 32, dtype=torch.float32)
    params = _params(real, padded, longest=max(real[i + 1] - real[i] for i in range(len(real) - 1)))
    ours = _grads(varlen, q, k, v, params, weight)
    theirs = _grads(reference, q, k, v, params, weight)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if padded is not None:
        # Padding tokens: zero output and no gradient into them.
        bounds = list(zip(real[:-1], real[1:], padded[:-1], padded[1:], strict=True))
        for r0, r1, p0, p1 in bounds:
            assert torch.all(ours[0][p0 + (r1 - r0) : p1] == 0)
            assert torch.all(ours[1][p0 + (r1 - r0) : p1] == 0)


def test_a_softmax_scale_of_its_own_is_honoured():
    torch.manual_seed(3)
    config = _config(heads=2, groups=2)
    varlen, reference = _modules(config, softmax_scale=0.05)
    q, k, v = (torch.randn(9, 2, 8, dtype=torch.float32) for _ in range(3))
    params = _params([0, 4, 9], None)
    torch.testing.assert_close(
        varlen(q, k, v, None, packed_seq_params=params),
        reference(q, k, v, None, packed_seq_params=params),
    )


def test_the_plan_gathers_real_tokens_and_drops_empty_segments():
    # Worked example of varlen_plan's docstring, plus an empty (all padding) segment.
    plan = varlen_plan(_params([0, 2, 3, 3], [0, 3, 5, 7]), 7, torch.device("cpu"))
    assert plan.index.tolist() == [0, 1, 3]
    assert plan.cu_seqlens.tolist() == [0, 2, 3] and plan.cu_seqlens.dtype == torch.int32
    assert plan.max_seqlen == 2
    # Without padding every token goes to the kernel as it is.
    plan = varlen_plan(_params([0, 5, 8], None), 8, torch.device("cpu"))
    assert plan.index is None and plan.cu_seqlens.tolist() == [0, 5, 8]


def test_bad_boundaries_are_refused_as_the_reference_refuses_them():
    varlen, _ = _modules(_config())
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    with pytest.raises(DynBatchValueError, match=r"do not describe 6 tokens"):
        varlen(q, kv, kv, None, packed_seq_params=_params([0, 4, 7], None))
    params = _params([0, 4, 6], None)
    params.max_seqlen_kv = 3
    with pytest.raises(DynBatchValueError, match=r"max_seqlen_kv=3 is smaller than"):
        varlen(q, kv, kv, None, packed_seq_params=params)
    params = _params([0, 4, 6], None)
    params.cu_seqlens_kv = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(DynBatchValueError, match="equal query and key/value THD boundaries"):
        varlen(q, kv, kv, None, packed_seq_params=params)


def test_rows_without_packed_seq_params_equal_the_reference_with_and_without_a_mask():
    torch.manual_seed(4)
    varlen, reference = _modules(_config(heads=4, groups=2))
    q = torch.randn(6, 3, 4, 8, dtype=torch.float32)
    k, v = (torch.randn(6, 3, 2, 8, dtype=torch.float32) for _ in range(2))
    torch.testing.assert_close(varlen(q, k, v, None), reference(q, k, v, None))
    segment = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = (segment[:, None] != segment[None, :])[None, None]  # True = masked, as Megatron's
    torch.testing.assert_close(varlen(q, k, v, mask), reference(q, k, v, mask))


def test_attention_dropout_is_refused_in_one_line_naming_the_flags():
    with pytest.raises(DynBatchValueError, match=r"--attention-dropout 0.*reference"):
        _modules(_config(dropout=0.1))


def _segment_sdpa(query, key, value, cu_q, max_q, scale, gqa):
    """What every release's varlen_attn computes, by SDPA per segment (default scale 1/sqrt(D))."""
    out = segment_sdpa_kernel(supports_gqa=gqa).fn(
        query, key, value, cu_q, max_q, 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    )
    return out


def _release_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                 return_aux=None):  # fmt: skip
    assert is_causal and key.shape[1] == query.shape[1]
    return _segment_sdpa(query, key, value, cu_seq_q, max_q, None, False)


def _release_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                 scale=None, window_size=(-1, -1)):  # fmt: skip
    assert window_size == (-1, 0) and key.shape[1] == query.shape[1]
    return _segment_sdpa(query, key, value, cu_seq_q, max_q, scale, False)


def _release_212(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                 scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                 block_table=None, num_splits=None):  # fmt: skip
    assert window_size == (-1, 0) and enable_gqa == (key.shape[1] != query.shape[1])
    return _segment_sdpa(query, key, value, cu_seq_q, max_q, scale, True)


@pytest.mark.parametrize("release", [_release_210, _release_211, _release_212])
@pytest.mark.parametrize("softmax_scale", [None, 0.05])
def test_each_torch_release_signature_is_called_as_it_takes_it(release, softmax_scale):
    """The adapter reads ``varlen_attn``'s signature (2.10: is_causal, no scale; 2.11: window_size
    and scale; 2.12 on: enable_gqa too). The stand-ins have those signatures and compute by SDPA
    per segment; a scale the release cannot take is folded into the query."""
    torch.manual_seed(5)
    config = _config(heads=4, groups=2)
    varlen, reference = _modules(config, softmax_scale=softmax_scale)
    varlen.kernel = torch_varlen_kernel(release)
    assert varlen.kernel.supports_gqa == ("enable_gqa" in inspect.signature(release).parameters)
    q = torch.randn(10, 4, 8, dtype=torch.float32)
    k, v = (torch.randn(10, 2, 8, dtype=torch.float32) for _ in range(2))
    params = _params([0, 3, 7, 8], [0, 4, 9, 10])
    torch.testing.assert_close(
        varlen(q, k, v, None, packed_seq_params=params),
        reference(q, k, v, None, packed_seq_params=params),
    )


def test_this_torchs_varlen_attn_is_read_by_its_signature():
    if not varlen_available():
        pytest.skip("this torch has no torch.nn.attention.varlen (torch < 2.10)")
    from torch.nn.attention.varlen import varlen_attn

    kernel = torch_varlen_kernel()
    assert kernel.supports_gqa == ("enable_gqa" in inspect.signature(varlen_attn).parameters)
