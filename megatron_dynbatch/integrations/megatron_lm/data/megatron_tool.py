"""Run Megatron-LM's own ``tools/preprocess_data.py`` in this project's environment.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python launch/megatron_preprocess.py \\
        --input corpus.jsonl --output-prefix data/corpus --append-eod --workers 2 \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model

The tool is not part of the megatron-core wheel: it comes from a Megatron-LM checkout (0.19,
``core_r0.19.0``), given by ``--megatron-lm-dir DIR`` or ``$MEGATRON_LM_DIR``. Run as is, it stops
in this environment before reading a line: ``megatron.core`` imports triton (not installed on
CPU machines) and ``megatron.training.arguments`` imports ``typing.override`` (Python 3.12).
:func:`run_preprocess_data` provides both (the project's triton stand-in and
``typing_extensions.override``) and then runs the tool unmodified, in this process, with every
other argument passed to it. Its worker pool forks, so the workers inherit both.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys
import warnings
from typing import Optional, Sequence

from megatron_dynbatch.errors import DynBatchError

__all__ = [
    "MEGATRON_LM_DIR_ENV",
    "MegatronToolError",
    "find_preprocess_tool",
    "main",
    "prepare_megatron_imports",
    "run_preprocess_data",
]

#: Environment variable naming a Megatron-LM checkout (its ``tools/`` directory is used).
MEGATRON_LM_DIR_ENV = "MEGATRON_LM_DIR"
_TOOL = pathlib.Path("tools") / "preprocess_data.py"


class MegatronToolError(DynBatchError, ValueError):
    """Megatron-LM's ``tools/preprocess_data.py`` cannot be found."""


def find_preprocess_tool(megatron_lm_dir: Optional[str] = None) -> pathlib.Path:
    """``tools/preprocess_data.py`` of ``megatron_lm_dir``, else of ``$MEGATRON_LM_DIR``.

    Raises:
        MegatronToolError: When neither is given, or the directory has no such file.
    """
    root = megatron_lm_dir or os.environ.get(MEGATRON_LM_DIR_ENV)
    if not root:
        raise MegatronToolError(
            "Megatron-LM's tools/preprocess_data.py is not in the megatron-core wheel; pass "
            f"--megatron-lm-dir DIR or set {MEGATRON_LM_DIR_ENV} to a Megatron-LM 0.19 checkout "
            "(git clone -b core_r0.19.0 https://github.com/NVIDIA/Megatron-LM)."
        )
    tool = pathlib.Path(root) / _TOOL
    if not tool.is_file():
        raise MegatronToolError(
            f"{tool} does not exist; {MEGATRON_LM_DIR_ENV} / --megatron-lm-dir must name the root "
            "of a Megatron-LM checkout (the directory holding tools/ and megatron/)."
        )
    return tool


def prepare_megatron_imports() -> None:
    """Let ``megatron.core`` and ``megatron.training`` import here; idempotent.

    Registers the triton stand-in when triton is missing and provides ``typing.override`` on
    Python 3.11; nothing else of the CPU support is applied (preprocessing needs no device).
    """
    from megatron_dynbatch.cpu.core_shim import register_triton_stand_in
    from megatron_dynbatch.cpu.training_shim import provide_typing_override

    register_triton_stand_in()
    provide_typing_override()


def run_preprocess_data(argv: Sequence[str], megatron_lm_dir: Optional[str] = None) -> None:
    """Run ``tools/preprocess_data.py`` with ``argv`` as its command line, in this process.

    The tool reads ``sys.argv`` and may call ``exit``; both behave as when it is run directly
    (``sys.argv`` is restored afterwards).
    """
    tool = find_preprocess_tool(megatron_lm_dir)
    prepare_megatron_imports()
    saved_argv = sys.argv
    sys.argv = [str(tool), *argv]
    try:
        with warnings.catch_warnings():
            # The tool imports megatron.training.arguments, which imports Megatron's model and
            # optimizer modules; they warn that apex / Transformer Engine are missing (unused here).
            warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
            # run_name "__main__" runs the tool's main block, and runpy installs the tool's
            # namespace as sys.modules["__main__"] meanwhile, so its worker pool can pickle its
            # Encoder.
            runpy.run_path(str(tool), run_name="__main__")
    finally:
        sys.argv = saved_argv


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``[--megatron-lm-dir DIR] <tools/preprocess_data.py arguments>``."""
    args = list(sys.argv[1:] if argv is None else argv)
    megatron_lm_dir = None
    # Only a leading --megatron-lm-dir is ours: everything else, --help included, is the tool's.
    if args and args[0] == "--megatron-lm-dir":
        if len(args) < 2:
            sys.exit("error: --megatron-lm-dir needs a directory")
        megatron_lm_dir, args = args[1], args[2:]
    elif args and args[0].startswith("--megatron-lm-dir="):
        megatron_lm_dir, args = args[0].split("=", 1)[1], args[1:]
    try:
        run_preprocess_data(args, megatron_lm_dir)
    except MegatronToolError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
