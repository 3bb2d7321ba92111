"""MoE losses under dynamic batching: how far each one moves from fixed micro-batches (CPU, gloo).

    .venv/bin/python -m benchmarks.moe_aux_losses            # ~3 min on 2 CPU cores
    .venv/bin/python -m benchmarks.moe_aux_losses --json

Trains a tiny Megatron-LM MoE GPT (4 layers, hidden 32, 4 experts, top-2, all-to-all dispatcher,
pp 2, mock documents, seq 128, 8 samples a step) through ``launch/train_gpt_dynbatch.sh``, once per
MoE loss setting and batching: dynamic (``MAX_TOKENS_PER_GPU=256``: packed rows of one micro-batch
size 1) and fixed micro-batches (``--document-samples``, every document padded to 128) at
``--micro-batch-size`` 2 and 4. For each setting it prints the largest relative lm-loss difference
over the iterations (and the grad norm at iteration 1) of dynamic vs fixed mbs 2, next to fixed's
own difference between mbs 2 and 4. It also prints the tokens the routers no longer count
(padding and placeholders: computed minus real tokens) per iteration of the dynamic run and of
fixed mbs 2, which Megatron's dispatcher still sends to the experts (see ``docs/moe.md``).

Figures, not assertions: the exact cases are asserted in ``tests/megatron/test_moe_pretrain.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "launch"))
import compare_runs  # noqa: E402

SEQ_LENGTH = 128
GLOBAL_BATCH = 8
_MODEL = [
    "--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4,
    "--seq-length", SEQ_LENGTH, "--max-position-embeddings", SEQ_LENGTH, "--vocab-size", 128,
    "--global-batch-size", GLOBAL_BATCH, "--eval-iters", 0, "--eval-interval", 1000,
    "--seed", 7, "--num-experts", 4, "--moe-router-topk", 2,
    "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
]  # fmt: skip
#: MoE loss settings: name -> extra flags.
SETTINGS = {
    "none": ["--moe-router-load-balancing-type", "none"],
    "z_loss": ["--moe-router-load-balancing-type", "none", "--moe-z-loss-coeff", "0.01"],
    "aux_loss": ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
    "seq_aux_loss": [
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
    ],
    "global_aux_loss": [
        "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01",
    ],
}  # fmt: skip


def train(batching: str, micro_batch_size: int, flags: List, iters: int) -> Dict:
    """One run of the demo launcher; returns the parsed iteration records."""
    bin_dir = os.path.dirname(sys.executable)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        BATCHING=batching,
        MAX_TOKENS_PER_GPU="256",
        GPUS_PER_NODE="2",
    )
    env.pop("MASTER_PORT", None)  # the launch script's --standalone binds a port the kernel assigns
    args = _MODEL + ["--micro-batch-size", micro_batch_size, "--train-iters", iters] + flags
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "train_gpt_dynbatch.sh"), *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if result.returncode:
        raise SystemExit(f"{batching} mbs {micro_batch_size} failed:\n{result.stdout[-4000:]}")
    return compare_runs.parse_text(result.stdout)["iterations"]


def _max_rel_loss_diff(a: Dict, b: Dict) -> float:
    common = sorted(set(a) & set(b))
    return max(abs(a[i]["loss"] - b[i]["loss"]) / abs(b[i]["loss"]) for i in common)


def measure(iters: int) -> Dict[str, Dict]:
    figures = {}
    for name, flags in SETTINGS.items():
        dynamic = train("dynamic", 2, flags, iters)  # the micro-batch size is the planner's
        fixed2 = train("fixed", 2, flags, iters)
        fixed4 = train("fixed", 4, flags, iters)
        figures[name] = {
            "dynamic_vs_fixed_mbs2": _max_rel_loss_diff(dynamic, fixed2),
            "fixed_mbs4_vs_mbs2": _max_rel_loss_diff(fixed4, fixed2),
            "grad_norm_1": [
                dynamic[1]["grad_norm"],
                fixed2[1]["grad_norm"],
                fixed4[1]["grad_norm"],
            ],
            "loss": {i: [dynamic[i]["loss"], fixed2[i]["loss"]] for i in sorted(dynamic)},
            "padding_tokens_dynamic": [
                int(dynamic[i]["computed"] - dynamic[i]["real"]) for i in sorted(dynamic)
            ],
            "real_tokens": [int(dynamic[i]["real"]) for i in sorted(dynamic)],
        }
        print(f"  {name}: done", file=sys.stderr)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=4, help="training iterations per run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    figures = measure(args.iters)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(
        f"tiny MoE (4 experts, top-2), pp 2, {GLOBAL_BATCH} mock documents a step, seq "
        f"{SEQ_LENGTH}, {args.iters} iterations; max relative lm-loss difference over iterations"
    )
    print(
        f"{'setting':<16} {'dyn vs fixed mbs2':>18} {'fixed mbs4 vs 2':>16}  grad norm @1 d/f2/f4"
    )
    for name, f in figures.items():
        norms = "/".join(f"{g:.3f}" for g in f["grad_norm_1"])
        print(
            f"{name:<16} {f['dynamic_vs_fixed_mbs2']:>18.2e} {f['fixed_mbs4_vs_mbs2']:>16.2e}  "
            f"{norms}"
        )
    first = next(iter(figures.values()))
    fixed_padding = [GLOBAL_BATCH * SEQ_LENGTH - r for r in first["real_tokens"]]
    print(
        "padding tokens per iteration (no longer in any router statistic, still dispatched): "
        f"dynamic {first['padding_tokens_dynamic']}, fixed {fixed_padding} "
        f"(real tokens {first['real_tokens']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
