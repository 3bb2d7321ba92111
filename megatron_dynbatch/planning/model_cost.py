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
:func:`megatron_dynbatch.integrations.slime.flops.cost_model`), so both hosts start from one
formula. The ratio is what the planner needs (its weights are relative); calibration later refits
both weights and the per-micro-batch overhead from measured iterations. Standard library only.

Worked example: a 7B Llama-like model (32 layers, h 4,096, 32 heads, ffn 11,008 gated, vocab
32,000) does ``1.32e10`` linear FLOPs per token and ``2.62e5`` attention FLOPs per ``L**2``, so a
sample's attention equals its linear work at ``L = 50,408``: ``attention_weight = 1.98e-5``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .model_dims import ModelDims
from .spec import ATTENTION_KINDS, CostModel

__all__ = [
    "CPU_RATES",
    "DeviceRates",
    "ESTIMATED_MIN_GAIN",
    "GPU_RATES",
    "OPS_PER_LAYER",
    "PhysicalCost",
    "forward_flops",
    "physical_cost",
]


def _layer_multiply_adds(dims: ModelDims) -> float:
    """Multiply-adds a token goes through in one transformer layer's matrices (all TP ranks):
    the QKV and output projections, the MLP (``fc1`` twice as wide with a gated linear unit; with
    MoE, ``topk`` experts and the router)."""
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
    return float(qkv + projection + mlp)


def forward_flops(dims: ModelDims) -> Tuple[float, float]:
    """``(linear FLOPs per token, attention FLOPs per L**2)`` of one forward of the whole model
    (every layer, every tensor-parallel rank together)."""
    h = dims.hidden_size
    linear = 2.0 * (dims.num_layers * _layer_multiply_adds(dims) + h * dims.vocab_size)
    attention = 2.0 * dims.num_layers * dims.query_width
    return linear, attention


# --- the physical default: seconds of one forward on the slowest pipeline stage -------------------


@dataclass(frozen=True, kw_only=True)
class DeviceRates:
    """What one device does per second: the default cost model's assumptions before any step is
    measured. Calibration later fits scales of the model these give (one throughput scale, the
    per-micro-batch overhead), so they need the right proportions more than the right values."""

    linear_flops: float
    """Achieved FLOP/s of the linear layers' GEMMs."""
    attention_flops: float
    """Achieved FLOP/s of the attention kernel's ``Q K^T`` and ``A V``."""
    score_bytes_per_second: float
    """Memory bandwidth the elementwise passes over materialised ``S x S`` scores run at (``dense``
    attention only: scale, mask, softmax and their backward read and write every score)."""
    op_seconds: float
    """Fixed cost of one operator (Python dispatch and kernel launch), whatever its size."""
    p2p_seconds: float
    """A pipeline send / receive of one micro-batch between two stages (latency)."""
    microbatch_seconds: float
    """Python per micro-batch besides the layers: Megatron's forward step, the loss, slicing."""

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise DynBatchValueError(f"DeviceRates {name}={value!r} must be a number > 0.")


#: The gain threshold (``PlannerConfig.min_gain``) of the physical default before a fit: more
#: micro-batches than the fewest only for a predicted gain of 10%. Its overhead comes from assumed
#: device rates and can be 2-3x off (more on a shared CPU, where every p2p send waits for the other
#: rank to be scheduled), while each added micro-batch's cost is real: at equal memory on CPU
#: (pp 2, the long/short mix) 16 micro-batches of [2 x 256] predicted 3% faster than 11 of
#: [3 x 256] ran 8-14% slower than fixed [4 x 256] under load. A fit's measured overhead trusts the
#: model again (threshold 0).
ESTIMATED_MIN_GAIN = 0.10

#: Operators one transformer layer's forward runs (norms, projections, rotary, the attention's
#: matmuls, mask and softmax, residual adds, the MLP): Megatron-Core's local layer runs about 30.
OPS_PER_LAYER = 30
#: Bytes moved per score element per forward by ``dense`` attention's elementwise passes (fp32
#: scores: scale, mask, softmax each read and write them).
_SCORE_PASS_BYTES = 24.0

