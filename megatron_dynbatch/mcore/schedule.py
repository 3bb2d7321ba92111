"""Run one Megatron forward(-backward) pass over an explicit list of micro-batch dicts."""

from typing import Callable, Optional

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime.iterators import chunk_data_iterators

__all__ = [
    "VARIABLE_SHAPE_KEYS",
    "check_schedule_config",
    "check_schedule_inputs",
    "check_uniform_shapes",
    "data_parallel_size",
    "interleaved_shape_exchange_hangs",
    "run_forward_backward",
    "unwrapped_model",
]

# Keys whose length legitimately differs between micro-batches: ``cu_seqlens`` has one entry per
# packed segment plus one. It never crosses a pipeline boundary, so it cannot break p2p shapes.
VARIABLE_SHAPE_KEYS = ("cu_seqlens",)


def interleaved_shape_exchange_hangs(
    pp: int, interleaved: bool, variable_seq_lengths: bool, overlap_p2p_comm: bool
) -> bool:
    """Whether megatron.core's interleaved schedule hangs on its shape exchange (see
    :func:`check_schedule_config`): interleaving at pp = 2 with variable sequence lengths and
    without overlapped p2p."""
    return interleaved and pp == 2 and variable_seq_lengths and not overlap_p2p_comm


def check_schedule_config(config: TransformerConfig) -> None:
    """Refuse schedule settings known to give silently wrong results in megatron.core 0.19.2.

    Interleaved 1F1B with two pipeline stages and ``batch_p2p_comm=True`` pairs batched sends with
    the wrong receives (both neighbours are the same rank), so gradients come out wrong without an
    error (on the tiny GPT with gloo: relative gradient error about 4, no exception). Megatron-LM's
    argument validation forbids it; megatron.core alone does not.

    The same pairing hangs the step with ``variable_seq_lengths=True`` (slime's setting) unless
    ``overlap_p2p_comm`` is on: megatron.core then exchanges shapes before every transfer with
    ``batch_isend_irecv``, whatever ``batch_p2p_comm`` says, and at pp = 2 a stage in warm-up and
    its neighbour in steady state post different numbers of batched ops to the same rank, so both
    wait forever (seen on gloo: the first training step never returns).

    Args:
        config: The model config the schedule will read.

    Raises:
        ValueError: If the config combines interleaving, pp = 2 and batched p2p, or interleaving,
            pp = 2 and variable sequence lengths without overlapped p2p.
    """
    vpp = config.virtual_pipeline_model_parallel_size
    pp = config.pipeline_model_parallel_size
    if vpp is not None and pp == 2 and config.batch_p2p_comm:
        raise DynBatchValueError(
            f"batch_p2p_comm=True with the interleaved schedule (virtual_pipeline_model_parallel_"
            f"size={vpp}) and pipeline_model_parallel_size=2 gives silently wrong gradients in "
            "megatron.core: both pipeline neighbours are the same rank, so batched sends pair with "
            "the wrong receives. Set batch_p2p_comm=False (Megatron-LM's argument validation forbids the "
            "combination for the same reason)."
        )
    if interleaved_shape_exchange_hangs(
        pp, vpp is not None, config.variable_seq_lengths, config.overlap_p2p_comm
    ):
        raise DynBatchValueError(
            f"variable_seq_lengths=True with the interleaved schedule (virtual_pipeline_model_"
            f"parallel_size={vpp}), pipeline_model_parallel_size=2 and overlap_p2p_comm=False "
            "hangs in megatron.core: shapes are exchanged with batched sends and receives, and "
            "with the same rank on both sides the two stages' batches do not pair up. Set "
            "overlap_p2p_comm=True (Megatron-LM's default for interleaving, which it requires at "
            "pp = 2), use pp > 2, or give every micro-batch the same length."
        )


