"""Kernel check: the torch-varlen core attention against the reference module, on random batches.

    python benchmarks/varlen_kernel_check.py            # CUDA: torch's flash kernels
    python benchmarks/varlen_kernel_check.py --json F   # also write the figures as JSON

Random packed THD rows (segment lengths from a long tail, with and without
``cu_seqlens_*_padded``, MHA and GQA, head dims 64 and 128) go through
``mcore/varlen_attention.TorchVarlenAttention`` and ``mcore/thd_attention.ThdReferenceAttention``
(dense, in fp32) with the same inputs; outputs and the gradients of query, key and value are
compared as the largest absolute difference over the largest reference magnitude. Rows without
``PackedSeqParams`` (``[s, b, h, d]``) go through SDPA's flash backend (bf16) and its
memory-efficient backend (fp32), against the same reference.

Tolerances (stated, not fitted): bf16 ``BF16_TOLERANCE`` (bf16 keeps 8 bits of mantissa: inputs
rounded to bf16 differ from fp32 by up to 2**-8 relative, and the kernels accumulate in fp32);
fp32 ``FP32_TOLERANCE``. Without CUDA (CI) the varlen kernel is replaced by torch's SDPA run
segment by segment (``segment_sdpa_kernel``): the logic around the kernel is checked, torch's
flash kernel is not, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import types
from typing import Dict, List

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: Largest |ours - reference| / max |reference| accepted in bf16 (outputs and gradients).
BF16_TOLERANCE = 2e-2
#: The same in fp32.
FP32_TOLERANCE = 1e-4

_TP1 = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))


def _error(ours, reference) -> float:
    scale = float(reference.abs().max()) or 1.0
    return float((ours.float() - reference.float()).abs().max()) / scale


def _segments(rng, total, with_padding):
    """Real and padded boundaries of ``total`` tokens, lengths from a log-normal long tail."""
    real, padded = [0], [0]
    while padded[-1] < total:
        n = max(1, min(int(rng.lognormvariate(math.log(total / 16), 1.0)), total - padded[-1]))
        pad = min(rng.randrange(0, 9), total - padded[-1] - n) if with_padding else 0
        real.append(real[-1] + n)
        padded.append(padded[-1] + n + pad)
    return real, (padded if with_padding else None)


def _modules(heads: int, groups: int, dim: int, cuda: bool):
    """torch-varlen and the reference module for one head layout (on CPU the varlen kernel is
    the per-segment SDPA stand-in). Imported here: on CPU, after :func:`run` applied the shim."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dynbatch.mcore.thd_attention import ThdReferenceAttention
    from megatron_dynbatch.mcore.varlen_attention import TorchVarlenAttention, segment_sdpa_kernel

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
    )
    kwargs = dict(
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pg_collection=_TP1,
    )
    varlen = TorchVarlenAttention(config, **kwargs).eval()
    if not cuda:
        varlen.kernel = segment_sdpa_kernel()
    return varlen, ThdReferenceAttention(config, **kwargs).eval()


def _errors(modules, inputs, grad, **call) -> List[float]:
    """Relative errors of the first module against the second: output, then q/k/v gradients."""
    results = []
    for module in modules:
        q, k, v = (x.clone().requires_grad_(True) for x in inputs)
        out = module(q, k, v, None, **call)
        out.backward(grad)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    return [_error(a, b) for a, b in zip(*results, strict=True)]


def _row(path, dtype, heads, groups, dim, tokens, segments, padded, errors) -> Dict:
    import torch

    return {
        "path": path,
        "dtype": str(dtype).replace("torch.", ""),
        "heads/groups/dim": f"{heads}/{groups}/{dim}",
        "tokens": tokens,
        "segments": segments,
        "padded boundaries": padded,
        "output": errors[0],
        "grad q/k/v": max(errors[1:]),
        "tolerance": BF16_TOLERANCE if dtype == torch.bfloat16 else FP32_TOLERANCE,
    }


def run(batches: int, tokens: int, seed: int) -> Dict:
    import random

    import torch

    if not torch.cuda.is_available():
        from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

        apply_cpu_shim()
    from megatron.core.packed_seq_params import PackedSeqParams

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = [(16, 16, 64), (16, 4, 128), (8, 2, 64)]  # heads, query groups, head dim
    rows: List[Dict] = []
    kernel_name = None
    for index in range(batches):
        heads, groups, dim = shapes[index % len(shapes)]
        varlen, reference = _modules(heads, groups, dim, cuda)
        with_padding = index % 2 == 1
        real, padded = _segments(rng, tokens if cuda else tokens // 8, with_padding)
        total = (padded or real)[-1]
        cu = torch.tensor(real, dtype=torch.int32, device=device)
        cu_padded = (
            None if padded is None else torch.tensor(padded, dtype=torch.int32, device=device)
        )
        longest = max(b - a for a, b in zip(real[:-1], real[1:], strict=True))
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        dtype = torch.bfloat16 if cuda else torch.float32
        inputs = [
            torch.randn(total, n, dim, device=device, dtype=dtype) for n in (heads, groups, groups)
        ]
        grad = torch.randn(total, heads * dim, device=device, dtype=dtype)
        errors = _errors((varlen, reference), inputs, grad, packed_seq_params=params)
        kernel_name = varlen.kernel.name
        rows.append(
            _row(
                "THD varlen", dtype, heads, groups, dim, total, len(real) - 1, with_padding, errors
            )
        )
    # Rows without PackedSeqParams: SDPA (flash in bf16, memory-efficient in fp32 on CUDA).
    for dtype in (torch.bfloat16, torch.float32) if cuda else (torch.float32,):
        heads, groups, dim = 16, 4, 64
        modules = _modules(heads, groups, dim, cuda)
        seq, batch = (2048, 2) if cuda else (128, 2)
        inputs = [
            torch.randn(seq, batch, n, dim, device=device, dtype=dtype)
            for n in (heads, groups, groups)
        ]
        grad = torch.randn(seq, batch, heads * dim, device=device, dtype=dtype)
        errors = _errors(modules, inputs, grad)
        rows.append(_row("SDPA rows", dtype, heads, groups, dim, seq * batch, batch, False, errors))
    passed = all(max(r["output"], r["grad q/k/v"]) <= r["tolerance"] for r in rows)
    kernel = kernel_name if cuda else f"{kernel_name} (CPU stand-in; torch's flash kernel not run)"
    return {"kernel": kernel, "torch": torch.__version__, "rows": rows, "passed": passed}


def render(result: Dict) -> str:
    lines = [
        f"Kernel check ({result['kernel']}, torch {result['torch']}) against the reference "
        f"module; error = max |ours - reference| / max |reference|; tolerance bf16 "
        f"{BF16_TOLERANCE:g}, fp32 {FP32_TOLERANCE:g}: "
        + ("**passed**" if result["passed"] else "**FAILED**"),
        "",
        "| path | dtype | heads/groups/dim | tokens | segments | padded boundaries | output | "
        "grad q/k/v |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['path']} | {row['dtype']} | {row['heads/groups/dim']} | {row['tokens']} | "
            f"{row['segments']} | {'yes' if row['padded boundaries'] else 'no'} | "
            f"{row['output']:.2e} | {row['grad q/k/v']:.2e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of a packed row (CUDA)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", type=pathlib.Path, help="write the result here as JSON")
    options = parser.parse_args(argv)
    result = run(options.batches, options.tokens, options.seed)
    print(render(result), flush=True)
    if options.json:
        options.json.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
