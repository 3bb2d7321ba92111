"""Planning speed and memory at scale: the speed table of the README, and how time grows.

Every figure is CPU time (``time.process_time``) of the single-threaded planner, the minimum of
five runs (other load on the machine only ever adds time: on a shared 2-core machine it can double
a figure), and peak memory from ``tracemalloc`` in
a separate run (tracing slows Python down). Workloads, all with the benchmark cost model
(``L + L^2/24576``, :data:`benchmarks.metrics.EVAL_COST`):

* ``16k/dp512``: 16,384 long-tailed GRPO samples (groups of 8), dp 512, cap 16,384;
* ``1M/dp512``: 1,048,576 of them (131,072 groups), dp 512;
* ``131k over half/dp8``: 131,072 samples all just over half the cap (8,193..8,704 of 16,384), dp 8:
  no two share a row;
* ``131k 5-5-4-3-3/dp512``: 131,072 samples repeating 8000, 8000, 6400, 4800, 4800 under a cap of
  16,000, dp 512: LPT breaks the cap, best fit pairs the 6400s, next fit packs them perfectly;
* ``cap 1e10``: peak memory of planning a few samples under a cap of 1e10 tokens against 1e4.

Then the growth of planning time with the sample count (4k..262k at dp 64) and with dp (8..1,024
at 65,536 samples), and our planner against verl on the 16k/dp512 step: our re-implementation of
verl's pipeline, and verl's real code when ``VERL_SRC`` names a checkout (``benchmarks/peers.py``).

``--small``: only the planning CPU of steps of 64-1,024 samples, told the per-micro-batch overhead
and not (:func:`small_steps`).

``--large``: only the planning CPU of pipelined GRPO steps of 1,408-65,536 samples with their own
rows (:func:`large_steps`), where the chosen shape is refined on a smaller budget.

Run: ``.venv/bin/python -m benchmarks.bench_planner [--quick | --small | --large] [--json]
[--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tracemalloc
from typing import Any, Callable, Dict, List, Optional, Tuple

from benchmarks import peers
from benchmarks.baselines import verl_kk
from benchmarks.lengths import LengthSet, grpo_lengths, lognormal_lengths
from benchmarks.metrics import EVAL_COST, planner_config
from megatron_dynbatch.planning import CostModel, ParallelLayout, PlannerConfig, plan_schedule

__all__ = ["WORKLOADS", "measure", "speed_table"]

TOKEN_CAP = 16384
GROUP_SIZE = 8
#: Goals of the speed table (issue 12): CPU seconds, or None where memory is the figure.
GOALS = {
    "16k/dp512": 0.050,
    "1M/dp512": 5.0,
    "131k over half/dp8": 2.0,
    "131k 5-5-4-3-3/dp512": 1.0,
}


def _grpo(num_samples: int) -> LengthSet:
    return grpo_lengths(num_samples // GROUP_SIZE, GROUP_SIZE, max_len=TOKEN_CAP, seed=0)


def _over_half(num_samples: int) -> LengthSet:
    # A fixed spread over (cap/2, cap/2 + 512]: 7919 is prime to 512, so every offset occurs.
    lengths = [TOKEN_CAP // 2 + 1 + (i * 7919) % 512 for i in range(num_samples)]
    return LengthSet(lengths, None, None)


def _pattern(num_samples: int) -> LengthSet:
    pattern = (8000, 8000, 6400, 4800, 4800)
    return LengthSet([pattern[i % 5] for i in range(num_samples)], None, None)


#: name -> (samples, dp, cap, generator).
WORKLOADS: Dict[str, Tuple[int, int, int, Callable[[int], LengthSet]]] = {
    "16k/dp512": (16384, 512, TOKEN_CAP, _grpo),
    "1M/dp512": (1 << 20, 512, TOKEN_CAP, _grpo),
    "131k over half/dp8": (1 << 17, 8, TOKEN_CAP, _over_half),
    "131k 5-5-4-3-3/dp512": (1 << 17, 512, 16000, _pattern),
}


def _config(dp: int, cap: int) -> PlannerConfig:
    return planner_config(cap, ParallelLayout(dp_size=dp), EVAL_COST)


def measure(
    ls: LengthSet, dp: int, cap: int, *, repeats: int = 3, memory: bool = True
) -> Dict[str, Any]:
    """CPU time (min and median of ``repeats``) and peak traced memory of planning one step."""
    config = _config(dp, cap)

    def plan():
        return plan_schedule(ls.lengths, ls.rollout_ids, ls.prompt_lengths, config=config)

    times = []
    for _ in range(repeats):
        start = time.process_time()
        result = plan()
        times.append(time.process_time() - start)
        if sum(times) > 20.0:  # enough CPU spent on one workload
            break
    step = result.steps[0]
    row: Dict[str, Any] = {
        "samples": len(ls.lengths),
        "dp": dp,
        "cap": cap,
        "cpu_s_min": min(times),
        "cpu_s_median": sorted(times)[len(times) // 2],
        "M": step.num_microbatches,
        "min_M": step.min_microbatches,
        "lower_bound_per_rank": math.ceil(step.lower_bound_microbatches / dp),
        "S": step.seq_length,
        "fill": step.fill,
    }
    if memory:
        tracemalloc.start()
        plan()
        row["peak_MB"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    return row


def cap_memory() -> Dict[str, float]:
    """Peak traced memory of planning a few samples under caps of 1e4 and 1e10 tokens."""
    peaks = {}
    for cap in (10**4, 10**10):
        tracemalloc.start()
        plan_schedule([100, 5000, 9000, 3, 7000], config=_config(2, cap))
        peaks[f"{cap:.0e}"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    return peaks


def speed_table(repeats: int = 5, names: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    rows = []
    for name in names or list(WORKLOADS):
        n, dp, cap, make = WORKLOADS[name]
        row = measure(make(n), dp, cap, repeats=repeats)
        row["workload"] = name
        row["goal_s"] = GOALS.get(name)
        rows.append(row)
    return rows


def growth(repeats: int = 3) -> List[Dict[str, Any]]:
    """Planning time against the sample count (dp 64) and against dp (65,536 samples)."""
    rows = []
    for n in (4096, 16384, 65536, 262144):
        rows.append({**measure(_grpo(n), 64, TOKEN_CAP, repeats=repeats, memory=False)})
    for dp in (8, 128, 1024):
        rows.append({**measure(_grpo(65536), dp, TOKEN_CAP, repeats=repeats, memory=False)})
    return rows


def versus_verl(repeats: int = 3) -> Dict[str, Any]:
    """16k/dp512: ours against verl's pipeline (our re-implementation, and the real code)."""
    ls = _grpo(16384)
    ours = measure(ls, 512, TOKEN_CAP, repeats=repeats, memory=False)
    start = time.process_time()
    verl_kk(ls.lengths, dp_size=512, token_cap=TOKEN_CAP)
    result = {
        "ours_ms": ours["cpu_s_min"] * 1e3,
        "verl_reimplementation_ms": (time.process_time() - start) * 1e3,
    }
    if peers.available("verl_kk"):
        _, times = peers.real_verl(ls.lengths, dp_size=512, token_cap=TOKEN_CAP)
        result["verl_real_driver_ms"] = times["driver_s"] * 1e3
        result["verl_real_slowest_rank_ms"] = times["slowest_rank_s"] * 1e3
    return result


