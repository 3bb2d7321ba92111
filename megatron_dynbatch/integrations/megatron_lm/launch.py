"""Start Megatron-LM's GPT pretraining with dynamic batching, from a checkout or an installed wheel.

The one body behind ``launch/pretrain_gpt_dynbatch.py``, ``python -m megatron_dynbatch pretrain``
and the ``megatron-dynbatch pretrain`` command (each under torchrun). Before anything imports
``megatron.training`` it makes that import load a tree with our patches applied
(:func:`~.patched_tree.use_patched_training`), with the patches shipped in the wheel
(``megatron_dynbatch/integrations/megatron_lm/shipped/``, copied there by ``setup.py``) or, in a
checkout, the repository's ``patches/`` and ``launch/apply_patches.sh``. Without CUDA it then
applies the CPU support; with CUDA nothing of it.

Imports only the standard library, torch and our CPU helpers at module level: ``megatron.training``
must not be imported before :func:`pretrain` has set the patched tree up.
"""

from __future__ import annotations

import atexit
import gc
import os
import pathlib
import sys
from typing import Callable, NoReturn, Optional, Sequence, Tuple

from megatron_dynbatch.cpu.core_shim import quiet_missing_gpu_library_warnings
from megatron_dynbatch.integrations.megatron_lm.patched_tree import (
    PatchError,
    use_patched_training,
)

__all__ = ["SHIPPED", "end_process", "patch_files", "prepare_megatron", "pretrain", "run_program"]

#: Where a wheel holds ``patches/*.patch`` and ``launch/{apply_patches,patch_series}.sh``
#: (setup.py's build step copies them; a checkout has no such folder and uses its own files).
SHIPPED = pathlib.Path(__file__).resolve().parent / "shipped"


def patch_files() -> Tuple[pathlib.Path, pathlib.Path]:
    """``(patches directory, apply_patches.sh)``: the wheel's copies, else the checkout's."""
    checkout = pathlib.Path(__file__).resolve().parents[3]
    for root in (SHIPPED, checkout):
        script = root / "launch" / "apply_patches.sh"
        if script.is_file() and any((root / "patches").glob("*.patch")):
            return root / "patches", script
    raise PatchError(
        f"megatron_dynbatch's Megatron-LM patches are missing: neither {SHIPPED} (an installed "
        f"wheel) nor {checkout}/patches (a checkout) holds them; reinstall the package from a "
        "wheel built with `pip wheel .` in the repository."
    )


def prepare_megatron() -> None:
    """Make ``import megatron.training`` load the patched tree; without CUDA, the CPU support.

    Idempotent; must run before anything imports ``megatron.training``.
    """
    # Before megatron.core is first imported: its notices that transformer-engine and apex are
    # missing are issued at import time (ten a rank on CPU; with CUDA they stay).
    quiet_missing_gpu_library_warnings()
    use_patched_training(*patch_files())

    from megatron_dynbatch.cpu.training_shim import (
        apply_training_cpu_shim,
        skip_helper_compilation_if_prebuilt,
    )

    apply_training_cpu_shim()  # a no-op where CUDA exists
    skip_helper_compilation_if_prebuilt()  # the megatron-core wheel ships the helpers


def pretrain(argv: Optional[Sequence[str]] = None) -> None:
    """:func:`prepare_megatron`, then the entry's ``main(argv)`` (Megatron-LM's ``pretrain()``).

    Args:
        argv: Megatron-LM's GPT arguments plus ours; default ``sys.argv[1:]``.
    """
    prepare_megatron()
    from megatron_dynbatch.integrations.megatron_lm.pretrain_gpt import main

    main(None if argv is None else list(argv))


def run_program(body: Optional[Callable[[], None]] = None) -> NoReturn:
    """Run ``body`` (default: :func:`pretrain` of ``sys.argv``), then :func:`end_process`.

    For a program's last line: the launch script run as a program, ``python -m megatron_dynbatch
    pretrain``, and a script of your own (``run_program(partial(main, datasets_provider=...))``).
    A script that calls ``main()`` itself keeps Python's own exit. A traceback (an unexpected
    exception) is left to Python and torchrun, as without us.
    """
    code = 0
    try:
        (body or pretrain)()
    except SystemExit as stop:  # argparse, fail(), Megatron's --exit-interval / --exit-duration
        if stop.code is not None and not isinstance(stop.code, int):
            raise  # a message to print: Python's own exit prints it
        code = stop.code or 0
    # Out of the handler: its traceback held pretrain()'s frames, and with them the data loaders'
    # iterators and their worker processes. Those workers inherited Megatron's SIGTERM handler
    # (--exit-signal-handler), so multiprocessing's atexit hook could not stop them and waited
    # forever; released (and collected), each iterator shuts its own workers down first.
    end_process(code)


def end_process(code: int) -> NoReturn:
    """Exit now: the ``atexit`` handlers and a flush, without the interpreter's module teardown.

    Why: a rank that imported ``megatron.training`` holds about 3,400 modules (torch's compiler
    stack among them, imported by Megatron's fused kernels). Tearing them down after the run took
    6-8 s a launch on a loaded 2-core machine with two ranks (1.3 s alone in one process): the time
    between a run's last line and torchrun's exit, paid by every run and every refused start-up.
    Everything a run writes is closed first (process groups by ``main()``; here the
    ``atexit`` handlers, Megatron's TensorBoard writer, stdout and stderr), so nothing is lost.
    """
    gc.collect()  # iterators in reference cycles too (see run_program)
    atexit._run_exitfuncs()
    writers = sys.modules.get("megatron.training.global_vars")
    writer = getattr(writers, "_GLOBAL_TENSORBOARD_WRITER", None)
    if writer is not None:
        writer.close()  # flushes the events file
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to save
            pass
    os._exit(code)
