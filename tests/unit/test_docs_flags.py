"""Every ``--flag`` README.md and docs/*.md name exists, and every default they state is the code's.

Issue 44: the docs named flags and defaults the code did not have. The flags are read from the
Markdown text; they must be options of Megatron-LM 0.19's parser with ours added (the launch
script's), of the ``megatron-dynbatch`` command's subcommands, of a script in the repository
(an ``add_argument("--...")`` in its source), or of another tool the docs show (torchrun, pip,
pytest, git: :data:`OTHER_TOOLS`). A stated default (```--flag` (default X)``, ```--flag`, default
X``) must be the default of that flag in one of our parsers (where a flag exists in several, e.g.
``--oversize-samples``: ``error`` in training, ``allow`` in ``plan`` / ``verify``, either is true)
or Megatron's. The docs' command blocks are run by their own tests (``<!-- tested: ... -->``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Dict, Iterable, List, Set, Tuple

import pytest

from megatron_dynbatch.config import FLAGS, DynBatchConfig
from tests._support import REPO

pytestmark = pytest.mark.unit

#: Flags of other tools the docs show, by tool (their commands are not ours to check).
OTHER_TOOLS = {
    "torchrun": {
        "--nproc-per-node",
        "--nproc_per_node",
        "--nnodes",
        "--node_rank",
        "--master_addr",
        "--master_port",
        "--standalone",
        "--no-python",
    },
    "pip": {
        "--no-deps",
        "--no-build-isolation",
        "--upgrade",
        "--index-url",
        "--extra-index-url",
        "--ignore-requires-python",
        "--only-binary",
        "--platform",
        "--python-version",
        "--implementation",
    },
    # slime's own flags (its checkout is not part of this repository; ours in it come from
    # patches/slime, which the scan below reads).
    "slime": {
        "--custom-generate-function-path",  # one of its --custom-*-path family
        "--allgather-cp",
        "--balance-by-flops",
        "--balance-data",
        "--data-pad-size-multiplier",
        "--loss-type",
        "--rollout-max-response-len",
        "--use-rollout-routing-replay",
        "--use-routing-replay",
    },
    # Newer slime's (after the pinned 624b824a8), which ours refuses by name (docs/slime.md).
    "slime, newer": {"--global-batch-tokens", "--multimodal-aware-packing"},
    "Megatron-LM tools/preprocess_data.py": {"--workers", "--partitions"},
    # Read by hand before the tool's own parser (launch/megatron_preprocess.py).
    "launch/megatron_preprocess.py": {"--megatron-lm-dir"},
    # The typo the docs show being refused.
    "typos shown as errors": {"--max-token-per-gpu"},
    "pytest": {"--durations", "--tb", "--collect-only", "--lf", "--dist", "--no-loadscope-reorder"},
    "git": {"--3way", "--ignored", "--oneline", "--check", "--stat", "--numstat"},
    "ruff/black": {"--fix", "--diff"},
    "curl/tar/shell": {"--help"},
}

# A flag, or a family ``--x-*``; not the parts of a shorthand ``--train/valid/test-data-path``.
_FLAG = re.compile(r"(?<![\w/-])--[A-Za-z][\w-]*(?![\w-])(?!/)\*?")
# ``--dynamic-batch-cost-{token,attention}-weight``: one flag per alternative.
_BRACES = re.compile(r"(?<![\w/-])(--[\w-]*)\{([\w,]+)\}([\w-]*)")
_SLASHES = re.compile(r"(?<![\w/-])--((?:[a-z]+/)+[a-z]+)(-[\w-]+)")


def _expanded(text: str) -> str:
    """The text with brace and slash shorthands written out as flags."""
    text = _BRACES.sub(
        lambda m: " ".join(m.group(1) + word + m.group(3) for word in m.group(2).split(",")), text
    )
    return _SLASHES.sub(
        lambda m: " ".join("--" + word + m.group(2) for word in m.group(1).split("/")), text
    )


# "`--flag` (default X", "`--flag`, default X", "`--flag` (default: X"
_STATED_DEFAULT = re.compile(r"`(--[A-Za-z][\w-]*)`,? \(?default:? `?([^`\s,;)]+)")


def _docs() -> List[Tuple[str, str]]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [(str(path.relative_to(REPO)), path.read_text(encoding="utf-8")) for path in paths]


def _megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM 0.19's parser with the launch script's extra flags (those it imports cheaply:
    ours and the CPU defaults; the launch script's own two are found in its source)."""
    import typing

    import typing_extensions

    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim
    from megatron_dynbatch.cpu.training_shim import add_cpu_defaults
    from megatron_dynbatch.integrations.megatron_lm.arguments import add_dynamic_batch_args

    apply_cpu_shim()
    if not hasattr(typing, "override"):  # megatron.training uses Python 3.12's typing.override
        typing.override = typing_extensions.override
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    return add_dynamic_batch_args(add_cpu_defaults(add_megatron_arguments(parser)))


