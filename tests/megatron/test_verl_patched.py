"""verl's own Megatron engine code, patched by ``patches/verl``, against a per-sample reference.

With ``VERL_DIR`` (a verl checkout at the commit named in ``patches/verl/README.md``) the patches
are applied to a copy with ``launch/apply_verl_patches.sh``; on gloo CPU ranks (tiny GPT, pp 2 at dp
1 and 2, tp 2 x pp 2, pp 2 x vpp 2) verl's real ``MegatronEngineWithLMHead.forward_backward_batch``
runs: its ``forward_step``, ``postprocess_micro_batch_func``, the THD model forward
(``gptmodel_forward_model_engine`` with ``preprocess_thd_engine`` / ``postprocess_thd_engine``), its
``ppo_loss`` with every ``loss_agg_mode`` and ``postprocess_batch_func`` /
``restore_dynamic_batch``, on a batch built by verl's own ``left_right_2_no_padding`` and sharded
over the DP ranks as verl's dispatch does (contiguous equal chunks). Checked: gradients equal a
single process running each sample alone (relative 1e-5) and the log-probs of the forward-only pass
come back in sample order (absolute 1e-5), including steps where a DP rank holds fewer samples than
the micro-batch count (stock verl asserts there); the critic's ``MegatronEngineWithValueHead``
(values forward-only, then ``value_loss``) likewise; with the switch off the patched tree is bitwise
the stock one. verl's own CPU unit tests of its seqlen balancing run on the patched tree.

What is not verl's in these runs, and why (also in docs/verl.md):

* modules verl imports that are not installed here and need Ray, a GPU or downloads are stubbed
  (:data:`VERL_STUBBED`; only those missing are stubbed);
* the engine object: ``MegatronEngine.__init__`` / ``initialize`` build the model through
  Megatron-Bridge from a Hugging Face checkpoint on a GPU, so the test makes the object with
  ``__new__`` and sets what ``forward_backward_batch`` reads (``engine_config``, a real
  ``McoreEngineConfig``; ``tf_config``, the tiny GPT's; ``module``, its DDP chunks; a model config
  naming one architecture and pad token 0);
* the tiny GPT's attention core is the project's reference THD attention
  (``megatron_dynbatch.mcore.thd_attention``; Transformer Engine needs CUDA), so verl's THD path
  (``use_remove_padding=True``, its default) runs as on a GPU;
* Megatron's gradient finalisation is ``finalize_model_grads`` set on the config, as verl's
  ``register_megatron_training_hooks`` does.

Without ``VERL_DIR`` these tests are skipped (the pure parts are in
``tests/unit/test_verl_plan.py``).
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()

from megatron_dynbatch.tools.testing.workers import (  # noqa: E402
    DistributedTestError,
    Layout,
    run_on_ranks,
)
from tests._support import (  # noqa: E402
    QWEN2_05B_HF,
    SMALL_MOE_HF,
    TINY_MOE,
    patched_copy,
    relative_error,
    stock_copy,
)

pytestmark = pytest.mark.verl

REPO = pathlib.Path(__file__).resolve().parents[2]
APPLY = REPO / "launch" / "apply_verl_patches.sh"
VERL_DIR = os.environ.get("VERL_DIR")
REL_TOL = 1e-5
#: verl's import chain is slow on a loaded 2-core machine; the pool's default is 180 s.
BODY_TIMEOUT_S = 600
SEED = 7
VOCAB = 128
#: Modules verl imports that need Ray, a GPU or downloads; stubbed when not installed.
VERL_STUBBED = (
    "ray",
    "transformers",
    "peft",
    "accelerate",
    "datasets",
    "pandas",
    "codetiming",
)
#: Megatron Bridge (Hugging Face checkpoint conversion) is a distribution of its own.
VERL_STUBBED_PREFIXES = ("megatron.bridge",)
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

needs_verl = pytest.mark.skipif(not VERL_DIR, reason="VERL_DIR is not set")


@pytest.fixture(scope="module")
def stock_verl(tmp_path_factory):
    """A pristine copy of VERL_DIR's ``verl/``, whether VERL_DIR is pristine or already patched
    (our patches are reverse-applied on the copy; VERL_DIR itself is never changed)."""
    return stock_copy(VERL_DIR, "verl", tmp_path_factory.mktemp("verl_stock"))


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory, stock_verl):
    """A copy of the stock tree with the patches applied."""
    return patched_copy(stock_verl, "verl", tmp_path_factory.mktemp("verl_patched"))


# -- running verl's code on a rank --------------------------------------------------------------

_VERL_ROOTS = set()


def _import_verl(verl_root):
    """Stub what verl needs and cannot have here; put ``verl_root`` first on ``sys.path``."""
    from megatron_dynbatch.tools.testing.host_stubs import install_stubs

    stubbed = install_stubs(VERL_STUBBED, prefixes=VERL_STUBBED_PREFIXES)
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p not in _VERL_ROOTS]
    _VERL_ROOTS.add(verl_root)
    sys.path.insert(0, verl_root)
    _cpu_platform()
    return stubbed


def _cpu_platform():
    """verl's device platform on the CPU, set through verl's own ``set_platform``: its CUDA
    platform with ``current_device()`` the CPU (the tensors stay where they are)."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import set_platform

    class CpuPlatform(PlatformCUDA):
        @property
        def device_name(self) -> str:
            return "cpu"

        def current_device(self):
            return "cpu"

        def is_available(self) -> bool:
            return True

    set_platform(CpuPlatform())


