"""An error about the parallel layout names the flag of the tool the user runs (issue 29).

``megatron-dynbatch plan`` has ``--vpp-size`` and ``--microbatch-group-size-per-vp-stage``;
Megatron-LM and slime have ``--num-virtual-stages-per-pipeline-rank`` /
``--num-layers-per-virtual-pipeline-stage`` and ``--microbatch-group-size-per-virtual-pipeline-
stage``; SkyRL has config keys. Each entry point names its own and never another tool's.
"""

import json
import types

import pytest

from megatron_dynbatch.adapters.slime import build_dp_schedule
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.arguments import parallel_layout_from_args
from megatron_dynbatch.planning import ParallelLayout
from megatron_dynbatch.planning.spec import layout_flags
from megatron_dynbatch.tools.cli import main

pytestmark = pytest.mark.unit

#: Flags that exist only in megatron-dynbatch's own CLI.
CLI_ONLY = ("--vpp-size", "--microbatch-group-size-per-vp-stage", "--pp-size", "--dp-size")


def test_slime_names_megatron_lms_flags():
    args = types.SimpleNamespace(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=64,
        pipeline_model_parallel_size=2,
        tensor_model_parallel_size=1,
    )
    sizes = {"dp_size": 1, "cp_size": 1, "vpp_size": 2, "microbatch_group_size_per_vp_stage": 1}
    with pytest.raises(DynBatchValueError) as caught:
        build_dp_schedule(args, sizes, [10, 20], global_batch_size=2, rollout_indices=[0, 1])
    text = str(caught.value)
    assert "microbatch_group_size_per_vp_stage=1 is smaller than pp_size=2" in text
    assert "--microbatch-group-size-per-virtual-pipeline-stage" in text
    assert "--pipeline-model-parallel-size" in text
    assert not any(flag in text for flag in CLI_ONLY), text


def test_megatron_lm_names_its_virtual_pipeline_flags():
    args = types.SimpleNamespace(
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=2,
        tensor_model_parallel_size=1,
        context_parallel_size=1,
    )
    with pytest.raises(DynBatchValueError) as caught:
        parallel_layout_from_args(args, dp_size=1)
    text = str(caught.value)
    assert "vpp_size=2 needs pp_size >= 2" in text
    assert "--num-virtual-stages-per-pipeline-rank" in text
    assert "--num-layers-per-virtual-pipeline-stage" in text
    assert not any(flag in text for flag in CLI_ONLY), text


def test_the_cli_names_its_own_flags(tmp_path, capsys):
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([10, 20]))
    argv = ["plan", str(samples), "--max-tokens-per-gpu", "64", "--vpp-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--vpp-size" in err and "--pp-size" in err


def test_skyrl_names_its_config_keys_once():
    with pytest.raises(DynBatchValueError) as caught:
        with layout_flags("SkyRL"), layout_flags("SkyRL"):
            ParallelLayout(pp_size=1, vpp_size=2)
    text = str(caught.value)
    # SkyRL's config keys stand in the settings' places, once, with no glossary after them.
    assert text.count("(flags: ") == 0 and "vpp_size" not in text, text
    assert text.startswith(
        "trainer.policy.megatron_config.transformer_config_kwargs.virtual_pipeline_model_parallel"
        "_size=2 needs trainer.policy.megatron_config.pipeline_model_parallel_size >= 2"
    ), text
    assert not any(flag in text for flag in CLI_ONLY), text
