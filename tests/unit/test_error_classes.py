"""Every error megatron_dynbatch raises on purpose is a ``DynBatchError`` (docs/api.md's promise).

Bad input is a ``DynBatchValueError`` (still a ``ValueError``, so callers that catch ``ValueError``
keep working); a refused run-time condition a ``DynBatchRuntimeError``; a wrong type a
``DynBatchTypeError``. The scan below fails on any deliberate ``raise ValueError(...)``,
``raise TypeError(...)`` or ``raise RuntimeError(...)`` in the package outside ``errors.py``.
"""

import ast
import pathlib

import pytest

import megatron_dynbatch
from megatron_dynbatch.config import DynBatchConfig
from megatron_dynbatch.errors import DynBatchError, DynBatchValueError
from megatron_dynbatch.planning import PlannerConfig, plan_schedule

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(megatron_dynbatch.__file__).parent
BUILTINS = {"ValueError", "TypeError", "RuntimeError"}


def builtin_raises(source: str):
    """(line, name) of each ``raise X(...)`` / ``raise X`` whose X is a builtin error class."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTINS:
                yield node.lineno, exc.id


def test_the_scanner_finds_a_builtin_raise():
    source = "def f(x):\n    if x:\n        raise ValueError('bad')\n    raise RuntimeError\n"
    assert sorted(builtin_raises(source)) == [(3, "ValueError"), (4, "RuntimeError")]
    assert list(builtin_raises("raise DynBatchValueError('bad')\n")) == []


def test_no_builtin_error_is_raised_on_purpose_outside_errors_py():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "errors.py":
            continue
        for line, name in builtin_raises(path.read_text()):
            found.append(f"{path.relative_to(PACKAGE)}:{line}: raise {name}")
    assert not found, "raise a megatron_dynbatch.errors class instead:\n" + "\n".join(found)


def test_bad_config_and_bad_lengths_are_dynbatch_errors():
    with pytest.raises(DynBatchValueError, match="layout"):
        DynBatchConfig(max_tokens_per_gpu=8, layout="x")
    with pytest.raises(DynBatchValueError, match="got sample 0: 0"):
        plan_schedule([0, 5], config=PlannerConfig(max_tokens_per_gpu=16))
    assert issubclass(DynBatchValueError, (DynBatchError, ValueError))