def _samples(num, seed=SEED, long_every=0):
    """(prompt tokens, response tokens, response mask) per sample; every ``long_every``-th sample
    (when > 0) is long, so ranks holding it need more micro-batches."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        prompt = torch.randint(
            1, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen
        )
        longest = 30 if long_every and i % long_every == 0 else 13
        response = torch.randint(
            1, VOCAB, (int(torch.randint(2, longest, (1,), generator=gen)),), generator=gen
        )
        mask = (torch.rand(response.numel(), generator=gen) > 0.2).to(torch.int64)
        mask[0] = 1
        out.append((prompt, response, mask))
    return out


def _padded_batch(samples, seed=SEED):
    """What verl's trainer holds before ``left_right_2_no_padding``: prompts left-padded,
    responses right-padded, ``response_mask`` the loss mask, advantages per token."""
    gen = torch.Generator().manual_seed(seed + 1)
    n = len(samples)
    prompt_len = max(s[0].numel() for s in samples)
    response_len = max(s[1].numel() for s in samples)
    prompts = torch.zeros((n, prompt_len), dtype=torch.int64)
    responses = torch.zeros((n, response_len), dtype=torch.int64)
    attention = torch.zeros((n, prompt_len + response_len), dtype=torch.int64)
    response_mask = torch.zeros((n, response_len), dtype=torch.int64)
    for i, (p, r, m) in enumerate(samples):
        prompts[i, prompt_len - p.numel() :] = p
        responses[i, : r.numel()] = r
        attention[i, prompt_len - p.numel() : prompt_len + r.numel()] = 1
        response_mask[i, : r.numel()] = m
    position_ids = (attention.cumsum(-1) - 1).clamp_min(0)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "advantages": torch.randn((n, response_len), generator=gen) * response_mask,
        "old_log_probs": torch.zeros((n, response_len)),
    }


def _shard(full, dp, dp_rank):
    """verl's dispatch: contiguous equal chunks of the batch per DP rank."""
    n = full["input_ids"].shape[0]
    assert n % dp == 0, "verl's dispatch needs a batch divisible by dp"
    per = n // dp
    lo, hi = dp_rank * per, (dp_rank + 1) * per
    return {k: v[lo:hi] for k, v in full.items()}, list(range(lo, hi))


def _actor_config(agg_mode, loss_scale_factor):
    from verl.workers.config import McoreActorConfig

    return McoreActorConfig(
        strategy="megatron",
        ppo_mini_batch_size=1,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=64,
        loss_agg_mode=agg_mode,
        loss_scale_factor=loss_scale_factor,
        entropy_coeff=0.0,
        use_kl_loss=False,
        rollout_n=1,
    )


