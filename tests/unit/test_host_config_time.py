"""slime's and NeMo-RL's config-time checks without a checkout (issue 43): the object slime's
``slime_validate_args`` calls (``MicroBatchPlanner.validate_args``) and what NeMo-RL's
``Policy.__init__`` calls (``shard.planner``), on the namespaces and dicts those hosts build. The
same checks through the hosts' own code: ``tests/megatron/test_slime_config_time.py`` and
``tests/megatron/test_nemo_rl_patched.py``."""

import math
import types

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.nemo_rl.shard import planner
from megatron_dynbatch.integrations.slime.hook import HOOK_PATH, MicroBatchPlanner

pytestmark = pytest.mark.unit


def _slime(**overrides):
    values = dict(
        use_dynamic_batch_size=True,
        use_slime_dynamic_batch_size=False,
        micro_batch_planner_path=HOOK_PATH,
        max_tokens_per_gpu=8192,
        log_probs_max_tokens_per_gpu=8192,
        oversize_samples="allow",
        max_memory_gib=None,
        dynamic_batch_planner=None,
        dynamic_batch_cost_microbatch_overhead=None,
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_slime_keeps_the_hook_only_while_ours_runs():
    assert MicroBatchPlanner.validate_args(_slime()) == HOOK_PATH
    assert MicroBatchPlanner.validate_args(_slime(use_slime_dynamic_batch_size=True)) is None
    assert MicroBatchPlanner.validate_args(_slime(use_dynamic_batch_size=False)) is None
    assert MicroBatchPlanner.validate_args(_slime(max_memory_gib=70.0)) == HOOK_PATH


# 1e300 and 1e-10: probes; the first overflowed the byte count into a traceback at the first
# schedule, the second became 0 bytes, refused as "budget_bytes=0".
@pytest.mark.parametrize("value", [-1.0, 0.0, math.nan, math.inf, 1e300, 1e-10])
def test_slime_refuses_a_memory_budget_that_is_not_gib(value):
    with pytest.raises(DynBatchValueError, match=r"--max-memory-gib .* must be a number of GiB"):
        MicroBatchPlanner.validate_args(_slime(max_memory_gib=value))


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, True, "330", 1e300])
def test_slime_refuses_a_microbatch_overhead_that_is_not_a_cost(value):
    with pytest.raises(
        DynBatchValueError, match=r"--dynamic-batch-cost-microbatch-overhead .* must be a finite"
    ):
        MicroBatchPlanner.validate_args(_slime(dynamic_batch_cost_microbatch_overhead=value))


def test_slime_hands_the_microbatch_overhead_to_the_planner():
    from megatron_dynbatch.integrations.slime.config import dynbatch_config_from_slime_args

    assert dynbatch_config_from_slime_args(_slime()).cost_microbatch_overhead is None
    for value in (0, 330.0):
        args = _slime(dynamic_batch_cost_microbatch_overhead=value)
        assert MicroBatchPlanner.validate_args(args) == HOOK_PATH
        assert dynbatch_config_from_slime_args(args).cost_microbatch_overhead == value


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(use_dynamic_batch_size=False, max_memory_gib=70.0), "without --use-dynamic"),
        (dict(use_slime_dynamic_batch_size=True, max_memory_gib=70.0), "with --use-slime-dynamic"),
        (dict(use_dynamic_batch_size=False, oversize_samples="error"), "--oversize-samples error"),
        (dict(use_dynamic_batch_size=False, dynamic_batch_planner="fixed"), "--dynamic-batch"),
        (
            dict(use_dynamic_batch_size=False, use_slime_dynamic_batch_size=True),
            "--use-slime-dynamic-batch-size is read only",
        ),
        (dict(dynamic_batch_planner="dynbach"), "--dynamic-batch-planner dynbach: no planner"),
        # slime always packs: 'fixed' (padded rows) was refused only at the first step.
        (dict(dynamic_batch_planner="fixed"), "fixed plans padded rows only, but slime runs"),
        (
            dict(use_dynamic_batch_size=False, dynamic_batch_cost_microbatch_overhead=330.0),
            "--dynamic-batch-cost-microbatch-overhead 330.0 is read only",
        ),
        (dict(max_tokens_per_gpu=0), "--max-tokens-per-gpu"),
    ],
)
def test_slime_refuses_what_it_would_ignore_or_cannot_use(change, words):
    with pytest.raises(DynBatchValueError, match=words):
        MicroBatchPlanner.validate_args(_slime(**change))


