"""Every baseline scheduler against the planner on one step, figure by figure, with a verdict.

Mixes (GRPO groups of 8 unless noted): ``lognormal`` (long-tailed, correlated within a group),
``bimodal``, ``uniform`` and ``multi_turn`` (agentic rollouts, a variable number of samples each).
Layouts: dp 8 pp 1; dp 4 pp 2; dp 64 pp 4 vpp 2. Per (mix, layout) a table of: micro-batches per
rank against the lower bound, fill (real / computed tokens), micro-batches over the cap, DP
imbalance (max/mean rank) by tokens and by cost ``L + L^2/24576``, placeholders, planning CPU time,
and the simulated step time over the ideal (all real work spread over every GPU with no bubble:
the same denominator for every scheduler, so padding and placeholders count against the scheduler
that makes them).

``ours`` is the planner with the cost model the figures use (``L + L^2/24576``); ``ours/tok``
(shown, not judged) is the planner with its default plain-token cost.

Run: ``.venv/bin/python -m benchmarks.bench_compare [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks.baselines import BASELINES, BaselineFailure, BaselineSchedule
from benchmarks.lengths import (
    LengthSet,
    bimodal_lengths,
    grpo_lengths,
    multi_turn_lengths,
    uniform_lengths,
)
from benchmarks.metrics import EVAL_COST, evaluate, ideal_step_time, planner_config, step_time
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import CostModel, ParallelLayout, SampleSet, run_planner

__all__ = [
    "CASE_LAYOUTS",
    "EVAL_COST",
    "FIGURES",
    "GROUP_SIZE",
    "MIXES",
    "TOKEN_CAP",
    "Layout",
    "make_mix",
    "run_case",
    "run_scheduler",
    "verdict",
]

#: The per-GPU token cap of every case. The mixes are clipped to it so no sample is oversize: verl
#: and NeMo-RL raise on oversize samples, and the comparison is about packing, not that check.
TOKEN_CAP = 16384
#: Samples per GRPO prompt group.
GROUP_SIZE = 8
OURS = "ours"
OURS_TOKENS = "ours/tok"
#: Rows the verdict does not judge (informational variants of the planner).
UNJUDGED = (OURS_TOKENS,)


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the number of GRPO prompts of its step."""

    name: str
    dp: int
    pp: int
    vpp: int
    num_prompts: int

    @property
    def parallel(self) -> ParallelLayout:
        return ParallelLayout(dp_size=self.dp, pp_size=self.pp, vpp_size=self.vpp)


CASE_LAYOUTS = (
    Layout("dp8 pp1", 8, 1, 1, 128),
    Layout("dp4 pp2", 4, 2, 1, 64),
    Layout("dp64 pp4 vpp2", 64, 4, 2, 512),
)


