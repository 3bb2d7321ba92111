"""No function or method of the package is defined and never used.

Every ``def`` in megatron_dynbatch/ (module functions, methods, nested functions) must be named
somewhere else in what runs: the package itself, the host patches (patches/), the launch scripts
(launch/), the examples (examples/) and the benchmarks (benchmarks/); a public name (no leading
underscore) may instead be documented in docs/api.md. A use in tests/ does not count: a function
only a test calls is dead code with a test. The one exception is the test harness the package
ships (megatron_dynbatch/tools/testing: the tiny models and the rank pool that tests/ and
``megatron-dynbatch verify`` run on), whose functions tests/ may be the only users of.

A name counts as used where Python code names it (a name, an attribute, an import, a word of a
string, e.g. ``getattr(x, "name")``; neither an ``__all__`` entry nor a docstring is a use) or
where a patch or shell script holds it as a word. A use inside the function's own body
(recursion) does not count. Exempt: dunder methods (Python calls them), and methods that
implement a base class's or protocol's method: the name is defined by a base class in the package,
the class derives from a class outside the package and the name is in :data:`HOST_METHODS` (what
torch, Megatron, PyYAML, importlib or logging call on their subclasses), or the name is in
:data:`HOST_PROTOCOL` (what a host calls on the stand-in we hand it for its own object).
"""

import ast
import pathlib
import re
from collections import defaultdict
from typing import Dict, Iterator, List, Sequence, Set, Tuple

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_dynbatch"
USERS = ("megatron_dynbatch", "patches", "launch", "examples", "benchmarks")
API_DOC = ROOT / "docs" / "api.md"
#: The test harness the package ships: tests/ count as its users.
HARNESS = PACKAGE / "tools" / "testing"

#: Methods an outside base class calls by its own name: torch's ``nn.Module`` and
#: ``autograd.Function``, Megatron's modules, PyYAML's loader, importlib's finders and loaders,
#: ``logging``'s handlers and filters.
HOST_METHODS = frozenset(
    {
        "forward",
        "backward",
        "setup_context",
        "sharded_state_dict",
        "state_dict",
        "load_state_dict",
        "construct_mapping",
        "find_spec",
        "create_module",
        "exec_module",
        "emit",
        "filter",
        "format",
    }
)

#: Methods a host calls on an object of ours that stands in for its own, by the host's name for
#: them: SkyRL's worker on the micro-batch iterator (its ``TokenBasedBatchIterator``'s).
HOST_PROTOCOL = frozenset({"reorder_and_combine_batches"})

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DUNDER = re.compile(r"^__\w+__$")


class _Definitions(ast.NodeVisitor):
    """Every ``def`` of one module: (name, qualified name, line, enclosing class or None)."""

    def __init__(self) -> None:
        self.found: List[Tuple[str, str, int, object]] = []
        self._stack: List[str] = []
        self._classes: List[ast.ClassDef] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._stack.append(node.name)
        self._classes.append(node)
        for child in node.body:
            self.visit(child)
        self._classes.pop()
        self._stack.pop()

    def _function(self, node) -> None:
        owner = (
            self._classes[-1]
            if self._classes and self._stack[-1] == self._classes[-1].name
            else None
        )
        self.found.append((node.name, ".".join(self._stack + [node.name]), node.lineno, owner))
        self._stack.append(node.name)
        for child in node.body:
            self.visit(child)
        self._stack.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function


