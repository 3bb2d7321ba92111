"""The model's dimensions from Megatron's parsed arguments, for the memory model: one reading of
Megatron's flags shared by every host that parses them (Megatron-LM's training entry and
``megatron-dynbatch plan``; slime, whose arguments are Megatron's plus its own).

No torch, no megatron: it reads attributes of a namespace (Megatron's parsed arguments, before or
after ``validate_args``, whose defaults it applies the same way), so a planner on a host's driver
(slime's rollout manager) builds the model without torch work.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_dynbatch.planning.memory import UNFITTED_SAFETY, MemoryModel
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.spec import ParallelLayout, round_up

__all__ = ["DEFAULT_VOCAB_SIZE", "memory_model_from_flags", "model_dims_from_args"]

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
    )


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
    return MemoryModel(
        dims=model_dims_from_args(args, parallel, vocab_size=vocab_size),
        attention=attention,
        recompute=recompute if recompute in ("selective", "full") else None,
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        base_bytes=base_bytes,
        token_scale=scale,
        score_scale=scale,
    )
