"""verl's and SkyRL's config-time checks without the hosts (integrations/verl/config.py,
integrations/skyrl/validate.py, integrations/host_memory.py): each pass's budget key, the memory
budget in the host's own key, a Hugging Face config read into the memory model's dimensions.
The same checks through the hosts' own config code: tests/megatron/test_verl_patched.py and
test_skyrl_patched.py."""

import json
import math
import re
from types import SimpleNamespace

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.host_memory import (
    check_memory_budget,
    hf_model_config,
    hf_model_dims,
    host_memory_limit,
    parse_gib,
)
from megatron_dynbatch.integrations.skyrl.validate import validate_trainer_config
from megatron_dynbatch.integrations.verl.config import BUDGET_KEYS, check_verl_config
from megatron_dynbatch.integrations.verl.engine import verl_host
from megatron_dynbatch.planning.spec import ParallelLayout

pytestmark = pytest.mark.unit

HF = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
}


def _verl(**over):
    actor = {
        "strategy": "megatron",
        "use_dynamic_bsz": True,
        "ppo_max_token_len_per_gpu": 4096,
        "megatron": {"use_dynamic_batch_size": True, "context_parallel_size": 1},
    }
    config = {
        "actor_rollout_ref": {
            "actor": actor,
            "rollout": {"log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 8192},
            "ref": {"log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 8192},
            "model": {"path": None},
        },
        "critic": {"megatron": {"use_dynamic_batch_size": False}},
        "trainer": {"n_gpus_per_node": 2, "nnodes": 1},
    }
    for dotted, value in over.items():
        node = config
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config


@pytest.mark.parametrize("value", [-1, 0, None, "8k", 100.5, True, 2**41])
@pytest.mark.parametrize(
    "where, key",
    [
        ("actor_rollout_ref__actor__ppo_max_token_len_per_gpu", BUDGET_KEYS[("actor", False)]),
        (
            "actor_rollout_ref__rollout__log_prob_max_token_len_per_gpu",
            BUDGET_KEYS[("actor", True)],
        ),
        ("actor_rollout_ref__ref__log_prob_max_token_len_per_gpu", BUDGET_KEYS[("ref", True)]),
    ],
)
def test_verl_refuses_each_passs_bad_budget_naming_its_own_key(value, where, key):
    with pytest.raises(DynBatchValueError) as caught:
        check_verl_config(_verl(**{where: value}), use_reference_policy=True, use_critic=False)
    message = str(caught.value)
    assert message.startswith(f"{key}="), message
    others = {k for k in BUDGET_KEYS.values() if k != key}
    assert not any(other.split(" ")[0] + "=" in message for other in others), message


def test_verl_accepts_good_budgets_and_an_empty_dynbatch_section():
    check_verl_config(_verl(), use_reference_policy=True, use_critic=False)
    config = _verl(actor_rollout_ref__actor__megatron__dynbatch=None)
    check_verl_config(config, use_reference_policy=True, use_critic=False)


@pytest.mark.parametrize("role", ["actor_rollout_ref__actor", "critic"])
def test_verl_refuses_dynbatch_settings_with_the_roles_switch_off(role):
    """``megatron.dynbatch`` given with the role's switch off was ignored unseen: refused, naming
    the switch and the section to drop; the switch on (or the section dropped) passes."""
    off = {f"{role}__megatron": {"use_dynamic_batch_size": False, "dynbatch": {"planner": "x"}}}
    where = role.replace("__", ".")
    with pytest.raises(DynBatchValueError, match=rf"{where}.megatron.dynbatch=.* is read only"):
        check_verl_config(_verl(**off), use_reference_policy=True, use_critic=True)
    # The fix named: the section dropped.
    dropped = {f"{role}__megatron": {"use_dynamic_batch_size": False, "dynbatch": {}}}
    check_verl_config(_verl(**dropped), use_reference_policy=True, use_critic=True)
    # An unused critic's section is not read.
    if role == "critic":
        check_verl_config(_verl(**off), use_reference_policy=True, use_critic=False)


def test_verl_refuses_reference_settings_that_differ_from_the_actors():
    """A probe: the reference model's own switch or settings were never checked at config time
    (they failed at its first log-prob pass, on the workers); they follow the actor's."""
    mismatched = _verl(actor_rollout_ref__ref__megatron={"use_dynamic_batch_size": False})
    with pytest.raises(DynBatchValueError, match=r"ref.megatron.use_dynamic_batch_size=False diff"):
        check_verl_config(mismatched, use_reference_policy=True, use_critic=False)
    check_verl_config(mismatched, use_reference_policy=False, use_critic=False)  # no reference
    same = _verl(actor_rollout_ref__ref__megatron={"use_dynamic_batch_size": True})
    check_verl_config(same, use_reference_policy=True, use_critic=False)
    check_verl_config(_verl(), use_reference_policy=True, use_critic=False)  # not set: follows


def test_verl_runtime_messages_name_the_engine_and_pass_key():
    assert verl_host("actor").key("max_tokens_per_gpu") == BUDGET_KEYS[("actor", False)]
    assert verl_host("actor", True).key("max_tokens_per_gpu") == BUDGET_KEYS[("actor", True)]
    assert verl_host("ref", True).key("max_tokens_per_gpu") == BUDGET_KEYS[("ref", True)]
    assert verl_host("critic", True).key("max_tokens_per_gpu") == BUDGET_KEYS[("critic", True)]
    # verl's keys: the rollout's and the reference's, never an actor log-prob key verl lacks.
    assert BUDGET_KEYS[("actor", True)].startswith("actor_rollout_ref.rollout.")
    assert BUDGET_KEYS[("ref", True)].startswith("actor_rollout_ref.ref.")


def test_verl_critic_training_key_follows_the_trainer_that_set_the_budget():
    # verl's v1 trainer copies ppo_infer_max_token_len_per_gpu into both of the engine's budgets
    # (trainer_base.py); the other trainer copies each key into its own (ray_trainer.py).
    legacy = SimpleNamespace(max_token_len_per_gpu=8192, infer_max_token_len_per_gpu=32768)
    v1_or_equal = SimpleNamespace(max_token_len_per_gpu=32768, infer_max_token_len_per_gpu=32768)
    key = verl_host("critic", False, legacy).key("max_tokens_per_gpu")
    assert key == "critic.ppo_max_token_len_per_gpu", key
    both = verl_host("critic", False, v1_or_equal).key("max_tokens_per_gpu")
    assert both == BUDGET_KEYS[("critic", False)], both
    assert verl_host("critic", False).key("max_tokens_per_gpu") == both
    # The forward pass and other engines read their own keys whatever the config says.
    assert (
        verl_host("critic", True, legacy).key("max_tokens_per_gpu") == BUDGET_KEYS[("critic", True)]
    )
    assert (
        verl_host("actor", False, legacy).key("max_tokens_per_gpu") == BUDGET_KEYS[("actor", False)]
    )


@pytest.mark.parametrize("value", [-1, 0, float("nan"), float("inf"), "lots", True])
def test_parse_gib_refuses_what_is_no_budget(value):
    with pytest.raises(DynBatchValueError, match="my.key="):
        parse_gib(value, "my.key")
    assert parse_gib(None, "my.key") is None
    assert parse_gib("70", "my.key") == 70.0


def test_hf_config_reads_dense_and_moe_dimensions(tmp_path):
    dims = hf_model_dims(HF, ParallelLayout(tp_size=2))
    assert (dims.num_layers, dims.hidden_size, dims.num_query_groups) == (4, 256, 2)
    assert dims.gated_linear_unit and dims.normalization == "RMSNorm" and not dims.num_experts
    assert dims.vocab_size % 256 == 0 and dims.vocab_size >= 1000
    moe = hf_model_dims(
        dict(HF, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128), ParallelLayout()
    )
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (8, 2, 128)
    (tmp_path / "config.json").write_text(json.dumps(HF))
    assert hf_model_config(str(tmp_path), key="k", path_key="p") == HF
    with pytest.raises(DynBatchValueError, match="k needs the model's dimensions"):
        hf_model_config(str(tmp_path / "nowhere"), key="k", path_key="p")


def test_too_small_a_memory_budget_names_the_smallest_that_works():
    dims = hf_model_dims(HF, ParallelLayout(pp_size=2))
    small = host_memory_limit(0.05, dims)
    with pytest.raises(DynBatchValueError) as caught:
        check_memory_budget(small, 8192, key="m.gib", gib=0.05, token_key="t", token_value=8192)
    message = str(caught.value)
    need = float(message.split("to at least ")[1].split(",")[0].rstrip("."))
    fits = host_memory_limit(need, dims)
    check_memory_budget(fits, 8192, key="m.gib", gib=need, token_key="t", token_value=8192)
    under = host_memory_limit(need - 0.002, dims)
    with pytest.raises(DynBatchValueError, match="is too small"):
        check_memory_budget(under, 8192, key="m.gib", gib=need, token_key="t", token_value=8192)
    assert math.isfinite(need) and need > 0.05


def test_a_hosts_block_recompute_keeps_the_layers_it_does_not_recompute():
    """A re-probe: SkyRL's and verl's memory budgets read only recompute_granularity, so block
    recompute of one layer was predicted as every layer recomputed (the budget could plan
    over it)."""
    dims = hf_model_dims(HF, ParallelLayout(pp_size=2))
    full = {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }
    block = dict(full, recompute_method="block")
    peaks = {
        name: host_memory_limit(4, dims, transformer_config=given).model.uniform_peak(0, (1, 4096))
        for name, given in (("none", {}), ("full", full), ("block", block))
    }
    assert peaks["full"] < peaks["block"] <= peaks["none"], peaks
    assert host_memory_limit(4, dims, transformer_config=block).model.recompute_block_layers == 1


def _skyrl(**over):
    trainer = SimpleNamespace(
        use_dynamic_batch_size=True,
        strategy="megatron",
        max_tokens_per_microbatch=8192,
        max_memory_gib=None,
        dynamic_batch_planner=None,
        dynamic_batch_cost_microbatch_overhead=None,
        policy=SimpleNamespace(model=SimpleNamespace(path=None), megatron_config=None),
        critic=SimpleNamespace(model=SimpleNamespace(path=None), megatron_config=None),
        placement=None,
    )
    for name, value in over.items():
        setattr(trainer, name, value)
    return trainer


@pytest.mark.parametrize("value", [0, -5, None, 100.5, "8k", True, 2**41])
def test_skyrl_refuses_bad_budgets_naming_its_key(value):
    with pytest.raises(DynBatchValueError, match="trainer.max_tokens_per_microbatch="):
        validate_trainer_config(_skyrl(max_tokens_per_microbatch=value))


def test_skyrl_planner_and_memory_keys():
    validate_trainer_config(_skyrl(dynamic_batch_planner="dynbatch"))
    with pytest.raises(DynBatchValueError, match="trainer.dynamic_batch_planner='nope'"):
        validate_trainer_config(_skyrl(dynamic_batch_planner="nope"))
    with pytest.raises(DynBatchValueError, match="trainer.max_memory_gib=-1"):
        validate_trainer_config(_skyrl(max_memory_gib=-1))
    # The flag off: SkyRL's own budget is not ours to check (SkyRL's own checks decide).
    validate_trainer_config(_skyrl(use_dynamic_batch_size=False, max_tokens_per_microbatch="8k"))


def test_skyrl_refuses_router_replay_and_checks_the_reference_models_layout():
    """Probes: routing replay with the switch was accepted (placeholder rows have no recorded
    experts: their tokens counted in the router's statistics), and the reference model's tp was
    not checked against the budget (refused at its first log-prob pass)."""
    replay = _skyrl()
    replay.policy.megatron_config = SimpleNamespace(moe_enable_routing_replay=True)
    with pytest.raises(DynBatchValueError, match="policy.megatron_config.moe_enable_routing_repl"):
        validate_trainer_config(replay)
    replay.policy.megatron_config = SimpleNamespace(moe_enable_routing_replay=False)
    validate_trainer_config(replay)  # the fix named
    ref = _skyrl(max_tokens_per_microbatch=4)
    ref.ref = SimpleNamespace(megatron_config=SimpleNamespace(tensor_model_parallel_size=8))
    with pytest.raises(DynBatchValueError, match="at least 8"):
        validate_trainer_config(ref)
    ref.max_tokens_per_microbatch = 8
    validate_trainer_config(ref)


def test_skyrl_refuses_an_interleaving_group_under_the_pipeline_at_config_time():
    """A probe: ``microbatch_group_size_per_vp_stage`` 1 at pp 2, vpp 2 (SkyRL hands
    ``transformer_config_kwargs`` to Megatron's provider as they are) passed ``validate_cfg`` and
    was refused at the first step; now refused here in SkyRL's keys, for each role."""
    for role in ("policy", "ref"):
        kwargs = dict(virtual_pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=1)
        trainer = _skyrl()
        setattr(
            trainer,
            role,
            SimpleNamespace(
                megatron_config=SimpleNamespace(
                    pipeline_model_parallel_size=2, transformer_config_kwargs=kwargs
                )
            ),
        )
        with pytest.raises(DynBatchValueError) as caught:
            validate_trainer_config(trainer)
        said = str(caught.value)
        key = f"trainer.{role}.megatron_config.transformer_config_kwargs.microbatch_group_size"
        assert key in said and "is smaller than" in said and "pp_size" not in said, said
        kwargs["microbatch_group_size_per_vp_stage"] = 2  # the fix named
        validate_trainer_config(trainer)
        del kwargs["microbatch_group_size_per_vp_stage"]  # or Megatron's default (pp)
        validate_trainer_config(trainer)
        # Without interleaving Megatron reads no group, and neither do we.
        kwargs.update(
            virtual_pipeline_model_parallel_size=None, microbatch_group_size_per_vp_stage=1
        )
        validate_trainer_config(trainer)


@pytest.mark.parametrize(
    "key, value",
    [
        ("max_memory_gib", 40),
        ("dynamic_batch_planner", "dynbatch"),
        ("dynamic_batch_cost_microbatch_overhead", 330),
    ],
)
def test_skyrl_refuses_our_keys_with_the_flag_off(key, value):
    """Our keys (patch 0001) given with the flag off were ignored unseen; refused, naming the
    switch and the key to drop (stock SkyRL refuses them as unknown)."""
    off = _skyrl(use_dynamic_batch_size=False, **{key: value})
    with pytest.raises(DynBatchValueError, match=rf"trainer.{key}=.* is read only by .* off"):
        validate_trainer_config(off)
    validate_trainer_config(_skyrl(use_dynamic_batch_size=False))  # the fix: the key dropped
    if key != "max_memory_gib":  # (the memory budget needs the model's config.json to be on)
        validate_trainer_config(_skyrl(**{key: value}))  # or the switch on


# 1e300: a probe; it passed here and the planner's overflow check refused it at the first step.
@pytest.mark.parametrize("value", [-1, math.nan, math.inf, "lots", True, 1e300])
def test_skyrl_refuses_a_bad_overhead_at_config_time_naming_its_key(value):
    """``trainer.dynamic_batch_cost_microbatch_overhead`` (patch 0001) is checked in
    ``validate_cfg``, before any worker: anything but a finite number >= 0 is refused, with a
    value that works."""
    key = "trainer.dynamic_batch_cost_microbatch_overhead"
    with pytest.raises(DynBatchValueError, match=re.escape(f"{key}={value!r} must be")) as caught:
        validate_trainer_config(_skyrl(dynamic_batch_cost_microbatch_overhead=value))
    assert f"e.g. {key}=330 " in str(caught.value) and "\n" not in str(caught.value)


def test_skyrl_accepts_a_told_overhead_or_none():
    for value in (None, 0, 330, 12.5):
        validate_trainer_config(_skyrl(dynamic_batch_cost_microbatch_overhead=value))
    # An older config without the key reads as not told.
    trainer = _skyrl()
    del trainer.dynamic_batch_cost_microbatch_overhead
    validate_trainer_config(trainer)


def test_verl_refuses_a_pipeline_layout_at_config_time_in_its_own_keys():
    # vpp 2 at pp 1 (or a group below pp) passed verl's config check without a memory budget and
    # failed at the first step, naming vpp_size / pp_size only.
    mega = "actor_rollout_ref__actor__megatron__"
    with pytest.raises(DynBatchValueError) as refused:
        check_verl_config(
            _verl(**{mega + "virtual_pipeline_model_parallel_size": 2}),
            use_reference_policy=True,
            use_critic=False,
        )
    message = str(refused.value)
    assert message.startswith(
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2 needs "
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size >= 2"
    ), message
    with pytest.raises(
        DynBatchValueError, match="actor.megatron.pipeline_model_parallel_size='two'"
    ):
        check_verl_config(
            _verl(**{mega + "pipeline_model_parallel_size": "two"}),
            use_reference_policy=True,
            use_critic=False,
        )
    fine = {
        mega + "pipeline_model_parallel_size": 2,
        mega + "virtual_pipeline_model_parallel_size": 2,
    }
    check_verl_config(_verl(**fine), use_reference_policy=True, use_critic=False)


def test_nemo_rl_refuses_a_pipeline_layout_at_config_time():
    from megatron_dynbatch.integrations.nemo_rl.plan import dynbatch_enabled

    policy = {
        "sequence_packing": {"enabled": True, "train_mb_tokens": 4096},
        "megatron_cfg": {
            "enabled": True,
            "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": 2,
            "dynbatch": {"enabled": True},
        },
    }
    with pytest.raises(
        DynBatchValueError, match="policy.megatron_cfg.pipeline_model_parallel_size"
    ):
        dynbatch_enabled(policy)
    policy["megatron_cfg"]["pipeline_model_parallel_size"] = "two"
    with pytest.raises(
        DynBatchValueError, match=r"pipeline_model_parallel_size='two' \(str\) is not an"
    ):
        dynbatch_enabled(policy)


def test_a_budget_under_one_padded_sample_is_refused_at_config_time_with_a_minimum_that_works():
    # SkyRL's budget caps the whole micro-batch: at tp 2 x cp 2 a sample is padded to 8, and the
    # first step said "max_tokens_per_gpu=2 (x cp_size=2) ... at least 4", refused again at 4.
    megatron = SimpleNamespace(tensor_model_parallel_size=2, context_parallel_size=2)
    policy = SimpleNamespace(model=SimpleNamespace(path=None), megatron_config=megatron)
    for budget in (4, 7):
        with pytest.raises(DynBatchValueError) as refused:
            validate_trainer_config(_skyrl(max_tokens_per_microbatch=budget, policy=policy))
        message = str(refused.value)
        assert message.startswith(f"trainer.max_tokens_per_microbatch={budget} is smaller")
        least = int(re.search(r"at least (\d+)", message).group(1))
        assert least == 8
    validate_trainer_config(_skyrl(max_tokens_per_microbatch=8, policy=policy))
    # verl: a budget under tp 8's padding, in the actor's key.
    mega = "actor_rollout_ref__actor__megatron__"
    with pytest.raises(DynBatchValueError, match=r"ppo_max_token_len_per_gpu=5 .* at least 8"):
        check_verl_config(
            _verl(
                **{
                    mega + "tensor_model_parallel_size": 8,
                    "actor_rollout_ref__actor__ppo_max_token_len_per_gpu": 5,
                }
            ),
            use_reference_policy=True,
            use_critic=False,
        )


def test_heads_that_do_not_split_over_tp_name_the_roles_key_under_a_memory_budget(tmp_path):
    # The memory model refused tp 3 for 8 heads naming `tp_size` (SkyRL) or told NeMo-RL users to
    # "use a model whose config gives them"; tp is what needs changing.
    (tmp_path / "config.json").write_text(json.dumps(HF))
    megatron = SimpleNamespace(tensor_model_parallel_size=3)
    policy = SimpleNamespace(model=SimpleNamespace(path=str(tmp_path)), megatron_config=megatron)
    key = "trainer.policy.megatron_config.tensor_model_parallel_size"
    with pytest.raises(DynBatchValueError, match=re.escape(f"must be multiples of {key}=3")):
        validate_trainer_config(
            _skyrl(max_memory_gib=70, policy=policy, max_tokens_per_microbatch=9)
        )
    from megatron_dynbatch.integrations.nemo_rl.memory import nemo_rl_memory_model

    policy_cfg = {"model_name": str(tmp_path), "megatron_cfg": {"tensor_model_parallel_size": 3}}
    with pytest.raises(DynBatchValueError) as refused:
        nemo_rl_memory_model(policy_cfg, SimpleNamespace(**HF), ParallelLayout(tp_size=3))
    message = str(refused.value)
    assert "policy.megatron_cfg.tensor_model_parallel_size" in message
    assert "use a model whose config" not in message


def test_skyrl_refuses_quantile_balancing_at_config_time_naming_its_key():
    # A launch probe met Megatron's "does not support padding masks" assert at the first step;
    # SkyRL's patched MoE forward passes the mask too.
    config = SimpleNamespace(moe_router_load_balancing_type="quantile_balancing")
    policy = SimpleNamespace(model=SimpleNamespace(path=None), megatron_config=config)
    key = "trainer.policy.megatron_config.moe_router_load_balancing_type"
    with pytest.raises(DynBatchValueError, match=re.escape(f"{key}='quantile_balancing'")):
        validate_trainer_config(_skyrl(policy=policy))
    kwargs = SimpleNamespace(
        moe_router_load_balancing_type="none",
        transformer_config_kwargs={"moe_router_load_balancing_type": "quantile_balancing"},
    )
    with pytest.raises(DynBatchValueError, match="transformer_config_kwargs"):
        validate_trainer_config(
            _skyrl(critic=SimpleNamespace(model=SimpleNamespace(path=None), megatron_config=kwargs))
        )
    config.moe_router_load_balancing_type = "aux_loss"
    validate_trainer_config(_skyrl(policy=policy))


_ON = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 4096}


@pytest.mark.parametrize(
    "over, key, least",
    [
        (  # the actor's log-prob pass runs on the actor's engine, at its tp
            {"actor_rollout_ref__actor__megatron__tensor_model_parallel_size": 8},
            BUDGET_KEYS[("actor", True)],
            8,
        ),
        (  # the reference's, at its own tp where set (verl interpolates the actor's)
            {"actor_rollout_ref__ref__megatron": {"tensor_model_parallel_size": 8}},
            BUDGET_KEYS[("ref", True)],
            8,
        ),
        (  # ... and at the actor's where not
            {"actor_rollout_ref__actor__megatron__tensor_model_parallel_size": 4},
            BUDGET_KEYS[("ref", True)],
            4,
        ),
        (  # the critic's values pass, at the critic's tp and 2 x cp
            {
                "critic": {
                    **_ON,
                    "megatron": {
                        "use_dynamic_batch_size": True,
                        "tensor_model_parallel_size": 2,
                        "context_parallel_size": 2,
                    },
                }
            },
            BUDGET_KEYS[("critic", True)],
            4,
        ),
    ],
)
def test_verl_refuses_a_log_prob_budget_under_one_padded_sample_at_config_time(over, key, least):
    # A probe: log_prob_max_token_len_per_gpu=3 at tp 8 passed validate_config and was refused at
    # the first log-prob pass, on the workers, after the rollout.
    where = {
        BUDGET_KEYS[("actor", True)]: "actor_rollout_ref__rollout__log_prob_max_token_len_per_gpu",
        BUDGET_KEYS[("ref", True)]: "actor_rollout_ref__ref__log_prob_max_token_len_per_gpu",
        BUDGET_KEYS[("critic", True)]: "critic__ppo_infer_max_token_len_per_gpu",
    }[key]
    critic = "critic" in over

    def config(budget):
        made = _verl(**over)
        node = made
        *parents, last = where.split("__")
        for part in parents:
            node = node[part]
        node[last] = budget
        return made

    with pytest.raises(DynBatchValueError) as caught:
        check_verl_config(config(least - 1), use_reference_policy=True, use_critic=critic)
    message = str(caught.value)
    assert message.startswith(f"{key}={least - 1} is smaller than one padded sample"), message
    assert message.endswith(f"raise {key} to at least {least}."), message
    check_verl_config(config(least), use_reference_policy=True, use_critic=critic)  # the fix
