"""Simulated step time at cluster scale (dp <= 1,024, pp <= 16, vpp <= 4), ours vs baselines.

Every scheduler plans one long-tailed GRPO step (log-normal responses, groups of 8) sized so the
planner runs about 16 micro-batches per rank (7 at dp 1,024 pp 4). Each DP rank's micro-batches,
with their computed cost ``L + L^2/24576`` (padding segment and placeholders included), are replayed
through Megatron's 1F1B or interleaved order by ``planning/simulate.py``. Reported: the makespan
(slowest DP rank) over the ideal (all real work spread perfectly over dp * pp GPUs, no bubble; the
same for every scheduler), beside the micro-batch count, fill, cap violations and the DP imbalance
of the real cost that explain it.

Two limits keep the default run to a few minutes of CPU, and are printed when they bite: first-fit
baselines (slime, NeMo-RL) scan every open bin per sample, O(samples x bins), and are skipped above
``FIRST_FIT_LIMIT``; a simulation above ``MAX_SIM_EVENTS`` forward/backward steps is skipped.

Run: ``.venv/bin/python -m benchmarks.bench_pipeline [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

from benchmarks.baselines import BASELINES
from benchmarks.bench_compare import (
    GROUP_SIZE,
    OURS,
    TOKEN_CAP,
    Layout,
    make_mix,
    run_scheduler,
)

__all__ = ["CLUSTER_LAYOUTS", "QUICK_LAYOUTS", "run_layout"]

#: Prompts per DP rank for about 16 micro-batches per rank: a micro-batch of the cap holds about 8
#: samples of the long-tailed mix (mean ~1.9k tokens), i.e. one GRPO group.
PROMPTS_PER_RANK_FOR_16 = 15

CLUSTER_LAYOUTS = (
    Layout("dp64 pp8", 64, 8, 1, 64 * PROMPTS_PER_RANK_FOR_16),
    Layout("dp256 pp8 vpp2", 256, 8, 2, 256 * PROMPTS_PER_RANK_FOR_16),
    Layout("dp1024 pp4", 1024, 4, 1, 1024 * PROMPTS_PER_RANK_FOR_16 // 2),
    Layout("dp1024 pp16 vpp4", 1024, 16, 4, 1024 * PROMPTS_PER_RANK_FOR_16),
)
QUICK_LAYOUTS = (
    Layout("dp64 pp4", 64, 4, 1, 64 * PROMPTS_PER_RANK_FOR_16 // 2),
    Layout("dp128 pp8 vpp2", 128, 8, 2, 128 * PROMPTS_PER_RANK_FOR_16),
)
#: Baselines whose packer is first fit over all open bins (O(samples x bins), as upstream).
FIRST_FIT = ("slime_first_fit", "nemo_rl_ffd", "nemo_rl_mffd")
#: Skip a first-fit baseline above this many bin probes (~samples x bins / 2; 1e8 is ~10 s of CPU).
FIRST_FIT_LIMIT = 1e8
#: Skip a simulation above this many forward/backward steps (~0.5 us of CPU each).
MAX_SIM_EVENTS = 5_000_000


def run_layout(layout: Layout, *, seed: int = 0, repeats: int = 1) -> Dict[str, Any]:
    ls = make_mix("lognormal", layout.num_prompts, seed)
    tokens = sum(ls.lengths)
    bins = tokens / TOKEN_CAP
    rows = []
    for name in (OURS, *BASELINES):
        probes = len(ls.lengths) * bins / 2
        if name in FIRST_FIT and probes > FIRST_FIT_LIMIT:
            rows.append(
                {
                    "scheduler": name,
                    "status": (
                        f"skipped: first fit ~{probes:.1e} bin probes > {FIRST_FIT_LIMIT:.0e}"
                    ),
                }
            )
            continue
        rows.append(
            run_scheduler(name, ls, layout.parallel, repeats=repeats, max_sim_events=MAX_SIM_EVENTS)
        )
    return {
        "layout": layout.name,
        "dp": layout.dp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "num_samples": len(ls.lengths),
        "num_prompts": layout.num_prompts,
        "group_size": GROUP_SIZE,
        "rows": rows,
    }


def format_layout(result: Dict[str, Any]) -> str:
    lines = [
        f"== {result['layout']}: {result['num_samples']} samples ({result['num_prompts']} GRPO "
        f"groups), cap {TOKEN_CAP} ==",
        f"{'scheduler':<16} {'M/rank':>6} {'LB':>4} {'fill':>6} {'overcap':>7} {'imb cost':>8} "
        f"{'plan ms':>9} {'step/ideal':>10}",
    ]
    for row in result["rows"]:
        if row["status"] != "ok":
            lines.append(f"{row['scheduler']:<16} {row['status']}")
            continue
        step = (
            f"{row['step_over_ideal']:>10.4f}"
            if "step_over_ideal" in row
            else f"{'-':>10}  ({row.get('sim_note', '')})"
        )
        lines.append(
            f"{row['scheduler']:<16} {row['num_microbatches']:>6} {row['lower_bound_per_rank']:>4} "
            f"{row['fill']:>6.3f} {row['over_cap_microbatches']:>7} "
            f"{row['dp_imbalance_cost']:>8.4f} "
            f"{row['plan_ms']:>9.1f} {step}"
        )
    return "\n".join(lines)


def summary(results: List[Dict[str, Any]]) -> List[str]:
    """Per layout: ours' step/ideal against the best simulated baseline."""
    lines = ["== makespan / ideal, ours vs best baseline =="]
    for result in results:
        rows = {r["scheduler"]: r for r in result["rows"]}
        ours = rows[OURS].get("step_over_ideal")
        others = [
            (r["step_over_ideal"], n)
            for n, r in rows.items()
            if n != OURS and r["status"] == "ok" and "step_over_ideal" in r
        ]
        if ours is None or not others:
            lines.append(f"{result['layout']:<18} (not enough simulated rows)")
            continue
        best, name = min(others)
        outcome = (
            "win" if ours < best * (1 - 1e-3) else "match" if ours <= best * (1 + 1e-3) else "LOSE"
        )
        lines.append(
            f"{result['layout']:<18} ours {ours:.4f}  best baseline {name} {best:.4f}  "
            f"({(ours / best - 1) * 100:+.1f}%)  {outcome}"
        )
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small cluster layouts")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of tables"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    layouts = QUICK_LAYOUTS if args.quick else CLUSTER_LAYOUTS
    results = []
    for layout in layouts:
        results.append(run_layout(layout, seed=args.seed))
        if not args.json:
            print(format_layout(results[-1]), flush=True)
            print()
    if args.json:
        print(json.dumps({"layouts": results, "summary": summary(results)}, allow_nan=False))
    else:
        print("\n".join(summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
