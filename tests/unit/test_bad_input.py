"""Careless or hostile input to the planner, its config and `plan`: one clear error each, never a
traceback, a hang, a MemoryError or NaN (issue 10, item 6)."""

import json
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
import torch

from megatron_dynbatch.config import DynBatchConfig, config_from_mapping, load_yaml_config
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import (
    CostModel,
    ParallelLayout,
    PlannerConfig,
    SampleSet,
    check_plan,
    plan_schedule,
)

pytestmark = pytest.mark.unit


def _cli(tmp_path, text, *extra):
    path = tmp_path / "samples.json"
    path.write_text(text)
    cmd = [sys.executable, "-m", "megatron_dynbatch.tools.cli", "plan", str(path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _one_line_error(proc, message):
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_deeply_nested_json_is_a_clean_error(tmp_path):
    proc = _cli(tmp_path, "[" * 100_000 + "]" * 100_000, "--max-tokens-per-gpu", "64")
    _one_line_error(proc, "nested too deeply")


def test_plot_into_a_missing_folder_fails_before_planning(tmp_path):
    missing = tmp_path / "no" / "such" / "step.png"
    proc = _cli(tmp_path, "[10, 20]", "--max-tokens-per-gpu", "64", "--plot", str(missing))
    _one_line_error(proc, "does not exist")


def test_a_huge_cap_plans_in_memory_independent_of_the_cap():
    tracemalloc.start()
    for cap in (10**8, 10**10):
        plan = plan_schedule([100, 5000, 70000, 3], config=PlannerConfig(max_tokens_per_gpu=cap))
        assert plan.steps[0].num_microbatches == 1
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 5_000_000, f"planning with a 1e10 cap allocated {peak} bytes"


@pytest.mark.parametrize(
    "parallel, what",
    [
        (ParallelLayout(dp_size=10_000_000), "dp_size=10000000"),
        (
            ParallelLayout(
                dp_size=8, pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=100_000
            ),
            "microbatch_group_size_per_vp_stage=100000",
        ),
    ],
)
def test_layouts_forcing_absurd_placeholder_counts_are_refused_fast(parallel, what):
    start = time.process_time()
    with pytest.raises(DynBatchValueError, match="would be placeholders") as info:
        plan_schedule([100] * 10, config=PlannerConfig(max_tokens_per_gpu=4096, parallel=parallel))
    assert what in str(info.value)
    assert time.process_time() - start < 5.0


def test_a_small_dp_with_few_samples_still_gets_placeholders():
    plan = plan_schedule(
        [100, 200],
        config=PlannerConfig(max_tokens_per_gpu=4096, parallel=ParallelLayout(dp_size=64)),
    )
    assert plan.steps[0].num_placeholders == 62


def test_overflowing_cost_weights_are_refused_and_json_never_holds_nan(tmp_path):
    with pytest.raises(DynBatchValueError, match="overflows"):
        plan_schedule(
            [100, 200],
            config=PlannerConfig(max_tokens_per_gpu=4096, cost=CostModel(attention_weight=1e308)),
        )
    proc = _cli(
        tmp_path,
        "[100, 200]",
        "--max-tokens-per-gpu",
        "64",
        "--cost-attention-weight",
        "1e308",
        "--json",
    )
    _one_line_error(proc, "overflows")
    proc = _cli(
        tmp_path,
        "[100, 200]",
        "--max-tokens-per-gpu",
        "64",
        "--cost-attention-weight",
        "1e-3",
        "--json",
    )
    assert proc.returncode == 0 and "NaN" not in proc.stdout and "Infinity" not in proc.stdout
    json.loads(proc.stdout)


@pytest.mark.parametrize(
    "integer", [np.int64, np.int32, torch.tensor], ids=["np.int64", "np.int32", "torch"]
)
def test_numpy_and_torch_integers_are_integers(integer):
    lengths = [integer(100), integer(250), integer(30)]
    config = PlannerConfig(
        max_tokens_per_gpu=integer(256),
        parallel=ParallelLayout(dp_size=integer(2)),
        rollouts_per_step=integer(1),
    )
    assert type(config.max_tokens_per_gpu) is int and type(config.parallel.dp_size) is int
    plan = plan_schedule(
        lengths, [integer(0), integer(0), integer(1)], [integer(10)] * 3, config=config
    )
    check_plan(plan, SampleSet.build([100, 250, 30], [0, 0, 1], [10] * 3), config)
    assert json.dumps(plan.to_dict())  # plain ints all the way
    dyn = DynBatchConfig(max_tokens_per_gpu=integer(4096), rollouts_per_step=integer(2))
    assert type(dyn.max_tokens_per_gpu) is int
    assert config_from_mapping({"max_tokens_per_gpu": np.int64(8)}).max_tokens_per_gpu == 8


def test_bools_are_still_not_integers():
    with pytest.raises(DynBatchValueError, match="True"):
        plan_schedule([100, True], config=PlannerConfig(max_tokens_per_gpu=256))
    with pytest.raises(DynBatchValueError, match="dp_size=True"):
        ParallelLayout(dp_size=True)


def test_deeply_nested_yaml_is_a_clean_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_tokens_per_gpu: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(DynBatchValueError, match="nested too deeply"):
        load_yaml_config(path)


def test_yaml_exponent_floats_are_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_tokens_per_gpu: 4096\ncost_attention_weight: 4e-5\n")
    values = load_yaml_config(path)
    assert values["cost_attention_weight"] == pytest.approx(4e-5)
    assert config_from_mapping(values).cost_attention_weight == pytest.approx(4e-5)


def test_duplicate_keys_are_refused_in_yaml_and_json(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_tokens_per_gpu: 4096\nmax_tokens_per_gpu: 8192\n")
    with pytest.raises(DynBatchValueError, match="duplicate key 'max_tokens_per_gpu'"):
        load_yaml_config(path)
    proc = _cli(tmp_path, '[{"length": 10, "length": 20}]', "--max-tokens-per-gpu", "64")
    _one_line_error(proc, "duplicate key(s) ['length']")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: plan_schedule({0: 10, 1: 20}, config=c), "lengths must be a sequence"),
        (lambda c: plan_schedule([10, 20, 30], "aab", config=c), "rollout_ids must be a sequence"),
        (lambda c: plan_schedule([10], None, "5", config=c), "prompt_lengths must be a sequence"),
        (
            lambda c: plan_schedule([10, 2**200], config=c),
            "above the supported maximum of 1099511627776",
        ),
        (lambda c: plan_schedule([[[[10]]]], config=c), "sample 0: [[[...]]]"),
    ],
    ids=["dict-lengths", "string-ids", "string-prompts", "2**200", "nested"],
)
def test_bad_containers_and_values_name_the_problem(call, message):
    with pytest.raises(DynBatchValueError) as info:
        call(PlannerConfig(max_tokens_per_gpu=64))
    assert message in str(info.value)


