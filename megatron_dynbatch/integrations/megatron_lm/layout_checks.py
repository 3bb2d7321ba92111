"""Megatron-LM's layout and launch checks that users meet first, made one line with flags and a fix.

Megatron 0.19's ``validate_args`` asserts these with its own wording ("number of layers per pipeline
stage must be divisible number of layers per virtual pipeline stage", "world size (1) is not
divisible by total_model_size (2)"), naming no flag and no fix (issue 44). The patched
``parse_and_validate_args`` runs :func:`check_model_layout` and :func:`check_world_size` (through
``hooks.configure``) right before Megatron's own checks, with dynamic batching on or off: they
refuse exactly what Megatron would refuse, in one line naming the flags and a value that works.
Cases Megatron words differently (``--hybrid-layer-pattern``, ``--pipeline-model-parallel-layout``,
uneven first / last stages) are left to Megatron.

With ``--use-dynamic-batch-size`` on, :func:`check_virtual_pipeline` (from
``validate_dynamic_batch_args``) also refuses the interleaving layouts Megatron accepts at argument
time but fails on later (a raw assert at model build). :func:`one_rank_without_torchrun` runs a
launch without torchrun as one rank (Megatron met it only in ``pretrain()``, with a traceback; the
launch entry runs it through ``hooks.entry_check``, with the switch on or under
``megatron-dynbatch pretrain``).

Imports only the standard library and :mod:`megatron_dynbatch.integrations.model_args` (no torch,
no megatron): testable without megatron.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Dict, List, Optional, Tuple

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.model_args import (
    extra_pipeline_layers,
    virtual_pipeline_size,
)

__all__ = [
    "PRETRAIN_PROGRAM",
    "check_fixed_interleaved_counts",
    "check_model_layout",
    "check_virtual_pipeline",
    "check_world_size",
    "one_rank_without_torchrun",
    "torchrun_command",
    "virtual_pipeline_size",
]

#: ``sys.argv[0]`` under ``megatron-dynbatch pretrain`` / ``python -m megatron_dynbatch pretrain``
#: (``tools.cli.PRETRAIN_PROGRAM``, which sets it; repeated here so that this module imports only
#: the standard library).
PRETRAIN_PROGRAM = "megatron-dynbatch pretrain"


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
    _check_uneven_interleaved_pair(args)
    _check_query_groups(args)
    _check_full_recompute(args)
    _check_positions(args)


def _check_uneven_interleaved_pair(args: Any) -> None:
    """Both uneven stage sizes with interleaving at two stages: Megatron 0.19 accepts them and
    divides by the middle stages (none at pp 2) when it builds the model (a probe: a bare
    ``ZeroDivisionError`` on one rank, "Connection closed by peer" on the other)."""
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    stages = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    pp = _size(args, "pipeline_model_parallel_size")
    if first is None or last is None or stages is None or stages < 2 or pp != 2:
        return
    # A first stage that builds alone: its layers and the last stage's split into `stages`
    # chunks each (a re-probe: the value given, 1 of 4 layers, was refused next for that).
    layers = getattr(args, "num_layers", None) or 0
    builds = [n for n in range(stages, layers, stages) if (layers - n) % stages == 0]
    alone = min(builds, key=lambda n: (abs(n - first), n)) if builds else None
    one = (
        f"give --decoder-first-pipeline-num-layers {alone} alone (the last stage takes the other "
        f"{layers - alone}; each a multiple of {stages}), or "
        if alone is not None
        else ""
    )
    raise DynBatchValueError(
        f"--decoder-first-pipeline-num-layers {first} and --decoder-last-pipeline-num-layers "
        f"{last} with --num-virtual-stages-per-pipeline-rank {stages} at "
        "--pipeline-model-parallel-size 2: Megatron spreads the other layers over the middle "
        "stages, and two stages have none (it divides by zero when it builds the model); "
        f"{one}use --pipeline-model-parallel-size 3 or more."
    )


def _check_query_groups(args: Any) -> None:
    """``--num-query-groups`` must divide ``--num-attention-heads``: Megatron checks it only
    against the tensor-parallel size, and the first forward failed on a reshape (a probe:
    "shape '[259, 1, 3, 48]' is invalid", the peer's connection closed)."""
    if not getattr(args, "group_query_attention", False):
        return
    groups = getattr(args, "num_query_groups", None)
    heads = getattr(args, "num_attention_heads", None)
    if not isinstance(groups, int) or not isinstance(heads, int) or groups < 1 or heads < 1:
        return
    if heads % groups == 0:
        return
    tp = _size(args, "tensor_model_parallel_size")
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and (d % tp == 0 or tp % d == 0)]
    raise DynBatchValueError(
        f"--num-query-groups {groups} does not divide --num-attention-heads {heads}: each query "
        "group shares one key/value head among the same number of query heads; use "
        f"{_either(fits, '--num-query-groups')}."
    )


