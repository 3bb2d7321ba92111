"""A checkpoint resumed in another data mode or order of the launch script: refused, by name.

The launch script reads its data in two units. Stock Megatron (neither flag) cuts ``--seq-length``
windows from the concatenated documents; ``--document-samples`` and ``--use-dynamic-batch-size``
read one sample per document, the same samples in the same order (so either resumes the other
exactly). A checkpoint's ``consumed_train_samples`` counts its own mode's units: resumed in the
other mode, the data would restart at the same count of the other unit, and samples would be
skipped or trained twice, with nothing said. Megatron checks a resumed checkpoint's arguments in
``checkpointing.check_checkpoint_args`` (not under ``--finetune``, which starts the data, the
iteration and the schedule at 0); :func:`refuse_resume_in_another_mode` wraps it to check the
data mode first, on every rank (each loads the same arguments), then, in the document unit, that
the arguments which draw its order are the saved ones (:func:`check_resumed_order`).
"""

from __future__ import annotations

import os
from typing import Any

from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "check_resumed_mode",
    "check_resumed_order",
    "data_mode",
    "refuse_resume_in_another_mode",
]

_MODES = {
    "documents": "one sample per document (--use-dynamic-batch-size or --document-samples)",
    "windows": "Megatron's stock --seq-length windows (neither --use-dynamic-batch-size nor "
    "--document-samples)",
}


def data_mode(args: Any) -> str:
    """``documents`` or ``windows``: the unit ``consumed_train_samples`` counts in a run of
    ``args`` (a checkpoint's saved arguments too; one saved by another launcher has neither flag:
    windows)."""
    if getattr(args, "use_dynamic_batch_size", False) or getattr(args, "document_samples", False):
        return "documents"
    return "windows"


#: What fixes which document is sample k of the one-sample-per-document order: its seed, the split,
#: the length documents are cut at, the data and how a blend draws (a probe: resumed with another
#: --seed, --split or --seq-length, 9 to 17 of the epoch's next samples had been trained already).
_ORDER = (
    ("seed", "--seed"),
    ("split", "--split"),
    ("seq_length", "--seq-length"),
    ("data_path", "--data-path"),
    ("train_data_path", "--train-data-path"),
    ("valid_data_path", "--valid-data-path"),
    ("test_data_path", "--test-data-path"),
    ("data_args_path", "--data-args-path"),
    ("per_split_data_args_path", "--per-split-data-args-path"),
    ("mock_data", "--mock-data"),
    ("blend_weights", "--blend-weights"),
    ("sft", "--sft"),
)


def _same(name: str, value: Any) -> Any:
    """What of ``value`` draws the order: a data path's file name, not its directory (a
    checkpoint resumed where the same files sit elsewhere is the same data)."""
    if name.endswith("_path") and isinstance(value, (list, tuple)):
        return [os.path.basename(str(v)) for v in value]
    if name.endswith("_path") and isinstance(value, str):
        return os.path.basename(value)
    return value


def _shown(value: Any) -> str:
    """A saved argument as it is typed (a list of paths space-separated; booleans as given)."""
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def check_resumed_order(checkpoint_args: Any, args: Any) -> None:
    """Refuse to resume a one-sample-per-document run whose sample order this run would change.

    ``consumed_train_samples`` is a position in the order the checkpoint's arguments drew; with
    another seed, split, document length or data the same position names other documents.

    Raises:
        DynBatchValueError: naming each argument that differs, its saved value and this run's,
            with the fixes (the saved values, or ``--finetune``).
    """
    consumed = getattr(checkpoint_args, "consumed_train_samples", 0) or 0
    if not consumed or data_mode(checkpoint_args) != "documents" or data_mode(args) != "documents":
        return
    missing = object()
    changed = [
        (flag, saved, now)
        for name, flag in _ORDER
        for saved, now in [(getattr(checkpoint_args, name, missing), getattr(args, name, missing))]
        if saved is not missing and now is not missing and _same(name, saved) != _same(name, now)
    ]
    if not changed:
        return
    shown = ", ".join(
        f"{flag} {_shown(saved)!r} (now {_shown(now)!r})" for flag, saved, now in changed
    )
    restore = ", ".join(
        (
            flag
            if saved is True
            else f"without {flag}" if saved in (None, False) else f"{flag} " f"{_shown(saved)}"
        )
        for flag, saved, _ in changed
    )
    raise DynBatchValueError(
        f"--load {getattr(args, 'load', None)} holds a run that had read {consumed} samples of "
        f"the order its arguments drew, and this run draws another: {shown}. Resumed, the data "
        "would go on at the same position of the new order (samples trained twice, others "
        "skipped). Resume with the saved values"
        + (f" ({restore})" if restore else "")
        + ", or add --finetune to load its weights alone and start the data, the iteration and "
        "the learning-rate schedule at 0."
    )


def check_resumed_mode(checkpoint_args: Any, args: Any) -> None:
    """Refuse to resume ``checkpoint_args``'s data position in another unit than it counts.

    Raises:
        DynBatchValueError: naming the checkpoint's mode and this run's, with the two fixes
            (resume in the saved mode, or ``--finetune`` to load the weights alone).
    """
    saved, now = data_mode(checkpoint_args), data_mode(args)
    consumed = getattr(checkpoint_args, "consumed_train_samples", 0) or 0
    if saved == now or not consumed:
        return
    switch = (
        "drop --use-dynamic-batch-size / --document-samples"
        if now == "documents"
        else "add --document-samples (or --use-dynamic-batch-size with its budget)"
    )
    raise DynBatchValueError(
        f"--load {getattr(args, 'load', None)} holds a run that read {_MODES[saved]}: its "
        f"{consumed} consumed samples count those, but this run reads {_MODES[now]}, so resumed "
        f"it would start at sample {consumed} of another order (samples skipped or trained "
        f"twice). Resume in the mode it was saved in ({switch}), or add --finetune to load its "
        "weights alone and start the data, the iteration and the learning-rate schedule at 0."
    )


def refuse_resume_in_another_mode(checkpointing: Any, args: Any, *, order: bool = True) -> None:
    """Wrap ``checkpointing.check_checkpoint_args`` (Megatron's ``megatron.training.checkpointing``)
    once, so that a resumed checkpoint is checked by :func:`check_resumed_mode` against ``args``
    before Megatron's own checks, and by :func:`check_resumed_order` where ``order`` (the launch
    script reads the documents; a provider of the user's own draws its own order)."""
    original = checkpointing.check_checkpoint_args
    if getattr(original, "_dynbatch_checks_mode", False):
        return

    def check_checkpoint_args(checkpoint_args: Any, *rest: Any, **kwargs: Any) -> Any:
        check_resumed_mode(checkpoint_args, args)
        if order:
            check_resumed_order(checkpoint_args, args)
        return original(checkpoint_args, *rest, **kwargs)

    check_checkpoint_args._dynbatch_checks_mode = True  # type: ignore[attr-defined]
    checkpointing.check_checkpoint_args = check_checkpoint_args