#: CPU (2 cores, PyTorch eager, fp32): a few GFLOP/s on small GEMMs, ~20 us an operator, gloo's
#: p2p about 0.6 ms a micro-batch and boundary (``benchmarks/bench_shape_exchange.py``).
CPU_RATES = DeviceRates(
    linear_flops=1e10,
    attention_flops=5e9,
    score_bytes_per_second=5e9,
    op_seconds=2e-5,
    p2p_seconds=6e-4,
    microbatch_seconds=1e-3,
)
#: CUDA, by parameter dtype (H100-class: bf16 GEMMs at ~40% of peak, flash attention a little
#: slower, launches of ~6 us, NCCL p2p latency of tens of us).
_GPU_HALF = DeviceRates(
    linear_flops=4e14,
    attention_flops=3e14,
    score_bytes_per_second=2e12,
    op_seconds=6e-6,
    p2p_seconds=5e-5,
    microbatch_seconds=3e-4,
)
GPU_RATES = {
    "bf16": _GPU_HALF,
    "fp16": _GPU_HALF,
    # fp32 runs off the tensor cores' half-precision path: GEMMs and attention about 8x slower.
    "fp32": replace(_GPU_HALF, linear_flops=5e13, attention_flops=4e13),
}


@dataclass(frozen=True)
class PhysicalCost:
    """Seconds of one forward on the slowest pipeline stage, by term (one TP rank)."""

    token_seconds: float
    """Linear work of one position of a row."""
    attention_seconds: float
    """One unit of the cost model's attention term (a causal ``L**2``; ``dense`` pays it twice)."""
    overhead_seconds: float
    """One micro-batch's fixed cost: its operators' launches, the p2p send, Python."""
    attention: str
    """The attention kind the figures are for."""

    def cost_model(self) -> CostModel:
        """In the planner's relative units (token weight 1)."""
        unit = self.token_seconds
        return CostModel(
            token_weight=1.0,
            attention_weight=self.attention_seconds / unit,
            microbatch_overhead=self.overhead_seconds / unit,
            attention=self.attention,  # type: ignore[arg-type]
        )


def physical_cost(dims: ModelDims, attention: str, rates: DeviceRates) -> PhysicalCost:
    """The default cost model of ``dims`` on a device of ``rates`` for attention kind ``attention``.

    Every figure is the slowest pipeline stage's (the planner gives a micro-batch one cost on every
    stage, and the slowest sets the pipeline's pace): its layers' linear FLOPs per token (plus the
    output layer on the last stage) over ``linear_flops``; its attention FLOPs per ``L**2`` over
    ``attention_flops`` (``dense`` computes the full square, which :mod:`.cost` counts as twice the
    causal term, and adds its scores' elementwise passes at ``score_bytes_per_second``); and a
    micro-batch's fixed cost: :data:`OPS_PER_LAYER` operators a layer, the p2p send between stages
    and Megatron's per-micro-batch Python. Tensor parallelism divides the FLOPs, not the launches.
    """
    if attention not in ATTENTION_KINDS:
        raise DynBatchValueError(f"attention={attention!r} is not one of {ATTENTION_KINDS}.")
    h = dims.hidden_size
    tp = dims.parallel.tp_size
    pp = dims.parallel.pp_size
    layer_linear = 2.0 * _layer_multiply_adds(dims) / tp
    layer_attention = 2.0 * dims.query_width / tp
    # Per causal L**2 unit; dense doubles it in .cost, so its score passes are halved here.
    layer_scores = (
        dims.num_attention_heads / tp * _SCORE_PASS_BYTES / 2.0 / rates.score_bytes_per_second
        if attention == "dense"
        else 0.0
    )
    worst = None
    for stage in dims.stages():
        layers = dims.stage_layers(stage)
        linear = layers * layer_linear + (2.0 * h * dims.vocab_size / tp if stage == pp - 1 else 0)
        token = linear / rates.linear_flops
        attn = layers * (layer_attention / rates.attention_flops + layer_scores)
        overhead = layers * OPS_PER_LAYER * rates.op_seconds + rates.microbatch_seconds
        if pp > 1:
            overhead += rates.p2p_seconds
        if worst is None or token > worst[0]:
            worst = (token, attn, overhead)
    token, attn, overhead = worst
    return PhysicalCost(
        token_seconds=token, attention_seconds=attn, overhead_seconds=overhead, attention=attention
    )
