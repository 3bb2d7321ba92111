"""Which ``megatron.training`` the launch script imports: the user's patched tree, or a patched copy.

``megatron`` is a namespace package (neither Megatron-LM nor the megatron-core wheel has a
``megatron/__init__.py``), so ``megatron.training`` is found in the first ``sys.path`` entry that
holds a ``megatron/training`` directory, independently of ``megatron.core``.
:func:`use_patched_training` therefore

1. finds the ``megatron/training`` Python would import (a Megatron-LM checkout on ``PYTHONPATH``,
   or the installed megatron-core 0.19.2 wheel);
2. uses it as is if ``patches/`` is already applied there (``launch/apply_patches.sh``);
3. otherwise applies ``patches/`` (with ``launch/apply_patches.sh``: every patch applies exactly or
   nothing changes) to a copy of that directory in a cache directory keyed by the source files and
   the patches, and puts the cache first on ``sys.path``. The installed files are never modified.

It must run before anything imports ``megatron.training``.
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

from megatron_dynbatch.errors import DynBatchError

__all__ = ["PatchError", "default_cache_dir", "is_patched", "use_patched_training"]

# Text every patched file holds (patch 0001 in arguments.py, 0002 in training.py); a tree patched
# by an older series (which imported hooks' functions by name) does not match and is re-patched.
_HOOKS_IMPORT = "from megatron_dynbatch.integrations.megatron_lm import hooks as dynbatch_hooks"
_MARKERS = {
    "arguments.py": f"{_HOOKS_IMPORT}\n\n        dynbatch_hooks.configure(args)",
    "training.py": f"{_HOOKS_IMPORT}\n\n        dynamic_step = dynbatch_hooks.prepare(",
}


class PatchError(DynBatchError, RuntimeError):
    """``patches/`` cannot be used with the ``megatron.training`` Python would import."""


def default_cache_dir() -> pathlib.Path:
    """``$MEGATRON_DYNBATCH_CACHE``, else ``$XDG_CACHE_HOME/megatron_dynbatch``, else ``~/.cache``."""
    explicit = os.environ.get("MEGATRON_DYNBATCH_CACHE")
    if explicit:
        return pathlib.Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "megatron_dynbatch"


def _training_dir() -> pathlib.Path:
    """The ``megatron/training`` directory ``import megatron.training`` would load (not imported)."""
    spec = importlib.util.find_spec("megatron")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = pathlib.Path(location) / "training"
        if (candidate / "__init__.py").is_file():
            return candidate
    raise PatchError(
        "no megatron/training found on sys.path; install megatron-core 0.19.2 (its wheel ships "
        "megatron/training) or put a Megatron-LM 0.19 checkout on PYTHONPATH."
    )


def is_patched(training_dir: pathlib.Path) -> bool:
    """Whether megatron_dynbatch's patches are applied in ``training_dir``."""
    return all(
        marker in (training_dir / name).read_text(encoding="utf-8")
        for name, marker in _MARKERS.items()
    )


def _digest(training_dir: pathlib.Path, patch_dir: pathlib.Path) -> str:
    digest = hashlib.sha256()
    for root, pattern in ((training_dir, "**/*.py"), (patch_dir, "*.patch")):
        for path in sorted(root.glob(pattern)):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _compile(tree: pathlib.Path, shown_as: pathlib.Path) -> None:
    """Write the bytecode of the copy's modules, as pip does for installed packages.

    Without it every rank of every launch compiles the copy's ~24,000 lines again where Python
    may not write bytecode itself (``PYTHONDONTWRITEBYTECODE``, a read-only cache): about 0.2-0.5 s
    of CPU a process on a 2-core machine. ``shown_as`` is the path tracebacks name (the copy is
    built under a scratch name). Bytecode only saves time, so a failure to write it is ignored
    (``py_compile`` writes each file atomically: ranks racing here are safe).
    """
    try:
        compileall.compile_dir(str(tree), ddir=str(shown_as), quiet=2, workers=1)
    except OSError:
        pass


def use_patched_training(
    patch_dir: pathlib.Path,
    apply_script: pathlib.Path,
    *,
    cache_dir: Optional[pathlib.Path] = None,
) -> pathlib.Path:
    """Make ``import megatron.training`` load a tree with ``patches/`` applied.

    Args:
        patch_dir: The repository's ``patches/`` directory.
        apply_script: ``launch/apply_patches.sh`` (checks every patch before changing anything).
        cache_dir: Where patched copies are kept; default :func:`default_cache_dir`.

    Returns:
        The ``megatron/training`` directory that will be imported.

    Raises:
        PatchError: When ``megatron.training`` is already imported from an unpatched tree, or the
            patches do not apply (another Megatron version), with the output of the apply script.
    """
    if "megatron.training" in sys.modules:
        loaded = pathlib.Path(sys.modules["megatron.training"].__file__).parent
        if is_patched(loaded):
            return loaded
        raise PatchError(
            f"megatron.training was imported from {loaded} before its patched copy was set up; "
            "call use_patched_training() before importing megatron.training."
        )
    source = _training_dir()
    if is_patched(source):
        return source
    cache = cache_dir or default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        if cache_dir is not None:
            raise
        # A read-only home (some clusters): fall back to the temporary directory.
        cache = pathlib.Path(tempfile.gettempdir()) / f"megatron_dynbatch-{os.getuid()}"
        cache.mkdir(parents=True, exist_ok=True)
    root = cache / f"training-{_digest(source, patch_dir)}"
    target = root / "megatron" / "training"
    if not (target / "__init__.py").is_file():
        # Build in a private directory and rename it into place: ranks on one node race here.
        scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"{root.name}.tmp-", dir=root.parent))
        try:
            shutil.copytree(
                source,
                scratch / "megatron" / "training",
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )
            result = subprocess.run(
                ["bash", str(apply_script), str(scratch)],
                env=dict(os.environ, MEGATRON_DYNBATCH_PATCH_DIR=str(patch_dir)),
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise PatchError(
                    f"megatron_dynbatch's patches do not apply to {source} (made for "
                    f"megatron-core / Megatron-LM 0.19.2):\n{result.stderr.strip()}"
                )
            _compile(scratch, root)
            try:
                os.rename(scratch, root)
            except OSError:
                if not (target / "__init__.py").is_file():
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    elif not (target / "__pycache__").is_dir():
        _compile(root, root)  # a copy made before copies were compiled
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    found = _training_dir()
    if found != target:
        raise PatchError(
            f"the patched copy {target} is on sys.path but Python would import {found}; is "
            "megatron a regular package (with an __init__.py) in this environment?"
        )
    return target