def _grouped(lengths: List[int]) -> LengthSet:
    """Consecutive samples in groups of GROUP_SIZE sharing a rollout id (a GRPO prompt group)."""
    return LengthSet(lengths, [i // GROUP_SIZE for i in range(len(lengths))], None)


#: name -> (num_prompts, seed) -> LengthSet; every sample <= TOKEN_CAP.
MIXES: Dict[str, Callable[[int, int], LengthSet]] = {
    "lognormal": lambda p, seed: grpo_lengths(p, GROUP_SIZE, max_len=TOKEN_CAP, seed=seed),
    "bimodal": lambda p, seed: _grouped(
        bimodal_lengths(p * GROUP_SIZE, max_len=TOKEN_CAP, seed=seed)
    ),
    "uniform": lambda p, seed: _grouped(uniform_lengths(p * GROUP_SIZE, high=8192, seed=seed)),
    # About three turns per rollout: this many rollouts give about as many samples as the others.
    "multi_turn": lambda p, seed: multi_turn_lengths(
        p * GROUP_SIZE // 3, max_len=TOKEN_CAP, seed=seed
    ),
}


def make_mix(mix: str, num_prompts: int, seed: int = 0) -> LengthSet:
    if mix not in MIXES:
        raise DynBatchValueError(f"mix={mix!r} is not one of {sorted(MIXES)}.")
    return MIXES[mix](num_prompts, seed)


def _timed(fn: Callable[[], Any], repeats: int) -> tuple:
    """(result of the last call, median CPU time in ms); one call when the first is slow (> 1 s).

    Process time, not wall time: every scheduler is single-threaded Python, and other load on the
    machine must not decide a comparison.
    """
    times = []
    result = None
    for _ in range(repeats):
        start = time.process_time()
        result = fn()
        times.append((time.process_time() - start) * 1e3)
        if times[0] > 1000.0:
            break
    return result, statistics.median(times)


def schedule(name: str, ls: LengthSet, parallel: ParallelLayout, token_cap: int):
    """``ranks[r][m]`` of one step by scheduler ``name`` (baselines may raise BaselineFailure).

    A baseline is called itself, for the upstream details its :class:`BaselineSchedule` carries;
    ours, and any other registered planner, run through the planner registry as the
    hosts run them (``ours``: the default planner with the evaluation cost model, ``ours/tok``
    with a token-only one)."""
    if name not in BASELINES:
        config = planner_config(
            token_cap, parallel, CostModel() if name == OURS_TOKENS else EVAL_COST
        )
        if name not in (OURS, OURS_TOKENS):
            config = dataclasses.replace(config, planner=name)
        samples = SampleSet.build(ls.lengths, ls.rollout_ids, ls.prompt_lengths)
        plan = run_planner(samples, config)
        assert len(plan.steps) == 1
        ranks = BaselineSchedule(
            [[list(mb) for mb in rank] for rank in plan.steps[0].ranks], baseline=name
        )
        ranks.min_microbatches = plan.steps[0].min_microbatches
        return ranks
    return BASELINES[name](
        ls.lengths,
        dp_size=parallel.dp_size,
        token_cap=token_cap,
        microbatch_multiple=parallel.microbatch_multiple,
        rollout_ids=ls.rollout_ids,
    )


def run_scheduler(
    name: str,
    ls: LengthSet,
    parallel: ParallelLayout,
    *,
    token_cap: int = TOKEN_CAP,
    repeats: int = 3,
    max_sim_events: Optional[int] = None,
) -> Dict[str, Any]:
    """One row: the scheduler's figures on one step (``status`` is ``ok`` or ``FAIL: reason``).

    The pipeline simulation is skipped (``sim_note`` says why) when it would replay more than
    ``max_sim_events`` forward/backward steps (``dp * pp * vpp * 2 * M``; about 4 us of CPU each).
    """
    row: Dict[str, Any] = {"scheduler": name}
    try:
        ranks, plan_ms = _timed(lambda: schedule(name, ls, parallel, token_cap), repeats)
    except BaselineFailure as exc:
        row["status"] = f"FAIL: {exc.reason}"
        return row
    layout = "padded" if name == "fixed_mbs" else "packed"
    m = evaluate(
        ranks,
        ls.lengths,
        token_cap=token_cap,
        layout=layout,
        dummy_lengths=getattr(ranks, "dummy_lengths", ()),
    )
    if not m["coverage_ok"]:
        row["status"] = (
            f"FAIL: coverage (missing {m['missing'][:5]}, duplicated {m['duplicated'][:5]})"
        )
        return row
    placeholders = m["num_placeholders"]
    row.update(
        status="ok",
        plan_ms=plan_ms,
        num_microbatches=m["num_microbatches"],
        # The fewest micro-batches the scheduler packs the step into: ours may run more when more,
        # shorter rows make a faster pipeline step.
        min_microbatches=getattr(ranks, "min_microbatches", m["num_microbatches"]),
        lower_bound_per_rank=m["lower_bound_per_rank"],
        seq_length=m["seq_length"],
        micro_batch_size=m["micro_batch_size"],
        fill=m["fill"],
        over_cap_microbatches=m["over_cap_microbatches"],
        dp_imbalance=m["dp_imbalance"],
        dp_imbalance_cost=m["dp_imbalance_cost"],
        placeholders=placeholders,
        harness_placeholders=getattr(ranks, "harness_placeholders", 0),
        notes=list(getattr(ranks, "notes", ())),
    )
    events = 2 * parallel.dp_size * parallel.pp_size * parallel.vpp_size * m["num_microbatches"]
    if max_sim_events is not None and events > max_sim_events:
        row["sim_note"] = f"not simulated: {events:.2e} events > {max_sim_events:.0e}"
    else:
        row["step_time"] = step_time(m["microbatch_costs"], parallel)
        row["step_over_ideal"] = row["step_time"] / ideal_step_time(ls.lengths, parallel)
    return row


def run_case(
    mix: str,
    layout: Layout,
    *,
    seed: int = 0,
    schedulers: Optional[Sequence[str]] = None,
    repeats: int = 3,
) -> Dict[str, Any]:
    ls = make_mix(mix, layout.num_prompts, seed)
    names = list(schedulers) if schedulers else [OURS, OURS_TOKENS, *BASELINES]
    rows = [run_scheduler(n, ls, layout.parallel, repeats=repeats) for n in names]
    return {
        "mix": mix,
        "layout": layout.name,
        "dp": layout.dp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "num_samples": len(ls.lengths),
        "token_cap": TOKEN_CAP,
        "rows": rows,
    }


# --------------------------------------------------------------------------------------------------
# Printing and the verdict.
# --------------------------------------------------------------------------------------------------

#: (label, row key, True if higher is better, relative tolerance for "matches").
FIGURES = (
    ("M/rank needed", "min_microbatches", False, 0.0),
    ("fill", "fill", True, 1e-3),
    ("over-cap", "over_cap_microbatches", False, 0.0),
    ("imb tok", "dp_imbalance", False, 1e-3),
    ("imb cost", "dp_imbalance_cost", False, 1e-3),
    ("placeh", "placeholders", False, 0.0),
    ("step/ideal", "step_over_ideal", False, 1e-3),
    ("plan ms", "plan_ms", False, 0.10),
)


def format_case(case: Dict[str, Any]) -> str:
    head = (
        f"== mix={case['mix']} layout={case['layout']} samples={case['num_samples']} "
        f"cap={case['token_cap']} =="
    )
    cols = (
        f"{'scheduler':<16} {'M/rank':>6} {'min':>4} {'LB':>4} {'fill':>6} {'overcap':>7} {'imb tok':>8} "
        f"{'imb cost':>8} {'placeh':>6} {'plan ms':>9} {'step/ideal':>10}"
    )
    lines = [head, cols]
    for row in case["rows"]:
        if row["status"] != "ok":
            lines.append(f"{row['scheduler']:<16} {row['status']}")
            continue
        step = f"{row['step_over_ideal']:>10.4f}" if "step_over_ideal" in row else f"{'-':>10}"
        lines.append(
            f"{row['scheduler']:<16} {row['num_microbatches']:>6} {row['min_microbatches']:>4} "
            f"{row['lower_bound_per_rank']:>4} "
            f"{row['fill']:>6.3f} {row['over_cap_microbatches']:>7} {row['dp_imbalance']:>8.4f} "
            f"{row['dp_imbalance_cost']:>8.4f} {row['placeholders']:>6} {row['plan_ms']:>9.1f} "
            f"{step}"
        )
    return "\n".join(lines)


def _compare(ours: float, best: float, higher: bool, tol: float) -> str:
    """'win', 'match' or 'lose' of ours against the best baseline value."""
    if higher:
        ours, best = -ours, -best
    slack = tol * abs(best)
    if ours < best - slack:
        return "win"
    if ours <= best + slack:
        return "match"
    return "lose"


def verdict(cases: Sequence[Dict[str, Any]], figures=FIGURES) -> Dict[str, Any]:
    """Per figure and case: ours against the best baseline; per baseline: where ours beats it."""
    judged: List[Dict[str, Any]] = []
    beaten: Dict[str, List[str]] = {}
    ours_over_cap = 0
    for case in cases:
        rows = {r["scheduler"]: r for r in case["rows"]}
        ours = rows.get(OURS)
        if ours is None or ours["status"] != "ok":
            judged.append({"case": f"{case['mix']} / {case['layout']}", "error": "ours failed"})
            continue
        ours_over_cap += ours["over_cap_microbatches"]
        baselines = [
            r for n, r in rows.items() if n not in (OURS, *UNJUDGED) and r["status"] == "ok"
        ]
        for label, key, higher, tol in figures:
            if key not in ours:
                continue
            values = [(r[key], r["scheduler"]) for r in baselines if key in r]
            if not values:
                continue
            best_value, best_name = (max if higher else min)(values)
            outcome = _compare(ours[key], best_value, higher, tol)
            best_row = rows[best_name]
            judged.append(
                {
                    "case": f"{case['mix']} / {case['layout']}",
                    "figure": label,
                    "ours": ours[key],
                    "best": best_value,
                    "best_baseline": best_name,
                    "best_over_cap": best_row["over_cap_microbatches"],
                    "outcome": outcome,
                }
            )
            for r in baselines:
                if key in r and _compare(ours[key], r[key], higher, tol) == "win":
                    beaten.setdefault(r["scheduler"], []).append(
                        f"{label} ({case['mix']} / {case['layout']})"
                    )
    all_baselines = sorted({r["scheduler"] for c in cases for r in c["rows"]} - {OURS, *UNJUDGED})
    return {
        "judged": judged,
        "ours_over_cap_microbatches": ours_over_cap,
        "beaten": {name: beaten.get(name, []) for name in all_baselines},
    }


def format_verdict(result: Dict[str, Any]) -> str:
    judged = [j for j in result["judged"] if "outcome" in j]
    lines = ["== verdict: ours against the best baseline, per figure =="]
    for label, _, higher, _ in FIGURES:
        rows = [j for j in judged if j["figure"] == label]
        if not rows:
            continue
        counts = {o: sum(1 for j in rows if j["outcome"] == o) for o in ("win", "match", "lose")}
        lines.append(
            f"{label:<11} win {counts['win']:>2}  match {counts['match']:>2}  "
            f"lose {counts['lose']:>2}"
            f"   ({'higher' if higher else 'lower'} is better)"
        )
    losses = [j for j in judged if j["outcome"] == "lose"]
    if losses:
        lines.append("losses (ours vs best baseline):")
        for j in losses:
            ratio = j["ours"] / j["best"] if j["best"] else float("inf")
            cap = " [best baseline breaks the cap]" if j["best_over_cap"] else ""
            lines.append(
                f"  {j['figure']:<11} {j['case']:<28} ours {j['ours']:.4g} vs {j['best_baseline']} "
                f"{j['best']:.4g} (x{ratio:.3f}){cap}"
            )
    lines.append(f"ours micro-batches over the cap: {result['ours_over_cap_microbatches']}")
    lines.append("baselines ours beats on at least one figure:")
    for name, where in result["beaten"].items():
        shown = ", ".join(sorted(set(w.split(" (")[0] for w in where))) if where else "NONE"
        lines.append(f"  {name:<16} {'yes' if where else 'NO '}  figures: {shown}")
    return "\n".join(lines)


def imbalance_target(cases: Sequence[Dict[str, Any]], limit: float = 1.02) -> List[str]:
    """The token-imbalance target on the long-tailed mix at dp 64."""
    lines = []
    for case in cases:
        if case["mix"] != "lognormal" or case["dp"] != 64:
            continue
        for row in case["rows"]:
            if row["scheduler"] in (OURS, OURS_TOKENS) and row["status"] == "ok":
                ok = "PASS" if row["dp_imbalance"] <= limit else "FAIL"
                lines.append(
                    f"target DP imbalance by tokens <= {limit} (lognormal, {case['layout']}): "
                    f"{row['scheduler']} {row['dp_imbalance']:.4f} {ok}"
                )
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="lognormal and bimodal, two layouts")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of tables"
    )
    parser.add_argument("--seed", type=int, default=0, help="length generator seed (default 0)")
    args = parser.parse_args(argv)
    mixes = ("lognormal", "bimodal") if args.quick else tuple(MIXES)
    layouts = CASE_LAYOUTS[:2] if args.quick else CASE_LAYOUTS
    cases = []
    for mix in mixes:
        for layout in layouts:
            case = run_case(mix, layout, seed=args.seed)
            cases.append(case)
            if not args.json:
                print(format_case(case), flush=True)
                print()
    result = verdict(cases)
    if args.json:
        print(json.dumps({"cases": cases, "verdict": result, "targets": imbalance_target(cases)}))
    else:
        print(format_verdict(result))
        for line in imbalance_target(cases):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