#: ``--small``: steps of at most 1,024 samples, where the planner also builds the trainers' own
#: schedules (``shape._peer_guard``): (samples, dp, pp, vpp, each micro-batch its own row).
SMALL_STEPS = (
    (64, 1, 2, 1, True),
    (256, 4, 2, 1, True),
    (256, 32, 2, 2, False),
    (512, 16, 4, 2, True),
    (1024, 8, 2, 1, True),
    (1024, 8, 2, 1, False),
)


def _timed_row(
    lengths: List[int],
    dp: int,
    pp: int,
    vpp: int,
    own_rows: bool,
    overhead: Optional[float],
    repeats: int,
) -> Dict[str, Any]:
    """The least planning CPU of ``repeats`` plans of one step (cap 16k, the benchmark's
    attention weight; ``overhead`` None: not told), and its micro-batch count."""
    config = PlannerConfig(
        max_tokens_per_gpu=TOKEN_CAP,
        parallel=ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp),
        cost=CostModel(attention_weight=EVAL_COST.attention_weight, microbatch_overhead=overhead),
        variable_row_lengths=own_rows,
        row_multiple=128 if own_rows else 1,
    )
    times = []
    for _ in range(repeats):
        start = time.process_time()
        plan = plan_schedule(lengths, config=config)
        times.append(time.process_time() - start)
    return {
        "samples": len(lengths),
        "dp": dp,
        "pp": pp,
        "vpp": vpp,
        "own_rows": own_rows,
        "told": overhead is not None,
        "cpu_s_min": min(times),
        "M": plan.steps[0].num_microbatches,
    }


def small_steps(repeats: int = 3) -> List[Dict[str, Any]]:
    """Planning CPU of long-tailed steps of 64-1,024 samples (cap 16k), not told the overhead
    (the planner assumes 2% of a row and checks its plan against the trainers' own schedules)
    and told it (2% of a row)."""
    rows = []
    for n, dp, pp, vpp, own_rows in SMALL_STEPS:
        lengths = lognormal_lengths(n, median=1024, sigma=1.2, max_len=TOKEN_CAP, seed=3)
        for overhead in (None, 0.02 * TOKEN_CAP):
            rows.append(_timed_row(lengths, dp, pp, vpp, own_rows, overhead, repeats))
    return rows


