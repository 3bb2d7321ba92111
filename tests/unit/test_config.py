"""DynBatchConfig, its YAML files and the dynamic-batching flags (no torch, no megatron needed)."""

import argparse
import dataclasses
import pathlib
import subprocess
import sys

import pytest
import yaml

from megatron_dynbatch.config import FLAGS, DynBatchConfig, config_from_mapping, load_yaml_config
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    add_dynamic_batch_args,
    dynbatch_config_from_args,
    validate_dynamic_batch_args,
)
from tests._support import megatron_lm_args

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
EXAMPLES = sorted((CONFIGS / "examples").glob("*.yaml"))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(DynBatchConfig)}


def _megatron_args(argv, **validated):
    return megatron_lm_args(argv, **validated)


# --- the dataclass ----------------------------------------------------------------------------


def test_dataclass_is_frozen_keyword_only_and_documented():
    config = DynBatchConfig(max_tokens_per_gpu=4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.layout = "padded"
    with pytest.raises(TypeError):
        DynBatchConfig(4096)  # keyword-only
    assert config.forward_only_max_tokens_per_gpu == 4096
    assert set(FLAGS) == set(DEFAULTS)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(max_tokens_per_gpu=0), "--max-tokens-per-gpu"),
        (dict(max_tokens_per_gpu=None), "--max-tokens-per-gpu"),
        (dict(max_tokens_per_gpu=64, log_probs_max_tokens_per_gpu=-1), "--log-probs-max-tokens"),
        (dict(max_tokens_per_gpu=64, rollouts_per_step=0), "--rollouts-per-step"),
        (dict(max_tokens_per_gpu=64, layout="thd"), "--dynamic-batch-layout"),
        (dict(max_tokens_per_gpu=64, cost_attention_weight=-1.0), "attention-weight"),
        (dict(max_tokens_per_gpu=64, cost_token_weight=float("nan")), "token-weight"),
        (dict(max_tokens_per_gpu=64, cost_token_weight=0.0), "token-weight"),
    ],
)
def test_post_init_errors_name_the_flag(kwargs, flag):
    with pytest.raises(DynBatchValueError, match=flag):
        DynBatchConfig(**kwargs)


def test_planner_config_names_the_budget_flag():
    from megatron_dynbatch.planning import ParallelLayout

    config = DynBatchConfig(max_tokens_per_gpu=4, log_probs_max_tokens_per_gpu=2)
    layout = ParallelLayout(tp_size=4)
    assert config.planner_config(layout).max_tokens_per_gpu == 4
    with pytest.raises(
        DynBatchValueError, match="^--log-probs-max-tokens-per-gpu=2 .*smaller than one"
    ):
        config.planner_config(layout, forward_only=True)


def test_config_module_does_not_import_torch():
    code = "import sys, megatron_dynbatch.config; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- YAML -------------------------------------------------------------------------------------


def test_reference_yaml_lists_every_key_with_the_dataclass_default():
    raw = yaml.safe_load((CONFIGS / "dynbatch.yaml").read_text())
    assert set(raw) == set(DEFAULTS)
    # The one required field, and the weight the Megatron-LM entry derives where unset (a file
    # writing its default 0.0 switched that off: tests/unit/test_model_cost.py).
    # The layout too: the entry derives padded under seq_aux_loss (a probe: the file wrote
    # packed, and the seq_aux_loss run was refused with it).
    derived = {"cost_attention_weight": None, "layout": None}
    assert raw == {**DEFAULTS, "max_tokens_per_gpu": None, **derived}
    text = (CONFIGS / "dynbatch.yaml").read_text().splitlines()
    for key in DEFAULTS:
        line = next(i for i, t in enumerate(text) if t.startswith(f"{key}:"))
        assert text[line - 1].startswith("#"), f"{key} has no comment above it"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_yaml_loads_and_unlisted_keys_keep_defaults(path):
    values = load_yaml_config(path)
    config = config_from_mapping(values)
    for key, default in DEFAULTS.items():
        if key not in values:
            assert getattr(config, key) == default, key
    assert path.read_text().lstrip().startswith("#"), "an example opens with what it is for"


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"pp2_vpp2.yaml", "long_context_cp2.yaml", "grpo_dp8.yaml"}


def test_yaml_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("max_tokens_per_gpu: 4096\nmax_token_per_gpu: 8192\n")
    with pytest.raises(
        DynBatchValueError, match=r"unknown key\(s\) \['max_token_per_gpu'\].*valid keys"
    ):
        load_yaml_config(path)


