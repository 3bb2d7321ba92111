"""Achieved GEMM and attention rates on this GPU, per model shard of :mod:`benchmarks.gpu_regime`:
the measured weights ``gpu_regime --weights`` reads instead of its assumed H100 rates.

For each model (its tensor-parallel shard: ``1/tp`` of the projections and heads) in bf16:

* **linear**: one layer's four GEMMs (QKV, output projection, MLP in and out) on 8,192 tokens,
  forward; TFLOP/s = their FLOPs over the time;
* **attention**: ``scaled_dot_product_attention`` (causal, grouped-query heads as the model has
  them) on one sequence of 4,096 / 8,192 / 16,384 tokens; TFLOP/s over the causal triangle
  (``2 * heads * head_dim * L**2``), the longest's rate kept;
* **kernel floor**: one layer's kernels on 64 tokens, the fixed cost a micro-batch pays per layer
  before any Python (reported, not used: Megatron's own per-micro-batch cost is larger).

Writes ``{"device", "linear_tflops", "attention_tflops", "models": {name: {"token_weight",
"attention_weight", "microbatch_overhead"}}, "measured": {...}}``: per model the cost weights
(microseconds) of :func:`benchmarks.gpu_regime.true_cost` at its own measured rates, with the
assumed per-micro-batch overhead and p2p. Needs torch with CUDA; ``--cpu`` runs tiny shapes on the
CPU so the script is exercised without a GPU (its figures then mean nothing).

Run: ``python -m benchmarks.gpu_rates --out docs/gpu_weights.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence

from benchmarks.gpu_regime import MODELS, Assumptions, cases, true_cost

__all__ = ["measure", "with_weights"]

TOKENS = 8192
LENGTHS = (4096, 8192, 16384)
HEAD_DIM = 128


def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    """Seconds per call, the best of ``repeats`` after two warm-up calls."""
    for _ in range(2):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure(cpu: bool = False, repeats: int = 10) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F

    device = "cpu" if cpu else "cuda"
    dtype = torch.float32 if cpu else torch.bfloat16
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    scale = 16 if cpu else 1  # tiny shapes on the CPU
    tokens = TOKENS // scale
    result: Dict[str, Any] = {
        "device": "cpu" if cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "measured": {},
    }
    for name, (dims, tp, _pp) in MODELS.items():
        h = dims["hidden_size"] // scale
        heads = dims["num_attention_heads"] // tp
        groups = max(1, dims["num_query_groups"] // tp)
        ffn = dims["ffn_hidden_size"] // scale
        hd = HEAD_DIM // (8 if cpu else 1)
        q_width = heads * hd
        weights = [
            torch.randn(h, q_width + 2 * groups * hd, device=device, dtype=dtype),
            torch.randn(q_width, h, device=device, dtype=dtype),
            torch.randn(h, 2 * ffn // tp, device=device, dtype=dtype),
            torch.randn(ffn // tp, h, device=device, dtype=dtype),
        ]
        inputs = [torch.randn(tokens, w.shape[0], device=device, dtype=dtype) for w in weights]

        def layer(inputs=inputs, weights=weights):
            for x, w in zip(inputs, weights, strict=True):
                torch.matmul(x, w)

        flops = sum(2 * tokens * w.shape[0] * w.shape[1] for w in weights)
        linear = flops / _timed(layer, sync, repeats) / 1e12
        small = [x[: 64 // (4 if cpu else 1)] for x in inputs]
        floor = _timed(lambda small=small, weights=weights: layer(small, weights), sync, repeats)
        rates = {}
        for length in LENGTHS:
            length //= scale
            q = torch.randn(1, heads, length, hd, device=device, dtype=dtype)
            kv = torch.randn(1, groups, length, hd, device=device, dtype=dtype)

            def attend(q=q, kv=kv):
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)

            rates[length] = 2 * heads * hd * length * length / _timed(attend, sync, repeats) / 1e12
            del q, kv
        result["measured"][name] = {
            "linear_tflops": linear,
            "attention_tflops_by_length": rates,
            "attention_tflops": rates[max(rates)],
            "layer_kernel_floor_us": floor * 1e6,
        }
        del weights, inputs
        if not cpu:
            torch.cuda.empty_cache()
    return with_weights(result)


def with_weights(result: Dict[str, Any]) -> Dict[str, Any]:
    """``result`` (``device``, ``measured`` per model) with the rates and per-model weights
    ``gpu_regime --weights`` reads filled in."""
    measured = result["measured"]
    result["linear_tflops"] = min(m["linear_tflops"] for m in measured.values())
    result["attention_tflops"] = min(m["attention_tflops"] for m in measured.values())
    # Per model: the true cost's weights at its own measured rates (overhead and p2p assumed).
    result["models"] = {}
    for case in cases(0):
        if case.model in result["models"]:
            continue
        m = measured[case.model]
        rates = dataclasses.replace(
            Assumptions(),
            linear_tflops=m["linear_tflops"],
            attention_tflops=m["attention_tflops"],
        )
        cost = true_cost(case, rates)
        result["models"][case.model] = {
            "token_weight": cost.token_weight,
            "attention_weight": cost.attention_weight,
            "microbatch_overhead": cost.overhead,
        }
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--measured",
        default=None,
        help="build the weights from a JSON of measured rates ({device, measured}) instead",
    )
    args = parser.parse_args(argv)
    if args.measured:
        with open(args.measured) as handle:
            result = with_weights(json.load(handle))
    else:
        result = measure(cpu=args.cpu, repeats=args.repeats)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