TINY = types.SimpleNamespace(
    num_hidden_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=768,
    hidden_act="silu",
    vocab_size=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _nemo(memory=None, section=True):
    cfg = {
        "model_name": "tiny",
        "precision": "bfloat16",
        "max_total_sequence_length": 64,
        "make_sequence_length_divisible_by": 4,
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {"enabled": True, "train_mb_tokens": 48, "logprob_mb_tokens": 96},
        "megatron_cfg": {
            "enabled": True,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 2,
            "context_parallel_size": 1,
            "dynbatch": {"enabled": True} if section else None,
        },
    }
    if memory is not None:
        cfg["megatron_cfg"]["dynbatch"]["max_memory_gib"] = memory
    return cfg


def test_nemo_rl_empty_section_is_absent_and_a_plain_one_plans_by_tokens():
    assert planner(_nemo(section=False), 4) is None
    assert planner(_nemo(), 4).memory is None


def test_nemo_rl_memory_budget_too_small_names_the_key_and_the_smallest_that_works():
    with pytest.raises(DynBatchValueError) as refused:
        planner(_nemo(memory=0.001), 4, hf_config=TINY)
    message = str(refused.value)
    assert message.startswith("policy.megatron_cfg.dynbatch.max_memory_gib=0.001 is too small")
    smallest = float(message.split("to at least ")[1].split(",")[0])
    limit = planner(_nemo(memory=smallest), 4, hf_config=TINY).memory
    assert limit.fits((1, 48)) and limit.budget_bytes == int(smallest * 2**30)
    with pytest.raises(DynBatchValueError, match="too small"):
        planner(_nemo(memory=smallest - 0.002), 4, hf_config=TINY)
    # The row is train_mb_tokens (48, under max_total_sequence_length 64): that key is named, and
    # lowering it is the fix offered (it named max_total_sequence_length=64 for a 48-token row).
    assert "(a sample of policy.sequence_packing.train_mb_tokens=48, padded)" in message
    assert "or lower policy.sequence_packing.train_mb_tokens" in message
    cfg = _nemo(memory=0.001)
    cfg["sequence_packing"]["train_mb_tokens"] = 96
    with pytest.raises(DynBatchValueError) as refused:
        planner(cfg, 4, hf_config=TINY)
    assert "(a sample of policy.max_total_sequence_length=64, padded)" in str(refused.value)


@pytest.mark.parametrize("value", [-1, 0, math.nan, math.inf, "lots", "-3", 1e300, "1e-10"])
def test_nemo_rl_memory_budget_must_be_gib(value):
    with pytest.raises(DynBatchValueError, match=r"policy\.megatron_cfg\.dynbatch\.max_memory_gib"):
        planner(_nemo(memory=value), 4, hf_config=TINY)


def test_nemo_rl_reads_a_memory_budget_given_as_a_string_as_verl_and_skyrl_do():
    # "70" (a YAML string, an interpolation) was refused by NeMo-RL alone.
    assert planner(_nemo(memory="70"), 4, hf_config=TINY).memory.budget_bytes == 70 * 2**30


def test_slime_refuses_moe_settings_the_padded_forward_cannot_run_before_any_actor():
    # A launch probe met Megatron's quantile-balancing assert at the first step (our MoE forward
    # passes a padding mask); slime parses the same flags and is refused as the launch is.
    moe = dict(num_experts=4, moe_router_load_balancing_type="quantile_balancing")
    with pytest.raises(DynBatchValueError, match="quantile_balancing cannot run with"):
        MicroBatchPlanner.validate_args(_slime(**moe))
    aux = dict(moe, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    recomputed = dict(aux, recompute_granularity="full", data_parallel_size=2)
    with pytest.raises(DynBatchValueError, match="Drop --recompute-granularity full"):
        MicroBatchPlanner.validate_args(_slime(**recomputed))
    assert MicroBatchPlanner.validate_args(_slime(**aux)) == HOOK_PATH


def test_slime_refuses_a_budget_under_one_padded_sample_at_argument_validation():
    # A probe: each of these passed slime's validation and was refused only by the first
    # schedule, after the first rollout; now at slime_validate_args, both budgets at once.
    with pytest.raises(DynBatchValueError, match="--max-tokens-per-gpu to at least 2"):
        MicroBatchPlanner.validate_args(_slime(tensor_model_parallel_size=2, max_tokens_per_gpu=1))
    lp = dict(tensor_model_parallel_size=4, log_probs_max_tokens_per_gpu=1)
    with pytest.raises(DynBatchValueError, match="--log-probs-max-tokens-per-gpu to at least 4"):
        MicroBatchPlanner.validate_args(_slime(**lp))
    both = dict(lp, max_tokens_per_gpu=3)
    with pytest.raises(DynBatchValueError) as caught:
        MicroBatchPlanner.validate_args(_slime(**both))
    assert "--max-tokens-per-gpu to at least 4" in str(caught.value)
    assert "--log-probs-max-tokens-per-gpu to at least 4" in str(caught.value)
    # Under newer slime's safety margin the fix named is the full --max-tokens-per-gpu.
    margin = dict(tensor_model_parallel_size=4, max_tokens_per_gpu=6, packing_safety_margin=0.5)
    with pytest.raises(DynBatchValueError, match="--max-tokens-per-gpu to at least 8"):
        MicroBatchPlanner.validate_args(_slime(**margin))
    # The fixes named pass.
    fixed = dict(tensor_model_parallel_size=4, max_tokens_per_gpu=4, log_probs_max_tokens_per_gpu=4)
    assert MicroBatchPlanner.validate_args(_slime(**fixed)) == HOOK_PATH
    assert (
        MicroBatchPlanner.validate_args(_slime(**dict(margin, max_tokens_per_gpu=8))) == HOOK_PATH
    )
    # Without a log-prob budget slime uses the training one: one refusal.
    no_lp = dict(
        tensor_model_parallel_size=2, max_tokens_per_gpu=1, log_probs_max_tokens_per_gpu=None
    )
    with pytest.raises(DynBatchValueError) as caught:
        MicroBatchPlanner.validate_args(_slime(**no_lp))
    assert "log-probs" not in str(caught.value)


def test_slime_refuses_an_interleaving_group_under_the_pipeline_at_argument_validation():
    interleaved = dict(
        pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2, num_layers=4
    )
    with pytest.raises(DynBatchValueError, match="--microbatch-group-size-per-virtual-pipeline"):
        MicroBatchPlanner.validate_args(_slime(**interleaved, microbatch_group_size_per_vp_stage=1))
    # Derived from --num-layers-per-virtual-pipeline-stage as Megatron derives it.
    per_stage = dict(
        pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1, num_layers=8
    )
    with pytest.raises(DynBatchValueError, match="smaller than pp_size=4"):
        MicroBatchPlanner.validate_args(_slime(**per_stage, microbatch_group_size_per_vp_stage=3))
    with pytest.raises(DynBatchValueError) as caught:
        MicroBatchPlanner.validate_args(_slime(**interleaved, microbatch_group_size_per_vp_stage=0))
    said = str(caught.value)
    assert "microbatch_group_size_per_vp_stage=0 must be >= 1" in said, said
    assert "is --microbatch-group-size-per-virtual-pipeline-stage" in said, said
    assert "train_parallel_config" not in said, said
    assert MicroBatchPlanner.validate_args(_slime(**interleaved)) == HOOK_PATH
    # Without interleaving Megatron reads no group, and neither do we.
    flat = dict(pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=1)
    assert MicroBatchPlanner.validate_args(_slime(**flat)) == HOOK_PATH
    ok = dict(interleaved, microbatch_group_size_per_vp_stage=2)
    assert MicroBatchPlanner.validate_args(_slime(**ok)) == HOOK_PATH
