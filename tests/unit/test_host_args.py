"""No integration writes into its host's ``args``: the run's state (calibration included) lives in
objects the integration owns, so what the user passed is what Megatron, slime, SkyRL or verl see.

Two files configure a namespace on purpose, before any of our code runs, and are allowed:
``megatron_lm/pretrain_gpt.py`` is the launch entry itself (it sets what Megatron-LM's own
``pretrain_gpt.py`` would: the external data loader, a validation interval) and
``megatron_lm/data/preprocess.py`` fills a namespace it created for Megatron's tokenizer builder.
"""

import ast
import pathlib

import pytest

import megatron_dynbatch

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(megatron_dynbatch.__file__).parent
ALLOWED = {
    "integrations/megatron_lm/pretrain_gpt.py",
    "integrations/megatron_lm/data/preprocess.py",
}
# Names a host's argument namespace goes by in our code.
ARGS_NAMES = {"args", "megatron_args", "slime_args"}


def _writes(source: str):
    """``args.x = ...``, ``args.x += ...``, ``setattr(args, ...)``, ``vars(args)[...] = ...``."""
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                if target.value.id in ARGS_NAMES:
                    yield node.lineno
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Call):
                call = target.value
                if getattr(call.func, "id", None) == "vars" and call.args:
                    if getattr(call.args[0], "id", None) in ARGS_NAMES:
                        yield node.lineno
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            if node.args and getattr(node.args[0], "id", None) in ARGS_NAMES:
                yield node.lineno


def test_no_integration_writes_into_the_hosts_args():
    found = []
    for path in sorted((PACKAGE / "integrations").rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name not in ALLOWED:
            found += [f"{name}:{line}" for line in _writes(path.read_text())]
    assert found == [], f"keep run state in the integration's own objects, not args: {found}"


def test_the_scanner_sees_each_kind_of_write():
    source = "args.a = 1\nargs.b += 1\nsetattr(args, 'c', 2)\nvars(args)['d'] = 3\nx.args = 4\n"
    assert sorted(_writes(source)) == [1, 2, 3, 4]
    assert list(_writes((PACKAGE / "integrations/megatron_lm/pretrain_gpt.py").read_text()))
