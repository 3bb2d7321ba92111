"""MoE routers see real tokens only: padding and placeholders enter no statistic and no count.

A tiny Megatron-Core MoE (4 layers, 4 experts, top-2) trains one planned step through the library's
forward step (``mcore.forward.make_forward_step``, the one the Megatron-LM entry and ``verify`` use)
at pp 2, dp 2, EP 2 on gloo, with packed rows (padding tails, rounding pads) and a placeholder
micro-batch on one DP rank, and with all three load-balancing losses and the z-loss on. What each
router hands to its statistics is recorded inside Megatron (``get_tokens_per_expert_and_token_count``
and ``z_loss_func``, observed, not replaced) and compared, per layer and per expert, with every
sample run alone without padding in one process.
"""

import contextlib

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

# Explicit, before the first megatron import (this module is also imported by the test workers).
apply_cpu_shim()

from megatron.core import parallel_state  # noqa: E402

from megatron_dynbatch.mcore.forward import build_attention_mask  # noqa: E402
from megatron_dynbatch.mcore.moe import padding_mask_of  # noqa: E402
from megatron_dynbatch.mcore.step import configure_loss, train_microbatches  # noqa: E402
from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches  # noqa: E402
from megatron_dynbatch.tools.testing.tiny_gpt import (  # noqa: E402
    TINY_VOCAB_SIZE,
    build_tiny_gpt,
    named_global_grads,
    tiny_transformer_config,
    wrap_in_ddp,
)
from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks  # noqa: E402
from tests._support import make_step_plan  # noqa: E402

pytestmark = pytest.mark.gloo

NUM_EXPERTS, TOPK, NUM_LAYERS = 4, 2, 4
LOAD_BALANCING = ["aux_loss", "seq_aux_loss", "global_aux_loss"]
SEED = 11
SEQ_LENGTH = 32
SAMPLE_MULTIPLE = 4  # rounding pads inside rows, as tp / cp alignment makes them
LENGTHS = (9, 6, 13, 11, 7)
# Per DP rank, per micro-batch: the samples of one packed row; () is a placeholder micro-batch.
RANKS = [[(0, 1), (2,)], [(3, 4), ()]]


def _config(pp: int, ep: int, *, aux: bool = True):
    config = tiny_transformer_config(
        pipeline_model_parallel_size=pp,
        num_layers=NUM_LAYERS,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        expert_model_parallel_size=ep,
    )
    if aux:
        config.moe_router_load_balancing_type = list(LOAD_BALANCING)
        config.moe_aux_loss_coeff = [1e-2] * len(LOAD_BALANCING)
        config.moe_z_loss_coeff = 1e-3
    return config


def _samples():
    generator = torch.Generator().manual_seed(SEED)
    return {
        i: {"tokens": torch.randint(0, TINY_VOCAB_SIZE, (n,), generator=generator)}
        for i, n in enumerate(LENGTHS)
    }