def _engine(ti, chunks, config, *, dynamic, pp, vpp):
    """verl's ``MegatronEngineWithLMHead`` without its model-building constructor."""
    import types

    from verl.workers.config import McoreEngineConfig

    engine = ti.MegatronEngineWithLMHead.__new__(ti.MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        use_remove_padding=True,
        sequence_parallel=False,
        use_mbridge=False,
        # None: the stock tree, whose config has no such field.
        **({} if dynamic is None else {"use_dynamic_batch_size": dynamic}),
    )
    engine.model_config = types.SimpleNamespace(
        mtp=types.SimpleNamespace(enable=False, enable_train=False),
        hf_config=types.SimpleNamespace(architectures=["TinyGPT"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
    )
    engine.tf_config = config
    engine.module = chunks
    engine.enable_routing_replay = False
    engine.mini_layer_topk_idx_list = []
    return engine


#: The tiny MoE of the router-statistics case: 4 layers, 4 experts, top-2.
MOE = TINY_MOE


def _verl_model(*, value_head=False, moe=False):
    """The tiny GPT on this rank's stages as verl's engine holds it: its ``TransformerConfig``
    (verl's regime) and DDP chunks; ``value_head``: a value model's one-unit output layer;
    ``moe``: the tiny MoE with a load-balancing loss and a z-loss."""
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_dynbatch.mcore.thd_attention import with_thd_reference_attention
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        make_schedule_config_safe,
        tiny_layer_spec,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    config = tiny_transformer_config(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        # verl's default regime: the schedule divides by the micro-batch count and DDP averages
        # over DP; verl's loss multiplies by both.
        calculate_per_token_loss=False,
        **(MOE if moe else {}),
    )
    if moe:
        config.moe_router_load_balancing_type = "aux_loss"
        config.moe_aux_loss_coeff = 1e-2
        config.moe_z_loss_coeff = 1e-3
    # verl's tf_config sets variable_seq_lengths (the communication shape is exchanged).
    config = dataclasses.replace(
        config, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall"
    )
    make_schedule_config_safe(config)
    experts = MOE["num_moe_experts"] if moe else None
    spec = with_thd_reference_attention(lambda c, vp_stage=None: tiny_layer_spec(experts))(None)
    chunks = build_tiny_gpt(config, seed=SEED, layer_spec=spec)
    chunks = wrap_in_ddp(_with_value_head(chunks) if value_head else chunks)
    config.finalize_model_grads_func = finalize_model_grads
    return config, chunks


def _forward_only(engine, data, key):
    """verl's forward-only pass; ``model_output[key]`` (padded to responses) on every stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from verl.workers.utils.padding import no_padding_2_padding

    out = engine.forward_backward_batch(data, loss_function=None, forward_only=True)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    holder = [no_padding_2_padding(out["model_output"][key], data) if last else None]
    dist.broadcast_object_list(
        holder,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return holder[0].detach().clone()


def _verl_body(
    verl_root, num, agg_mode, budget, *, dynamic=True, long_every=0, scale=None, moe=False
):
    """verl's engine on this rank's shard: a forward-only pass (old log-probs), then a training
    pass with ``ppo_loss``. Returns the log-probs, the gradients and what ran; ``moe``: the tiny
    MoE, and the tokens each router layer counted in the training pass (``router_tokens``)."""
    from functools import partial

    from megatron.core import parallel_state as ps

    stubbed = _import_verl(verl_root)
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron import transformer_impl as ti
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from megatron_dynbatch.tools.testing.tiny_gpt import named_global_grads

    assert ti.__file__.startswith(verl_root), ti.__file__
    pp = ps.get_pipeline_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    config, chunks = _verl_model(moe=moe)
    engine = _engine(ti, chunks, config, dynamic=dynamic, pp=pp, vpp=vpp)

    samples = _samples(num, long_every=long_every)
    full = _padded_batch(samples)
    mine, positions = _shard(full, dp, dp_rank)

    def batch(old_log_probs=None):
        values = dict(mine)
        if old_log_probs is not None:
            values["old_log_probs"] = old_log_probs
        data = TensorDict(values, batch_size=[len(positions)])
        data = left_right_2_no_padding(data)
        tu.assign_non_tensor(
            data,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=budget,
            temperature=1.0,
            global_batch_size=num,
            calculate_entropy=False,
        )
        return data

    old = _forward_only(engine, batch(), "log_probs")
    train = batch(old_log_probs=old)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    loss_function = partial(ppo_loss, config=_actor_config(agg_mode, scale))
    from tests._support import RouterTokens

    router_tokens = RouterTokens()
    with router_tokens.installed():
        router_tokens.active = True
        result = engine.forward_backward_batch(train, loss_function=loss_function)
        router_tokens.active = False
    grads = named_global_grads(chunks, tp_group=ps.get_tensor_model_parallel_group())
    return {
        "router_tokens": dict(router_tokens.per_layer),
        "tokens": int(mine["attention_mask"].sum()),
        "lengths": mine["attention_mask"].sum(dim=1).tolist(),
        "finite": all(bool(torch.isfinite(g).all()) for g in grads.values()),
        "stubbed": stubbed,
        "grads": {k: v.clone() for k, v in grads.items()},
        "log_probs": old,
        "positions": positions,
        "num_microbatches": tu.get_non_tensor_data(train, "num_micro_batch", None),
        "losses": result.get("loss") if ps.is_pipeline_last_stage(ignore_virtual=True) else None,
    }


def _aggregated(per_token, mask, agg_mode, num, total_tokens, scale):
    """One sample's share of verl's ``agg_loss`` over the whole batch (``per_token`` is masked)."""
    if agg_mode == "token-mean":
        return per_token.sum() / total_tokens
    if agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq = per_token.sum() / num
        return seq / scale if agg_mode == "seq-mean-token-sum-norm" else seq
    return per_token.sum() / (mask.sum() + 1e-8) / num


def _reference_body(num, agg_mode, scale=None, long_every=0):
    """Each sample alone through a single-process tiny GPT, verl's PPO loss at ratio 1 with the
    aggregation written out over the whole batch."""
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        response_outputs,
        tiny_transformer_config,
    )

    samples = _samples(num, long_every=long_every)
    full = _padded_batch(samples)
    [model] = build_tiny_gpt(tiny_transformer_config(), seed=SEED)

    def response_log_probs(p, r):
        scored = torch.log_softmax(response_outputs(model, p, r).float(), dim=-1)
        return scored.gather(1, r.unsqueeze(1)).squeeze(1)

    model.zero_grad()
    total_tokens = sum(int(m.sum()) for _, _, m in samples)
    total = 0.0
    log_probs = []
    for i, (p, r, m) in enumerate(samples):
        lp = response_log_probs(p, r)
        log_probs.append(lp.detach())
        adv = full["advantages"][i, : r.numel()]
        per_token = -adv * torch.exp(lp - lp.detach()) * m
        total = total + _aggregated(per_token, m, agg_mode, num, total_tokens, scale)
    total.backward()
    return {"grads": named_global_grads([model]), "log_probs": log_probs}


def _check(results, reference, num, what, output="log-prob"):
    merged = {}
    for r in results:
        merged.update(r["grads"])  # every rank holds the DP-reduced gradients of its stage
    assert set(merged) == set(reference["grads"])
    worst = 0.0
    for name, ref in reference["grads"].items():
        err = relative_error(merged[name], ref)
        worst = max(worst, err)
        assert err <= REL_TOL, (name, err)
    worst_lp = 0.0
    seen = set()
    for r in results:
        for row, position in enumerate(r["positions"]):
            seen.add(position)
            want = reference["log_probs"][position]
            got = r["log_probs"][row, : want.numel()]
            worst_lp = max(worst_lp, float((got - want).abs().max()))
    assert seen == set(range(num))
    assert worst_lp <= 1e-5, worst_lp
    counts = {r["num_microbatches"] for r in results}
    print(
        f"\n[verl {what}] grad rel diff max={worst:.2e} {output} abs diff max={worst_lp:.2e} "
        f"microbatches={sorted(counts)} stubbed={results[0]['stubbed']}"
    )
    return counts


#: (world, layout, samples, loss_agg_mode, budget, every n-th sample long, loss_scale_factor)
CASES = [
    pytest.param(2, Layout(pp=2), 9, "token-mean", 40, 0, None, id="pp2-dp1-token-mean"),
    *(
        pytest.param(4, Layout(pp=2), 8, mode, 40, 3, 16.0, id=f"pp2-dp2-{mode}")
        for mode in LOSS_AGG_MODES
    ),
    pytest.param(2, Layout(pp=2, vpp=2), 5, "token-mean", 40, 2, None, id="pp2-vpp2-dp1"),
    # TP 2: verl aligns each packed sequence to a multiple of tp; the cap counts it so.
    pytest.param(4, Layout(tp=2, pp=2), 7, "token-mean", 40, 3, None, id="tp2-pp2-dp1"),
    # One sample per DP rank, two micro-batches (the interleaved group): stock verl asserts here.
    pytest.param(
        4, Layout(pp=2, vpp=2), 2, "seq-mean-token-mean", 40, 0, None, id="pp2-vpp2-dp2-1-sample"
    ),
]


@needs_verl
@pytest.mark.parametrize("world, layout, num, mode, budget, long_every, scale", CASES)
def test_verl_engine_matches_per_sample_reference(
    patched_verl, world, layout, num, mode, budget, long_every, scale
):
    results = run_on_ranks(
        world,
        _verl_body,
        patched_verl,
        num,
        mode,
        budget,
        long_every=long_every,
        scale=scale,
        layout=layout,
        timeout_s=BODY_TIMEOUT_S,
    )
    [reference] = run_on_ranks(
        1, _reference_body, num, mode, scale=scale, long_every=long_every, layout=Layout()
    )
    dp = world // (layout.tp * layout.pp)
    counts = _check(results, reference, num, f"{layout} dp={dp} {mode}")
    assert len(counts) == 1, f"DP ranks ran different micro-batch counts: {counts}"
    [count] = counts
    if layout.vpp:
        assert count % layout.pp == 0, count
    if num // dp < count:
        # The step verl cannot run: a rank with fewer samples than micro-batches (placeholders).
        assert all(len(r["positions"]) < count for r in results)


# -- the critic: verl's value-head engine, values forward-only and the value loss ----------------


class _ValueHead(torch.nn.Module):
    """A value model's output layer (hidden -> 1), called as Megatron's output layer is."""

    def __init__(self, hidden):
        super().__init__()
        gen = torch.Generator().manual_seed(SEED + 3)
        self.weight = torch.nn.Parameter(torch.randn(1, hidden, generator=gen) * 0.2)

    def forward(self, hidden_states, weight=None, **_):
        return torch.nn.functional.linear(hidden_states, self.weight), None


def _with_value_head(chunks):
    """verl's critic is the GPT with a one-unit output layer (Megatron-Bridge builds it so)."""
    for chunk in chunks:
        if getattr(chunk, "post_process", False):
            chunk.output_layer = _ValueHead(chunk.config.hidden_size)
    return chunks


def _critic_returns(full, seed=SEED):
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randn(full["response_mask"].shape, generator=gen) * full["response_mask"]


def _critic_body(verl_root, num, budget, long_every, agg_mode, scale):
    """verl's ``MegatronEngineWithValueHead`` on this rank's shard: a forward-only pass (the old
    values), then a training pass with verl's ``value_loss``."""
    from functools import partial

    from megatron.core import parallel_state as ps

    _import_verl(verl_root)
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreCriticConfig
    from verl.workers.engine.megatron import transformer_impl as ti
    from verl.workers.utils.losses import value_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from megatron_dynbatch.tools.testing.tiny_gpt import named_global_grads

    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    config, chunks = _verl_model(value_head=True)
    engine = _engine(ti, chunks, config, dynamic=True, pp=pp, vpp=vpp)
    engine.__class__ = ti.MegatronEngineWithValueHead
    # Record what the plan gave this rank in each pass (real micro-batches, count).
    from megatron_dynbatch.integrations.verl import engine as dynbatch

    planned, prepare = [], dynbatch.prepare_micro_batches

    def recording(*args, **kwargs):
        micro_batches, indices = prepare(*args, **kwargs)
        planned.append((len(indices), len(micro_batches)))
        return micro_batches, indices

    dynbatch.prepare_micro_batches = recording

    full = _padded_batch(_samples(num, long_every=long_every))
    full["returns"] = _critic_returns(full)
    mine, positions = _shard(full, dp, dp_rank)

    def batch(values=None):
        fields = dict(mine)
        if values is not None:
            fields["values"] = values
        data = left_right_2_no_padding(TensorDict(fields, batch_size=[len(positions)]))
        tu.assign_non_tensor(
            data, use_dynamic_bsz=True, max_token_len_per_gpu=budget, global_batch_size=num
        )
        return data

    old = _forward_only(engine, batch(), "values")
    train = batch(values=old)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    critic = McoreCriticConfig(
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=budget,
        loss_agg_mode=agg_mode,
        loss_scale_factor=scale,
    )
    engine.forward_backward_batch(train, loss_function=partial(value_loss, config=critic))
    grads = named_global_grads(chunks, tp_group=ps.get_tensor_model_parallel_group())
    return {
        "grads": {k: v.clone() for k, v in grads.items()},
        "values": old,
        "positions": positions,
        "num_microbatches": tu.get_non_tensor_data(train, "num_micro_batch", None),
        "planned": planned,
    }


def _critic_reference_body(num, long_every, agg_mode, scale):
    """Each sample alone through the single-process value model; verl's value loss at the old
    values (no clipping), aggregated over the whole batch."""
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        response_outputs,
        tiny_transformer_config,
    )

    samples = _samples(num, long_every=long_every)
    returns = _critic_returns(_padded_batch(samples))
    [model] = _with_value_head(build_tiny_gpt(tiny_transformer_config(), seed=SEED))
    model.zero_grad()
    total_tokens = sum(int(m.sum()) for _, _, m in samples)
    total, values = 0.0, []
    for i, (p, r, m) in enumerate(samples):
        v = response_outputs(model, p, r)[:, 0]
        values.append(v.detach())
        per_token = 0.5 * (v - returns[i, : r.numel()]) ** 2 * m
        total = total + _aggregated(per_token, m, agg_mode, num, total_tokens, scale)
    total.backward()
    return {"grads": named_global_grads([model]), "log_probs": values}


@needs_verl
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_verl_critic_values_and_value_loss_match_per_sample_reference(patched_verl, mode):
    """The critic's passes are planned the same way: verl's ``MegatronEngineWithValueHead`` at
    pp 2 x vpp 2, dp 2, one sample a rank (fewer than the interleaved group: placeholders); the
    forward-only values come back in sample order and the value loss's gradients equal each
    sample run alone. (A rank that needs fewer micro-batches than another but holds as many
    samples now fills the count with its own samples, placeholders being copies of a sample.)"""
    num, budget, long_every, scale = 2, 36, 2, 16.0
    results = run_on_ranks(
        4,
        _critic_body,
        patched_verl,
        num,
        budget,
        long_every,
        mode,
        scale,
        layout=Layout(pp=2, vpp=2),
        timeout_s=BODY_TIMEOUT_S,
    )
    [reference] = run_on_ranks(
        1, _critic_reference_body, num, long_every, mode, scale, layout=Layout()
    )
    for r in results:
        r["log_probs"] = r["values"]  # _check compares the forward-only outputs under this key
        r["stubbed"] = ()
    counts = _check(results, reference, num, f"critic pp2 vpp2 dp2 {mode}", output="value")
    assert len(counts) == 1, f"DP ranks ran different micro-batch counts: {counts}"
    # Both passes ran through the plan, and a rank ran placeholders after its real micro-batches.
    planned = [r["planned"] for r in results]
    assert all(len(passes) == 2 for passes in planned), planned
    assert any(real < total for passes in planned for real, total in passes), planned
    names = {name for r in results for name in r["grads"]}
    assert any("output_layer" in name for name in names), sorted(names)


@needs_verl
def test_stock_verl_asserts_where_the_plan_runs_placeholders(stock_verl):
    """The last case above under stock verl (``use_dynamic_bsz``, pp 2 x vpp 2, one sample per DP
    rank): ``rearrange_micro_batches`` rounds the count up to the interleaved group (2) and then
    asserts that every rank has that many samples (verl #1004)."""
    # The match reads the whole report: each failed rank's message and traceback.
    match = "assert 2 <= 1|num_micro_batches <= num_groups"
    with pytest.raises(DistributedTestError, match=match) as caught:
        run_on_ranks(
            4,
            _verl_body,
            stock_verl,
            2,
            "seq-mean-token-mean",
            40,
            dynamic=None,
            layout=Layout(pp=2, vpp=2),
            timeout_s=BODY_TIMEOUT_S,
        )
    assert "AssertionError" in {name for name, _ in caught.value.errors.values()}, caught.value


@needs_verl
def test_with_the_switch_off_patched_verl_is_bitwise_stock(patched_verl, stock_verl):
    """Every patched line runs only with ``use_dynamic_batch_size``: with it off (verl's own
    ``rearrange_micro_batches`` at the same budget) the patched tree and the stock tree (VERL_DIR
    with our patches reverse-applied on a copy) give bitwise the same log-probs, gradients and
    losses."""
    runs = {
        name: run_on_ranks(
            4,
            _verl_body,
            root,
            8,
            "token-mean",
            40,
            dynamic=dynamic,
            long_every=3,
            layout=Layout(pp=2),
            timeout_s=BODY_TIMEOUT_S,
        )
        for name, root, dynamic in (
            ("patched", patched_verl, False),
            ("stock", stock_verl, None),
        )
    }
    for mine, theirs in zip(runs["patched"], runs["stock"], strict=True):
        assert mine["grads"].keys() == theirs["grads"].keys()
        for name, grad in mine["grads"].items():
            assert torch.equal(grad, theirs["grads"][name]), name
        assert torch.equal(mine["log_probs"], theirs["log_probs"])
        assert mine["losses"] == theirs["losses"]
        assert mine["num_microbatches"] == theirs["num_microbatches"]


@needs_verl
def test_an_oversize_sample_is_refused_on_every_rank_naming_verls_key(patched_verl):
    """A sample longer than the cap on one DP rank stops every rank before the pipeline, with the
    same message naming verl's budget key of the pass that met it (not a hang, not a silent
    over-budget micro-batch). The body's first pass is the actor's old log-probs, whose budget is
    the rollout's key: the message names it, not the training key (issue 43)."""
    rollout = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
    with pytest.raises(DistributedTestError, match=rollout) as caught:
        run_on_ranks(
            4,
            _verl_body,
            patched_verl,
            8,
            "token-mean",
            24,
            long_every=5,
            layout=Layout(pp=2),
            timeout_s=BODY_TIMEOUT_S,
        )
    errors = caught.value.errors
    assert sorted(errors) == [0, 1, 2, 3], errors
    for name, message in errors.values():
        assert name == "StepAgreementError", (name, message)
        assert f"({rollout}=24)" in message and "exceed the token cap 24" in message
        assert f"Raise {rollout} to at least" in message
        assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" not in message


@needs_verl
def test_moe_routers_count_only_the_tokens_of_real_micro_batches(patched_verl):
    """Patch 0002: a tiny MoE (aux loss and z-loss on) through verl's forward_backward_batch at
    pp 2 x vpp 2, dp 2, one sample a rank, so each runs a placeholder micro-batch (the
    interleaved group is 2): every router of every rank counts exactly its own samples' tokens
    (tp 1: no alignment pad), none of a placeholder's; gradients stay finite."""
    results = run_on_ranks(
        4,
        _verl_body,
        patched_verl,
        2,
        "token-mean",
        40,
        long_every=8,
        moe=True,
        layout=Layout(pp=2, vpp=2),
        timeout_s=BODY_TIMEOUT_S,
    )
    from megatron_dynbatch.integrations.verl.engine import plan_verl_batch, verl_planner_config

    # The case must run placeholders (else the count would hold without the mask too).
    config = verl_planner_config(
        40,
        pp_size=2,
        vpp_size=2,
        microbatch_group_size_per_vp_stage=None,
        tp_size=1,
        cp_size=1,
        packed=True,
    )
    shards = sorted({tuple(r["positions"]): r["lengths"] for r in results}.items())
    plan = plan_verl_batch([lengths for _, lengths in shards], config)
    assert plan.placeholders(0) + plan.placeholders(1) > 0, plan
    assert {r["num_microbatches"] for r in results} == {plan.num_microbatches}
    for r in results:
        assert r["finite"]
        layers = r["router_tokens"]
        assert len(layers) == MOE["num_layers"] // 2, layers
        assert all(count == r["tokens"] for count in layers.values()), (layers, r["tokens"])


def _marker_body(verl_root):
    """verl's own ``tensordict_utils`` on a batch whose placeholder is an exact copy of a real
    sample (every key kept: the content says nothing): the marker alone tells them apart."""
    _import_verl(verl_root)
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from megatron_dynbatch.integrations.verl import engine
    from megatron_dynbatch.integrations.verl.moe import is_placeholder_batch

    data = TensorDict(
        {
            "input_ids": torch.arange(1, 13).reshape(3, 4),
            "attention_mask": torch.ones(3, 4, dtype=torch.int64),
            "loss_mask": torch.ones(3, 4),
        },
        batch_size=[3],
    )
    structural = engine.STRUCTURAL_KEYS
    engine.STRUCTURAL_KEYS = tuple(
        data.keys()
    )  # a copy of the sample; restored (workers are reused)
    try:
        filler = engine.placeholder_micro_batch(data, 2, tu)
    finally:
        engine.STRUCTURAL_KEYS = structural
    real = tu.index_select_tensor_dict(data, [2])
    same = all(torch.equal(filler[key], real[key]) for key in data.keys())
    return (
        same,
        is_placeholder_batch(real, tu),
        [is_placeholder_batch(b, tu) for b in (filler, filler.clone())],
    )


@needs_verl
def test_a_placeholder_is_known_by_its_marker_not_its_content(patched_verl):
    [(same, real, placeholder)] = run_on_ranks(
        1, _marker_body, patched_verl, layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    assert same, "the placeholder must carry the real sample's content for this case"
    assert not real and placeholder == [True, True]


def _media_body(verl_root):
    """A VLM batch as verl's Megatron VLM examples build it (``multi_modal_inputs``: a stack of
    per-sample dicts of ``pixel_values`` / ``image_grid_thw``), read back through verl's own
    ``extract_multi_modal_inputs``: what the forward of a placeholder gets."""
    _import_verl(verl_root)
    from tensordict import NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import extract_multi_modal_inputs

    from megatron_dynbatch.integrations.verl import engine

    image = 151655  # Qwen2-VL's image token
    ids = torch.tensor([[1, image, image, 5], [1, image, image, 7]])
    data = TensorDict(
        {"input_ids": ids, "attention_mask": torch.ones(2, 4, dtype=torch.int64),
         "loss_mask": torch.ones(2, 4)},
        batch_size=[2],
    )  # fmt: skip
    media = [{"pixel_values": torch.randn(8, 4), "image_grid_thw": torch.tensor([[1, 2, 4]])}] * 2
    data["multi_modal_inputs"] = NonTensorStack(*media)
    filler = engine.placeholder_micro_batch(data, 0, tu)
    real = tu.index_select_tensor_dict(data, [0])
    return (
        int((filler["input_ids"] == image).sum()),
        sorted(extract_multi_modal_inputs(filler.get("multi_modal_inputs", []))),
        sorted(extract_multi_modal_inputs(real.get("multi_modal_inputs", []))),
    )


@needs_verl
def test_a_vlm_placeholder_carries_no_media_as_it_carries_no_image_token(patched_verl):
    """A probe: the placeholder kept its template's pixel_values while its input_ids (image
    tokens included) were zeroed, a mismatch VLMs refuse ("Image features and image tokens do
    not match"); it is now a text sample, as verl reads a sample without media."""
    [(tokens, placeholder, real)] = run_on_ranks(
        1, _media_body, patched_verl, layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    assert tokens == 0 and placeholder == [], placeholder
    assert real == ["image_grid_thw", "pixel_values"], real


def _config_body(verl_root, cases):
    """verl's own config path on the driver: its generated trainer YAML, each case's overrides as
    Hydra's parser reads a command line, then verl's ``validate_config`` (what ``main_ppo.main``
    runs before any worker; it builds the actor's and the critic's config dataclasses). Returns,
    per case, the error or None, and the actor's flag as verl's dataclass reads it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    _import_verl(verl_root)
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    path = pathlib.Path(verl_root) / "verl" / "trainer" / "config"
    results = []
    for overrides, use_critic in cases:
        cfg = OmegaConf.load(path / "_generated_ppo_megatron_trainer.yaml")
        for override in OverridesParser.create().parse_overrides(overrides):
            OmegaConf.update(cfg, override.key_or_group, override.value(), force_add=True)
        try:
            validate_config(cfg, use_reference_policy=True, use_critic=use_critic)
            actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        except Exception as error:  # hydra wraps a dataclass's error in its own
            results.append({"error": f"{type(error).__name__}: {error}"})
            continue
        results.append(
            {"error": None, "flag": getattr(actor.megatron, "use_dynamic_batch_size", None)}
        )
    return results


def _validate(verl_root, cases):
    [results] = run_on_ranks(
        1, _config_body, verl_root, cases, layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    return results


FLAG = "actor_rollout_ref.actor.megatron.use_dynamic_batch_size"
#: verl's own checks want fixed micro-batch sizes without use_dynamic_bsz.
FIXED = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
]
ON = [f"{FLAG}=true", "actor_rollout_ref.actor.use_dynamic_bsz=true"]
CRITIC_ON = [
    "critic.megatron.use_dynamic_batch_size=true",
    "critic.use_dynamic_bsz=true",
]
ACTOR_BUDGET = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
ROLLOUT_BUDGET = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
REF_BUDGET = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
#: Bad budgets stock verl accepts at config time (they fail at the first batch, on the workers).
BAD_BUDGETS = ("-1", "0", "null", "8k", "100.5")


@needs_verl
def test_config_refusals_happen_in_verls_own_config_parser(patched_verl):
    """What a user types on verl's command line, through verl's own ``validate_config``: refused
    at config time, before any worker starts, one line naming verl's key for the pass it sets
    (training, the rollout's log-probs, the reference's, the critic's)."""
    pytest.importorskip("hydra", reason="verl's config path instantiates through hydra-core")
    cases = [
        (FIXED + [f"{FLAG}=off"], f"{FLAG}='off' is not a boolean (OmegaConf reads it as false"),
        (FIXED + [f"{FLAG}=yes_please"], "OmegaConf does not read it as a boolean either"),
        (FIXED + [f"{FLAG}=true"], "actor_rollout_ref.actor.use_dynamic_bsz=false"),
        (ON + ["actor_rollout_ref.actor.megatron.router_replay.mode=R2"], "mode='R2'"),
        (ON + ["actor_rollout_ref.actor.router_replay.mode=R3"], "router_replay.mode='R3'"),
        (
            ON
            + [
                "actor_rollout_ref.actor.megatron.dynamic_context_parallel=true",
                "actor_rollout_ref.actor.megatron.max_seqlen_per_dp_cp_rank=1024",
            ],
            "dynamic_context_parallel=true",
        ),
        (
            ON
            + [
                "+actor_rollout_ref.actor.megatron.override_transformer_config."
                "calculate_per_token_loss=true"
            ],
            "calculate_per_token_loss=true",
        ),
        (
            ON + ["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false"],
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
        ),
    ]
    cases += [(ON + [f"{ACTOR_BUDGET}={v}"], f"{ACTOR_BUDGET}=") for v in BAD_BUDGETS]
    cases += [(ON + [f"{ROLLOUT_BUDGET}=-5"], f"{ROLLOUT_BUDGET}=-5 must be > 0")]
    cases += [(ON + [f"{REF_BUDGET}=0"], f"{REF_BUDGET}=0 must be > 0")]
    cases += [
        (ON + CRITIC_ON + [f"critic.ppo_max_token_len_per_gpu={v}"], "critic.ppo_max_token_len_")
        for v in ("0", "8k")
    ]
    cases += [
        (
            ON + CRITIC_ON + ["critic.ppo_infer_max_token_len_per_gpu=-3"],
            "critic.ppo_infer_max_token_len_per_gpu=-3 must be > 0",
        )
    ]
    memory = "actor_rollout_ref.actor.megatron.dynbatch.max_memory_gib"
    cases += [(ON + [f"+{memory}={v}"], f"{memory}=") for v in ("-1", "0", "nan", "inf", "lots")]
    dynbatch = "actor_rollout_ref.actor.megatron.dynbatch"
    cases += [
        (ON + [f"+{dynbatch}.planner=nope"], f"{dynbatch}.planner='nope': no planner named"),
        # verl packs THD rows (use_remove_padding, its default): 'fixed' plans padded ones.
        (ON + [f"+{dynbatch}.planner=fixed"], f"{dynbatch}.planner='fixed' plans padded rows"),
        (
            ON + [f"+{dynbatch}.max_memory_gb=70"],
            f"{dynbatch} has unknown key(s) ['max_memory_gb']",
        ),
    ]
    overhead = f"{dynbatch}.cost_microbatch_overhead"
    cases += [
        (ON + [f"+{overhead}={v}"], f"{overhead}={r} must be a finite number >= 0")
        for v, r in (("-1", "-1"), ("nan", "nan"), ("inf", "inf"), ("lots", "'lots'"))
    ]
    # Our settings with the role's switch off were ignored unseen (patch 0001 now checks them).
    off = "is read only by megatron_dynbatch's dynamic batching, which is off"
    cases += [
        (FIXED + flag + [f"+{dynbatch}.{setting}"], f"{dynbatch}={{{shown}}} {off}")
        for flag in ([], [f"{FLAG}=false"])
        for setting, shown in (("planner=dynbatch", "'planner': 'dynbatch'"),)
    ]
    # The engine's rows are the model config's use_remove_padding (verl's worker copies it), not
    # megatron.use_remove_padding (a probe: the check read that one).
    fixed_planner = f"+{dynbatch}.planner=fixed"
    cases += [
        (
            ON + ["actor_rollout_ref.actor.megatron.use_remove_padding=false", fixed_planner],
            f"{dynbatch}.planner='fixed' plans padded rows",
        )
    ]
    # The reference model's own keys follow the actor's (a probe: set otherwise, unchecked).
    ref = "actor_rollout_ref.ref"
    cases += [
        (
            FIXED
            + [
                f"{ref}.megatron.use_dynamic_batch_size=true",
                f"{ref}.log_prob_use_dynamic_bsz=true",
                f"{ref}.log_prob_max_token_len_per_gpu=0",
            ],
            f"{ref}.megatron.use_dynamic_batch_size=True differs from {FLAG}=False",
        )
    ]
    cases += [
        (
            FIXED + ["+critic.megatron.dynbatch.max_memory_gib=40"],
            f"critic.megatron.dynbatch={{'max_memory_gib': 40}} {off}",
        )
    ]
    results = _validate(patched_verl, [(o, any("critic" in x for x in o)) for o, _ in cases])
    for (overrides, match), result in zip(cases, results, strict=True):
        assert result["error"] and "DynBatchValueError" in result["error"], (overrides, result)
        assert match in result["error"], (overrides, result)
        assert "\n" not in result["error"].split("DynBatchValueError: ")[-1], result
    # The budget errors name the pass's own key, never another pass's.
    for (overrides, _), result in zip(cases, results, strict=True):
        if any(o.startswith(ROLLOUT_BUDGET) for o in overrides):
            assert ACTOR_BUDGET not in result["error"], result
    ok = [(ON, True), (FIXED + [f"{FLAG}=false"], False), (FIXED, False)]
    # An empty (null) section reads as absent; a registered planner is accepted.
    ok += [(ON + [f"{dynbatch}=null"], True), (ON + [f"+{dynbatch}.planner=dynbatch"], True)]
    # A per-micro-batch overhead the planner is told (tokens of linear work).
    ok += [(ON + [f"+{overhead}=330"], True), (ON + [f"+{overhead}=0"], True)]
    ok += [(ON + ["actor_rollout_ref.model.use_remove_padding=false", fixed_planner], True)]
    # (A critic that passes our checks goes on to verl's own HFModelConfig, which needs the real
    # transformers; the critic's refusals above come first, before verl builds it.)
    results = _validate(patched_verl, [(o, any("critic" in x for x in o)) for o, _ in ok])
    for (overrides, flag_value), result in zip(ok, results, strict=True):
        assert result == {"error": None, "flag": flag_value}, (overrides, result)


#: A model's ``config.json`` as Hugging Face writes it (a Qwen2-style 0.5B-class dense model and
#: a small Qwen3-MoE-style one), for the memory budget at config time.
DENSE_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    **QWEN2_05B_HF,
    "tie_word_embeddings": True,
}
MOE_CONFIG = dict(DENSE_CONFIG, architectures=["Qwen3MoeForCausalLM"], **SMALL_MOE_HF)


@needs_verl
@pytest.mark.parametrize("hf", [DENSE_CONFIG, MOE_CONFIG], ids=["dense", "moe"])
def test_memory_budget_is_planned_at_config_time_naming_its_key(patched_verl, tmp_path, hf):
    """``...megatron.dynbatch.max_memory_gib`` through verl's ``validate_config``: a budget too small for
    a micro-batch at the token budget is refused naming the key and the smallest budget that
    works; that budget is accepted, one a little smaller refused; the critic's key is its own."""
    pytest.importorskip("hydra", reason="verl's config path instantiates through hydra-core")
    import json
    import re

    (tmp_path / "config.json").write_text(json.dumps(hf))
    memory = "actor_rollout_ref.actor.megatron.dynbatch.max_memory_gib"
    base = ON + [
        f"actor_rollout_ref.model.path={tmp_path}",
        f"{ACTOR_BUDGET}=32768",
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    ]
    [small] = _validate(patched_verl, [(base + [f"+{memory}=8"], False)])
    assert "DynBatchValueError" in small["error"] and f"{memory}=8 is too small" in small["error"]
    assert f"{ACTOR_BUDGET}=32768" in small["error"], small
    need = float(re.search(r"set \S+ to at least ([0-9]+\.[0-9]+)", small["error"]).group(1))
    lower = re.search(rf"lower {ACTOR_BUDGET} to at most (\d+)", small["error"])
    cases = [
        (base + [f"+{memory}={need}"], False),
        (base + [f"+{memory}={need - 0.01:.3f}"], False),
    ]
    if lower:  # the token budget the error names fits the budget it was refused with
        cases.append((base + [f"+{memory}=8", f"{ACTOR_BUDGET}={lower.group(1)}"], False))
    critic = CRITIC_ON + [
        f"critic.model.path={tmp_path}",
        "+critic.megatron.dynbatch.max_memory_gib=1",
    ]
    cases.append((base + [f"+{memory}={need}"] + critic, True))
    results = _validate(patched_verl, cases)
    assert results[0] == {"error": None, "flag": True}, results[0]
    assert "is too small" in results[1]["error"], results[1]
    if lower:
        assert results[2] == {"error": None, "flag": True}, results[2]
    assert "critic.megatron.dynbatch.max_memory_gib=1 is too small" in results[-1]["error"]
    print(
        f"\n[verl max_memory_gib, {hf['architectures'][0]}] smallest {need} GiB; {small['error']}"
    )


@needs_verl
def test_with_the_switch_off_patched_verl_validates_as_stock(patched_verl, stock_verl):
    """The way back, on verl's config path: with the switch off (absent or false), every case,
    bad values and cases where verl itself raises included, gives the patched tree's
    ``validate_config`` the same result as the stock tree's."""
    pytest.importorskip("hydra", reason="verl's config path instantiates through hydra-core")
    dyn = ["actor_rollout_ref.actor.use_dynamic_bsz=true"]
    cases = [
        (FIXED, False),
        ([], False),  # verl raises: no micro-batch size without use_dynamic_bsz
        (dyn, False),
        (dyn + [f"{ACTOR_BUDGET}={v}" for v in ("-1",)], False),
        (dyn + [f"{ACTOR_BUDGET}=8k", f"{ROLLOUT_BUDGET}=-5"], False),
        (FIXED + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], False),  # raises
        (FIXED + ["actor_rollout_ref.actor.loss_agg_mode=nope"], False),  # verl raises
        (dyn + ["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=0"], True),
    ]
    patched = _validate(patched_verl, cases)
    off = _validate(patched_verl, [(o + [f"{FLAG}=false"], c) for o, c in cases])
    stock = _validate(stock_verl, cases)
    for case, mine, explicit, theirs in zip(cases, patched, off, stock, strict=True):
        theirs = dict(theirs)
        if theirs.get("error") is None:
            assert theirs["flag"] is None  # the stock dataclass has no flag
            theirs["flag"] = False  # the patched one's default
        assert mine == theirs, (case, mine, theirs)
        assert explicit == theirs, (case, explicit, theirs)
    assert any(r["error"] for r in stock) and any(r["error"] is None for r in stock), stock


#: verl's own CPU unit tests of what the patches touch (seqlen balancing and dynamic micro-batches,
#: ``prepare_micro_batches``, the engine configs, the Megatron engine's forward step and its
#: helpers), run on the patched tree. Not run: ``test_engine_return_model_output_on_cpu.py``
#: (it imports verl's whole worker stack: pydantic, rollout servers).
VERL_OWN_TESTS = (
    "tests/utils/test_seqlen_balancing.py",
    "tests/utils/test_prepare_micro_batches_with_group_size.py",
    "tests/workers/config/test_engine_config_on_cpu.py",
    "tests/workers/test_engine_forward_step_detach_on_cpu.py",
    "tests/workers/test_router_replay_engine_helpers_on_cpu.py",
    "tests/workers/test_packed_pad_to_length_on_cpu.py",
)
#: Deselected, with the reason: it spawns fresh processes (``mp.spawn``) that run an NCCL process
#: group on GPUs (and do not inherit the stubs).
VERL_OWN_DESELECTED = (
    "tests/utils/test_seqlen_balancing.py::test_seqlen_balancing_distributed_params",
)


def _run_verl_own_tests(tree, tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    args = ["-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini")]
    args += ["--rootdir", str(tree), *(str(tree / f) for f in VERL_OWN_TESTS)]
    args += [f"--deselect={f}" for f in VERL_OWN_DESELECTED]
    # This module is loaded by path under another name: verl's tests import their own top-level
    # ``tests`` package, which this repository's ``tests`` would shadow. It imports this
    # repository's tests._support first (REPO first on the path for that import only), then
    # forgets our ``tests`` so that verl's own tests import theirs (as SkyRL's runner does).
    code = (
        f"import importlib.util, sys; sys.path.insert(0, {str(REPO)!r}); "
        f"spec = importlib.util.spec_from_file_location('_verl_stubs', {__file__!r}); "
        "helpers = importlib.util.module_from_spec(spec); spec.loader.exec_module(helpers); "
        "[sys.modules.pop(k) for k in list(sys.modules) if k.split('.')[0] == 'tests']; "
        "sys.path.pop(0); "
        f"helpers._import_verl({str(tree)!r}); import pytest; "
        f"sys.exit(pytest.main({args!r}))"
    )
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tree,
        env=dict(os.environ, PYTHONPATH=path),
        timeout=600,
    )


@needs_verl
def test_verls_own_batching_unit_tests_pass_on_the_patched_tree(tmp_path, patched_verl):
    tree = tmp_path / "tree"
    shutil.copytree(pathlib.Path(patched_verl) / "verl", tree / "verl")
    shutil.copytree(pathlib.Path(VERL_DIR) / "tests", tree / "tests")
    result = _run_verl_own_tests(tree, tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary and "error" not in summary, summary
    print("\n[verl's own tests on the patched tree] " + summary)