def _check_full_recompute(args: Any) -> None:
    """``--recompute-granularity full`` needs ``--recompute-method`` and ``--recompute-num-layers``:
    Megatron's model config asks for them one at a time (a probe: the method named alone, then
    refused again for the count), after the arguments were dumped. The other way out, selective
    recompute, takes neither (Megatron refuses a method or a count with it), so it is named
    with the flags to drop (a re-probe)."""
    if getattr(args, "recompute_granularity", None) != "full":
        return
    method = getattr(args, "recompute_method", None)
    count = getattr(args, "recompute_num_layers", None)
    if method is not None and count is not None:
        return
    missing = []
    if method is None:
        missing.append(("--recompute-method", "uniform"))
    if count is None:
        # One layer a recompute unit (uniform) or recomputed (block) is valid for any stage.
        missing.append(("--recompute-num-layers", "1"))
    given = [
        flag
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", count))
        if value is not None
    ]
    selective = "use --recompute-granularity selective" + (f" and drop {given[0]}" if given else "")
    raise DynBatchValueError(
        "--recompute-granularity full recomputes whole layers and needs "
        f"{' and '.join(flag for flag, _ in missing)}: add "
        f"{' '.join(f'{flag} {value}' for flag, value in missing)}, or {selective}."
    )


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
    extra = extra_pipeline_layers(args)
    counted = layers + len(extra)
    counted_note = _counted_note(extra)
    _check_layers_per_stage(layers, extra, pp)
    per_vp = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_vp is None:
        return
    per_stage = counted // pp
    if per_vp < 1:
        # No --num-layers makes 0 layers a chunk divide a stage (a probe followed the divisor
        # message's "--num-layers 4" and was refused again, with the same advice).
        raise DynBatchValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_vp} must be >= 1 (layers per model "
            "chunk); pass 1 or more, or drop it (no interleaving)."
        )
    if per_stage % per_vp:
        divisors = [d for d in range(1, per_stage) if per_stage % d == 0]
        # A stage of one layer has no divisor that makes two chunks: name none.
        chunks = (
            f"--num-layers-per-virtual-pipeline-stage {', '.join(map(str, divisors))} (layers per "
            "model chunk), "
            if divisors
            else ""
        )
        raise DynBatchValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_vp} does not divide the {per_stage} "
            f"layer{'s' if per_stage != 1 else ''} of each pipeline stage (--num-layers {layers}{counted_note} / "
            f"--pipeline-model-parallel-size {pp}); use {chunks}"
            f"--num-layers {pp * per_vp * 2 - len(extra)} "
            f"({2 * per_vp} layers a stage, 2 chunks), or drop "
            "--num-layers-per-virtual-pipeline-stage (no interleaving)."
        )


def _counted_note(extra: List[str]) -> str:
    return f" (+{len(extra)} for {', '.join(extra)})" if extra else ""


def _check_layers_per_stage(layers: int, extra: List[str], pp: int) -> None:
    counted = layers + len(extra)
    if counted % pp:
        fix = _either([m - len(extra) for m in _nearest_multiples(counted, pp)], "--num-layers")
        raise DynBatchValueError(
            f"--num-layers {layers}{_counted_note(extra)} is not a multiple of "
            f"--pipeline-model-parallel-size {pp}: Megatron gives every pipeline stage the same "
            f"number of layers; use {fix}, or a --pipeline-model-parallel-size that divides "
            f"{counted}."
        )