def _cli_parsers() -> List[argparse.ArgumentParser]:
    from megatron_dynbatch.tools.cli import build_parser

    parser = build_parser()
    subparsers = [
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    ]
    return [parser, *(sub for action in subparsers for sub in action.choices.values())]


_ADD_ARGUMENT = re.compile(
    r"add_argument\((?:\s*#[^\n]*)?\s*((?:[\"']-[^\"']*[\"']\s*,\s*)+)", re.S
)


def _script_flags() -> Set[str]:
    """Options any Python file of the repository (scripts, benchmarks, tools) or a patch to a
    host registers."""
    flags: Set[str] = set()
    paths = [*REPO.glob("**/*.py"), *REPO.glob("patches/**/*.patch")]
    for path in paths:
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".patch":
            text = re.sub(r"^[+ -]", "", text, flags=re.M)
        for match in _ADD_ARGUMENT.finditer(text):
            flags.update(re.findall(r"[\"'](--[\w-]+)[\"']", match.group(1)))
    return flags


def _effective_defaults(parser: argparse.ArgumentParser) -> Dict[str, object]:
    """Flag -> default; ours that default to ``None`` (the YAML, then the config decides) take
    the :class:`DynBatchConfig` field's default."""
    fields = {f.name: f.default for f in dataclasses.fields(DynBatchConfig)}
    by_flag = {flag: fields[field] for field, flag in FLAGS.items()}
    defaults = {}
    for option, action in parser._option_string_actions.items():
        if not option.startswith("--"):
            continue
        value = action.default
        if value is None and option in by_flag:
            value = by_flag[option]
        defaults[option] = value
    return defaults


@pytest.fixture(scope="module")
def known():
    megatron = _megatron_parser()
    clis = _cli_parsers()
    flags = set(megatron._option_string_actions)
    for parser in clis:
        flags |= set(parser._option_string_actions)
    flags |= _script_flags()
    for tool in OTHER_TOOLS.values():
        flags |= tool
    defaults: Dict[str, List[object]] = {}
    for parser in (megatron, *clis):
        for flag, value in _effective_defaults(parser).items():
            defaults.setdefault(flag, []).append(value)
    return flags, defaults


def unknown_flags(texts: Iterable[Tuple[str, str]], flags: Set[str]) -> List[str]:
    """``file: --flag`` for every flag the texts name that none of ``flags`` is (``--x-*``: a
    family, known when some flag starts with ``--x-``)."""
    missing = []
    for name, text in texts:
        for flag in sorted(set(_FLAG.findall(_expanded(text)))):
            if flag.endswith("*"):
                prefix = flag[:-1]
                if not any(known.startswith(prefix) for known in flags):
                    missing.append(f"{name}: {flag}")
            elif flag not in flags:
                missing.append(f"{name}: {flag}")
    return missing


def _same(stated: str, value: object) -> bool:
    if isinstance(value, bool) or value is None:
        return stated.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(stated) == float(value)
        except ValueError:
            return False
    return stated == str(value)


def wrong_defaults(
    texts: Iterable[Tuple[str, str]], defaults: Dict[str, List[object]]
) -> List[str]:
    """``file: --flag default X (code: ...)`` for every stated default no parser has."""
    wrong = []
    for name, text in texts:
        for flag, stated in _STATED_DEFAULT.findall(text):
            stated = stated.rstrip(".:")
            if flag not in defaults or stated.startswith("-"):
                continue  # another tool's flag, or a default that is another flag's value
            if not any(_same(stated, value) for value in defaults[flag]):
                wrong.append(f"{name}: {flag} default {stated} (code: {defaults[flag]})")
    return wrong


def test_every_flag_the_docs_name_exists(known):
    flags, _ = known
    assert unknown_flags(_docs(), flags) == []


def test_every_default_the_docs_state_is_the_codes(known):
    _, defaults = known
    docs = _docs()
    # The check has something to check: the docs state defaults of our flags.
    stated = [flag for _, text in docs for flag, _ in _STATED_DEFAULT.findall(text)]
    assert "--dynamic-batch-calibration-steps" in stated, stated
    assert wrong_defaults(docs, defaults) == []


def test_the_check_fails_on_a_flag_or_default_the_code_does_not_have(known):
    flags, defaults = known
    page = [
        (
            "bad.md",
            "Pass `--max-tokens-per-gpus 1024` (a typo), `--dynamic-batch-calibration-steps` "
            "(default 16), `--oversize-samples` (default `refuse`), `--recompute-*` and "
            "`--dynamic-batch-nothing-*`; `--dynamic-batch-calibration-max-error` (default 0.2) is right.",
        )
    ]
    assert unknown_flags(page, flags) == [
        "bad.md: --dynamic-batch-nothing-*",
        "bad.md: --max-tokens-per-gpus",
    ]
    assert [line.split(" (code")[0] for line in wrong_defaults(page, defaults)] == [
        "bad.md: --dynamic-batch-calibration-steps default 16",
        "bad.md: --oversize-samples default refuse",
    ]
