"""Stand-ins for a trainer's imports that need Ray, a GPU or a download, so its own code can run.

The tests that drive a trainer's modules (slime, SkyRL, verl) on gloo CPU ranks import that
trainer's real code; some of what it imports at module level is not installed here and cannot run
without a cluster, a GPU or a model download (``ray``, ``vllm``, ``transformers``, ...). Those
modules, and only those that are missing, are answered by a module whose every attribute is a
class that accepts any call (decorators, annotations, base classes), so importing works and any
real use fails visibly. What each test stubs, and why, is listed in its docs page.

    stubbed = install_stubs(("ray", "transformers"), prefixes=("megatron.bridge",))
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Iterable, List, Sequence

__all__ = ["install_stubs", "unstub"]


class _Anything(type):
    """A class every attribute of which is another such class, callable with anything."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        # Stubbed decorators and annotations (pydantic's Discriminator("type"), ...).
        return _Anything(cls.__name__, (), {})

    def __getitem__(cls, item):
        # Subscripted annotations (``PreTrainedTokenizer | None``, ``Foo[int]``).
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls


class _StubModule(types.ModuleType):
    __stub__ = True

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(name, (), {})
        setattr(self, name, value)
        return value


def _ray_remote(*args, **kwargs):
    # ``@ray.remote`` and ``@ray.remote(num_gpus=1)`` both leave the class or function as it is.
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: Sequence[str], prefixes: Sequence[str]):
        self.roots = list(roots)
        self.prefixes = list(prefixes)
        self.stubbed = self.roots + self.prefixes

    def covers(self, name: str) -> bool:
        if name.split(".")[0] in self.roots:
            return True
        return any(name == p or name.startswith(p + ".") for p in self.prefixes)

    def find_spec(self, name, path, target=None):
        if self.covers(name):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        if spec.name == "ray":
            module.remote = _ray_remote
            module.is_initialized = lambda: False
        return module

    def exec_module(self, module):
        pass


def _missing(name: str) -> bool:
    if "." not in name:
        return importlib.machinery.PathFinder.find_spec(name) is None
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:
        return True


def install_stubs(
    roots: Iterable[str], prefixes: Iterable[str] = (), replace: Iterable[str] = ()
) -> List[str]:
    """Answer the imports of ``roots`` (top-level packages) and ``prefixes`` that are missing.

    Installed modules are not replaced, except the top-level packages in ``replace``: those are
    answered by stand-ins even where installed (forgotten if already imported), for a package that
    is installed for another trainer but that this trainer's code cannot use here (SkyRL's pydantic
    models use ``typing.TypedDict``, which pydantic refuses on Python < 3.12; SkyRL needs 3.12).
    Calling it again in the same process adds to what the earlier call stubbed (a worker of the
    persistent pool runs cases of several trainers).

    Returns:
        Every module name this process now answers with a stand-in.
    """
    replace = list(replace)
    # isinstance, not getattr(module, "__stub__"): a real package's module-level __getattr__
    # (pydantic's lazy imports) would import its submodules again while they are being forgotten.
    for name in [n for n in sys.modules if n.split(".")[0] in replace]:
        if not isinstance(sys.modules.get(name), _StubModule):
            sys.modules.pop(name, None)
    roots = [r for r in roots if r in replace or _missing(r)]
    prefixes = [p for p in prefixes if _missing(p)]
    finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
    if finder is None:
        finder = _Finder((), ())
        sys.meta_path.insert(0, finder)
    for name in roots:
        if name not in finder.roots:
            finder.roots.append(name)
    for name in prefixes:
        if name not in finder.prefixes:
            finder.prefixes.append(name)
    finder.stubbed = finder.roots + finder.prefixes
    return list(finder.stubbed)


def unstub(roots: Iterable[str]) -> None:
    """Stop answering the top-level packages ``roots`` with stand-ins, and forget the stand-ins
    already imported, so the installed packages are imported next time.

    For a trainer that needs a package another trainer's cases replaced in the same process: a
    worker of the persistent pool that ran SkyRL's cases (pydantic replaced, see
    :func:`install_stubs`) and then runs NeMo-RL's, whose configs are pydantic models.
    """
    roots = set(roots)
    finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
    if finder is not None:
        finder.roots = [r for r in finder.roots if r not in roots]
        finder.stubbed = finder.roots + finder.prefixes
    for name in [n for n in sys.modules if n.split(".")[0] in roots]:
        if isinstance(sys.modules.get(name), _StubModule):
            del sys.modules[name]
