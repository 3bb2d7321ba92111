"""End to end at equal memory: Megatron-LM's entry script, dynamic against fixed micro-batches.

Equal memory means equal bytes, measured: in every pair the fixed run goes first, and its measured
peak (``peak memory measured over training (MiB)``, the largest rank's) becomes the dynamic run's
``--max-memory-gib``, with a token budget (``--memory-token-budget``, default 4096) that would
otherwise allow far larger rows. Both peaks are printed beside the times, and the memory model's
calibrated prediction error (``peak memory predicted/measured`` of iterations 3+).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_e2e_megatron_lm.py --pairs 3 \\
        --data-dir /tmp/dynbatch-data --out /tmp/dynbatch-e2e

For each bundled corpus (``short``: Python's documentation one paragraph per document,
``launch/make_pydoc_corpus.py``; ``mixed``: very long documents mixed with short ones,
``launch/make_mixed_corpus.py``, cut at ``--seq-length``) it runs ``launch/train_gpt_dynbatch.sh``
(pp 2 on 2 gloo processes on a CPU) alternately with ``BATCHING=fixed`` (Megatron's ``[4 x 256]``
micro-batches on the same samples) and ``BATCHING=dynamic`` with a budget of the same memory,
``--max-tokens-per-gpu 1024`` = 4 x 256 (default settings: calibration on), ``--pairs`` times, and
prints per corpus: the median over pairs of the dynamic / fixed time per iteration (mean of
iterations 2+ of each run, from Megatron's ``elapsed time per iteration``), each run's fill, the
largest relative loss difference, whether the learning rates are identical, and how far the
calibrated prediction (``step time predicted/measured`` in the dynamic iteration line) is from
Megatron's measured time per iteration. ``--budget`` adds more dynamic budgets (e.g. 256, a
quarter of the memory) beside the equal-memory one; ``--variable-seq-lengths`` adds the
equal-memory budget with per-micro-batch rows (``--variable-seq-lengths``) beside uniform rows.
Each ratio line prints its pairs and their spread (largest minus smallest).

Timings on a shared machine are noisy: the load average (``os.getloadavg``) is printed before and
after, and the runs alternate so that load drifts hit both sides.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from typing import Dict, List

REPO = pathlib.Path(__file__).resolve().parents[1]
SEQ_LENGTH = 256  # launch/train_gpt_dynbatch.sh
MICRO_BATCH_SIZE = 4  # launch/train_gpt_dynbatch.sh: fixed micro-batches are [4 x 256]
_PREDICTED = re.compile(r"step time predicted/measured \(ms\): ([\d.]+)/([\d.]+) \(fit\)")
_PEAK = re.compile(r"peak memory measured over training \(MiB\): ([\d.]+)")
_MEMORY = re.compile(r"peak memory predicted/measured \(MiB\): (\d+)/(\d+)")
#: Iterations whose memory prediction counts as calibrated: the first is the probe, the second is
#: planned from the probe's cover-all factor, the fit starts with the third.
MEMORY_CALIBRATED_FROM = 3
EQUAL_BYTES = "dynamic-memory"
_ITERATION = re.compile(r"iteration\s+(\d+)/")


def _compare_runs():
    spec = importlib.util.spec_from_file_location(
        "compare_runs", REPO / "launch" / "compare_runs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMPARE = _compare_runs()
CORPORA = {"short": "make_pydoc_corpus.py", "mixed": "make_mixed_corpus.py"}


def build_corpus(name: str, data_dir: pathlib.Path, python: str) -> str:
    """The indexed dataset prefix of corpus ``name``, built on first use."""
    prefix = data_dir / f"{name}_text_document"
    if not (prefix.with_suffix(".idx").is_file() and prefix.with_suffix(".bin").is_file()):
        data_dir.mkdir(parents=True, exist_ok=True)
        jsonl = data_dir / f"{name}.jsonl"
        subprocess.run([python, str(REPO / "launch" / CORPORA[name]), str(jsonl)], check=True)
        subprocess.run(
            [
                python,
                "-m",
                "megatron_dynbatch.integrations.megatron_lm.data.preprocess",
                "--input",
                str(jsonl),
                "--output-prefix",
                str(data_dir / name),
                "--append-eod",
            ],
            check=True,
            cwd=REPO,
        )
    return str(prefix)


def run(batching: str, data: str, budget: int, extra: List[str], log: pathlib.Path) -> str:
    """One ``launch/train_gpt_dynbatch.sh`` run; its log text."""
    env = dict(
        os.environ,
        BATCHING=batching,
        DATA_PATH=data,
        MAX_TOKENS_PER_GPU=str(budget),
        TORCHRUN=os.environ.get("TORCHRUN", str(pathlib.Path(sys.executable).parent / "torchrun")),
        MASTER_PORT=os.environ.get("MASTER_PORT", "6123"),
    )
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "train_gpt_dynbatch.sh"), *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log.write_text(result.stdout)
    if result.returncode != 0:
        raise SystemExit(f"error: the {batching} run failed (rc {result.returncode}); see {log}")
    return result.stdout


def summarize(text: str, fixed: bool) -> Dict[str, float]:
    """Mean time per iteration (2+), fill, and the per-iteration records of one log."""
    parsed = COMPARE.parse_text(text)
    its = parsed["iterations"]
    timed = [i for i in sorted(its) if i > 1]
    ms = statistics.fmean(its[i]["ms"] for i in timed)
    if fixed:
        fill = None
    else:
        fill = sum(its[i]["real"] for i in its) / sum(its[i]["computed"] for i in its)
    errors = []
    for line in text.splitlines():
        found, it = _PREDICTED.search(line), _ITERATION.search(line)
        if found and it and int(it.group(1)) in its:
            measured = its[int(it.group(1))]["ms"]
            errors.append(abs(float(found.group(1)) - measured) / measured)
    calibrated = sorted(
        int(it.group(1))
        for line in text.splitlines()
        if _PREDICTED.search(line) and (it := _ITERATION.search(line))
    )
    peak = _PEAK.search(text)
    memory_errors = []
    for line in text.splitlines():
        found, it = _MEMORY.search(line), _ITERATION.search(line)
        if found and it and int(it.group(1)) >= MEMORY_CALIBRATED_FROM:
            predicted, measured = float(found.group(1)), float(found.group(2))
            memory_errors.append((predicted - measured) / measured)
    return {
        "ms": ms,
        "fill": fill,
        "its": its,
        "prediction_errors": errors,
        "calibrated": calibrated,
        "peak": float(peak.group(1)) if peak else None,
        "memory_errors": memory_errors,
    }


def _mean_ms(run: Dict, iterations) -> float:
    return statistics.fmean(run["its"][i]["ms"] for i in iterations)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="alternating dynamic/fixed pairs")
    parser.add_argument("--corpus", choices=[*CORPORA, "both"], default="both")
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument(
        "--budget",
        type=int,
        action="append",
        default=[],
        help="extra dynamic token budgets besides the equal-bytes run (e.g. 1024 = 4 x 256, the "
        "equal-token comparison)",
    )
    parser.add_argument(
        "--memory-token-budget",
        type=int,
        default=4096,
        help="--max-tokens-per-gpu of the equal-bytes run, beside --max-memory-gib (default "
        "4096: four times fixed's 4 x 256, so memory, not tokens, bounds the rows)",
    )
    parser.add_argument(
        "--variable-seq-lengths",
        action="store_true",
        help="also run the equal-memory budget with --variable-seq-lengths (each micro-batch its "
        "own row, shapes exchanged), beside the uniform rows",
    )
    parser.add_argument(
        "--dynamic-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra flag for the dynamic runs only, e.g. "
        "--dynamic-arg=--dynamic-batch-calibration-steps --dynamic-arg=0 (the default model alone)",
    )
    parser.add_argument("--data-dir", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument(
        "--reuse-logs", action="store_true", help="summarize the logs already in --out, run nothing"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    extra = ["--train-iters", str(args.train_iters), "--eval-iters", "0"]
    budgets = list(dict.fromkeys(args.budget))
    corpora = list(CORPORA) if args.corpus == "both" else [args.corpus]
    print(f"load average before: {os.getloadavg()}")
    started = time.monotonic()
    for corpus in corpora:
        data = None if args.reuse_logs else build_corpus(corpus, args.data_dir, sys.executable)
        results: Dict[str, List[Dict[str, float]]] = {"fixed": [], EQUAL_BYTES: []}
        for budget in budgets:
            results[f"dynamic-{budget}"] = []
        if args.variable_seq_lengths:
            results[f"{EQUAL_BYTES}-variable"] = []
        for pair in range(args.pairs):
            # Fixed first: its measured peak is the equal-bytes runs' memory budget.
            dynamic = [name for name in results if name != "fixed"]
            order = ["fixed"] + (dynamic if pair % 2 == 0 else list(reversed(dynamic)))
            for name in order:
                log = args.out / f"{corpus}-{name}-{pair}.log"
                flags = extra + (["--variable-seq-lengths"] if name.endswith("-variable") else [])
                if name == "fixed":
                    batching, budget = "fixed", MICRO_BATCH_SIZE * SEQ_LENGTH
                elif name.startswith(EQUAL_BYTES):
                    batching, budget = "dynamic", args.memory_token_budget
                    peak = results["fixed"][-1]["peak"]
                    if peak is None:
                        raise SystemExit(f"error: no measured peak in the fixed run's log {log}")
                    flags += ["--max-memory-gib", f"{peak / 1024:.6f}"]
                else:
                    batching, budget = "dynamic", int(name.split("-")[1])
                if batching == "dynamic":
                    flags += args.dynamic_arg
                if args.reuse_logs:
                    text = log.read_text()
                else:
                    text = run(batching, data, budget, flags, log)
                results[name].append(summarize(text, fixed=name == "fixed"))
                last = results[name][-1]
                print(
                    f"  {corpus} {name} run {pair}: {last['ms']:.1f} ms/iteration, peak "
                    f"{last['peak']} MiB"
                )
        fixed_fill = _fixed_fill(results)
        print(
            f"\n=== {corpus} (fixed [{MICRO_BATCH_SIZE}x{SEQ_LENGTH}], fill {fixed_fill:.3f}) ==="
        )
        for name in results:
            if name == "fixed":
                continue
            ratios = [
                d["ms"] / f["ms"] for d, f in zip(results[name], results["fixed"], strict=True)
            ]
            worst, lr_equal = _agreement(results[name], results["fixed"])
            errors = [e for r in results[name] for e in r["prediction_errors"]]
            fill = statistics.fmean(r["fill"] for r in results[name])
            print(
                f"{name}: time per iteration dynamic/fixed median {statistics.median(ratios):.3f} "
                f"(pairs {', '.join(f'{r:.3f}' for r in ratios)}; spread "
                f"{max(ratios) - min(ratios):.3f}); fill {fill:.3f}; largest "
                f"relative loss difference {worst:.1e}; learning rates identical: "
                f"{'yes' if lr_equal else 'NO'}"
            )
            after = [
                _mean_ms(d, d["calibrated"]) / _mean_ms(f, d["calibrated"])
                for d, f in zip(results[name], results["fixed"], strict=True)
                if d["calibrated"]
            ]
            if after:
                first = min(r["calibrated"][0] for r in results[name] if r["calibrated"])
                print(
                    f"  after an applied fit only (iterations {first}+ of the "
                    f"{len(after)} run(s) that applied one): dynamic/fixed median "
                    f"{statistics.median(after):.3f} (pairs {', '.join(f'{r:.3f}' for r in after)}"
                    f"; spread {max(after) - min(after):.3f})"
                )
            if errors:
                print(
                    f"  calibrated prediction vs measured time per iteration: median error "
                    f"{100 * statistics.median(errors):.1f}% over {len(errors)} iterations"
                )
            peaks = [
                (d["peak"], f["peak"])
                for d, f in zip(results[name], results["fixed"], strict=True)
                if d["peak"] and f["peak"]
            ]
            if peaks:
                print(
                    "  peak memory (largest rank, MiB) dynamic/fixed: "
                    + ", ".join(f"{d:.1f}/{f:.1f} ({d / f:.3f})" for d, f in peaks)
                )
            memory_errors = [e for r in results[name] for e in r["memory_errors"]]
            if memory_errors:
                absolute = sorted(abs(e) for e in memory_errors)
                print(
                    f"  peak memory predicted vs measured (iterations {MEMORY_CALIBRATED_FROM}+): "
                    f"median error {100 * statistics.median(absolute):.1f}%, largest "
                    f"{100 * absolute[-1]:.1f}% ({100 * min(memory_errors):+.1f}% to "
                    f"{100 * max(memory_errors):+.1f}%) over {len(memory_errors)} iterations"
                )
    print(f"\nload average after: {os.getloadavg()}; {time.monotonic() - started:.0f} s in all")
    return 0


def _fixed_fill(results) -> float:
    dynamic = next(v for k, v in results.items() if k != "fixed")
    real = sum(r["its"][i]["real"] for r in dynamic[:1] for i in r["its"])
    computed = sum(
        r["its"][i]["batch"] * SEQ_LENGTH for r in results["fixed"][:1] for i in r["its"]
    )
    return real / computed


def _agreement(dynamic_runs, fixed_runs):
    worst, lr_equal = 0.0, True
    for d_run, f_run in zip(dynamic_runs, fixed_runs, strict=True):
        for i, f in f_run["its"].items():
            d = d_run["its"][i]
            worst = max(worst, abs(d["loss"] - f["loss"]) / max(abs(f["loss"]), 1e-12))
            lr_equal &= d["lr"] == f["lr"]
    return worst, lr_equal


if __name__ == "__main__":
    sys.exit(main())
