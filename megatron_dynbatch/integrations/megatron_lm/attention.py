"""Which core attention a Megatron-LM launch runs: ``--dynamic-batch-attention`` resolved.

One option, in every mode of the launch script (stock, document samples, dynamic batching):

* ``transformer-engine``: Megatron's transformer-engine spec as it is
  (``--transformer-impl transformer_engine``; TE must import);
* ``torch-varlen``: the local spec with :class:`~megatron_dynbatch.mcore.varlen_attention.
  TorchVarlenAttention` (torch's flash kernels: ``varlen_attn`` on packed THD rows, SDPA's flash
  backend on the others); CUDA, bf16 / fp16, torch >= 2.10, ``--transformer-impl local``;
* ``reference``: the local spec with :class:`~megatron_dynbatch.mcore.thd_attention.
  ThdReferenceAttention` (dense torch, any device, ``--transformer-impl local``);
* ``auto`` (default): transformer-engine with ``--transformer-impl transformer_engine``; else
  torch-varlen where it can run (CUDA, bf16 / fp16); else (CPU, fp32) Megatron's own local
  attention where it can run the rows (``local``: today's CPU path, block-diagonal masks for
  document samples) and the reference where the rows are THD (Megatron's stock path with
  ``--dataloader-inter-document-masking`` or ``--sft``, which the local attention refuses).

A choice that cannot run here is refused at start-up in one line naming the option
(:func:`check_attention`). Imports torch only inside the functions that look at the machine.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from megatron_dynbatch.config import ATTENTION_CHOICES, FLAGS
from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "THD_ATTENTIONS",
    "attention_of_args",
    "check_attention",
    "cuda_available",
    "lenient_attention",
    "requested_attention",
    "resolve_attention",
    "stock_rows_are_thd",
]

FLAG = FLAGS["attention"]
#: The retired flag, kept as an alias of ``--dynamic-batch-attention reference``.
LEGACY_FLAG = "--dynamic-batch-reference-thd-attention"
#: Resolved attentions that take THD ``PackedSeqParams`` (the forward step passes them).
THD_ATTENTIONS = ("transformer-engine", "torch-varlen", "reference")


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (a function, so tests can stand in another machine)."""
    import torch

    return torch.cuda.is_available()


def varlen_importable() -> bool:
    from megatron_dynbatch.mcore.varlen_attention import varlen_available

    return varlen_available()


@functools.lru_cache(maxsize=1)
def te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means it cannot run here
        return False
    return True


def _impl(args: Any) -> str:
    return str(getattr(args, "transformer_impl", None) or "transformer_engine").lower()


def _half(args: Any) -> bool:
    return bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))


def requested_attention(args: Any, yaml_value: Optional[str] = None) -> str:
    """The attention asked for: the flag, else the retired flag (``reference``), else the YAML's
    ``attention`` (``yaml_value``), else ``auto``.

    Raises:
        DynBatchValueError: The retired flag beside a different ``--dynamic-batch-attention``.
    """
    given = getattr(args, "dynamic_batch_attention", None)
    legacy = bool(getattr(args, "dynamic_batch_reference_thd_attention", False))
    if legacy and given not in (None, "reference"):
        raise DynBatchValueError(
            f"{LEGACY_FLAG} (retired: {FLAG} reference) contradicts {FLAG} {given}; drop "
            f"{LEGACY_FLAG}."
        )
    if given is not None:
        return given
    if legacy:
        return "reference"
    return yaml_value or "auto"


def stock_rows_are_thd(args: Any, document_samples: bool) -> bool:
    """Whether Megatron's stock data path hands the model THD rows (``cu_seqlens``)."""
    if document_samples:
        return False
    return bool(
        getattr(args, "dataloader_inter_document_masking", False) or getattr(args, "sft", False)
    )


def resolve_attention(
    requested: str,
    transformer_impl: Optional[str],
    *,
    cuda: bool,
    half: bool,
    varlen: bool,
    thd_rows: bool,
) -> str:
    """The attention that runs: a name of :data:`ATTENTION_CHOICES` but ``auto``, or ``local``
    (Megatron's own local attention, nothing replaced). Never raises: :func:`check_attention`
    refuses what cannot run."""
    if requested != "auto":
        return requested
    if str(transformer_impl or "transformer_engine").lower() == "transformer_engine":
        return "transformer-engine"
    if cuda and half and varlen:
        return "torch-varlen"
    return "reference" if thd_rows else "local"


