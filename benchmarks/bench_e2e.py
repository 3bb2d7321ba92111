"""End-to-end on real Megatron-Core (tiny GPT, CPU, gloo): dynamic vs fixed micro-batches.

Both modes run in one torchrun job from the same initial weights on the same long-tailed GRPO
rollouts (``benchmarks/train_demo.py``), so the ratio is measured under one machine state. Prints step
wall time, real tokens/s, computed and padded tokens, and the dynamic / fixed wall-time ratio
(target: <= 0.6). The first step of each mode is excluded from the timing (warm-up).

    .venv/bin/python -m benchmarks.bench_e2e [--steps 8] [--nproc 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2, help="processes (pp=2 each pipeline)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "e2e.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.nproc),
            str(ROOT / "benchmarks" / "train_demo.py"),
            "--use-dynamic-batch-size",
            "--steps",
            str(args.steps + 1),
            "--max-tokens-per-gpu",
            str(args.max_tokens_per_gpu),
            "--micro-batch-size",
            str(args.micro_batch_size),
            "--json-out",
            str(out),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            return proc.returncode
        runs = json.loads(out.read_text())["runs"]
    figures = {}
    for mode, history in runs.items():
        timed = history[1:]  # step 1 pays one-off allocations and lazy initialisation
        wall = sum(r["seconds"] for r in timed)
        real = sum(r["real_tokens"] for r in timed)
        computed = sum(r["computed_tokens"] for r in timed)
        figures[mode] = {
            "steps_timed": len(timed),
            "step_wall_s": wall / len(timed),
            "tokens_per_s": real / wall,
            "computed_tokens": computed,
            "padded_tokens": computed - real,
            "fill": real / computed,
            "final_loss": history[-1]["loss"],
        }
    ratio = figures["dynamic"]["step_wall_s"] / figures["fixed"]["step_wall_s"]
    report = {"figures": figures, "dynamic_over_fixed_step_time": ratio, "target": TARGET_RATIO}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{'':22}{'dynamic':>12}{'fixed':>12}")
    for key, fmt in (
        ("step_wall_s", "{:.3f}"),
        ("tokens_per_s", "{:.0f}"),
        ("computed_tokens", "{}"),
        ("padded_tokens", "{}"),
        ("fill", "{:.3f}"),
        ("final_loss", "{:.5f}"),
    ):
        print(
            f"{key:22}"
            + "".join(f"{fmt.format(figures[m][key]):>12}" for m in ("dynamic", "fixed"))
        )
    verdict = "meets" if ratio <= TARGET_RATIO else "misses"
    print(f"dynamic / fixed step time: {ratio:.2f}x ({verdict} the <= {TARGET_RATIO} target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
