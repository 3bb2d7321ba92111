"""A planner registered by name is really called on every host's planning path.

One spy planner (it records its calls and then plans as the built-in ``dynbatch``) is named the
way each host's users name a planner, and each host's planning entry is driven with it: the
function the host's patched code calls, from the host's own option values. Which path each case
drives:

* Megatron-LM: ``--dynamic-batch-planner`` -> ``DynamicBatchHooks._plan`` (what
  ``prepare_train_step`` plans with);
* slime: ``args.dynamic_batch_planner`` -> ``integrations.slime.schedule.build_dp_schedule``
  (slime's patched ``build_dp_schedule``);
* SkyRL: ``trainer.dynamic_batch_planner`` -> ``integrations.skyrl.plan.plan_skyrl_minibatch``
  (what the patched worker's ``microbatch_iterator`` plans with; the worker reads the key in
  ``integrations.skyrl.worker``);
* verl: ``...megatron.dynbatch.planner`` -> ``integrations.verl.engine.verl_planner_config`` and
  ``plan_verl_batch`` (what the patched ``MegatronEngine.forward_backward_batch`` plans with;
  the engine reads the key in ``prepare_micro_batches``);
* NeMo-RL: ``policy.megatron_cfg.dynbatch.planner`` -> ``integrations.nemo_rl.plan``
  (``nemo_rl_planner_config`` and ``plan_nemo_rl_shards``, what the patched ``Policy`` plans with).

slime's and NeMo-RL's paths honour the name since the hostcfg branch (issue 43) was merged; the
others since this one.
"""

from types import SimpleNamespace

import pytest

from megatron_dynbatch.cpu.core_shim import register_triton_stand_in

register_triton_stand_in()  # Megatron-LM's hooks import megatron.core, which wants triton

from megatron_dynbatch.planning import ParallelLayout  # noqa: E402
from megatron_dynbatch.planning.registry import get_planner, register_planner  # noqa: E402

pytestmark = pytest.mark.unit

SPY = "test-spy-planner"
CALLS = []


def _spy(samples, config):
    CALLS.append(len(samples))
    return get_planner("dynbatch")(samples, config)


register_planner(SPY, _spy, replace=True)
LENGTHS = [30, 12, 50, 7, 22, 41, 9, 16]


@pytest.fixture(autouse=True)
def _fresh_calls():
    CALLS.clear()
    yield


def _megatron_lm():
    from megatron_dynbatch.config import DynBatchConfig
    from megatron_dynbatch.integrations.megatron_lm.hooks import DynamicBatchHooks

    config = DynBatchConfig(max_tokens_per_gpu=64, planner=SPY)
    hooks = DynamicBatchHooks(SimpleNamespace(), config)
    batch = SimpleNamespace(
        lengths=lambda: list(LENGTHS),
        rollout_ids=list(range(len(LENGTHS))),
        prompt_lengths=lambda: [1] * len(LENGTHS),
    )
    plan, _ = hooks._plan(batch, ParallelLayout(dp_size=2, pp_size=2), False)
    return plan


def _slime():
    from megatron_dynbatch.integrations.slime.schedule import build_dp_schedule

    args = SimpleNamespace(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=64,
        micro_batch_size=1,
        balance_data=False,
        dynamic_batch_planner=SPY,
    )
    parallel = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    return build_dp_schedule(
        args,
        parallel,
        LENGTHS,
        global_batch_size=len(LENGTHS),
        rollout_indices=list(range(len(LENGTHS))),
    )


def _skyrl():
    from megatron_dynbatch.integrations.skyrl.plan import plan_skyrl_minibatch

    return plan_skyrl_minibatch([LENGTHS[:4], LENGTHS[4:]], 64, pp_size=2, planner=SPY)


def _verl():
    from megatron_dynbatch.integrations.verl.engine import plan_verl_batch, verl_planner_config

    config = verl_planner_config(
        64,
        pp_size=2,
        vpp_size=1,
        microbatch_group_size_per_vp_stage=None,
        tp_size=1,
        cp_size=1,
        packed=True,
        planner=SPY,
    )
    return plan_verl_batch([LENGTHS[:4], LENGTHS[4:]], config)


def _nemo_rl():
    from megatron_dynbatch.integrations.nemo_rl.plan import (
        nemo_rl_planner_config,
        plan_nemo_rl_shards,
    )

    policy = {
        "sequence_packing": {"train_mb_tokens": 64, "logprob_mb_tokens": 128},
        "megatron_cfg": {
            "pipeline_model_parallel_size": 2,
            "dynbatch": {"enabled": True, "planner": SPY},
        },
    }
    config = nemo_rl_planner_config(policy, dp_size=2, forward_only=False)
    return plan_nemo_rl_shards(
        LENGTHS, config, batch_size=len(LENGTHS), pad_multiple=1, placeholder_length=1
    )


HOSTS = [
    pytest.param(_megatron_lm, id="Megatron-LM"),
    pytest.param(_slime, id="slime"),
    pytest.param(_skyrl, id="SkyRL"),
    pytest.param(_verl, id="verl"),
    pytest.param(_nemo_rl, id="NeMo-RL"),
]


@pytest.mark.parametrize("plan_on_host", HOSTS)
def test_a_registered_planner_is_called_on_every_hosts_planning_path(plan_on_host):
    plan = plan_on_host()
    assert plan is not None
    assert CALLS, "the planner the host's option names was never called"
    # Sharded hosts (SkyRL, verl) plan each DP rank's shard (one call a rank, together every
    # sample; SkyRL may plan every shard a second time, with room for its placeholder rows);
    # slime plans the training step and then its forward-only passes.
    assert sum(CALLS) in (len(LENGTHS), 2 * len(LENGTHS)) or CALLS[0] == len(LENGTHS), CALLS
