"""One table of settings (megatron_dynbatch/settings.py) is where every flag, YAML key and help text
comes from: the Megatron-LM argument group, ``plan`` / ``verify``'s parsers, the config dataclass,
the YAML reader and configs/dynbatch.yaml are built from it, and adding a setting is one row."""

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from megatron_dynbatch.config import FLAGS, DynBatchConfig, load_yaml_config
from megatron_dynbatch.integrations.hosts import HOSTS
from megatron_dynbatch.integrations.megatron_lm.arguments import add_dynamic_batch_args
from megatron_dynbatch.settings import (
    REQUIRED,
    SETTINGS,
    cli_settings,
    config_settings,
    reference_yaml,
    setting,
)
from megatron_dynbatch.tools.cli import build_parser, main

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]

#: The options of plan / verify that are not settings: the parallel layout (the command's own
#: stand-in for a launch's world), the input, the output, the model and the check to run.
COMMAND_OPTIONS = {
    "plan": {"--dp-size", "--pp-size", "--vpp-size", "--microbatch-group-size-per-vp-stage"}
    | {"--tp-size", "--cp-size", "--json", "--plot", "-h", "--help"},
    "verify": {"--dp-size", "--pp-size", "--vpp-size", "--microbatch-group-size-per-vp-stage"}
    | {"--tp-size", "--cp-size", "--json", "-h", "--help", "--loss", "--samples", "--moe"}
    | {"--moe-ep-size", "--moe-z-loss-coeff"},
}
#: Megatron-LM's own model flags, which ``plan`` takes with their spellings (not our settings).
MODEL_TITLE = "model (Megatron-LM's flags"


def _actions(parser):
    return {s: a for a in parser._actions for s in a.option_strings}


def _subparser(name):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _megatron_group():
    parser = add_dynamic_batch_args(argparse.ArgumentParser(allow_abbrev=False))
    return next(g for g in parser._action_groups if g.title.startswith("dynamic batching"))


def test_the_megatron_lm_argument_group_is_the_table():
    group = _megatron_group()
    flags = [s for a in group._group_actions for s in a.option_strings]
    assert [a.option_strings[0] for a in group._group_actions] == [row.flag for row in SETTINGS]
    for flag in flags:
        # A negated boolean (--no-variable-seq-lengths) is its row's too.
        row = setting(flag.replace("--no-", "--", 1) if flag.startswith("--no-") else flag)
        action = next(a for a in group._group_actions if flag in a.option_strings)
        assert action.help == row.help, flag
        assert action.dest == row.training_dest, flag
        if row.name is not None:
            # None tells a flag given from one left out (the YAML, then the default, applies).
            assert action.default is None and action.dest == FLAGS[row.name][2:].replace("-", "_")
        else:
            assert action.default == row.default, flag
        assert action.choices == row.choices, flag


@pytest.mark.parametrize("command", ["plan", "verify"])
def test_plan_and_verify_take_every_setting_under_its_training_flag(command):
    parser = _subparser(command)
    actions = _actions(parser)
    rows = cli_settings(command)
    for row in rows:
        shown = actions[row.flag]
        assert shown.help.startswith(row.cli.help or row.help), row.flag
        assert shown.dest == row.cli_dest
        for alias in row.cli.aliases:
            hidden = actions[alias]
            assert hidden.help == argparse.SUPPRESS and hidden.dest == shown.dest, alias
            assert hidden.choices == shown.choices and hidden.type == shown.type, alias
    # Every other option is the command's own or Megatron's model flag: no setting hand-written.
    model = {
        s
        for g in parser._action_groups
        if g.title and g.title.startswith(MODEL_TITLE)
        for a in g._group_actions
        for s in a.option_strings
    }
    from_table = {s for row in rows for s in (row.flag, *row.cli.aliases)}
    from_table |= {"--no-" + row.flag[2:] for row in rows if row.flag == "--variable-seq-lengths"}
    others = set(actions) - from_table - model
    assert others == COMMAND_OPTIONS[command]
    assert model.isdisjoint({row.flag for row in SETTINGS} - from_table)