def check_uniform_shapes(
    microbatches: list[dict],
    *,
    variable_keys: tuple[str, ...] = VARIABLE_SHAPE_KEYS,
    variable_rows: bool = False,
) -> None:
    """Check that every micro-batch has the same keys and the same shape per key.

    With ``variable_seq_lengths=False`` the pipeline receive buffers have one fixed shape for the
    whole step; a smaller message fills a gloo buffer partly without an error.

    Args:
        microbatches: The step's micro-batch dicts.
        variable_keys: Keys exempt from the shape comparison (they must still be present).
        variable_rows: Each micro-batch has a row length of its own (a plan of
            ``variable_row_lengths``): the sequence dimension (dim 1) is not compared.

    Raises:
        DynBatchValueError: On an empty list or a micro-batch whose keys or shapes differ.
    """
    if not microbatches:
        raise DynBatchValueError(
            "no micro-batches to run; a step needs at least one (placeholders for a rank without "
            "samples: materialize_microbatches fabricates them from the plan)."
        )

    def shapes_of(microbatch: dict) -> dict:
        return {
            key: None if key in variable_keys else _shape(value, variable_rows)
            for key, value in microbatch.items()
        }

    reference = shapes_of(microbatches[0])
    for index, microbatch in enumerate(microbatches):
        shapes = shapes_of(microbatch)
        if shapes != reference:
            raise DynBatchValueError(
                f"micro-batch {index} has shapes {shapes}, micro-batch 0 has {reference}; every "
                "micro-batch of a step needs the same keys and shapes (Megatron sizes its pipeline "
                "buffers once per step): materialize them from one StepPlan."
            )


def _shape(value: torch.Tensor, variable_rows: bool) -> tuple:
    """A tensor's shape as compared between micro-batches (``None`` for the row length)."""
    shape = tuple(value.shape)
    return shape[:1] + (None,) + shape[2:] if variable_rows and len(shape) > 1 else shape


