"""What the Megatron-LM entry prints for the user at start-up: notes once, errors never lost.

:func:`print_rank_0` prints a note once per launch, on global rank 0, also before
``torch.distributed`` is initialized (Megatron's ``print_rank_0`` prints on every rank then, so
start-up notes such as a blend's drawn shares appeared once per rank).

Bad input stops the run through :func:`fail`. Every rank that fails calls :func:`fail`. Under torchrun the first rank to exit makes the launcher
send SIGTERM to the others, so an error printed by one chosen rank (rank 0, say) can vanish when
another rank exits first (issue 29). Instead, every failing rank:

1. ignores SIGTERM while it reports, so the launcher cannot cut the line short;
2. prints ``PROG: error: [rank R] MESSAGE`` unless a rank of the same launch already printed the
   same message: the ranks of one torchrun launch on one node share the launcher's attempt
   directory (the parent of ``$TORCHELASTIC_ERROR_FILE``'s folder), and the first rank to create
   a file named by the message's hash there prints it, so an error every rank has is printed once
   per node by whichever rank gets there first;
3. writes the message into its ``$TORCHELASTIC_ERROR_FILE``, so torchrun's closing report (its
   "Root Cause (first observed failure)") shows the same line instead of "To enable traceback
   see ...";
4. exits with the given status (torchrun then exits 1 and lists each rank's status; a rank whose
   process groups are open takes SIGTERM again first, so the launcher can end a stuck teardown).

Without torchrun (one process, or another launcher) the line is printed by every failing rank,
rank-prefixed when ``WORLD_SIZE`` is more than 1: a repeated line rather than a lost one.

:func:`error_text` turns an exception into that one line, including Megatron's bare ``assert``
statements, whose message is empty: the assert's own source is quoted with the flags it names.
"""

from __future__ import annotations

import hashlib
import json
import linecache
import os
import re
import signal
import sys
import time
import traceback
from typing import Any, NoReturn, Optional

__all__ = ["error_text", "fail", "model_config_error", "print_rank_0", "world_size"]

#: Name prefix of the files that mark a message as printed in torchrun's attempt directory.
_CLAIM_PREFIX = "megatron_dynbatch_error_"


def _program() -> str:
    return os.path.basename(sys.argv[0]) or "pretrain_gpt_dynbatch.py"


def _process_value(getter: str, variable: str, default: int) -> int:
    """torch.distributed's ``getter()`` once initialized (torch is not imported for it), else the
    launcher's environment ``variable``."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return getattr(dist, getter)()
    return int(os.environ.get(variable, str(default)))


def _rank() -> int:
    """This process's global rank, before or after process groups exist."""
    return _process_value("get_rank", "RANK", 0)


def world_size() -> int:
    """The number of processes of the launch, before or after process groups exist."""
    return _process_value("get_world_size", "WORLD_SIZE", 1)


def print_rank_0(message: str) -> None:
    """Print ``message`` on global rank 0 only, before or after process groups exist."""
    if _rank() == 0:
        print(message, flush=True)


#: Arguments Megatron derives rather than parses: the flags that set them (a probe: a quoted
#: check named ``--data-parallel-size``, which no parser takes, and not ``--micro-batch-size``,
#: which ``eval_micro_batch_size`` defaults to).
_DERIVED = {
    "data_parallel_size": (
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
        "torchrun's --nproc-per-node",
    ),
    "eval_micro_batch_size": ("--eval-micro-batch-size", "--micro-batch-size"),
    "eval_global_batch_size": ("--eval-global-batch-size", "--global-batch-size"),
    "world_size": ("torchrun's --nproc-per-node",),
}


def _parsed_flags() -> Optional[frozenset]:
    """Every option string of Megatron's parser (the checks quoted are Megatron's, on its own
    arguments), or ``None`` where it cannot be built here."""
    try:
        import argparse

        from megatron.training.arguments import add_megatron_arguments

        parser = argparse.ArgumentParser(add_help=False)
        add_megatron_arguments(parser)
        return frozenset(parser._option_string_actions)
    except Exception:  # an error path: never let naming the flags raise another error
        return None


def _flags_named(source: str) -> list:
    """``--save-interval`` for every ``args.save_interval`` an assert reads: the flags that set
    it where Megatron derives it, and only options its parser takes."""
    return _flags_of(re.findall(r"\bargs\.([A-Za-z_][A-Za-z0-9_]*)", source), _DERIVED)


def _flags_of(names: list, other: dict) -> list:
    """The flags that set ``names`` (``--`` and the name, or ``other``'s where a flag of another
    name sets it), once each, and only options Megatron's parser takes."""
    flags: list = []
    for name in dict.fromkeys(names):
        flags += other.get(name, ("--" + name.replace("_", "-"),))
    known = _parsed_flags()
    return [
        flag
        for flag in dict.fromkeys(flags)
        if known is None or not flag.startswith("--") or flag in known
    ]


#: TransformerConfig fields a flag of another name sets (the others: ``--`` and the name).
_CONFIG_FIELDS = {
    "num_layers_in_first_pipeline_stage": ("--decoder-first-pipeline-num-layers",),
    "num_layers_in_last_pipeline_stage": ("--decoder-last-pipeline-num-layers",),
    "num_moe_experts": ("--num-experts",),
    "virtual_pipeline_model_parallel_size": (
        "--num-virtual-stages-per-pipeline-rank",
        "--num-layers-per-virtual-pipeline-stage",
    ),
}


