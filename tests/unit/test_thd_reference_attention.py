"""The reference THD attention against Megatron's own attention, segment by segment."""

import types

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()  # importing megatron.core needs the triton stand-in on this machine

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_dynbatch.errors import DynBatchValueError  # noqa: E402
from megatron_dynbatch.mcore.thd_attention import (  # noqa: E402
    ThdReferenceAttention,
    segment_mask,
    thd_boundaries,
    with_thd_reference_attention,
)

pytestmark = pytest.mark.unit

_TP1 = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))


@pytest.fixture(autouse=True, scope="module")
def _memory_buffer():
    # Megatron's DotProductAttention takes its score buffer from parallel_state's global buffer.
    # It also forks the model-parallel RNG (mapped to the CPU generator by the shim).
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 1234)
    yield


def _config(heads=4, groups=2, head_dim=8):
    return TransformerConfig(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
        num_query_groups=groups, attention_dropout=0.0, use_cpu_initialization=True,
        masked_softmax_fusion=False,
    )  # fmt: skip


def _modules(config):
    kwargs = dict(layer_number=1, attention_type="self", pg_collection=_TP1)
    ours = ThdReferenceAttention(config, attn_mask_type=AttnMaskType.causal, **kwargs)
    megatron = DotProductAttention(config, attn_mask_type=AttnMaskType.causal, **kwargs)
    return ours.eval(), megatron.eval()


def _params(real, padded):
    cu = torch.tensor(real, dtype=torch.int32)
    cu_padded = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest,
    )  # fmt: skip


def test_segment_mask_is_causal_within_real_tokens_of_each_segment():
    # Segments of 2 and 1 real tokens, padded to 3 and 2.
    boundaries = thd_boundaries(torch.tensor([0, 2, 3]), torch.tensor([0, 3, 5]), 5)
    mask = segment_mask(*boundaries, 5).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0],  # padding of segment 0
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0],  # padding of segment 1
    ]


@pytest.mark.parametrize(
    "real, padded",
    [([0, 5, 12, 13, 20], None), ([0, 5, 12, 13, 20], [0, 6, 14, 16, 24])],
)
def test_thd_equals_megatrons_causal_attention_run_on_each_segment_alone(real, padded):
    torch.manual_seed(0)
    config = _config()
    ours, megatron = _modules(config)
    bounds = padded or real
    total = bounds[-1]
    query = torch.randn(total, 4, 8)
    key, value = torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    out = ours(query, key, value, None, packed_seq_params=_params(real, padded))
    assert out.shape == (total, 32)
    for i in range(len(real) - 1):
        start, count = bounds[i], real[i + 1] - real[i]
        piece = slice(start, start + count)
        alone = megatron(
            query[piece, None], key[piece, None], value[piece, None], None,
            attn_mask_type=AttnMaskType.causal,
        )  # fmt: skip
        torch.testing.assert_close(out[piece], alone[:, 0], rtol=1e-5, atol=1e-6)
        # Padding tokens get zero output, as transformer-engine's THD attention gives.
        assert torch.all(out[start + count : bounds[i + 1]] == 0)


def test_padded_rows_follow_megatrons_attention_with_and_without_a_mask():
    torch.manual_seed(1)
    config = _config(groups=4)
    ours, megatron = _modules(config)
    query, key, value = (torch.randn(6, 2, 4, 8) for _ in range(3))
    expected = megatron(query, key, value, None, attn_mask_type=AttnMaskType.causal)
    torch.testing.assert_close(ours(query, key, value, None), expected, rtol=1e-5, atol=1e-6)
    # A block-diagonal mask (True = masked) restricts it further: two segments of 3.
    segment = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = (segment[:, None] != segment[None, :]) | torch.ones(6, 6, dtype=torch.bool).triu(1)
    out = ours(query, key, value, mask[None, None])
    torch.testing.assert_close(out[3:], ours(query[3:], key[3:], value[3:], None))


def test_inconsistent_boundaries_and_short_max_seqlen_are_refused():
    ours, _ = _modules(_config())
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    with pytest.raises(DynBatchValueError, match=r"do not describe 6 tokens"):
        ours(q, kv, kv, None, packed_seq_params=_params([0, 4, 7], None))
    with pytest.raises(DynBatchValueError, match="each real segment must fit its padded one"):
        ours(q, kv, kv, None, packed_seq_params=_params([0, 4, 6], [0, 3, 6]))
    params = _params([0, 4, 6], None)
    params.max_seqlen_q = 3
    with pytest.raises(DynBatchValueError, match=r"max_seqlen_q=3 is smaller than .* \(4 tokens"):
        ours(q, kv, kv, None, packed_seq_params=params)


def test_the_layer_spec_swaps_the_core_attention_only():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    base = get_gpt_layer_local_spec()
    spec = with_thd_reference_attention(lambda config, vp_stage=None: get_gpt_layer_local_spec())
    swapped = spec(None).submodules.self_attention
    assert swapped.submodules.core_attention is ThdReferenceAttention
    assert swapped.params["attn_mask_type"] == AttnMaskType.causal
    original = base.submodules.self_attention.submodules
    assert original.core_attention is DotProductAttention
    assert swapped.submodules.linear_qkv is original.linear_qkv


def test_packed_rows_of_several_per_microbatch_are_refused_by_thd_with_the_fix():
    """The planner packs B > 1 rows only for row-wise attention; a plan made for the local
    implementation's dense mask run under THD says what to change instead of mixing samples."""
    from megatron_dynbatch.mcore.forward import _attention
    from megatron_dynbatch.planning import CostModel, PlannerConfig, plan_schedule
    from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches

    lengths = [5, 7, 3, 9, 4, 6, 2, 8, 3, 2, 4, 1]
    dense = CostModel(attention_weight=0.1, attention="dense", microbatch_overhead=100.0)
    plan = plan_schedule(lengths, config=PlannerConfig(max_tokens_per_gpu=32, cost=dense))
    step = plan.steps[0]
    assert step.micro_batch_size > 1
    samples = {i: {"tokens": torch.ones(n, dtype=torch.int64)} for i, n in enumerate(lengths)}
    microbatches = materialize_microbatches(
        step, 0, samples, BatchSchema(), layout="packed", sample_multiple=1
    )
    # A micro-batch with a row of two samples or more (segment ids 0, 1 and the tail's 2).
    batch = max(microbatches, key=lambda mb: int(mb["segment_ids"].max()))
    assert int(batch["segment_ids"].max()) > 1
    mask, params = _attention(batch, thd=False)
    assert (
        params is None and tuple(mask.shape) == (step.micro_batch_size, 1) + (step.seq_length,) * 2
    )
    with pytest.raises(DynBatchValueError, match="runs one packed row a micro-batch.*'segment'"):
        _attention(batch, thd=True)