def check_attention(
    requested: str,
    resolved: str,
    transformer_impl: Optional[str],
    *,
    cuda: bool,
    half: bool,
    varlen: bool,
    te: bool,
) -> None:
    """Refuse, in one line naming the option, an attention that cannot run here.

    Raises:
        DynBatchValueError: e.g. torch-varlen without CUDA, or beside
            ``--transformer-impl transformer_engine``.
    """
    if requested not in ATTENTION_CHOICES:
        raise DynBatchValueError(f"{FLAG} {requested}: pick one of {', '.join(ATTENTION_CHOICES)}.")
    impl = str(transformer_impl or "transformer_engine").lower()
    asked = f"{FLAG} {requested}" + (f" (resolved to {resolved})" if requested == "auto" else "")
    if resolved == "transformer-engine":
        # Where transformer_engine does not import, say so first: a probe was told to pass
        # --transformer-impl transformer_engine, then told to take it back.
        if not te:
            local = "" if impl == "local" else " with --transformer-impl local"
            raise DynBatchValueError(
                f"{asked}: transformer_engine does not import on this machine; pass {FLAG} auto"
                f"{local} (torch-varlen on CUDA, Megatron's local attention on CPU), or {FLAG} "
                f"reference{local}."
            )
        if impl != "transformer_engine":
            raise DynBatchValueError(
                f"{asked} runs Megatron's transformer-engine spec, but --transformer-impl is "
                f"{impl}; pass --transformer-impl transformer_engine, or {FLAG} torch-varlen / "
                "reference with the local implementation."
            )
        return
    if resolved in ("torch-varlen", "reference") and impl != "local":
        other = f", or {FLAG} transformer-engine" if te else ""
        raise DynBatchValueError(
            f"{asked} replaces the core attention of Megatron's local implementation, but "
            f"--transformer-impl is {impl}; pass --transformer-impl local{other}."
        )
    if resolved == "torch-varlen":
        if not cuda:
            raise DynBatchValueError(
                f"{asked} runs torch's flash kernels, which need CUDA, and this machine has "
                f"none; use {FLAG} reference (or auto)."
            )
        if not varlen:
            import torch

            raise DynBatchValueError(
                f"{asked} needs torch.nn.attention.varlen (torch >= 2.10), which torch "
                f"{torch.__version__} lacks; upgrade torch or use {FLAG} reference."
            )
        if not half:
            raise DynBatchValueError(
                f"{asked}: torch's flash kernels take bf16 / fp16 only, and this run is fp32; "
                f"pass --bf16, or use {FLAG} reference for fp32."
            )


def attention_of_args(
    args: Any, *, document_samples: bool, yaml_value: Optional[str] = None
) -> str:
    """The checked attention of a launch (see the module docstring).

    Args:
        args: Megatron's arguments.
        document_samples: Whether the launch trains on document samples (``--document-samples``
            or ``--use-dynamic-batch-size``) rather than Megatron's stock data path.
        yaml_value: ``attention`` of the ``--dynamic-batch-config`` YAML, if any.

    Raises:
        DynBatchValueError: What :func:`check_attention` refuses.
    """
    requested = requested_attention(args, yaml_value)
    cuda, half = cuda_available(), _half(args)
    varlen = cuda and varlen_importable()
    resolved = resolve_attention(
        requested,
        _impl(args),
        cuda=cuda,
        half=half,
        varlen=varlen,
        thd_rows=stock_rows_are_thd(args, document_samples),
    )
    check_attention(
        requested,
        resolved,
        _impl(args),
        cuda=cuda,
        half=half,
        varlen=varlen,
        te=resolved != "transformer-engine" or te_importable(),
    )
    return resolved


def lenient_attention(args: Any, requested: str) -> str:
    """The attention :func:`attention_of_args` resolves to, without its checks (the cost model's
    attention kind is read before the launch checks run; they refuse what cannot run)."""
    cuda = cuda_available()
    return resolve_attention(
        requested,
        _impl(args),
        cuda=cuda,
        half=_half(args),
        varlen=cuda and varlen_importable(),
        thd_rows=False,
    )
