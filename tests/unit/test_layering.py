"""Imports flow one way: planning -> runtime -> megatron integration -> adapters / CLI.

Every ``import`` statement of the package (module level and inside functions, relative ones
resolved) is read from the source, so a lazy import that breaks the layering is caught too.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_dynbatch"

# What each part of the package may import from the package itself (besides its own part).
ALLOWED = {
    "planning": set(),
    "aggregation": set(),
    "config": {"planning"},
    "plotting": {"planning"},
    "runtime": {"planning", "aggregation"},
    "megatron": {"planning", "aggregation", "config", "runtime"},
    "megatron.verify": {"planning", "aggregation", "config", "runtime", "megatron", "testing"},
    "testing": {"planning", "aggregation", "runtime", "megatron"},
    "adapters": {"planning", "aggregation", "config", "runtime", "megatron"},
    "cli": {"planning", "aggregation", "config", "plotting", "megatron.verify"},
}
# Third-party packages a part must never import, even lazily.
FORBIDDEN_EXTERNAL = {
    "planning": {"torch", "megatron", "numpy"},
    "aggregation": {"torch", "megatron", "numpy"},
    "config": {"torch", "megatron"},
    "runtime": {"megatron"},
}


def _part(module: str) -> str:
    """The layer of a dotted module name below ``megatron_dynbatch``."""
    parts = module.split(".")[1:]
    if parts[:2] == ["megatron", "verify"]:
        return "megatron.verify"
    return parts[0] if parts else ""


def _module_name(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path):
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield node.lineno, target


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layers(path):
    part = _part(_module_name(path))
    if part not in ALLOWED:
        return  # the package's __init__
    allowed = ALLOWED[part] | {part}
    forbidden = FORBIDDEN_EXTERNAL.get(part, set())
    problems = []
    for line, target in _imports(path):
        top = target.split(".")[0]
        if top == "megatron_dynbatch":
            used = _part(target)
            if used and used not in allowed:
                problems.append(f"line {line}: {part} imports {target}")
        elif top in forbidden:
            problems.append(f"line {line}: {part} imports {target}")
    assert not problems, problems


def test_the_checker_sees_a_violation(tmp_path):
    """The rule can fail: a runtime module importing the Megatron layer is reported."""
    bad = PACKAGE / "runtime" / "_layering_probe.py"
    try:
        bad.write_text("def f():\n    from megatron_dynbatch.megatron import step\n")
        with pytest.raises(AssertionError, match="runtime imports megatron_dynbatch.megatron"):
            test_imports_follow_the_layers(bad)
    finally:
        bad.unlink()