def unwrapped_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside its wrappers (Megatron's DDP, Float16Module, a host's own): each keeps
    the one it wraps in ``.module``."""
    while hasattr(model, "module"):
        model = model.module
    return model


def data_parallel_size(pg_collection=None) -> Optional[int]:
    """The data-parallel ranks of the schedule: ``pg_collection.dp``'s, else Megatron's once its
    model parallelism is initialized, else None (unknown)."""
    group = getattr(pg_collection, "dp", None) if pg_collection is not None else None
    if group is not None:
        return group.size()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_world_size()
    return None


def _check_token_ids(model_chunks: list[torch.nn.Module], microbatches: list[dict]) -> None:
    """Refuse a token or label id the model's vocabulary does not hold, before the schedule: in
    it, the embedding (first stage) or the loss (last stage) raised a bare ``IndexError`` on
    that stage alone, and a surviving peer waited in its p2p (a probe; a pad id over the
    vocabulary failed only on steps with padding)."""
    vocab = getattr(unwrapped_model(model_chunks[0]), "vocab_size", None)
    if not isinstance(vocab, int):
        return
    checked = [
        (index, key, microbatch[key])
        for index, microbatch in enumerate(microbatches)
        for key in ("tokens", "labels")
        if microbatch.get(key) is not None
        and microbatch[key].numel()
        and not microbatch[key].is_floating_point()
    ]
    if not checked:
        return
    # One device-to-host copy for the step's maxima, not one a micro-batch.
    maxima = torch.stack([ids.max().to(torch.int64) for _, _, ids in checked]).tolist()
    for (index, key, ids), largest in zip(checked, maxima, strict=True):
        if largest < vocab:
            continue
        microbatch = microbatches[index]
        where = "padding"
        sample_index = microbatch.get("sample_index")
        if sample_index is not None and sample_index.shape == ids.shape:
            owner = int(sample_index.reshape(-1)[int(ids.reshape(-1).argmax())])
            where = f"sample {owner}" if owner >= 0 else "padding"
        fix = (
            f"give BatchSchema a pad_token_id below {vocab}"
            if where == "padding"
            else f"keep that sample's token ids below {vocab} (its tokenizer and the model's "
            "vocab_size must agree)"
        )
        raise DynBatchValueError(
            f"micro-batch {index}: {key} holds id {largest} ({where}), and the model's "
            f"vocabulary has {vocab} ids (0 to {vocab - 1}); {fix}."
        )


def check_schedule_inputs(
    model_chunks: list[torch.nn.Module],
    microbatches: list[dict],
    *,
    seq_length: int,
    micro_batch_size: int,
    pg_collection=None,
    variable_rows: bool = False,
) -> tuple[int, Optional[int]]:
    """What :func:`run_forward_backward` checks before it starts the schedule, on this rank alone
    (run it inside a step agreement first, so a rank that fails does not leave its peers waiting
    in the schedule's first p2p or all-reduce).

    ``variable_rows``: the step's micro-batches have rows of their own lengths (a plan of
    ``variable_row_lengths``); the schedule runs them where no stage receives a fixed shape: one
    stage, or ``variable_seq_lengths=True`` (Megatron exchanges each micro-batch's shape).

    Returns:
        The pipeline and virtual pipeline sizes the schedule runs.

    Raises:
        DynBatchValueError: on micro-batches of other keys or shapes than each other or than
            ``[micro_batch_size, seq_length]``, or model chunks the schedule cannot run.
    """
    check_uniform_shapes(microbatches, variable_rows=variable_rows)
    first = microbatches[0]
    if "tokens" in first:
        shape = tuple(first["tokens"].shape)
        if shape[0] != micro_batch_size or (not variable_rows and shape[1] != seq_length):
            raise DynBatchValueError(
                f"tokens have shape {shape} but the schedule was given "
                f"micro_batch_size={micro_batch_size}, seq_length={seq_length}; pass the step's "
                "StepPlan.micro_batch_size and seq_length."
            )
    _check_token_ids(model_chunks, microbatches)
    config = model_chunks[0].config
    for chunk in model_chunks:
        check_schedule_config(chunk.config)
    pp_size = config.pipeline_model_parallel_size
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        pp_size = pg_collection.pp.size()
    if variable_rows and pp_size > 1 and not config.variable_seq_lengths:
        raise DynBatchValueError(
            "the step's micro-batches have rows of their own lengths (planned with "
            f"variable_row_lengths=True), and pipeline_model_parallel_size={pp_size} receives "
            "one fixed shape a step unless Megatron exchanges them: set the model config's "
            "variable_seq_lengths=True (--variable-seq-lengths), or plan with "
            "variable_row_lengths=False (one row length a step)."
        )
    vp_size = config.virtual_pipeline_model_parallel_size
    if len(model_chunks) != (vp_size or 1):
        raise DynBatchValueError(
            f"{len(model_chunks)} model chunks for virtual_pipeline_model_parallel_size={vp_size}; "
            "pass every model chunk of this rank (one per virtual stage)."
        )
    return pp_size, vp_size


def run_forward_backward(
    model_chunks: list[torch.nn.Module],
    microbatches: list[dict],
    *,
    forward_step: Callable,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    pg_collection=None,
    variable_rows: bool = False,
) -> list:
    """Run Megatron's schedule for this rank's model chunks over ``microbatches``.

    Every rank of a pipeline passes the same micro-batch list (later stages read labels, masks and
    loss masks from it). The schedule follows the model chunks' config (and ``pg_collection``'s
    pipeline group): no pipelining, 1F1B, or interleaved 1F1B with one data iterator per chunk.

    Args:
        model_chunks: This rank's chunks (DDP-wrapped for training with finalize_model_grads).
        microbatches: Dicts of ``[micro_batch_size, seq_length]`` tensors, all of equal shapes.
        forward_step: From :func:`megatron_dynbatch.mcore.forward.make_forward_step`.
        seq_length: Sequence length of every micro-batch (sizes the p2p buffers).
        micro_batch_size: Rows per micro-batch.
        forward_only: Skip the backward pass (and finalize_model_grads).
        collect_non_loss_data: Let the loss function return arbitrary data (log-probs).
        pg_collection: Megatron ``ProcessGroupCollection`` for the schedule; None uses Megatron's
            default groups.
        variable_rows: Each micro-batch has a row length of its own (see
            :func:`check_schedule_inputs`); ``seq_length`` is then the longest.

    Returns:
        What the schedule returns: on the last pipeline stage one entry per micro-batch (the loss
        function's logging dict, or its data when ``collect_non_loss_data``), elsewhere ``[]``.
    """
    pp_size, vp_size = check_schedule_inputs(
        model_chunks,
        microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        pg_collection=pg_collection,
        variable_rows=variable_rows,
    )
    kwargs = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    # The sizes of the model we were given, never Megatron's global parallel state.
    forward_backward_func = get_forward_backward_func(pp_size=pp_size, vp_size=vp_size)
    return forward_backward_func(
        forward_step_func=forward_step,
        data_iterator=chunk_data_iterators(microbatches, len(model_chunks)),
        model=model_chunks[0] if len(model_chunks) == 1 else list(model_chunks),
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=None,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        **kwargs,
    )
