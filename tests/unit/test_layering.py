"""Imports flow one way, in data-flow order: planning -> runtime -> mcore -> integrations -> tools.

Every ``import`` statement of the package (module level, inside functions and under ``if
TYPE_CHECKING:``, relative ones resolved) is read from the source, so a lazy or annotation-only
import that breaks the layering or closes a circle is caught too. Test
support (``tools.testing``) is imported only from ``tools``, and no two modules import each other,
directly or through others.
"""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_dynbatch"

# What each part of the package may import from the package itself (besides its own part). A part
# is the first folder below the package, or a top-level module; ``tools.testing`` is its own part.
ALLOWED = {
    "errors": set(),
    "planning": {"errors"},
    # The settings table: every flag, YAML key and help text (the config, the parsers read it).
    "settings": {"errors", "planning"},
    "config": {"errors", "planning", "runtime.aggregation", "settings"},
    "runtime": {"errors", "planning"},
    "mcore": {"errors", "planning", "runtime"},
    "cpu": {"errors"},
    "integrations.megatron_lm": {
        "errors",
        "planning",
        "config",
        "settings",
        "runtime",
        "mcore",
        "cpu",
        "integrations.model_args",
        "integrations.moe_args",
    },
    "integrations.slime": {
        "errors",
        "planning",
        "config",
        "runtime",
        "mcore",
        "integrations.hosts",
        "integrations.model_args",
        "integrations.moe_args",  # Megatron's MoE flags our forward cannot run, refused alike
        "integrations.host_memory",  # the memory refusal every host words the same way
    },
    "integrations.skyrl": {
        "errors",
        "planning",
        "config",
        "runtime",
        "mcore",
        "integrations.hosts",
        "integrations.host_memory",
        "integrations.moe_args",  # Megatron's MoE settings our padded forward cannot run
    },
    "integrations.verl": {
        "errors",
        "planning",
        "config",
        "runtime",
        "mcore",
        "integrations.hosts",
        "integrations.host_memory",
        "integrations.moe_args",  # Megatron's MoE settings our padded forward cannot run
    },
    "integrations.nemo_rl": {
        "errors",
        "planning",
        "config",
        "runtime",
        "mcore",
        "integrations.hosts",
        "integrations.model_args",  # max_memory_gib: the HF config read in Megatron's flag names
        "integrations.host_memory",  # the memory refusal every host words the same way
        "integrations.moe_args",  # Megatron's MoE settings our padded forward cannot run
    },
    "integrations": set(),  # the sub-package's __init__
    "integrations.hosts": {"errors", "planning", "config"},
    # Megatron's arguments -> the memory model: every host that parses Megatron's flags.
    "integrations.model_args": {"errors", "planning"},
    # Megatron's MoE flags as our padded forward meets them: Megatron-LM's launch and slime.
    "integrations.moe_args": {"errors"},
    # A memory budget in a host's own key, from a Hugging Face config.json (verl, SkyRL), and the
    # config-time memory refusal every host words the same way.
    "integrations.host_memory": {"errors", "planning", "config"},
    "adapters": {"integrations.slime"},
    "tools": {
        "errors",
        "planning",
        "config",
        "settings",
        "runtime",
        "mcore",
        "cpu",
        "integrations.megatron_lm",
        "integrations.slime",
        "tools.testing",
    },
    "tools.testing": {"errors", "planning", "runtime", "mcore", "cpu"},
    "": {"errors", "planning", "runtime"},  # the package's __init__
    "__main__": {"tools"},  # python -m megatron_dynbatch: the command
}
# Third-party packages a part must never import, even lazily.
FORBIDDEN_EXTERNAL = {
    "errors": {"torch", "megatron", "numpy"},
    "planning": {"torch", "megatron", "numpy"},
    "config": {"torch", "megatron"},
    "settings": {"torch", "megatron", "numpy"},
    "runtime": {"megatron"},
}


