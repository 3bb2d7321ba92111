"""slime's FLOPs estimate of a sample (its ``calculate_fwd_flops``), from the model's Megatron
arguments: the weights of ``--balance-data`` on slime's static path, and the attention-to-linear
ratio of the cost model the dynamic path plans with (:func:`cost_model`).

The expressions keep slime's operation order, so the floating-point sums, and with them the
balancing decisions, are slime's. Standard library and the pure planner only.
"""

from __future__ import annotations

import numbers
from typing import Any, List, Sequence

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.slime.dp_schedule import DPScheduleError
from megatron_dynbatch.planning import CostModel
from megatron_dynbatch.planning.spec import ATTENTION_CROSSOVER_7B

__all__ = ["FLOPS_ARGS", "balance_flops", "cost_model", "forward_flops", "layer_flops"]


def layer_flops(args: Any, s: int, ffn: int) -> float:
    """Forward FLOPs of one transformer layer on a sequence of ``s`` tokens (slime's estimate).

    The expressions keep slime's operation order so the floating-point sums, and with them the
    balancing decisions, are identical.
    """
    h = args.hidden_size
    heads = args.num_attention_heads
    mla = bool(getattr(args, "multi_latent_attention", False))
    if mla and args.q_lora_rank is not None:
        q = 2 * s * args.q_lora_rank * (h + heads * (args.qk_head_dim + args.qk_pos_emb_head_dim))
    else:
        q_head_dim = args.qk_head_dim + args.qk_pos_emb_head_dim if mla else args.kv_channels
        q = 2 * s * h * heads * q_head_dim
    if mla and args.kv_lora_rank is not None:
        kv = (
            2
            * s
            * (
                args.kv_lora_rank * (h + heads * (args.qk_head_dim + args.v_head_dim))
                + h * args.qk_pos_emb_head_dim
            )
        )
    else:
        kv = 2 * 2 * s * h * args.num_query_groups * args.kv_channels
    if mla:
        attention = 2 * heads * s * s * (args.qk_head_dim + args.qk_pos_emb_head_dim) / 2
        attention += heads * s * s * args.v_head_dim
    else:
        attention = 2 * heads * s * s * args.kv_channels / 2
        attention += heads * s * s * args.kv_channels
    return (q + kv) + attention + 2 * s * h * h + 2 * s * h * ffn * 3


def forward_flops(args: Any, s: int) -> float:
    """slime's ``calculate_fwd_flops([s], args)``: every layer plus the output projection."""
    if args.num_experts is None:
        num_dense, num_moe, moe_ffn = args.num_layers, 0, 0
    else:
        shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
        moe_ffn = args.moe_ffn_hidden_size * args.moe_router_topk + shared
        if hasattr(args, "moe_layer_freq"):
            freq = args.moe_layer_freq
            if isinstance(freq, list):
                num_dense = sum(1 for f in freq if f == 0)
                num_moe = sum(1 for f in freq if f > 0)
            else:
                if isinstance(freq, bool) or not isinstance(freq, numbers.Integral) or freq < 1:
                    # slime's own estimate divides by it (ZeroDivisionError at 0).
                    raise DynBatchValueError(
                        f"--moe-layer-freq {freq!r} must be an integer >= 1 (every freq-th layer "
                        "is MoE) or a list of 0/1 per layer; pass e.g. --moe-layer-freq 1."
                    )
                num_dense = sum(1 for i in range(args.num_layers) if i % freq != 0)
                num_moe = sum(1 for i in range(args.num_layers) if i % freq == 0)
        else:
            num_dense, num_moe = 0, args.num_layers
    total = 0
    if num_dense > 0:
        total += layer_flops(args, s, args.ffn_hidden_size) * num_dense
    if num_moe > 0:
        total += layer_flops(args, s, moe_ffn) * num_moe
    return total + 2 * s * args.hidden_size * args.vocab_size


#: The model arguments slime's FLOPs estimate reads for a dense model (Megatron's names).
FLOPS_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "vocab_size",
)


def balance_flops(args: Any, lengths: Sequence[int]) -> List[float]:
    """``--balance-data``'s weights: slime's FLOPs estimate of every sample, or a
    ``DynBatchValueError`` naming the model arguments it needs where ``args`` lacks them (slime's
    own estimate would stop on an ``AttributeError``)."""
    try:
        return [forward_flops(args, n) for n in lengths]
    except (AttributeError, TypeError):
        missing = [name for name in FLOPS_ARGS if getattr(args, name, None) is None]
        if not hasattr(args, "num_experts"):
            missing.append("num_experts")
        raise DPScheduleError(
            "--balance-data balances ranks by slime's FLOPs estimate, which needs the model's "
            f"Megatron arguments on args; missing or None: {', '.join(missing) or 'a MoE/MLA size'}"
            ". Pass slime's parsed arguments, or drop --balance-data (strided assignment)."
        ) from None


def cost_model(args: Any) -> CostModel:
    """What one micro-batch costs on one GPU: linear work per position plus attention per sample.

    slime's THD rows attend per sample (``cu_seqlens``), so a micro-batch of long samples costs
    more than one of as many tokens in short samples; the planner balances and orders by that.
    The ratio is slime's own FLOPs estimate (``calculate_fwd_flops``, what ``--balance-data``
    and ``--balance-by-flops`` balance) from the model dimensions on ``args``, or, without them
    (a bare namespace), a 7B-class model's (:data:`ATTENTION_CROSSOVER_7B`).
    """
    default = CostModel(token_weight=1.0, attention_weight=1.0 / ATTENTION_CROSSOVER_7B)
    try:
        # FLOPs(L) = a * L + b * L**2: b from the second difference, a from FLOPs(1).
        quadratic = (forward_flops(args, 2) - 2 * forward_flops(args, 1)) / 2
        linear = forward_flops(args, 1) - quadratic
    except (AttributeError, TypeError):
        return default
    if linear <= 0 or quadratic < 0:
        return default
    return CostModel(token_weight=1.0, attention_weight=quadratic / linear)