@contextlib.contextmanager
def _observed_router_statistics():
    """Record, per router layer, what Megatron's load-balancing and z-loss code is handed.

    ``stats[layer]["lb"][k]``: per-expert tokens of the k-th load-balancing loss (in the order of
    ``LOAD_BALANCING``) summed over calls, and ``"lb_tokens"`` the token counts they were divided
    by; ``"z_tokens"``: real tokens in the z-loss. The wrapped functions return exactly what
    Megatron's own return.
    """
    from megatron.core.transformer.moe import router as router_module

    stats: dict = {}
    current = {}
    originals = (
        router_module.TopKRouter.routing,
        router_module.get_tokens_per_expert_and_token_count,
        router_module.z_loss_func,
    )

    def routing(self, logits, padding_mask=None):
        # The losses this call computes, in Megatron's order (a placeholder's may be fewer).
        active = [k for k, name in enumerate(LOAD_BALANCING) if self.get_aux_loss_coeff(name) > 0]
        current["layer"], current["losses"] = self.layer_number, iter(active)
        return originals[0](self, logits, padding_mask=padding_mask)

    def counts(routing_map, reduce_group, topk=None, with_padding_mask=False):
        result = originals[1](routing_map, reduce_group, topk, with_padding_mask)
        entry = stats.setdefault(current["layer"], {"lb": {}, "lb_tokens": {}, "z_tokens": 0})
        k = next(current["losses"])
        per_expert = routing_map.sum(dim=0).reshape(-1, NUM_EXPERTS).sum(dim=0).double()
        entry["lb"][k] = entry["lb"].get(k, 0) + per_expert
        # local_num_tokens: the weight of this micro-batch's loss under per-token scaling.
        local = float(result[1]) * (topk // TOPK if k == 1 else 1)
        entry["lb_tokens"][k] = entry["lb_tokens"].get(k, 0) + local
        return result

    def z_loss(logits, coeff, padding_mask=None):
        entry = stats.setdefault(current["layer"], {"lb": {}, "lb_tokens": {}, "z_tokens": 0})
        real = logits.shape[0] if padding_mask is None else int((~padding_mask).sum())
        entry["z_tokens"] += real
        return originals[2](logits, coeff, padding_mask=padding_mask)

    router_module.TopKRouter.routing = routing
    router_module.get_tokens_per_expert_and_token_count = counts
    router_module.z_loss_func = z_loss
    try:
        yield stats
    finally:
        (
            router_module.TopKRouter.routing,
            router_module.get_tokens_per_expert_and_token_count,
            router_module.z_loss_func,
        ) = originals


def _rank_step(ranks):
    """This DP rank's step of the plan ``ranks`` and its materialized micro-batches."""
    dp_rank = parallel_state.get_data_parallel_rank()
    step = make_step_plan(ranks, seq_length=SEQ_LENGTH, micro_batch_size=1)
    samples = _samples()
    mine = {i: samples[i] for mb in ranks[dp_rank] for i in mb}
    microbatches = materialize_microbatches(
        step, dp_rank, mine, BatchSchema(), layout="packed", sample_multiple=SAMPLE_MULTIPLE
    )
    return step, microbatches


def _planned_step(make_config):
    """This rank's step of ``RANKS``, its micro-batches, and the model of ``make_config(pp, ep)``
    ready to train them."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    step, microbatches = _rank_step(RANKS)
    chunks = wrap_in_ddp(build_tiny_gpt(make_config(pp, ep), seed=SEED))
    configure_loss(chunks, "token-mean")
    return step, microbatches, chunks


def _dynamic_body():
    step, microbatches, chunks = _planned_step(_config)
    with _observed_router_statistics() as stats:
        train_microbatches(chunks, step, microbatches, aggregation="token-mean")
    grads = named_global_grads(chunks)
    padding = [padding_mask_of(mb) for mb in microbatches]
    return {
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "stats": stats,
        "real_tokens": sum(int((~p).sum()) for p in padding),
        "padding_tokens": sum(int(p.sum()) for p in padding),
        "finite": all(bool(torch.isfinite(g).all()) for g in grads.values()),
    }


def _reference_body(indices):
    """Every sample alone in a row of its own length (no padding at all), one process."""
    [model] = build_tiny_gpt(_config(1, 1), seed=SEED)
    samples = _samples()
    with _observed_router_statistics() as stats:
        for i in indices:
            tokens = samples[i]["tokens"].unsqueeze(0)
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
            model(tokens, positions, build_attention_mask(torch.zeros_like(tokens)))
    return stats


def test_routers_count_real_tokens_times_topk_per_expert_with_placeholders():
    results = run_on_ranks(4, _dynamic_body, layout=Layout(pp=2, ep=2))
    assert any(r["padding_tokens"] > 0 for r in results), "the data must hold padding"
    # DP rank 1 holds a placeholder micro-batch (all padding): it must not turn the
    # load-balancing losses' 0 / 0 into NaN gradients.
    assert all(r["finite"] for r in results), [r["finite"] for r in results]
    everyone = sum(LENGTHS[i] for rank in RANKS for mb in rank for i in mb)
    for dp_rank in (0, 1):
        indices = [i for mb in RANKS[dp_rank] for i in mb]
        real = sum(LENGTHS[i] for i in indices)
        [reference] = run_on_ranks(1, _reference_body, indices, layout=Layout())
        ranks = [r for r in results if r["dp_rank"] == dp_rank]
        assert all(r["real_tokens"] == real for r in ranks)
        seen = {}
        for r in ranks:  # the two pipeline stages of this DP rank hold different layers
            assert not set(seen) & set(r["stats"]), "a layer counted on two ranks"
            seen.update(r["stats"])
        assert sorted(seen) == list(range(1, NUM_LAYERS + 1)), sorted(seen)
        for layer, entry in seen.items():
            ref = reference[layer]
            assert entry["z_tokens"] == real, (dp_rank, layer, entry["z_tokens"], real)
            for k, name in enumerate(LOAD_BALANCING):
                where = f"dp rank {dp_rank}, layer {layer}, {name}"
                per_expert = entry["lb"][k]
                assert float(per_expert.sum()) == real * TOPK, (where, per_expert, real)
                # Routing is per token: each expert sees exactly the tokens it gets when every
                # sample runs alone.
                assert torch.equal(per_expert, ref["lb"][k]), (where, per_expert, ref["lb"][k])
                # The weight of the loss under per-token scaling counts real tokens only. For
                # global_aux_loss megatron.core 0.19.2 counts them over the data-parallel group:
                # with a padding mask its all-reduce of the tokens per expert runs in place, so
                # "local_num_tokens" becomes the group's count (here both DP ranks' tokens).
                want = everyone if name == "global_aux_loss" else real
                assert entry["lb_tokens"][k] == want, (where, entry["lb_tokens"][k], want)


def test_padding_mask_marks_padding_and_placeholders_true():
    step = make_step_plan([[(0, 1), ()]], seq_length=SEQ_LENGTH, micro_batch_size=1)
    samples = _samples()
    real, placeholder = materialize_microbatches(
        step, 0, {0: samples[0], 1: samples[1]}, BatchSchema(), layout="packed", sample_multiple=4
    )
    mask = padding_mask_of(real)
    assert mask.dtype == torch.bool and mask.shape == real["tokens"].shape
    # 9 tokens + 3 rounding pad, 6 tokens + 2 rounding pad, then the row's tail.
    assert int((~mask).sum()) == LENGTHS[0] + LENGTHS[1]
    assert mask[0, 9:12].all() and mask[0, 18:].all() and not mask[0, :9].any()
    assert padding_mask_of(placeholder).all()


def _placeholder_rank_body():
    """DP rank 1 holds placeholders only; then Megatron's MoE metrics are reduced over ranks."""
    from megatron.core.transformer.moe.moe_logging import (
        MoEMetricsTracker,
        get_moe_metrics_tracker,
        set_moe_metrics_tracker,
    )
    from megatron.core.transformer.moe.moe_utils import reduce_aux_losses_tracker_across_ranks

    ranks = [[(0, 1), (2,)], [(), ()]]
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    step, microbatches = _rank_step(ranks)
    chunks = wrap_in_ddp(build_tiny_gpt(_config(pp, 1), seed=SEED))
    configure_loss(chunks, "token-mean")
    set_moe_metrics_tracker(MoEMetricsTracker())  # this case's records only
    train_microbatches(chunks, step, microbatches, aggregation="token-mean")
    names = sorted(get_moe_metrics_tracker().metrics)
    # What SkyRL does after every step (and Megatron-LM when it logs): one all-reduce per name
    # over the pipeline and data-parallel groups; a name missing on one rank hangs the others.
    reduce_aux_losses_tracker_across_ranks()
    finite = all(bool(torch.isfinite(g).all()) for g in named_global_grads(chunks).values())
    return names, finite


def test_a_rank_of_placeholders_only_logs_the_same_moe_metrics_as_its_peers():
    results = run_on_ranks(4, _placeholder_rank_body, layout=Layout(pp=2), timeout_s=120)
    names = {tuple(r[0]) for r in results}
    assert names == {
        ("global_load_balancing_loss", "load_balancing_loss", "seq_load_balancing_loss", "z_loss")
    }, names
    assert all(r[1] for r in results)


def _expert_bias_config(pp: int, ep: int):
    config = _config(pp, ep, aux=False)
    config.moe_router_score_function = "sigmoid"
    config.moe_router_enable_expert_bias = True
    return config


@contextlib.contextmanager
def _observed_expert_bias_counts(chunks=None):
    """``counts[layer]``: the tokens per expert each router's expert bias is updated from, read
    where Megatron all-reduces them at the end of the step (``finalize_model_grads``), or, for a
    forward without that step (``chunks`` None), from the routers afterwards."""
    import importlib

    finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    from megatron.core.transformer.moe.router import TopKRouter

    counts: dict = {}
    original = finalize_module._update_router_expert_bias

    def read(model):
        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    counts[module.layer_number] = module.local_tokens_per_expert.double().clone()

    def update(model, config, *args, **kwargs):
        read(model)
        return original(model, config, *args, **kwargs)

    finalize_module._update_router_expert_bias = update
    try:
        yield counts, read
    finally:
        finalize_module._update_router_expert_bias = original


def _expert_bias_body():
    step, microbatches, chunks = _planned_step(_expert_bias_config)
    with _observed_expert_bias_counts() as (counts, _):
        train_microbatches(chunks, step, microbatches, aggregation="token-mean")
    return parallel_state.get_data_parallel_rank(), counts


def _expert_bias_reference_body(indices):
    [model] = build_tiny_gpt(_expert_bias_config(1, 1), seed=SEED)
    samples = _samples()
    with _observed_expert_bias_counts() as (counts, read):
        for i in indices:
            tokens = samples[i]["tokens"].unsqueeze(0)
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
            model(tokens, positions, build_attention_mask(torch.zeros_like(tokens)))
        read([model])
    return counts


def test_the_expert_bias_is_updated_from_real_tokens_only():
    # megatron.core 0.19.2 raised at the first step whenever the expert bias met a padding mask
    # (a [tokens] mask against the [tokens, experts] routing map; stock Megatron passes none).
    results = run_on_ranks(4, _expert_bias_body, layout=Layout(pp=2, ep=2))
    for dp_rank in (0, 1):
        indices = [i for mb in RANKS[dp_rank] for i in mb]
        [reference] = run_on_ranks(1, _expert_bias_reference_body, indices, layout=Layout())
        seen = {}
        for rank, counts in results:
            if rank == dp_rank:
                seen.update(counts)
        assert sorted(seen) == list(range(1, NUM_LAYERS + 1)), sorted(seen)
        real = sum(LENGTHS[i] for i in indices)
        for layer, count in seen.items():
            where = f"dp rank {dp_rank}, layer {layer}"
            assert float(count.sum()) == real * TOPK, (where, count, real)
            assert torch.equal(count, reference[layer]), (where, count, reference[layer])
