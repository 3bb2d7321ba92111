"""The model's dimensions from Megatron's parsed arguments, for the memory model: one reading of
Megatron's flags shared by every host that parses them (Megatron-LM's training entry and
``megatron-dynbatch plan``; slime, whose arguments are Megatron's plus its own).

No torch, no megatron: it reads attributes of a namespace (Megatron's parsed arguments, before or
after ``validate_args``, whose defaults it applies the same way), so a planner on a host's driver
(slime's rollout manager) builds the model without torch work.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from megatron_dynbatch.planning.memory import UNFITTED_SAFETY, MemoryModel, block_recompute_layers
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.spec import ParallelLayout, round_up

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "VIRTUAL_FLAGS",
    "extra_pipeline_layers",
    "memory_model_from_flags",
    "model_dims_from_args",
    "virtual_pipeline_size",
]

#: Vocabulary assumed when neither the arguments nor a tokenizer give one (GPT-2's).
DEFAULT_VOCAB_SIZE = 50257


def _padded_vocab(args: Any, vocab_size: Optional[int]) -> int:
    """Megatron's padded vocabulary: ``make_vocab_size_divisible_by x tp`` rows at least."""
    padded = getattr(args, "padded_vocab_size", None)
    if padded:
        return int(padded)
    vocab = vocab_size or getattr(args, "vocab_size", None) or DEFAULT_VOCAB_SIZE
    multiple = (getattr(args, "make_vocab_size_divisible_by", None) or 128) * int(
        getattr(args, "tensor_model_parallel_size", None) or 1
    )
    return round_up(int(vocab), multiple)


def _ffn_hidden_size(args: Any) -> int:
    if getattr(args, "ffn_hidden_size", None):
        return int(args.ffn_hidden_size)
    if getattr(args, "swiglu", False):
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64  # Megatron's validate_args
    return 4 * int(args.hidden_size)


def _params_dtype(args: Any) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


def model_dims_from_args(
    args: Any, parallel: ParallelLayout, *, vocab_size: Optional[int] = None
) -> ModelDims:
    """:class:`ModelDims` of Megatron's arguments (before or after ``validate_args``).

    ``vocab_size``: the tokenizer's vocabulary where the arguments hold none (Megatron pads it);
    ``args.padded_vocab_size``, once Megatron has set it, wins.
    """
    heads = int(args.num_attention_heads)
    groups = heads
    if getattr(args, "group_query_attention", False) and getattr(args, "num_query_groups", None):
        groups = int(args.num_query_groups)
    learned = getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute"
    experts = int(getattr(args, "num_experts", None) or 0)
    return ModelDims(
        num_layers=int(args.num_layers),
        hidden_size=int(args.hidden_size),
        num_attention_heads=heads,
        vocab_size=_padded_vocab(args, vocab_size),
        ffn_hidden_size=_ffn_hidden_size(args),
        num_query_groups=groups,
        kv_channels=getattr(args, "kv_channels", None) or None,
        gated_linear_unit=bool(getattr(args, "swiglu", False)),
        add_bias_linear=bool(getattr(args, "add_bias_linear", True)),
        normalization="RMSNorm" if getattr(args, "normalization", "") == "RMSNorm" else "LayerNorm",
        position_embeddings=(
            int(getattr(args, "max_position_embeddings", 0) or 0) if learned else 0
        ),
        untie_embeddings=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        params_dtype=_params_dtype(args),
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        num_experts=experts,
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or None,
        moe_router_topk=int(getattr(args, "moe_router_topk", None) or 2),
        ep_size=int(getattr(args, "expert_model_parallel_size", None) or 1) if experts else 1,
        parallel=parallel,
        stage_chunk_layers=_stage_chunk_layers(args, parallel),
    )


