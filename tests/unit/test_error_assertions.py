"""Tests assert the error the package raises, not a base class that any bug would also satisfy.

The package raises ``DynBatchValueError`` for bad input (tests/unit/test_error_classes.py pins
that), so ``pytest.raises(ValueError)`` would also pass on a stray ``ValueError`` from torch or a
typo, and ``pytest.raises(Exception)`` on anything at all. The scan below fails on either, anywhere
under tests/ (a host's own error, such as SkyRL's ``IndexError`` in a worker, is asserted through
``DistributedTestError`` and the failed ranks' exception names).
"""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

TESTS = pathlib.Path(__file__).resolve().parents[1]
#: Too broad to show that the package refused the input on purpose.
BROAD = {"BaseException", "Exception", "ValueError"}


def broad_raises(source: str):
    """(line, name) of each ``pytest.raises(X, ...)`` whose X (or a member of a tuple X) is broad."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr == "raises"):
            continue
        if not (isinstance(func.value, ast.Name) and func.value.id == "pytest"):
            continue
        first = node.args[0]
        for exc in first.elts if isinstance(first, ast.Tuple) else [first]:
            if isinstance(exc, ast.Name) and exc.id in BROAD:
                yield node.lineno, exc.id


def test_the_scanner_finds_broad_error_assertions():
    source = (
        "with pytest.raises(ValueError, match='x'):\n    f()\n"
        "with pytest.raises(Exception):\n    f()\n"
        "with pytest.raises((DynBatchValueError, ValueError)):\n    f()\n"
        "with pytest.raises(DynBatchValueError, match='x'):\n    f()\n"
    )
    assert list(broad_raises(source)) == [(1, "ValueError"), (3, "Exception"), (5, "ValueError")]


def unchecked_messages(source: str):
    """Lines of ``with pytest.raises(DynBatch...Error)`` that neither match the message nor keep the
    error (``as info``) to assert on it: the message is half of what a user gets."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.With, ast.AsyncWith)):
            continue
        for item in node.items:
            call = item.context_expr
            if not (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "raises"
                and call.args
                and isinstance(call.args[0], ast.Name)
                and call.args[0].id.startswith("DynBatch")
            ):
                continue
            if item.optional_vars is None and not any(k.arg == "match" for k in call.keywords):
                yield node.lineno


def test_the_message_checker_finds_an_unchecked_message():
    source = (
        "with pytest.raises(DynBatchValueError):\n    f()\n"
        "with pytest.raises(DynBatchValueError, match='x'):\n    f()\n"
        "with pytest.raises(DynBatchValueError) as info:\n    f()\n"
    )
    assert list(unchecked_messages(source)) == [1]


def test_every_dynbatch_error_assertion_checks_the_message():
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        for line in unchecked_messages(path.read_text())
    ]
    assert not found, "add match=... (or `as info` and assert on it):\n" + "\n".join(found)


def test_no_test_asserts_a_bare_value_error_or_exception():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for line, name in broad_raises(path.read_text()):
            found.append(f"{path.relative_to(TESTS)}:{line}: pytest.raises({name}")
    assert not found, (
        "assert the specific error (pytest.raises(DynBatchValueError, match=...), or the host's "
        "own class):\n" + "\n".join(found)
    )
