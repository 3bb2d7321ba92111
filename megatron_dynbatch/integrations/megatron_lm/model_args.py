"""The model's dimensions from Megatron-LM's arguments, for the memory model: one reading of
Megatron's flags shared by the training entry and ``megatron-dynbatch plan``.

No torch, no megatron: it reads attributes of a namespace (Megatron's parsed arguments, before or
after ``validate_args``, whose defaults it applies the same way), so ``plan`` stays instant.
:func:`add_model_args` gives ``plan`` the same flags, spelled as Megatron spells them.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.spec import ParallelLayout, round_up

__all__ = ["add_model_args", "model_dims_from_args"]

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


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's model flags ``plan`` needs to predict memory (same spellings and defaults)."""
    group = parser.add_argument_group(
        "model (Megatron-LM's flags; with --num-layers, plan --json predicts each stage's peak)"
    )
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--hidden-size", type=int, default=None)
    group.add_argument("--num-attention-heads", type=int, default=None)
    group.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    group.add_argument(
        "--num-query-groups", type=int, default=None, help="grouped-query attention's KV heads"
    )
    group.add_argument("--vocab-size", type=int, default=None, help=f"default {DEFAULT_VOCAB_SIZE}")
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--recompute-granularity", choices=("selective", "full"), default=None)
    group.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope", "none"),
        default="rope",
        help="default rope here (no position table); Megatron's own default is learned_absolute",
    )
    group.add_argument("--max-position-embeddings", type=int, default=None)