#: ``--large``: pipelined GRPO steps of more than 1,024 samples with their own rows (slime's
#: default), where the chosen shape is refined on a smaller budget (``shape._LARGE_REFINE_STEPS``)
#: or, with many ranks and micro-batches, not at all: (samples, dp, pp, vpp).
LARGE_STEPS = (
    (1408, 64, 4, 2),
    (2048, 16, 4, 1),
    (4096, 64, 4, 2),
    (16384, 64, 2, 1),
    (16384, 512, 4, 2),
    (65536, 64, 4, 2),
)


def large_steps(repeats: int = 3) -> List[Dict[str, Any]]:
    """Planning CPU of pipelined GRPO steps of 1,408-65,536 samples (groups of 8, cap 16k), each
    micro-batch its own row (rounded to 128), the overhead not told."""
    return [
        _timed_row(
            grpo_lengths(n // GROUP_SIZE, GROUP_SIZE, max_len=TOKEN_CAP, seed=1).lengths,
            dp,
            pp,
            vpp,
            True,
            None,
            repeats,
        )
        for n, dp, pp, vpp in LARGE_STEPS
    ]


def _format_row(row: Dict[str, Any]) -> str:
    name = row.get("workload", f"{row['samples']}/dp{row['dp']}")
    goal = row.get("goal_s")
    verdict = "" if goal is None else ("  PASS" if row["cpu_s_min"] <= goal else "  FAIL")
    goal_text = f"{goal * 1e3:>8.0f}" if goal is not None else f"{'-':>8}"
    memory = f"{row['peak_MB']:>8.0f}" if "peak_MB" in row else f"{'-':>8}"
    return (
        f"{name:<22} {row['cpu_s_min'] * 1e3:>9.1f} {row['cpu_s_median'] * 1e3:>9.1f} "
        f"{goal_text} {memory} {row['M']:>5} {row['min_M']:>5} {row['lower_bound_per_rank']:>4} "
        f"{row['S']:>6} {row['fill']:>6.3f}{verdict}"
    )


HEADER = (
    f"{'workload':<22} {'min ms':>9} {'med ms':>9} {'goal ms':>8} {'peak MB':>8} {'M':>5} "
    f"{'minM':>5} {'LB':>4} {'S':>6} {'fill':>6}"
)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 16k/dp512 row only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (min reported)")
    parser.add_argument(
        "--small", action="store_true", help="steps of 64-1,024 samples only, told and not"
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help="pipelined steps of 1,408-65,536 samples with their own rows only",
    )
    args = parser.parse_args(argv)
    if args.small or args.large:
        key = "small_steps" if args.small else "large_steps"
        rows = small_steps(args.repeats) if args.small else large_steps(args.repeats)
        if args.json:
            print(json.dumps({key: rows}, allow_nan=False))
            return 0
        for row in rows:
            print(
                f"{row['samples']:>5} samples dp {row['dp']:>3} pp {row['pp']} vpp {row['vpp']} "
                f"{'own rows' if row['own_rows'] else 'one row '} "
                f"{'told    ' if row['told'] else 'not told'}: {row['cpu_s_min'] * 1e3:7.1f} ms "
                f"(min of {args.repeats}), M {row['M']}"
            )
        return 0
    names = ["16k/dp512"] if args.quick else None
    table = speed_table(args.repeats, names)
    result: Dict[str, Any] = {"speed": table, "cap_memory_MB": cap_memory()}
    if not args.quick:
        result["growth"] = growth(args.repeats)
        result["versus_verl"] = versus_verl(args.repeats)
    if args.json:
        print(json.dumps(result, allow_nan=False))
        return 0
    print(HEADER)
    for row in table:
        print(_format_row(row))
    caps = result["cap_memory_MB"]
    print(
        "peak memory planning 5 samples: "
        + ", ".join(f"cap {k}: {v:.2f} MB" for k, v in caps.items())
    )
    if "growth" in result:
        print("growth (time per sample should stay about flat):")
        for row in result["growth"]:
            per = row["cpu_s_min"] / row["samples"] * 1e6
            print(
                f"  {row['samples']:>7} samples dp {row['dp']:>4}: {row['cpu_s_min'] * 1e3:>8.1f} ms, {per:.2f} us/sample"
            )
        verl = result["versus_verl"]
        line = (
            f"16k/dp512: ours {verl['ours_ms']:.0f} ms; verl re-implementation "
            f"{verl['verl_reimplementation_ms']:.0f} ms"
        )
        if "verl_real_driver_ms" in verl:
            line += (
                f"; verl real: driver {verl['verl_real_driver_ms']:.0f} ms + slowest rank "
                f"{verl['verl_real_slowest_rank_ms']:.1f} ms"
            )
        else:
            line += " (set VERL_SRC to a verl checkout to time the real code)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