class _Uses(ast.NodeVisitor):
    """Every name one module uses, with the functions it is used in (to drop recursion)."""

    def __init__(self) -> None:
        self.uses: Dict[str, List[Tuple[str, ...]]] = defaultdict(list)
        self._functions: List[str] = []

    def _use(self, name: str) -> None:
        self.uses[name].append(tuple(self._functions))

    def _function(self, node) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        self.visit(node.args)
        if node.returns is not None:
            self.visit(node.returns)
        self._functions.append(node.name)
        for child in node.body:
            self.visit(child)
        self._functions.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return  # a listing in __all__ is not a use
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self._use(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._use(node.attr)
        self.generic_visit(node)

    def visit_alias(self, node: ast.alias) -> None:
        for part in node.name.split("."):
            self._use(part)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring (of a module, class, function or attribute) is no use
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            for word in _WORD.findall(node.value):
                self._use(word)


def _python_files(folder: pathlib.Path) -> Iterator[pathlib.Path]:
    yield from sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _uses(users=USERS) -> Dict[str, List[Tuple[str, ...]]]:
    """Every name used by ``users`` (folders; see the module docstring), with the functions each
    use is in."""
    uses: Dict[str, List[Tuple[str, ...]]] = defaultdict(list)
    for top in users:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if path.suffix == ".py":
                visitor = _Uses()
                visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
                for name, where in visitor.uses.items():
                    uses[name].extend(where)
            elif path.suffix in (".patch", ".sh"):
                for word in _WORD.findall(path.read_text(encoding="utf-8")):
                    uses[word].append(())
    return uses


def _package_classes() -> Dict[str, Set[str]]:
    """Class name -> the method names it defines, over the whole package."""
    methods: Dict[str, Set[str]] = defaultdict(set)
    for path in _python_files(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                methods[node.name] |= {
                    n.name
                    for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
    return methods


def _base_names(node: ast.ClassDef) -> List[str]:
    names = []
    for base in node.bases:
        if isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
            base = base.value
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def _implements_a_base(name: str, owner: ast.ClassDef, classes: Dict[str, Set[str]]) -> bool:
    """``owner.name`` overrides a package base class's method, or an outside base's hook."""
    outside = False
    seen: Set[str] = set()
    todo = _base_names(owner)
    while todo:
        base = todo.pop()
        if base in seen or base in ("object", "Generic"):
            continue
        seen.add(base)
        if base in classes:
            if name in classes[base]:
                return True
            todo.extend(_base_names_of(base))
        elif base != "Protocol":
            outside = True
    return outside and name in HOST_METHODS


_CLASS_NODES: Dict[str, ast.ClassDef] = {}


def _base_names_of(class_name: str) -> List[str]:
    node = _CLASS_NODES.get(class_name)
    return _base_names(node) if node is not None else []


def dead_functions(extra: Sequence[pathlib.Path] = ()) -> List[str]:
    """``path:line qualified.name`` of every function nothing uses (see the module docstring);
    ``extra``: more modules to check as if they were the package's (not counted as users)."""
    uses = _uses()
    test_uses = _uses(("tests",))
    doc_words = set(_WORD.findall(API_DOC.read_text(encoding="utf-8")))
    classes = _package_classes()
    for path in _python_files(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                _CLASS_NODES.setdefault(node.name, node)
    dead = []
    for path in [*_python_files(PACKAGE), *extra]:
        finder = _Definitions()
        finder.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for name, qualified, line, owner in finder.found:
            if _DUNDER.match(name):
                continue
            if owner is not None and (
                name in HOST_PROTOCOL or _implements_a_base(name, owner, classes)
            ):
                continue
            # Uses outside the function's own body (a recursive call is no use).
            if any(name not in where for where in uses.get(name, ())):
                continue
            if HARNESS in path.parents and test_uses.get(name):
                continue
            if not name.startswith("_") and name in doc_words:
                continue
            where = path.relative_to(ROOT) if ROOT in path.parents else path
            dead.append(f"{where}:{line} {qualified}")
    return dead


def test_every_function_of_the_package_is_used_outside_the_tests():
    dead = dead_functions()
    assert not dead, (
        "defined and never used outside tests/ (remove it, or use it where it belongs):\n"
        + "\n".join(dead)
    )


def test_a_planted_dead_function_is_found(tmp_path):
    """The check can fail: a module with an unused function, a recursive-only one, an unused
    method and a dunder method (exempt)."""
    plant = tmp_path / "_dead_code_plant.py"
    plant.write_text(
        "def planted_never_called_xyz():\n    return 1\n\n\n"
        "def planted_recursive_xyz(n):\n    return 0 if n == 0 else planted_recursive_xyz(n - 1)\n\n\n"
        "class PlantedXyz:\n    def planted_method_xyz(self):\n        return 2\n\n"
        "    def __repr__(self):\n        return 'x'\n",
        encoding="utf-8",
    )
    dead = dead_functions(extra=[plant])
    found = [d for d in dead if "_dead_code_plant.py" in d]
    assert sorted(d.split()[-1] for d in found) == [
        "PlantedXyz.planted_method_xyz",
        "planted_never_called_xyz",
        "planted_recursive_xyz",
    ]
