"""Regenerate the benchmark figures the README shows: ``docs/benchmarks.md`` and ``docs/step.png``.

Deterministic inputs (fixed seeds): every figure except the planning times (CPU time of the
machine that ran it) is identical from run to run.

Run: ``.venv/bin/python -m benchmarks.make_readme_figures [--out-dir docs] [--cases 300]``
(set ``VERL_SRC`` to a verl checkout to add the real verl pipeline's time, see
``benchmarks/peers.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
from typing import Any, Dict, List, Optional, Sequence

from benchmarks import gpu_regime
from benchmarks.baselines import BASELINES
from benchmarks.bench_compare import (
    CASE_LAYOUTS,
    FIGURES,
    MIXES,
    OURS,
    TOKEN_CAP,
    make_mix,
    run_case,
    verdict,
)
from benchmarks.bench_planner import GOALS, cap_memory, speed_table, versus_verl
from benchmarks.metrics import EVAL_COST, planner_config
from benchmarks.search import search
from megatron_dynbatch.planning import ParallelLayout, SampleSet, plan_samples
from megatron_dynbatch.tools.plotting import plot_step

SEED = 0
#: The layout and mix of the detailed table and of the picture.
HEADLINE_MIX = "lognormal"
HEADLINE_LAYOUT = CASE_LAYOUTS[-1]  # dp 64, pp 4, vpp 2
#: The pictured step: small enough that every micro-batch and pipeline box stays legible.
PICTURE_PARALLEL = ParallelLayout(dp_size=8, pp_size=4, vpp_size=2)
PICTURE_PROMPTS = 56
COMMAND = ".venv/bin/python -m benchmarks.make_readme_figures"
#: The docs folder of the repository (the default output).
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _fmt(row: Dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key in ("fill",):
        return f"{value:.3f}"
    if key in ("dp_imbalance", "dp_imbalance_cost", "step_over_ideal"):
        return f"{value:.4f}"
    if key == "plan_ms":
        return f"{value:.1f}"
    return str(value)


def detail_table(case: Dict[str, Any]) -> List[str]:
    lines = [
        "| scheduler | M/rank (fewest, LB) | S | fill | over cap | DP imb. tokens | DP imb. cost | "
        "placeholders | plan CPU ms | step / ideal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in case["rows"]:
        if row["status"] != "ok":
            lines.append(f"| {row['scheduler']} | {row['status']} |||||||")
            continue
        lines.append(
            f"| {'**ours**' if row['scheduler'] == OURS else row['scheduler']} "
            f"| {row['num_microbatches']} ({row['min_microbatches']}, "
            f"{row['lower_bound_per_rank']}) | {row['seq_length']} | {_fmt(row, 'fill')} "
            f"| {row['over_cap_microbatches']} | {_fmt(row, 'dp_imbalance')} "
            f"| {_fmt(row, 'dp_imbalance_cost')} | {row['placeholders']} | {_fmt(row, 'plan_ms')} "
            f"| {_fmt(row, 'step_over_ideal')} |"
        )
    return lines


def step_table(cases: Sequence[Dict[str, Any]]) -> List[str]:
    names = [OURS, *BASELINES]
    lines = [
        "| mix / layout | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for case in cases:
        rows = {r["scheduler"]: r for r in case["rows"]}
        values = {
            n: rows[n]["step_over_ideal"]
            for n in names
            if n in rows and rows[n]["status"] == "ok" and "step_over_ideal" in rows[n]
        }
        best = min(values.values())
        cells = []
        for n in names:
            if n not in values:
                cells.append("fails")
                continue
            text = f"{values[n]:.3f}"
            if rows[n]["over_cap_microbatches"]:
                text += "†"
            cells.append(f"**{text}**" if values[n] == best else text)
        lines.append(f"| {case['mix']} / {case['layout']} | " + " | ".join(cells) + " |")
    return lines


def verdict_lines(result: Dict[str, Any]) -> List[str]:
    judged = [j for j in result["judged"] if "outcome" in j]
    lines = ["| figure | win | match | lose |", "|---|---|---|---|"]
    for label, _, _, _ in FIGURES:
        rows = [j for j in judged if j["figure"] == label]
        counts = [sum(1 for j in rows if j["outcome"] == o) for o in ("win", "match", "lose")]
        lines.append(f"| {label} | {counts[0]} | {counts[1]} | {counts[2]} |")
    losses = [j for j in judged if j["outcome"] == "lose" and j["figure"] != "plan ms"]
    if losses:
        lines.append("")
        lines.append("Figures where a baseline is better than ours (planning time aside):")
        lines.append("")
        for j in losses:
            cap = " (that baseline breaks the token cap)" if j["best_over_cap"] else ""
            lines.append(
                f"- {j['figure']}, {j['case']}: ours {j['ours']:.4f}, {j['best_baseline']} "
                f"{j['best']:.4f}{cap}"
            )
    return lines


def speed_lines(table: Sequence[Dict[str, Any]], caps: Dict[str, float], verl) -> List[str]:
    lines = [
        "| workload | CPU ms (min of 5) | goal ms | peak MB | M/rank (LB) | S | fill |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table:
        goal = GOALS.get(row["workload"])
        lines.append(
            f"| {row['workload']} | {row['cpu_s_min'] * 1e3:.0f} | "
            f"{goal * 1e3:.0f} | {row['peak_MB']:.0f} | {row['M']} ({row['lower_bound_per_rank']}) "
            f"| {row['S']} | {row['fill']:.3f} |"
        )
    lines += [
        "",
        "Peak memory of planning five samples: "
        + ", ".join(f"cap {cap}: {mb:.2f} MB" for cap, mb in caps.items())
        + " (independent of the cap).",
        "",
        f"16,384 samples at dp 512: ours {verl['ours_ms']:.0f} ms; verl's pipeline "
        f"re-implemented here {verl['verl_reimplementation_ms']:.0f} ms"
        + (
            f"; verl's real code (`VERL_SRC`, KK on tensor elements in the driver) "
            f"{verl['verl_real_driver_ms']:.0f} ms in the driver + "
            f"{verl['verl_real_slowest_rank_ms']:.1f} ms on the slowest rank."
            if "verl_real_driver_ms" in verl
            else " (verl's real code not timed: set `VERL_SRC`)."
        ),
    ]
    return lines


def search_lines(result: Dict[str, Any]) -> List[str]:
    worst = result["worst_step_loss"]
    lines = [
        f"{result['num_cases']} random steps (seed {result['seed']}: GRPO groups, bimodal, uniform, "
        "short, multi-turn; dp 2-128, pp 1/2/4, vpp 1/2, caps 8k/16k), every baseline of "
        "`benchmarks/baselines.py` that keeps the cap in the case against ours:",
        "",
        f"- cases where a baseline's simulated step is more than 0.5% faster than ours: "
        f"{result['cases_beaten'].get('step', 0)}"
        + (
            f" (worst: {worst[0]}, {worst[1]} {worst[3]:.4f} vs ours {worst[2]:.4f})"
            if worst
            else ""
        ),
        f"- cases where a baseline needs fewer micro-batches per rank than ours can pack into: "
        f"{result['cases_beaten'].get('M', 0)}",
        f"- cases where a baseline has a higher fill / a lower DP cost imbalance than ours (not "
        f"judged: ours trades them for step time): {result['cases_beaten'].get('fill', 0)} / "
        f"{result['cases_beaten'].get('imbalance', 0)}",
        f"- ours' micro-batches over the cap: {result['ours_over_cap']}; slowest plan "
        f"{result['max_plan_ms']:.0f} ms CPU",
    ]
    return lines


def write_markdown(path: pathlib.Path, cases, speed, searched, gpu=()) -> None:
    headline = next(
        c for c in cases if c["mix"] == HEADLINE_MIX and c["layout"] == HEADLINE_LAYOUT.name
    )
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{COMMAND}` (seed {SEED}; planning times are CPU time on "
        f"{platform.machine()} with Python {platform.python_version()}, everything else is exact). "
        "The scripts and what they measure: `benchmarks/README.md`.",
        "",
        "Every schedule is scored the same way: each micro-batch's cost from the planner's cost "
        "model (`megatron_dynbatch/planning/cost.py`: linear work on every position of the row, "
        "padding included; attention per segment, the packed row's padding tail its own segment; "
        "here `token_weight` 1, `attention_weight` 1/24576, no overhead), backward = 2 x forward, "
        "replayed through Megatron's 1F1B or interleaved order. *step / ideal*: the slowest DP "
        "rank's simulated step over all real work spread over every GPU with no bubble (the same "
        "denominator for every scheduler). Baselines behave exactly as the peers' code "
        "(`benchmarks/peers.py` diffs them against the real functions).",
        "",
        f"## {HEADLINE_MIX} GRPO mix, {HEADLINE_LAYOUT.name} ({headline['num_samples']} samples)",
        "",
        "*M/rank*: micro-batches per rank run (the fewest ours packs into, the token lower "
        "bound); ours runs more where the pipeline makes more, shorter rows faster.",
        "",
        *detail_table(headline),
        "",
        "## Simulated step time / ideal, every mix and layout",
        "",
        "Best per row in bold; † = the schedule has micro-batches over the token cap; "
        "*fails* = the upstream code rejects the input (verl and NeMo-RL: a sample count that "
        "is not a multiple of dp).",
        "",
        *step_table(cases),
        "",
        "## Random-workload search (`python -m benchmarks.search`)",
        "",
        *search_lines(searched),
        "",
        *gpu,
        "",
        "## Planning speed and memory (`python -m benchmarks.bench_planner`)",
        "",
        *speed_lines(*speed),
        "",
        "## Ours against the best baseline, per figure (the mix and layout cases above)",
        "",
        "Matching allows 0.1% on ratios and 10% on planning time.",
        "",
        *verdict_lines(verdict(cases)),
        "",
        "## One planned step",
        "",
        f"`{HEADLINE_MIX}` GRPO step, {PICTURE_PROMPTS} prompts x 8, "
        f"dp {PICTURE_PARALLEL.dp_size}, "
        f"pp {PICTURE_PARALLEL.pp_size}, vpp {PICTURE_PARALLEL.vpp_size}, cap {TOKEN_CAP}: "
        "micro-batches per rank (top) and rank 0's simulated interleaved pipeline (bottom).",
        "",
        "![one planned step](step.png)",
        "",
    ]
    # Measurements made by hand (end-to-end runs, moved from the README) follow a marker line and
    # are kept as they are: this script regenerates only what it measures itself.
    kept = ""
    if path.is_file():
        old = path.read_text(encoding="utf-8")
        if HAND_WRITTEN in old:
            kept = "\n" + old[old.index(HAND_WRITTEN) :]
    path.write_text("\n".join(lines) + kept, encoding="utf-8")


#: The line after which docs/benchmarks.md holds hand-written measurements.
HAND_WRITTEN = "<!-- hand-written below: measured end to end; make_readme_figures keeps it -->"


def write_picture(path: pathlib.Path) -> None:
    ls = make_mix(HEADLINE_MIX, PICTURE_PROMPTS, SEED)
    samples = SampleSet.build(ls.lengths, ls.rollout_ids, ls.prompt_lengths)
    config = planner_config(TOKEN_CAP, PICTURE_PARALLEL, EVAL_COST)
    plot_step(plan_samples(samples, config), 0, samples, config, str(path))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=str(DOCS), help="default: docs/")
    parser.add_argument("--cases", type=int, default=300, help="random-search cases")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases = [run_case(mix, layout, seed=SEED) for mix in MIXES for layout in CASE_LAYOUTS]
    searched = search(args.cases, SEED)
    speed = (speed_table(), cap_memory(), versus_verl())
    gpu = gpu_regime.docs_section()
    write_markdown(out / "benchmarks.md", cases, speed, searched, gpu)
    write_picture(out / "step.png")
    print(f"wrote {out / 'benchmarks.md'} and {out / 'step.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
