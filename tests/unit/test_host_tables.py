"""One constructor of DynBatchConfig, every host's option table (slime, SkyRL, verl, NeMo-RL, the
CLI)."""

import ast
import pathlib

import pytest

from megatron_dynbatch.config import _FIELDS, config_from_mapping
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import HOSTS, VERL
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
    tables = {name: host.options for name, host in HOSTS.items()}
    tables["cli"] = {f: f for f in CLI_FIELDS}
    for name, table in tables.items():
        assert set(table.values()) <= set(_FIELDS), name
    for name, host in HOSTS.items():
        assert set(host.fixed) <= set(_FIELDS), name
        assert set(host.keys) <= set(_FIELDS), name
        assert set(host.defaults) <= set(host.options), name


def test_no_integration_keeps_its_own_option_table():
    # The host record is the one home of a host's option names (issue 34).
    for path in sorted((PACKAGE / "integrations").rglob("*.py")):
        text = path.read_text()
        for name in (
            "SLIME_OPTIONS",
            "SKYRL_OPTIONS",
            "VERL_OPTIONS",
            "SKYRL_FIXED",
            "NEMO_RL_OPTIONS",
            "NEMO_RL_FIXED",
        ):
            assert f"{name} =" not in text, f"{path.relative_to(REPO)} defines {name}"
    # Every host that plans with us has a record (issue 36: NeMo-RL too).
    assert set(HOSTS) == {"Megatron-LM", "slime", "SkyRL", "verl", "NeMo-RL"}


def test_a_host_option_maps_to_its_field_and_errors_name_the_host_option():
    config = config_from_mapping(
        {"max_token_len_per_gpu": 4096}, table=VERL.options, fixed={"layout": "padded"}
    )
    assert config.max_tokens_per_gpu == 4096 and config.layout == "padded"
    with pytest.raises(DynBatchValueError, match=r"verl: unknown option\(s\) \['ppo_max'\]"):
        config_from_mapping({"ppo_max": 1}, table=VERL.options, host="verl")
    with pytest.raises(DynBatchValueError, match="max_token_len_per_gpu -> max_tokens_per_gpu"):
        config_from_mapping({"max_token_len_per_gpu": 0}, table=VERL.options, host="verl")
    # Without a table the keys are the fields themselves (YAML, Megatron-LM's flags).
    with pytest.raises(DynBatchValueError, match="unknown dynamic-batch config key"):
        config_from_mapping({"max_token_len_per_gpu": 1})


def test_no_host_function_is_forked_into_the_package():
    # slime's loss is its own loss_function, wrapped (backend.wrap_loss_function); a copy would
    # silently miss slime's next fix to it (issue 34).
    forked = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        forked += [
            f"{path.relative_to(REPO)}:{node.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name in ("loss_function",)
        ]
    assert forked == [], forked


def test_slimes_way_back_names_the_flag_its_patch_registers():
    # The record's documented way back must be an option the patched slime really parses.
    flag = HOSTS["slime"].fallback.split()[0]
    patches = "".join(p.read_text() for p in sorted((REPO / "patches" / "slime").glob("*.patch")))
    assert f'"{flag}"' in patches, flag
