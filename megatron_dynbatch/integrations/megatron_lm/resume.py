"""A checkpoint resumed in another data mode of the launch script: refused, by name.

The launch script reads its data in two units. Stock Megatron (neither flag) cuts ``--seq-length``
windows from the concatenated documents; ``--document-samples`` and ``--use-dynamic-batch-size``
read one sample per document, the same samples in the same order (so either resumes the other
exactly). A checkpoint's ``consumed_train_samples`` counts its own mode's units: resumed in the
other mode, the data would restart at the same count of the other unit, and samples would be
skipped or trained twice, with nothing said. Megatron checks a resumed checkpoint's arguments in
``checkpointing.check_checkpoint_args`` (not under ``--finetune``, which starts the data, the
iteration and the schedule at 0); :func:`refuse_resume_in_another_mode` wraps it to check the
data mode first, on every rank (each loads the same arguments).
"""

from __future__ import annotations

from typing import Any

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["check_resumed_mode", "data_mode", "refuse_resume_in_another_mode"]

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


def refuse_resume_in_another_mode(checkpointing: Any, args: Any) -> None:
    """Wrap ``checkpointing.check_checkpoint_args`` (Megatron's ``megatron.training.checkpointing``)
    once, so that a resumed checkpoint is checked by :func:`check_resumed_mode` against ``args``
    before Megatron's own checks."""
    original = checkpointing.check_checkpoint_args
    if getattr(original, "_dynbatch_checks_mode", False):
        return

    def check_checkpoint_args(checkpoint_args: Any, *rest: Any, **kwargs: Any) -> Any:
        check_resumed_mode(checkpoint_args, args)
        return original(checkpoint_args, *rest, **kwargs)

    check_checkpoint_args._dynbatch_checks_mode = True  # type: ignore[attr-defined]
    checkpointing.check_checkpoint_args = check_checkpoint_args
