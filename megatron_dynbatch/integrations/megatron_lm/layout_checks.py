"""Megatron-LM's layout and launch checks that users meet first, made one line with flags and a fix.

Megatron 0.19's ``validate_args`` asserts these with its own wording ("number of layers per pipeline
stage must be divisible number of layers per virtual pipeline stage", "world size (1) is not
divisible by total_model_size (2)"), naming no flag and no fix (issue 44). The patched
``parse_and_validate_args`` runs :func:`check_model_layout` and :func:`check_world_size` (through
``hooks.configure``) right before Megatron's own checks, with dynamic batching on or off: they
refuse exactly what Megatron would refuse, in one line naming the flags and a value that works.
Cases Megatron words differently (``--hybrid-layer-pattern``, ``--pipeline-model-parallel-layout``,
uneven first / last stages) are left to Megatron.

Imports only the standard library: testable without megatron.
"""

from __future__ import annotations

import os
import sys
from typing import Any, List, Optional

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["check_model_layout", "check_world_size", "torchrun_command"]


def _size(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    return 1 if value is None else int(value)


def _nearest_multiples(value: int, step: int) -> List[int]:
    """The multiples of ``step`` just below (when > 0) and above ``value``."""
    lower, upper = (value // step) * step, (value // step + 1) * step
    return [m for m in (lower, upper) if m > 0]


def _either(values: List[int], flag: str) -> str:
    return " or ".join(f"{flag} {v}" for v in values)


def check_model_layout(args: Any) -> None:
    """Layer counts against the pipeline (and virtual pipeline) sizes, and ``--seq-length``
    against ``--max-position-embeddings``, as Megatron's ``validate_args`` asserts them.

    Raises:
        DynBatchValueError: Naming the flags, their values and values that pass.
    """
    _check_layers(args)
    _check_positions(args)


def _check_layers(args: Any) -> None:
    if any(
        getattr(args, name, None) is not None
        for name in (
            "hybrid_layer_pattern",
            "pipeline_model_parallel_layout",
            "num_virtual_stages_per_pipeline_rank",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
        )
    ):
        return
    layers = getattr(args, "num_layers", None)
    pp = _size(args, "pipeline_model_parallel_size")
    if layers is None or pp < 1:
        return
    extra = [
        flag
        for name, flag in (
            (
                "account_for_embedding_in_pipeline_split",
                "--account-for-embedding-in-pipeline-split",
            ),
            ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
        )
        if getattr(args, name, False)
    ]
    counted = layers + len(extra)
    counted_note = f" (+{len(extra)} for {', '.join(extra)})" if extra else ""
    if counted % pp:
        fix = _either([m - len(extra) for m in _nearest_multiples(counted, pp)], "--num-layers")
        raise DynBatchValueError(
            f"--num-layers {layers}{counted_note} is not a multiple of "
            f"--pipeline-model-parallel-size {pp}: Megatron gives every pipeline stage the same "
            f"number of layers; use {fix}, or a --pipeline-model-parallel-size that divides "
            f"{counted}."
        )
    per_vp = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_vp is None:
        return
    per_stage = counted // pp
    if per_vp < 1 or per_stage % per_vp:
        divisors = [d for d in range(1, per_stage) if per_stage % d == 0]
        chunks = f"--num-layers-per-virtual-pipeline-stage {', '.join(map(str, divisors))}"
        raise DynBatchValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_vp} does not divide the {per_stage} "
            f"layers of each pipeline stage (--num-layers {layers}{counted_note} / "
            f"--pipeline-model-parallel-size {pp}); use {chunks} (layers per model chunk), "
            f"--num-layers {pp * max(per_vp, 1) * 2 - len(extra)} "
            f"({2 * max(per_vp, 1)} layers a stage, 2 chunks), or drop "
            "--num-layers-per-virtual-pipeline-stage (no interleaving)."
        )


def _check_positions(args: Any) -> None:
    positions = getattr(args, "max_position_embeddings", None)
    if positions is None:
        return
    for name, flag in (
        ("seq_length", "--seq-length"),
        ("decoder_seq_length", "--decoder-seq-length"),
    ):
        length = getattr(args, name, None)
        if length is None or length <= positions:
            continue
        kind = getattr(args, "position_embedding_type", None) or "learned_absolute"
        note = (
            " (with --position-embedding-type learned_absolute that adds position weights: a "
            f"checkpoint of {positions} positions will not load)"
            if kind == "learned_absolute"
            else f" (--position-embedding-type {kind} holds no weights for it)"
        )
        raise DynBatchValueError(
            f"{flag} {length} is longer than --max-position-embeddings {positions} (Megatron "
            f"requires max_position_embeddings >= seq_length); raise --max-position-embeddings "
            f"to {length}{note}, or lower {flag} to {positions}."
        )


def torchrun_command(ranks: int, program: Optional[str] = None) -> str:
    """The torchrun command line of this launch with ``ranks`` processes (arguments elided)."""
    program = os.path.basename(program if program is not None else sys.argv[0])
    if program.endswith(".py") and program != "__main__.py":
        return (
            f"torchrun --nproc-per-node {ranks} launch/{program} ... (from a checkout) or "
            f"torchrun --nproc-per-node {ranks} -m megatron_dynbatch pretrain ..."
        )
    return f"torchrun --nproc-per-node {ranks} -m megatron_dynbatch pretrain ..."


def check_world_size(args: Any, environ: Optional[dict] = None) -> None:
    """The ranks launched against the model-parallel sizes: a launch without torchrun (one
    process) of a model split over ranks is told the torchrun command; a world size that is not
    a multiple of the model size is told the sizes that are.

    Raises:
        DynBatchValueError: Naming the sizes, their flags and a launch that works.
    """
    environ = os.environ if environ is None else environ
    # Megatron's parse_args sets it (from WORLD_SIZE, 1 without); a namespace without it was not
    # parsed from a launch (hooks driven by hand, tests): nothing to say about the launch.
    world = getattr(args, "world_size", None)
    if world is None:
        return
    sizes = [
        ("--tensor-model-parallel-size", _size(args, "tensor_model_parallel_size")),
        ("--pipeline-model-parallel-size", _size(args, "pipeline_model_parallel_size")),
        ("--context-parallel-size", _size(args, "context_parallel_size")),
    ]
    model = 1
    for _, size in sizes:
        model *= max(size, 1)
    if world % model == 0:
        return
    named = " x ".join(f"{flag} {size}" for flag, size in sizes if size != 1)
    if "WORLD_SIZE" not in environ:
        raise DynBatchValueError(
            f"started as one process, without torchrun, but {named} splits the model over "
            f"{model} ranks; launch it under torchrun: {torchrun_command(model)} (the same "
            "arguments; a multiple of that many processes adds data-parallel ranks)."
        )
    ranks = " or ".join(str(m) for m in _nearest_multiples(world, model))
    raise DynBatchValueError(
        f"{world} ranks launched (torchrun's --nproc-per-node x --nnodes), but {named} = {model} "
        f"ranks per model copy does not divide them; launch {ranks} ranks "
        f"(e.g. torchrun --nproc-per-node {model}), or change the sizes so that their product "
        f"divides {world}."
    )