def test_the_config_and_its_flags_are_the_table():
    fields = dataclasses.fields(DynBatchConfig)
    rows = config_settings()
    assert [f.name for f in fields] == [row.name for row in rows]
    for f, row in zip(fields, rows, strict=True):
        assert f.metadata["row"] is row
        if row.default is REQUIRED:
            assert f.default is dataclasses.MISSING
        else:
            assert f.default == row.default
        assert f"{row.name} ({row.flag}): {row.doc}" in DynBatchConfig.__doc__
    assert FLAGS == {row.name: row.flag for row in rows}


def test_the_reference_yaml_is_written_from_the_table(tmp_path):
    text = (REPO / "configs" / "dynbatch.yaml").read_text()
    assert text == reference_yaml(), "rewrite it: python -m megatron_dynbatch.settings"
    comments = " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    for row in config_settings():
        assert f"{row.doc} Flag: {row.flag}." in comments, row.name
    # The YAML reader knows exactly these keys.
    path = tmp_path / "all.yaml"
    path.write_text(text.replace("max_tokens_per_gpu: null", "max_tokens_per_gpu: 64"))
    assert set(load_yaml_config(path)) == {row.name for row in config_settings()}


def test_every_host_key_names_a_setting_of_the_table():
    names = {row.name for row in config_settings()}
    for host in HOSTS.values():
        assert set(host.options.values()) <= names, host.name
        assert set(host.keys) <= names and set(host.fixed) <= names, host.name
    # Megatron-LM's keys are the table's flags.
    assert HOSTS["Megatron-LM"].keys == FLAGS