def model_config_error(error: BaseException) -> str:
    """One line for a refusal of Megatron's model config (``TransformerConfig.__post_init__``,
    about a hundred ``ValueError`` checks that name config fields, raised when the launch builds
    the config after the arguments passed): its text, and the flags of the fields it names (a
    probe: a traceback on every rank, and an empty TensorBoard file)."""
    text = error_text(error)
    flags = _flags_of(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", text), _CONFIG_FIELDS)
    hint = f"; check {', '.join(flags)}" if flags else ""
    return f"Megatron's model config refused these arguments: {text}{hint}"


def _assert_source(error: BaseException) -> Optional[str]:
    """The statement of the innermost frame that raised ``error`` (all its lines), or None."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None
    frame = frames[-1]
    last = getattr(frame, "end_lineno", None) or frame.lineno
    lines = [linecache.getline(frame.filename, n).strip() for n in range(frame.lineno, last + 1)]
    source = " ".join(line.rstrip("\\").strip() for line in lines if line) or (frame.line or "")
    if not source:
        return None
    parts = frame.filename.replace(os.sep, "/").split("/")
    where = "/".join(parts[-3:]) if "megatron" in parts else os.path.basename(frame.filename)
    return f"`{source}` ({where}, line {frame.lineno})"


#: torch's DataLoader re-raises a worker's error with the worker's whole traceback as its message.
_WORKER = re.compile(r"Caught \w+ in DataLoader worker process \d+\.\s*Original Traceback")


def _worker_message(text: str) -> str:
    """A DataLoader worker's error as the worker raised it: its message without the traceback
    torch puts before it (a probe: about 2,000 characters of frames on the one line)."""
    if not _WORKER.search(text):
        return text
    lines = text.split("Original Traceback (most recent call last):", 1)[1].splitlines()
    # The frames are indented; the error is the first line after them that is not.
    tail = [i for i, line in enumerate(lines) if line.strip() and not line.startswith(" ")]
    if not tail:
        return text
    message = "\n".join(lines[tail[0] :])
    return re.sub(r"^[\w.]+: ", "", message, count=1)


def error_text(error: Any) -> str:
    """One line of text for ``error``: its message, or for a bare ``assert`` the assert itself.

    Megatron's argument validation has asserts without a message (``assert args.save_interval is
    not None`` after ``--save``); their text is empty, so the statement is quoted instead, with
    the command-line flags it reads.
    """
    text = " ".join(_worker_message(str(error)).split())
    if text and isinstance(error, AssertionError) and "--" not in text:
        # Megatron's messages that name no flag ("expected iteration-based training", for
        # --train-iters with --train-samples): the check is quoted with the flags it reads.
        source = _assert_source(error)
        flags = _flags_named(source) if source and "megatron/" in source else []
        if flags:
            return f"{text} (Megatron's check {source} failed; check {', '.join(flags)})"
    if text or not isinstance(error, BaseException):
        return text
    source = _assert_source(error)
    if source is None:
        return f"{type(error).__name__} without a message (see the code that raised it)"
    flags = _flags_named(source)
    hint = f"; check {', '.join(flags)}" if flags else ""
    return f"Megatron's check {source} failed{hint}"


def _attempt_dir() -> Optional[str]:
    """torchrun's per-launch, per-node directory the local ranks share, or None."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not error_file or error_file == os.devnull:
        return None
    directory = os.path.dirname(os.path.dirname(os.path.abspath(error_file)))
    return directory if os.path.isdir(directory) else None


def _first_to_claim(text: str) -> bool:
    """Whether this rank is the first of its launch (on this node) to report ``text``."""
    directory = _attempt_dir()
    if directory is None:
        return True
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    try:
        handle = os.open(os.path.join(directory, _CLAIM_PREFIX + digest), os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    except OSError:
        return True  # no shared directory after all: print (a repeat beats a lost line)
    os.close(handle)
    return True


def _write_error_file(line: str) -> None:
    """Hand the line to torchrun's report (its error-file format: a message and a timestamp)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path or path == os.devnull:
        return
    payload = {"message": {"message": line, "extraInfo": {"py_callstack": line}}}
    payload["message"]["extraInfo"]["timestamp"] = str(int(time.time()))
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(payload, handle)
    except OSError:
        pass  # the report then says "To enable traceback see ..."; the printed line stays


def fail(message: Any, *, code: int = 2) -> NoReturn:
    """Stop this rank with one line naming the bad input, and no traceback (see the module).

    Args:
        message: The error, an exception or text (printed on one line, see :func:`error_text`).
        code: The exit status (2 for bad arguments or data at start-up, as argparse; 1 for bad
            input met while training).
    """
    try:
        # The launcher's SIGTERM (another rank exited first) must not cut the report short.
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    text = error_text(message)
    where = f"[rank {_rank()}] " if world_size() > 1 else ""
    line = f"{_program()}: error: {where}{text}"
    if _first_to_claim(text):
        print(line, file=sys.stderr, flush=True)
    _write_error_file(line)
    dist = sys.modules.get("torch.distributed")
    if previous is not None and dist is not None and dist.is_initialized():
        # With process groups open, leave the launcher its way to end a teardown that hangs.
        # Before them (start-up errors) the exit is immediate, and the status stays ``code``.
        signal.signal(signal.SIGTERM, previous)
    raise SystemExit(code)