def _part(module: str) -> str:
    """The layer of a dotted module name below ``megatron_dynbatch``."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "runtime" and parts[1:2] == ["aggregation"]:
        return "runtime.aggregation"
    if parts[0] in ("integrations", "tools") and len(parts) > 1:
        if parts[0] == "tools" and parts[1] != "testing":
            return "tools"
        return ".".join(parts[:2])
    return parts[0]


def _allowed(part: str) -> set:
    allowed = set(ALLOWED[part]) | {part}
    if part.startswith("runtime"):
        allowed |= {"runtime", "runtime.aggregation"}
    if "runtime" in allowed:
        allowed.add("runtime.aggregation")
    if part == "tools":
        allowed.add("integrations")
    return allowed


def _module_name(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, with_names: bool = False):
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, node.col_offset == 0
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield node.lineno, target, node.col_offset == 0
            if with_names:  # ``from pkg import mod`` imports the module ``pkg.mod``
                for alias in node.names:
                    yield node.lineno, f"{target}.{alias.name}", node.col_offset == 0


SOURCES = sorted(PACKAGE.rglob("*.py"))


def _problems(path: pathlib.Path):
    part = _part(_module_name(path))
    part = "runtime" if part == "runtime.aggregation" else part
    assert part in ALLOWED, f"{path}: part {part!r} has no layering rule; add it to ALLOWED"
    allowed = _allowed(part)
    forbidden = FORBIDDEN_EXTERNAL.get(part, set())
    if _module_name(path).endswith("runtime.aggregation"):
        forbidden = FORBIDDEN_EXTERNAL["planning"]
    problems = []
    for line, target, _ in _imports(path):
        top = target.split(".")[0]
        if top == "megatron_dynbatch":
            used = _part(target)
            if used and used not in allowed:
                problems.append(f"line {line}: {part or 'megatron_dynbatch'} imports {target}")
        elif top in forbidden:
            problems.append(f"line {line}: {part} imports {target}")
    return problems


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layers(path):
    problems = _problems(path)
    assert not problems, problems


def _module_graph(sources):
    """Module -> package modules it imports, at module level, inside functions (a lazy import
    runs too, later: two modules importing each other that way are still a circle) or under ``if
    TYPE_CHECKING:`` (a reader and a type checker follow it: two modules that need each other's
    names are one concern split in two, or need a protocol)."""
    names = {_module_name(p) for p in sources}
    graph = {}
    for path in sources:
        edges = set()
        for _, target, _ in _imports(path, with_names=True):
            if not target.startswith("megatron_dynbatch"):
                continue
            # ``from pkg import mod`` names a module too; take the longest known prefix.
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != _module_name(path):
                edges.add(target)
        graph[_module_name(path)] = edges
    return graph


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = _module_graph(SOURCES)
    # A package's __init__ importing its own modules is how packages work, not a cycle.
    for module in graph:
        graph[module] = {m for m in graph[module] if not module.startswith(m + ".")}
    assert _cycle(graph) is None, _cycle(graph)


def test_the_checker_sees_a_violation(tmp_path):
    """The rules can fail: a runtime module importing mcore, and a two-module cycle, are reported."""
    fake = tmp_path / "megatron_dynbatch"
    (fake / "runtime").mkdir(parents=True)
    probe = fake / "runtime" / "probe.py"
    probe.write_text("def f():\n    from megatron_dynbatch.mcore import step\n")
    global PACKAGE
    saved = PACKAGE
    PACKAGE = fake
    try:
        assert _problems(probe) == ["line 2: runtime imports megatron_dynbatch.mcore"]
        (fake / "runtime" / "a.py").write_text("import megatron_dynbatch.runtime.b\n")
        # A lazy import closes the circle too.
        (fake / "runtime" / "b.py").write_text(
            "def f():\n    from megatron_dynbatch.runtime import a\n"
        )
        graph = _module_graph(sorted(fake.rglob("*.py")))
        assert _cycle(graph) in (
            [
                "megatron_dynbatch.runtime.a",
                "megatron_dynbatch.runtime.b",
                "megatron_dynbatch.runtime.a",
            ],
        )
        # An import for annotations only closes it too, and breaks the layering like any other.
        (fake / "runtime" / "b.py").write_text(
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from megatron_dynbatch.runtime.a import A\n"
            "    from megatron_dynbatch.mcore.step import S\n"
        )
        graph = _module_graph(sorted(fake.rglob("*.py")))
        assert _cycle(graph) == [
            "megatron_dynbatch.runtime.a",
            "megatron_dynbatch.runtime.b",
            "megatron_dynbatch.runtime.a",
        ]
        assert _problems(fake / "runtime" / "b.py") == [
            "line 4: runtime imports megatron_dynbatch.mcore.step"
        ]
    finally:
        PACKAGE = saved


def test_only_tools_imports_test_support():
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in SOURCES
        if _part(_module_name(path)) not in ("tools", "tools.testing")
        for line, target, _ in _imports(path)
        if target.startswith("megatron_dynbatch.tools.testing")
    ]
    assert not offenders, offenders


def _test_module_imports(tests_root: pathlib.Path):
    """(file, line, target) for every import of a ``tests.*.test_*`` module by a test file."""
    found = []
    for path in sorted(tests_root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("tests.") and target.split(".")[-1].startswith("test_"):
                    found.append((path.relative_to(tests_root).as_posix(), node.lineno, target))
    return found


def test_no_test_module_imports_another(tmp_path):
    # Shared helpers live in tests/_support.py; a test module importing another ties their
    # selection together (deselecting one breaks the other) and runs its module-level set-up.
    offenders = _test_module_imports(PACKAGE.parent / "tests")
    assert not offenders, offenders
    # The check itself sees such an import.
    (tmp_path / "test_a.py").write_text("from tests.megatron.test_pretrain import LAUNCH\n")
    assert _test_module_imports(tmp_path) == [("test_a.py", 1, "tests.megatron.test_pretrain")]


#: The kind markers (tests/conftest.py's KINDS) and the folder that holds each kind's modules:
#: tests/unit only unit tests (no test there needs a trainer checkout, a process group or a
#: launch), and no unit-marked module elsewhere.
KINDS = ("unit", "gloo", "torchrun", "slime", "skyrl", "verl")


def _kind_marks(path: pathlib.Path):
    """``(line, kind, module_level)`` of every ``pytest.mark.<kind>`` a test file uses
    (``pytestmark = ...`` at module level, a decorator, or an alias such as ``needs_slime``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module_level = {
        id(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in KINDS
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
            and getattr(node.value.value, "id", None) == "pytest"
        ):
            yield node.lineno, node.attr, id(node) in module_level


def _misplaced(tests_root: pathlib.Path):
    found = []
    for path in sorted(tests_root.rglob("test_*.py")):
        folder = path.relative_to(tests_root).parts[0]
        for line, kind, module_level in _kind_marks(path):
            where = f"{path.relative_to(tests_root).as_posix()}:{line}"
            if folder == "unit" and kind != "unit":
                found.append(f"{where}: a {kind} test in tests/unit")
            elif folder != "unit" and kind == "unit" and module_level:
                found.append(f"{where}: a unit-marked module outside tests/unit")
    return found


def test_test_modules_live_in_the_folder_of_their_kind(tmp_path):
    offenders = _misplaced(PACKAGE.parent / "tests")
    assert not offenders, offenders
    # The check itself sees both.
    (tmp_path / "unit").mkdir()
    (tmp_path / "megatron").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text(
        "import pytest\npytestmark = pytest.mark.unit\nneeds_slime = pytest.mark.slime\n"
    )
    (tmp_path / "megatron" / "test_b.py").write_text(
        "import pytest\npytestmark = pytest.mark.unit\n"
    )
    assert _misplaced(tmp_path) == [
        "megatron/test_b.py:2: a unit-marked module outside tests/unit",
        "unit/test_a.py:3: a slime test in tests/unit",
    ]
