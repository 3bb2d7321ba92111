"""What planning the next batch while a step trains saves: the Megatron-LM entry with
``--dynamic-batch-plan-ahead`` (the default) against ``--no-dynamic-batch-plan-ahead``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_plan_ahead.py --pairs 3 \\
        --data-dir /tmp/dynbatch-data --out /tmp/dynbatch-plan-ahead

Runs ``launch/train_gpt_dynbatch.sh`` (pp 2 on 2 gloo processes on a CPU; ``BATCHING=dynamic``)
on the ``short`` corpus (``benchmarks/bench_e2e_megatron_lm.py``'s), alternately with the plan made
ahead and made when its step starts, ``--pairs`` times, with ``--global-batch-size`` samples a
step (default 128: planning then takes tens of milliseconds) under ``--max-tokens-per-gpu``
(default 1024). Prints per run, over iterations 3+: the mean ``host prep (ms)`` (the time a step
spends in dynamic batching before its first micro-batch, the wait for a plan made ahead
included), the mean time per iteration, the batches planned ahead (``planned ahead: k/n``), and
whether the losses and learning rates of each pair are identical (the plans are the same).

On a CPU the ranks' own Python holds the interpreter lock that the planning thread needs, and two
ranks keep the two cores busy, so the time per iteration gains less than the host prep does; on a
GPU the step's kernels and collectives release the lock.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_e2e_megatron_lm import COMPARE, build_corpus, run  # noqa: E402

_PREP = re.compile(r"iteration\s+(\d+)/.*host prep \(ms\): ([\d.]+)")
_AHEAD = re.compile(r"planned ahead: (\d+)/(\d+)")
FROM_ITERATION = 3


def summarize(text: str) -> dict:
    """Mean host prep and time per iteration (iterations 3+), batches planned ahead, losses."""
    parsed = COMPARE.parse_text(text)
    its = parsed["iterations"]
    timed = [i for i in sorted(its) if i >= FROM_ITERATION]
    prep = {int(m.group(1)): float(m.group(2)) for m in map(_PREP.search, text.splitlines()) if m}
    ahead = [tuple(map(int, m.groups())) for m in map(_AHEAD.search, text.splitlines()) if m]
    return {
        "prep_ms": statistics.fmean(prep[i] for i in timed),
        "ms": statistics.fmean(its[i]["ms"] for i in timed),
        "ahead": (sum(k for k, _ in ahead), sum(n for _, n in ahead)),
        "losses": [its[i]["loss"] for i in sorted(its)],
        "lrs": [its[i]["lr"] for i in sorted(its)],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--train-iters", type=int, default=12)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=1024)
    parser.add_argument("--data-dir", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("extra", nargs="*", help="more Megatron arguments for both runs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = build_corpus("short", args.data_dir, sys.executable)
    common = [
        "--train-iters",
        str(args.train_iters),
        "--global-batch-size",
        str(args.global_batch_size),
        "--eval-iters",
        "0",
        *args.extra,
    ]
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    results = {"ahead": [], "then": []}
    for pair in range(args.pairs):
        for mode, flag in (
            ("ahead", "--dynamic-batch-plan-ahead"),
            ("then", "--no-dynamic-batch-plan-ahead"),
        ):
            log = args.out / f"{mode}-{pair}.log"
            text = run("dynamic", data, args.max_tokens_per_gpu, [*common, flag], log)
            results[mode].append(summarize(text))
            got = results[mode][-1]
            print(
                f"pair {pair} {mode:5s}: host prep {got['prep_ms']:.1f} ms, iteration "
                f"{got['ms']:.1f} ms, planned ahead {got['ahead'][0]}/{got['ahead'][1]} ({log})",
                flush=True,
            )
        same = all(
            results["ahead"][pair][key] == results["then"][pair][key] for key in ("losses", "lrs")
        )
        print(f"pair {pair}: losses and learning rates identical: {same}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for key, what in (("prep_ms", "host prep (ms)"), ("ms", "time per iteration (ms)")):
        ahead = statistics.median(r[key] for r in results["ahead"])
        then = statistics.median(r[key] for r in results["then"])
        print(
            f"median {what}: planned ahead {ahead:.1f}, planned then {then:.1f} ({ahead / then:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