def check_virtual_pipeline(args: Any) -> None:
    """Interleaving (``--num-virtual-stages-per-pipeline-rank``, or
    ``--num-layers-per-virtual-pipeline-stage``) against the pipeline: run with
    ``--use-dynamic-batch-size`` only (without it Megatron's own behaviour is kept).

    Megatron 0.19 takes ``--num-virtual-stages-per-pipeline-rank`` as given at argument time and
    asserts only when it builds the model ("num_layers_per_pipeline_rank 1 should be divisible by
    vp_size 2", a traceback per rank); with ``--pipeline-model-parallel-size 1`` it refuses any
    interleaving in words that name no flag. Both are refused here, before the model is built.

    Raises:
        DynBatchValueError: Naming the flags, their values and values that pass.
    """
    vpp = virtual_pipeline_size(args)
    if vpp is None:
        return
    stages = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_vp = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    flag = (
        f"--num-layers-per-virtual-pipeline-stage {per_vp}"
        if stages is None and per_vp is not None
        else f"--num-virtual-stages-per-pipeline-rank {vpp if stages is None else stages}"
    )
    if stages is not None and stages < 1:
        # Megatron would take 0 as the size and divide by it when it builds the model.
        raise DynBatchValueError(
            f"{flag}: the model chunks of each pipeline stage must be 1 or more; use "
            "--num-virtual-stages-per-pipeline-rank 2 (or more) to interleave, or drop it."
        )
    pp = _size(args, "pipeline_model_parallel_size")
    if vpp > 1 and pp < 2:
        # Megatron's own refusal ("When interleaved schedule is used, pipeline-model-parallel size
        # should be greater than 1") names neither flag; without p2p overlap it needs 3 stages.
        least = 2 if getattr(args, "overlap_p2p_comm", True) else 3
        raise DynBatchValueError(
            f"{flag} interleaves {vpp} model chunks per pipeline stage, but "
            f"--pipeline-model-parallel-size is {pp}: interleaving splits the layers of each "
            f"pipeline stage, so it needs {least} stages or more; drop {flag.split()[0]} (no "
            f"interleaving), or set --pipeline-model-parallel-size {least} or more (and launch "
            "that many ranks per model copy)."
        )
    if stages is None or any(
        getattr(args, name, None) is not None
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
    ):
        # --num-layers-per-virtual-pipeline-stage: check_model_layout checked it; uneven first /
        # last stages: Megatron's TransformerConfig checks them with its own message.
        return
    layers = getattr(args, "num_layers", None)
    if layers is None or pp < 2:
        return
    extra = extra_pipeline_layers(args)
    _check_layers_per_stage(layers, extra, pp)  # Megatron asserts it at model build here too
    per_stage = (layers + len(extra)) // pp
    if per_stage % stages == 0:
        return
    divisors = [d for d in range(2, per_stage + 1) if per_stage % d == 0]
    other = (
        f"{_either(divisors, '--num-virtual-stages-per-pipeline-rank')} (model chunks per "
        "stage), "
        if divisors
        else ""
    )
    # The fewest layers at or above --num-layers that split into `stages` chunks a stage.
    chunk = -(-(layers + len(extra)) // (pp * stages))
    raise DynBatchValueError(
        f"{flag} does not divide the {per_stage} layers of each pipeline stage (--num-layers "
        f"{layers}{_counted_note(extra)} / --pipeline-model-parallel-size {pp}): Megatron gives "
        f"every model chunk of a stage the same number of layers; use {other}--num-layers "
        f"{pp * stages * chunk - len(extra)} ({stages * chunk} layers a stage, {chunk} a chunk), "
        "or drop --num-virtual-stages-per-pipeline-rank (no interleaving)."
    )


def check_fixed_interleaved_counts(args: Any) -> None:
    """``--document-samples`` runs Megatron's fixed micro-batch count, which its interleaved
    schedule needs in whole groups of ``--pipeline-model-parallel-size`` (one group at least): a
    count that is not failed in the schedule at the first step, after the model was built (a
    probe). Refused here, naming the global batch size that works."""
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    if vpp <= 1:
        return
    pp, dp = args.pipeline_model_parallel_size, args.data_parallel_size
    passes = [
        ("--global-batch-size", args.global_batch_size, "--micro-batch-size", args.micro_batch_size)
    ]
    if (getattr(args, "eval_iters", 0) or 0) > 0:
        passes.append(
            (
                "--eval-global-batch-size",
                getattr(args, "eval_global_batch_size", None) or args.global_batch_size,
                "--eval-micro-batch-size",
                getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size,
            )
        )
    for batch_flag, batch, micro_flag, micro in passes:
        count = batch // (micro * dp)
        if count % pp:
            works = -(-count // pp) * pp * micro * dp
            raise DynBatchValueError(
                f"--document-samples runs Megatron's fixed {count} micro-batches a step "
                f"({batch_flag} {batch} / ({micro_flag} {micro} x {dp} data-parallel ranks)), and "
                "its interleaved schedule needs a multiple of --pipeline-model-parallel-size "
                f"{pp}: pass {batch_flag} {works}, or drop the virtual pipeline stages "
                "(--use-dynamic-batch-size aligns its counts itself)."
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


def _model_sizes(args: Any) -> List[Tuple[str, int]]:
    """The sizes that split one model copy over ranks, each with its flag."""
    return [
        ("--tensor-model-parallel-size", _size(args, "tensor_model_parallel_size")),
        ("--pipeline-model-parallel-size", _size(args, "pipeline_model_parallel_size")),
        ("--context-parallel-size", _size(args, "context_parallel_size")),
    ]


def _model_ranks(sizes: List[Tuple[str, int]]) -> int:
    """Ranks per model copy: the product of :func:`_model_sizes` (a size below 1 counts 1)."""
    model = 1
    for _, size in sizes:
        model *= max(size, 1)
    return model


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
    sizes = _model_sizes(args)
    model = _model_ranks(sizes)
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


#: What torchrun sets for every process it starts; without any of them this is a bare process.
_TORCHRUN_ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def one_rank_without_torchrun(
    args: Any, environ: Optional[dict] = None, program: Optional[str] = None
) -> Optional[Dict[str, str]]:
    """A launch without torchrun runs as one rank: with ``--use-dynamic-batch-size`` or
    ``--document-samples`` (our modes; a probe ran the README's fixed baseline without torchrun
    into the traceback below), or under ``megatron-dynbatch pretrain`` (``program``, default
    ``sys.argv[0]``), where the model fits one process.

    Megatron-LM's ``pretrain()`` joins the process group through torchrun's environment
    (``env://``); a bare ``python launch/pretrain_gpt_dynbatch.py ...`` (as a bare ``python
    pretrain_gpt.py ...``) stopped there in an ~890-line traceback about ``MASTER_ADDR``, after
    the argument dump. Here the environment of a one-process torchrun is set instead (rank 0 of
    1, a free local port), as the README promises the console script. A model split over more
    ranks than were launched is :func:`check_world_size`'s to refuse (with the ranks it needs).

    Returns:
        The variables set in ``environ`` (default ``os.environ``), or ``None`` where nothing was
        (under torchrun, stock mode, or a model that needs more ranks).
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _TORCHRUN_ENVIRONMENT):
        return None
    program = os.path.basename(program if program is not None else sys.argv[0])
    ours = getattr(args, "use_dynamic_batch_size", False) or getattr(
        args, "document_samples", False
    )
    if not (ours or program == PRETRAIN_PROGRAM):
        return None  # stock Megatron's own behaviour (the same traceback) is kept
    if _model_ranks(_model_sizes(args)) > 1:
        return None  # check_world_size names the ranks this model needs
    with socket.socket() as probe:  # a free port for the one-rank group's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    chosen = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for name, value in chosen.items():
        environ.setdefault(name, value)
    return chosen