def test_a_cap_above_the_supported_maximum_is_refused():
    with pytest.raises(DynBatchValueError, match="supported maximum"):
        PlannerConfig(max_tokens_per_gpu=2**41)


def test_config_refusals_name_the_python_field_on_the_api_and_only_the_flag_elsewhere(
    tmp_path, capsys
):
    # A probe: a trainer on the Python API was told to pass --max-tokens-per-gpu.
    from megatron_dynbatch.tools.cli import main

    with pytest.raises(DynBatchValueError, match=r"\(max_tokens_per_gpu=\) with the token"):
        PlannerConfig(max_tokens_per_gpu=0)
    with pytest.raises(DynBatchValueError, match=r"\(rollouts_per_step=None\)"):
        PlannerConfig(max_tokens_per_gpu=8, rollouts_per_step=0)
    with pytest.raises(DynBatchValueError, match=r"\(layout='packed'\) or turn"):
        PlannerConfig(max_tokens_per_gpu=8, layout="padded", variable_row_lengths=True)
    # The command line names its own flag once, without the Python spelling.
    samples = tmp_path / "samples.json"
    samples.write_text("[5, 6]")
    assert main(["plan", str(samples), "--max-tokens-per-gpu", "0"]) == 2
    err = capsys.readouterr().err
    assert "pass --max-tokens-per-gpu with the token budget" in err and "=)" not in err
