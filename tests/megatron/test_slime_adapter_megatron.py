"""The slime-style adapter driving real Megatron-Core schedules: exact gradients, ordered log-probs.

Rollout data in slime's form (per-sample lists, response-only advantages and loss masks) goes
through ``DynamicBatching`` (plan, iterators) into Megatron's schedule; the gradient of a
policy-gradient token-mean loss and the forward-only response log-probs must equal a single process
running every sample alone.
"""

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

# Results unpickled here may reference megatron modules, which import only with the shim on CPU.
apply_cpu_shim()

from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks  # noqa: E402

pytestmark = pytest.mark.gloo

VOCAB = 128
SEED = 11
REL_TOL = 1e-5


def _rollout_data():
    gen = torch.Generator().manual_seed(SEED)
    data = {
        k: []
        for k in (
            "tokens",
            "total_lengths",
            "response_lengths",
            "loss_masks",
            "advantages",
            "rollout_ids",
        )
    }
    for group in range(5):
        prompt = int(torch.randint(2, 12, (1,), generator=gen))
        for _ in range(3):
            response = int(torch.randint(1, 50, (1,), generator=gen))
            data["tokens"].append(torch.randint(0, VOCAB, (prompt + response,), generator=gen))
            data["total_lengths"].append(prompt + response)
            data["response_lengths"].append(response)
            data["loss_masks"].append((torch.rand(response, generator=gen) > 0.25).float())
            data["advantages"].append(torch.randn(response, generator=gen))
            data["rollout_ids"].append(group)
    return data


def _adapter_body():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dynbatch.adapters.slime import DynamicBatching
    from megatron_dynbatch.config import DynBatchConfig
    from megatron_dynbatch.mcore.agreement import check_plan_agreement
    from megatron_dynbatch.mcore.step import (
        configure_loss,
        forward_only_outputs,
        train_microbatches,
    )
    from megatron_dynbatch.planning import ParallelLayout
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    data = _rollout_data()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    batching = DynamicBatching(
        DynBatchConfig(max_tokens_per_gpu=96, log_probs_max_tokens_per_gpu=160),
        ParallelLayout(dp_size=dp, pp_size=pp),
        response_keys=("advantages",),
    )
    chunks = wrap_in_ddp(
        build_tiny_gpt(tiny_transformer_config(pipeline_model_parallel_size=pp), seed=SEED)
    )
    configure_loss(chunks, "token-mean")

    plan = batching.plan(data)
    check_plan_agreement(plan)
    [step] = plan.steps
    iterator, num_microbatches = batching.data_iterators(data, plan, 0, dp_rank)
    microbatches = list(iterator)
    assert len(microbatches) == num_microbatches
    train_microbatches(
        chunks,
        step,
        microbatches,
        aggregation="token-mean",
        token_loss=lambda batch, ce: ce * batch["advantages"],
    )
    grads = {k: v.detach().clone() for k, v in named_global_grads(chunks).items()}

    forward_plan = batching.plan(data, forward_only=True)
    [forward_step] = forward_plan.steps
    iterator, _ = batching.data_iterators(data, forward_plan, 0, dp_rank)
    per_sample = forward_only_outputs(chunks, forward_step, list(iterator))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_sample)
    log_probs = batching.response_outputs(data, [g for g in gathered if g])
    return {"grads": grads, "log_probs": log_probs, "placeholders": plan.stats.num_placeholders}


def _reference_body():
    from megatron_dynbatch.mcore.forward import build_attention_mask
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        tiny_transformer_config,
    )

    data = _rollout_data()
    [model] = build_tiny_gpt(tiny_transformer_config(), seed=SEED)
    total_loss, total_tokens, log_probs = 0.0, 0.0, []
    for tokens, response, mask, adv in zip(
        data["tokens"],
        data["response_lengths"],
        data["loss_masks"],
        data["advantages"],
        strict=True,
    ):
        length = tokens.numel()
        prompt = length - response
        labels = torch.zeros(1, length, dtype=torch.int64)
        labels[0, :-1] = tokens[1:]
        ce = model(
            tokens.unsqueeze(0),
            torch.arange(length).unsqueeze(0),
            build_attention_mask(torch.zeros(1, length, dtype=torch.int64)),
            labels=labels,
        )[0]
        # Response token t (t >= prompt) is predicted at position t - 1.
        scored = ce[prompt - 1 : length - 1] if prompt > 0 else ce[: length - 1]
        weights = mask if prompt > 0 else mask[1:]
        advantages = adv if prompt > 0 else adv[1:]
        total_loss = total_loss + (scored * advantages * weights).sum()
        total_tokens += float(weights.sum())
        log_probs.append((-ce[max(prompt - 1, 0) : length - 1]).detach())
    (total_loss / total_tokens).backward()
    return {"grads": named_global_grads([model]), "log_probs": log_probs}


@pytest.mark.parametrize("world, layout", [(2, Layout(pp=2)), (2, Layout())], ids=["pp2", "dp2"])
def test_adapter_on_megatron_matches_per_sample_reference(world, layout):
    results = run_on_ranks(world, _adapter_body, layout=layout)
    [reference, *_] = run_on_ranks(1, _reference_body, layout=Layout())
    merged = {}
    for result in results:
        merged.update(result["grads"])
    assert set(merged) == set(reference["grads"])
    for name, ref in reference["grads"].items():
        err = float((merged[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        assert err <= REL_TOL, (name, err)
    data = _rollout_data()
    for result in results:
        for i, (got, want) in enumerate(
            zip(result["log_probs"], reference["log_probs"], strict=True)
        ):
            assert got.shape == (data["response_lengths"][i],)
            # An all-response sample has no score for its first token; the adapter pads a zero.
            offset = 1 if got.shape[0] != want.shape[0] else 0
            assert torch.allclose(got[offset:], want, atol=1e-5), i