def _plan(tmp_path, capsys, *argv):
    path = tmp_path / "samples.json"
    path.write_text(json.dumps([120, 300, 280, 900, 40, 700, 64]))
    code = main(["plan", str(path), "--max-tokens-per-gpu", "1024", "--dp-size", "2", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "old, new",
    [
        (["--layout", "padded"], ["--dynamic-batch-layout", "padded"]),
        (["--cost-attention-weight", "0.001"], ["--dynamic-batch-cost-attention-weight", "0.001"]),
        (["--cost-response-weight", "0.5"], ["--dynamic-batch-cost-response-weight", "0.5"]),
        (["--cost-microbatch-overhead", "40"], ["--dynamic-batch-cost-microbatch-overhead", "40"]),
        (
            ["--cost-shape-exchange-overhead", "3"],
            ["--dynamic-batch-cost-shape-exchange-overhead", "3"],
        ),
        (["--cost-attention", "dense"], ["--dynamic-batch-cost-attention", "dense"]),
        (["--min-gain", "0.2"], ["--dynamic-batch-min-gain", "0.2"]),
        (["--planner", "fixed", "--layout", "padded"], ["--dynamic-batch-planner", "fixed"]),
    ],
)
def test_old_spellings_plan_exactly_as_the_training_flags(tmp_path, capsys, old, new):
    if new[0] == "--dynamic-batch-planner":
        new = new + ["--dynamic-batch-layout", "padded"]
    code, old_out, _ = _plan(tmp_path, capsys, *old, "--json")
    assert code == 0
    code, new_out, _ = _plan(tmp_path, capsys, *new, "--json")
    assert code == 0 and json.loads(new_out) == json.loads(old_out)
    # Both spellings set the setting's one destination to the value given.
    common = ["plan", "x.json", "--max-tokens-per-gpu", "8"]
    parsed_old = build_parser().parse_args(common + old)
    parsed_new = build_parser().parse_args(common + new)
    default = build_parser().parse_args(common)
    row = setting(new[0])
    assert getattr(parsed_old, row.cli_dest) == getattr(parsed_new, row.cli_dest)
    assert getattr(parsed_new, row.cli_dest) != getattr(default, row.cli_dest)


def test_messages_answer_in_the_spelling_the_command_line_used(tmp_path, capsys):
    # The setting named in place by the flag, in the spelling typed (no "(flags: ...)" tail).
    code, _, err = _plan(tmp_path, capsys, "--dynamic-batch-cost-attention-weight", "-1")
    assert code == 2 and "model --dynamic-batch-cost-attention-weight=-1.0 must be" in err, err
    assert "(flags:" not in err and "attention_weight" not in err, err
    code, _, err = _plan(tmp_path, capsys, "--cost-attention-weight", "-1")
    assert code == 2 and "model --cost-attention-weight=-1.0 must be" in err, err
    # A setting the user did not type is named in the spelling of the rest of the command line.
    code, _, err = _plan(tmp_path, capsys, "--dynamic-batch-planner", "fixed")
    assert code == 2 and "--dynamic-batch-layout padded" in err
    code, _, err = _plan(tmp_path, capsys, "--planner", "fixed")
    assert code == 2 and "--layout padded" in err and "--dynamic-batch-layout" not in err


def test_help_lists_the_training_flags_only(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    assert "--dynamic-batch-layout" in text and "--dynamic-batch-planner" in text
    for row in SETTINGS:
        for alias in row.cli.aliases if row.cli else ():
            assert f" {alias} " not in text and f"[{alias} " not in text, alias
    assert "strategy" not in text


# -- adding a setting is one row ------------------------------------------------------------------

_NEW_ROW = textwrap.dedent("""
    import argparse, json, sys, tempfile, os
    import megatron_dynbatch.settings as settings

    settings.SETTINGS = settings.SETTINGS + (
        settings.Setting(
            name="test_knob",
            flag="--dynamic-batch-test-knob",
            annotation=int,
            default=3,
            parse=int,
            help="A knob of the test.",
            doc="A knob only this test adds.",
            cli=settings.Cli(aliases=("--test-knob",)),
        ),
    )
    from megatron_dynbatch.config import FLAGS, DynBatchConfig, config_from_mapping, load_yaml_config
    from megatron_dynbatch.integrations.megatron_lm.arguments import (
        add_dynamic_batch_args, dynbatch_config_from_args,
    )
    from megatron_dynbatch.tools.cli import CLI_FIELDS, build_parser

    out = {"flag": FLAGS["test_knob"], "default": DynBatchConfig(max_tokens_per_gpu=8).test_knob}
    parser = add_dynamic_batch_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--dynamic-batch-test-knob", "7"]
    )
    out["training"] = dynbatch_config_from_args(args).test_knob
    out["training_help"] = next(a.help for a in parser._actions if "--dynamic-batch-test-knob" in a.option_strings)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "c.yaml")
        with open(path, "w") as handle:
            handle.write("max_tokens_per_gpu: 64\\ntest_knob: 5\\n")
        out["yaml"] = config_from_mapping(load_yaml_config(path)).test_knob
    out["reference_yaml"] = "test_knob: 3" in settings.reference_yaml()
    cli = build_parser()
    for spelling in ("--dynamic-batch-test-knob", "--test-knob"):
        parsed = cli.parse_args(["plan", "x.json", "--max-tokens-per-gpu", "8", spelling, "9"])
        out[spelling] = parsed.test_knob
    out["cli_fields"] = "test_knob" in CLI_FIELDS
    print(json.dumps(out))
    """)


def test_a_new_row_reaches_every_parser_the_config_and_the_yaml():
    proc = subprocess.run(
        [sys.executable, "-c", _NEW_ROW], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "flag": "--dynamic-batch-test-knob",
        "default": 3,
        "training": 7,
        "training_help": "A knob of the test.",
        "yaml": 5,
        "reference_yaml": True,
        "--dynamic-batch-test-knob": 9,
        "--test-knob": 9,
        "cli_fields": True,
    }