def _stage_chunk_layers(
    args: Any, parallel: ParallelLayout
) -> Optional[Tuple[Tuple[int, ...], ...]]:
    """Layers of each model chunk of each pipeline stage where Megatron's split is not the even
    one, else ``None``; also ``None`` for a split Megatron refuses (its own check names it).

    As Megatron-Core 0.19 splits them (``transformer_block.get_num_layers_to_build``): with
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` the first /
    last stage holds that many and the other stages share the rest evenly; with
    ``--account-for-embedding-in-pipeline-split`` / ``-loss-`` the embedding / loss counts as a
    layer in an even split and the first / last chunk builds one layer less; each stage's layers
    are shared evenly by its virtual chunks. ``--pipeline-model-parallel-layout`` is read with
    Megatron's own parser, where megatron is importable (only then: this module imports neither
    torch nor megatron otherwise)."""
    pp, vpp = parallel.pp_size, parallel.vpp_size
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    embedding = bool(getattr(args, "account_for_embedding_in_pipeline_split", False))
    loss = bool(getattr(args, "account_for_loss_in_pipeline_split", False))
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return _layout_layers(layout, pp, vpp)
    uneven = first is not None or last is not None
    if pp == 1 or not (uneven or embedding or loss):
        return None
    layers = int(args.num_layers)
    if uneven:
        if embedding or loss:
            return None  # Megatron refuses both
        given = {0: first, pp - 1: last}
        given = {stage: int(n) for stage, n in given.items() if n is not None}
        rest_stages = pp - len(given)
        rest = layers - sum(given.values())
        if rest_stages and (rest < 0 or rest % rest_stages):
            return None
        per_stage = [
            given.get(stage, rest // rest_stages if rest_stages else 0) for stage in range(pp)
        ]
    else:
        total = layers + embedding + loss
        if total % pp:
            return None
        per_stage = [total // pp] * pp
    if any(n % vpp for n in per_stage):
        return None
    chunks = [[n // vpp] * vpp for n in per_stage]
    if not uneven:
        if embedding:
            chunks[0][0] -= 1
        if loss:
            chunks[pp - 1][vpp - 1] -= 1
    if any(n < 0 for stage in chunks for n in stage):
        return None
    return tuple(tuple(stage) for stage in chunks)


def _layout_layers(layout: Any, pp: int, vpp: int) -> Optional[Tuple[Tuple[int, ...], ...]]:
    """Decoder layers per ``[stage][chunk]`` of ``--pipeline-model-parallel-layout``."""
    try:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )
    except ImportError:
        return None
    try:
        if isinstance(layout, (str, list)):
            layout = PipelineParallelLayerLayout(layout, pp)
        return tuple(
            tuple(layout.layout[stage][chunk].count(LayerType.decoder) for chunk in range(vpp))
            for stage in range(pp)
        )
    except (AssertionError, ValueError, IndexError, TypeError, AttributeError):
        return None  # Megatron's own check refuses this layout


def memory_model_from_flags(
    args: Any,
    parallel: ParallelLayout,
    attention: str,
    *,
    vocab_size: Optional[int] = None,
    base_bytes: float = 0.0,
    unfitted: bool = False,
) -> MemoryModel:
    """The :class:`MemoryModel` of Megatron's arguments (uncalibrated). ``unfitted``: no run has
    fitted it (a host's driver, before any training GPU), so activations are counted
    x :data:`~megatron_dynbatch.planning.memory.UNFITTED_SAFETY`."""
    recompute = getattr(args, "recompute_granularity", None)
    scale = UNFITTED_SAFETY if unfitted else 1.0
    block = block_recompute_layers(
        recompute,
        getattr(args, "recompute_method", None),
        getattr(args, "recompute_num_layers", None),
    )
    return MemoryModel(
        dims=model_dims_from_args(args, parallel, vocab_size=vocab_size),
        attention=attention,
        recompute=recompute if recompute in ("selective", "full") else None,
        recompute_block_layers=block,
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        base_bytes=base_bytes,
        token_scale=scale,
        score_scale=scale,
    )


#: Megatron's flags that describe interleaving themselves (at most one of them; Megatron refuses
#: two, with its own message).
VIRTUAL_FLAGS = (
    ("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank"),
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
)


def extra_pipeline_layers(args: Any) -> List[str]:
    """The flags that count the embedding / the loss as a layer of the pipeline split."""
    return [
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


def virtual_pipeline_size(args: Any) -> Optional[int]:
    """Model chunks per pipeline stage, as Megatron's ``validate_args`` derives
    ``args.virtual_pipeline_model_parallel_size`` (which it sets only after the patched
    ``parse_and_validate_args`` has run our checks), or ``None``: no interleaving, or a layout
    only Megatron reads (``--pipeline-model-parallel-layout``, ``--hybrid-layer-pattern``, two
    interleaving flags at once, a split that Megatron-LM's ``layout_checks.check_model_layout``
    refuses).
    """
    derived = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if derived is not None:  # after Megatron's validation
        return int(derived)
    given = [name for name, _ in VIRTUAL_FLAGS if getattr(args, name, None) is not None]
    if len(given) != 1 or getattr(args, "hybrid_layer_pattern", None) is not None:
        return None
    stages = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if stages is not None:
        return int(stages)
    per_vp = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    layers = getattr(args, "num_layers", None)
    pp = getattr(args, "pipeline_model_parallel_size", None)
    pp = 1 if pp is None else int(pp)
    if per_vp is None or layers is None or per_vp < 1 or pp < 1:
        return None
    counted = layers + len(extra_pipeline_layers(args))
    if counted % pp or (counted // pp) % per_vp:
        return None
    return counted // pp // per_vp
