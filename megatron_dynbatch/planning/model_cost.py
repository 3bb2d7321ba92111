"""The first plan's cost model from the model's own dimensions: linear work per token plus
attention per sample, in the ratio of their FLOPs.

A forward pass over one sequence of ``L`` tokens does ``linear * L + attention * L**2`` FLOPs:

* ``linear``: every matrix multiply a token goes through, ``2`` FLOPs a multiply-add: per layer
  the QKV projection (``h x (heads + 2 * groups) * kv_channels``), the output projection, the MLP
  (``fc1`` twice as wide with a gated linear unit; with MoE, ``topk`` experts and the router), and
  the output layer (``h x vocab``) once;
* ``attention``: a causal kernel's ``Q K^T`` and ``A V`` over the lower triangle,
  ``2 * heads * kv_channels * L**2`` a layer (grouped-query attention shares keys and values,
  which changes the projection, not this term).

The same sums slime's ``calculate_fwd_flops`` makes (its slime drop-in derives its ratio from it,
:func:`megatron_dynbatch.integrations.slime.schedule._cost_model`), so both hosts start from one
formula. The ratio is what the planner needs (its weights are relative); calibration later refits
both weights and the per-micro-batch overhead from measured iterations. Standard library only.

Worked example: a 7B Llama-like model (32 layers, h 4,096, 32 heads, ffn 11,008 gated, vocab
32,000) does ``1.32e10`` linear FLOPs per token and ``2.62e5`` attention FLOPs per ``L**2``, so a
sample's attention equals its linear work at ``L = 50,408``: ``attention_weight = 1.98e-5``.
"""

from __future__ import annotations

from typing import Optional, Tuple

from .model_dims import ModelDims
from .spec import CostModel

__all__ = ["cost_model_from_dims", "forward_flops"]


def forward_flops(dims: ModelDims) -> Tuple[float, float]:
    """``(linear FLOPs per token, attention FLOPs per L**2)`` of one forward of the whole model
    (every layer, every tensor-parallel rank together)."""
    h = dims.hidden_size
    qkv = h * (dims.query_width + 2 * dims.kv_width)
    projection = dims.query_width * h
    gate = 2 if dims.gated_linear_unit else 1
    if dims.num_experts:
        ffn = dims.moe_ffn_hidden_size
        mlp = dims.moe_router_topk * (h * gate * ffn + ffn * h) + h * dims.num_experts
    else:
        ffn = dims.ffn_hidden_size
        mlp = h * gate * ffn + ffn * h
    linear = 2.0 * (dims.num_layers * (qkv + projection + mlp) + h * dims.vocab_size)
    attention = 2.0 * dims.num_layers * dims.query_width
    return linear, attention


def cost_model_from_dims(
    dims: ModelDims,
    *,
    microbatch_overhead: Optional[float] = None,
    attention: Optional[str] = None,
) -> CostModel:
    """The planner's cost model of ``dims``: token weight 1, attention weight the FLOPs ratio.

    Args:
        dims: The model's dimensions.
        microbatch_overhead: The fixed cost of a micro-batch in the same units (token weight 1),
            when known; ``None`` leaves it to the planner's default (a share of a full row).
        attention: What the attention kernel runs (``spec.ATTENTION_KINDS``); ``None`` follows
            the layout.
    """
    linear, quadratic = forward_flops(dims)
    return CostModel(
        token_weight=1.0,
        attention_weight=quadratic / linear,
        microbatch_overhead=microbatch_overhead,
        attention=attention,  # type: ignore[arg-type]
    )