@pytest.mark.parametrize(
    "text, match",
    [
        ("- 1\n- 2\n", "must hold a mapping"),
        ("layout: ragged\n", "--dynamic-batch-layout"),
        ("max_tokens_per_gpu: [1\n", "not valid YAML"),
    ],
)
def test_yaml_bad_content(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(DynBatchValueError, match=match):
        load_yaml_config(path)


def test_yaml_missing_file(tmp_path):
    with pytest.raises(DynBatchValueError, match="does not exist"):
        load_yaml_config(tmp_path / "nope.yaml")


def test_config_from_mapping_unknown_key():
    with pytest.raises(DynBatchValueError, match="unknown dynamic-batch config key"):
        config_from_mapping({"max_tokens_per_gpu": 8, "bogus": 1})


# --- flags and validation after Megatron's ----------------------------------------------------


def test_flags_resolve_without_writing_back():
    args = _megatron_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--rollouts-per-step", "8"],
        global_batch_size=8,
    )
    before = dict(vars(args))
    config = validate_dynamic_batch_args(args)
    # The attention kind is read from Megatron's flags (default transformer-engine: THD segments).
    assert config == DynBatchConfig(
        max_tokens_per_gpu=4096, rollouts_per_step=8, cost_attention="segment"
    )
    # The config is resolved once; Megatron's namespace keeps what the user typed.
    assert vars(args) == before
    assert args.dynamic_batch_layout is None and args.dynamic_batch_cost_token_weight is None
    assert dynbatch_config_from_args(args) == config


def test_command_line_overrides_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_tokens_per_gpu: 1024\nlayout: padded\ncost_attention_weight: 0.5\n")
    args = _megatron_args(
        ["--use-dynamic-batch-size", "--dynamic-batch-config", str(path)]
        + ["--max-tokens-per-gpu", "2048"]
    )
    config = validate_dynamic_batch_args(args)
    assert (config.max_tokens_per_gpu, config.layout, config.cost_attention_weight) == (
        2048,
        "padded",
        0.5,
    )


def test_flag_off_returns_none_and_rejects_stray_flags():
    assert validate_dynamic_batch_args(_megatron_args([])) is None
    with pytest.raises(
        DynBatchValueError, match="--max-tokens-per-gpu given without --use-dynamic-batch"
    ):
        validate_dynamic_batch_args(_megatron_args(["--max-tokens-per-gpu", "64"]))


@pytest.mark.parametrize(
    "argv, validated, match",
    [
        ([], {}, "--max-tokens-per-gpu"),
        (["--max-tokens-per-gpu", "64"], {"calculate_per_token_loss": False}, "--calculate-per-"),
        (["--max-tokens-per-gpu", "64"], {"rampup_batch_size": [8, 8, 100]}, "--rampup-batch-size"),
        (["--max-tokens-per-gpu", "64"], {"iterations_to_skip": [3]}, "--iterations-to-skip"),
        (["--max-tokens-per-gpu", "64"], {"perform_rl_step": True}, "--perform-rl-step"),
        (["--max-tokens-per-gpu", "64"], {"decrease_batch_size_if_needed": True}, "--decrease-"),
        (["--max-tokens-per-gpu", "64"], {"hybrid_context_parallel": True}, "--hybrid-context-par"),
        (["--max-tokens-per-gpu", "64"], {"gtp_weight_remat_size": 2}, "weight-shards"),
        # tp=2, cp=2: a sample is padded to tp*cp*2 = 8 tokens; 3 per GPU x cp 2 = 6 < 8.
        (
            ["--max-tokens-per-gpu", "3"],
            {"tensor_model_parallel_size": 2, "context_parallel_size": 2},
            "^--max-tokens-per-gpu=3 .*raise --max-tokens-per-gpu to at least 4",
        ),
        (
            ["--max-tokens-per-gpu", "64", "--log-probs-max-tokens-per-gpu", "1"],
            {"tensor_model_parallel_size": 2},
            "^--log-probs-max-tokens-per-gpu",
        ),
    ],
)
def test_validation_errors_name_the_flag(argv, validated, match):
    args = _megatron_args(["--use-dynamic-batch-size", *argv], **validated)
    with pytest.raises(DynBatchValueError, match=match):
        validate_dynamic_batch_args(args)


def test_argparse_rejects_bad_layout():
    parser = add_dynamic_batch_args(argparse.ArgumentParser(allow_abbrev=False))
    with pytest.raises(SystemExit):
        parser.parse_args(["--dynamic-batch-layout", "ragged"])
