"""The memory model's MoE token-dispatch and context-parallel terms (planning/memory.py).

A dense model at cp 1 must predict what the per-tensor count (Korthikanti et al.) gives, re-derived
here from the dimensions, so the new terms change nothing where they do not apply; the terms grow
with what they count (top-k, tokens) and context parallelism divides a rank's share.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynbatch.planning.memory import MemoryLimit, MemoryModel
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.spec import ParallelLayout

pytestmark = pytest.mark.unit


def _dims(*, cp=1, tp=1, pp=1, experts=0, topk=2, **overrides):
    values = dict(
        num_layers=8,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=384,
        ffn_hidden_size=256,
        params_dtype="bf16",
        num_experts=experts,
        moe_router_topk=topk,
        parallel=ParallelLayout(tp_size=tp, pp_size=pp, cp_size=cp),
    )
    values.update(overrides)
    return ModelDims(**values)


def _korthikanti_layer_bytes(dims):
    """Bytes a token keeps in one dense layer: two norm inputs and the QKV / fc1 inputs (h each),
    query, key, value and the attention output, fc1's and the activation's output."""
    tp = dims.parallel.tp_size
    h = dims.hidden_size / (tp if dims.sequence_parallel else 1)
    q = dims.num_attention_heads * dims.kv_channels
    kv = dims.num_query_groups * dims.kv_channels
    fc1 = dims.ffn_hidden_size * (2 if dims.gated_linear_unit else 1)
    return dims.dtype_bytes * (4 * h + (2 * q + 2 * kv) / tp + (fc1 + dims.ffn_hidden_size) / tp)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_dense_cp1_is_the_per_tensor_count_with_no_new_term(pp, tp, recompute):
    dims = _dims(pp=pp, tp=tp)
    model = MemoryModel(dims=dims, attention="causal", recompute=recompute)
    assert model.moe_dispatch_token_bytes() == 0
    assert model.cp_ring_bytes((2, 512)) == 0
    assert model.layer_token_bytes() == pytest.approx(_korthikanti_layer_bytes(dims))
    rows, length = 2, 512
    for stage in dims.stages():
        layer_mbs, embeds, logits = model.worst_live(stage)
        tokens = rows * length
        expected = (
            layer_mbs * tokens * _korthikanti_layer_bytes(dims)
            + embeds * tokens * dims.hidden_size * dims.dtype_bytes
            + logits * tokens * model.logit_token_bytes()
        )
        tok, sq = model.uniform_terms(stage, (rows, length))
        assert sq == 0
        assert tok == pytest.approx(expected)
        assert model.uniform_peak(stage, (rows, length)) == pytest.approx(
            model.resting(stage) + expected
        )


def test_moe_dispatch_is_two_topk_hidden_buffers_a_token_and_grows_with_topk():
    dense = MemoryModel(dims=_dims(), attention="causal")
    previous = None
    for topk in (1, 2, 4, 8):
        moe = MemoryModel(dims=_dims(experts=8, topk=topk), attention="causal")
        dispatch = moe.moe_dispatch_token_bytes()
        assert dispatch == 2 * topk * 64 * 2  # two buffers, top-k copies of h, bf16
        if previous is not None:
            assert moe.layer_token_bytes() > previous
        previous = moe.layer_token_bytes()
    # Expert parallelism moves the dispatched tokens, it does not shrink them.
    ep = MemoryModel(dims=_dims(experts=8, topk=2, ep_size=4), attention="causal")
    assert ep.moe_dispatch_token_bytes() == 2 * 2 * 64 * 2
    # Full recompute keeps the layer input only: no dispatch buffers between layers.
    full = MemoryModel(dims=_dims(experts=8, topk=2), attention="causal", recompute="full")
    assert full.moe_dispatch_token_bytes() == 0
    assert dense.moe_dispatch_token_bytes() == 0


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(64, 8192),
    more=st.integers(1, 4096),
    experts=st.sampled_from([0, 8]),
    cp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
)
def test_peaks_are_monotonic_in_tokens_with_moe_and_cp(length, more, experts, cp, pp):
    model = MemoryModel(dims=_dims(experts=experts, cp=cp, pp=pp), attention="causal")
    for stage in model.dims.stages():
        small = model.uniform_peak(stage, (1, length))
        large = model.uniform_peak(stage, (1, length + more))
        assert large > small
        shapes = [(1, length), (1, length + more)]
        assert model.stage_peak(stage, shapes).total >= model.stage_peak(stage, shapes[:1]).total


@pytest.mark.parametrize("experts", [0, 8])
def test_context_parallelism_divides_a_ranks_activations_and_adds_the_ring(experts):
    length = 4096
    one = MemoryModel(dims=_dims(experts=experts), attention="causal")
    previous = None
    for cp in (2, 4, 8):
        model = MemoryModel(dims=_dims(experts=experts, cp=cp), attention="causal")
        # The ring: four key/value blocks of the rank's tokens, (2 x kv_width / tp) each.
        kv_width = 2 * (64 // 4)
        assert model.cp_ring_bytes((1, length)) == 4 * 2 * kv_width * 2 * length / cp
        tok, _ = model.uniform_terms(0, (1, length))
        one_tok, _ = one.uniform_terms(0, (1, length))
        # Everything per token is divided by cp; the ring is added once, while a layer runs.
        assert tok == pytest.approx(one_tok / cp + model.cp_ring_bytes((1, length)))
        if previous is not None:
            assert tok < previous
        previous = tok


def test_a_budget_holds_fewer_tokens_with_moe_dispatch_and_more_with_cp():
    budget = 64 << 20
    dense = MemoryLimit(model=MemoryModel(dims=_dims(), attention="causal"), budget_bytes=budget)
    moe = MemoryLimit(
        model=MemoryModel(dims=_dims(experts=8, topk=4, ffn_hidden_size=256), attention="causal"),
        budget_bytes=budget,
    )
    cp2 = MemoryLimit(model=MemoryModel(dims=_dims(cp=2), attention="causal"), budget_bytes=budget)
    assert 0 < moe.row_cap(1) < dense.row_cap(1) < cp2.row_cap(1)
