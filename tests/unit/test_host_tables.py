"""One constructor of DynBatchConfig, every host's option table (slime, SkyRL, verl, NeMo-RL, the
CLI)."""

import ast
import pathlib

import pytest

from megatron_dynbatch.config import _FIELDS, config_from_mapping
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.nemo_rl.plan import NEMO_RL_FIXED, NEMO_RL_OPTIONS
from megatron_dynbatch.integrations.skyrl.plan import SKYRL_FIXED, SKYRL_OPTIONS
from megatron_dynbatch.integrations.slime.config import SLIME_OPTIONS
from megatron_dynbatch.integrations.verl.engine import VERL_OPTIONS
from megatron_dynbatch.tools.cli import CLI_FIELDS

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_dynbatch"


def test_dynbatch_config_is_constructed_in_one_function():
    calls = []
    # Everything outside tests: the package, the benchmarks, the launch scripts.
    paths = [
        p
        for folder in ("megatron_dynbatch", "benchmarks", "launch")
        for p in (REPO / folder).rglob("*.py")
    ]
    for path in sorted(paths):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "DynBatchConfig"
                ):
                    calls.append(f"{path.relative_to(REPO)}:{fn.name}")
    assert calls == ["megatron_dynbatch/config.py:config_from_mapping"], calls


def test_every_table_names_real_fields():
    for name, table in (
        ("slime", SLIME_OPTIONS),
        ("skyrl", SKYRL_OPTIONS),
        ("verl", VERL_OPTIONS),
        ("nemo_rl", NEMO_RL_OPTIONS),
        ("cli", {f: f for f in CLI_FIELDS}),
    ):
        assert set(table.values()) <= set(_FIELDS), name
    assert set(SKYRL_FIXED) <= set(_FIELDS)
    assert set(NEMO_RL_FIXED) <= set(_FIELDS)


def test_a_host_option_maps_to_its_field_and_errors_name_the_host_option():
    config = config_from_mapping(
        {"max_token_len_per_gpu": 4096}, table=VERL_OPTIONS, fixed={"layout": "padded"}
    )
    assert config.max_tokens_per_gpu == 4096 and config.layout == "padded"
    with pytest.raises(DynBatchValueError, match=r"verl: unknown option\(s\) \['ppo_max'\]"):
        config_from_mapping({"ppo_max": 1}, table=VERL_OPTIONS, host="verl")
    with pytest.raises(DynBatchValueError, match="max_token_len_per_gpu -> max_tokens_per_gpu"):
        config_from_mapping({"max_token_len_per_gpu": 0}, table=VERL_OPTIONS, host="verl")
    # Without a table the keys are the fields themselves (YAML, Megatron-LM's flags).
    with pytest.raises(DynBatchValueError, match="unknown dynamic-batch config key"):
        config_from_mapping({"max_token_len_per_gpu": 1})
