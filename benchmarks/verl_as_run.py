"""verl steps as its Megatron engine runs them: ours (``megatron.use_dynamic_batch_size``) against
verl's own ``use_dynamic_bsz`` micro-batching, on the shards verl's driver hands each DP rank.

verl's driver balances a batch over the DP ranks (``RayPPOTrainer._balance_batch``: Karmarkar-Karp
with equal counts on ``24576 L + L^2``) and dispatches equal chunks; samples stay on their rank.
verl's engine then splits each chunk with ``rearrange_micro_batches`` (``ceil(tokens / budget)``
micro-batches, MAX over DP, rounded up to the interleaved group; Karmarkar-Karp on the same
workload; lighter micro-batches at both ends). verl's own code runs when ``VERL_SRC`` names a
checkout (:func:`benchmarks.peers.real_verl`), else its stand-in
(:func:`benchmarks.baselines.verl_kk`). Ours is what the patched engine runs:
:func:`megatron_dynbatch.integrations.verl.engine.plan_verl_batch` on the same chunks (THD,
``use_remove_padding``), a rank's placeholders each one copy of its shortest sample.

Both are scored alike on each rank as verl's THD forward runs a micro-batch (``use_remove_padding``,
its default with Megatron; ``variable_seq_lengths``): one packed row of its samples, each padded to
the tensor-parallel size, linear work on those tokens, attention per sample at ``L**2 /
crossover``, plus a fixed cost per micro-batch of 0, 1% or 5% of a full row at the budget; each
rank's micro-batches replayed through Megatron's 1F1B or interleaved order
(:func:`megatron_dynbatch.planning.simulate.pipeline_makespan`, backward 2 x forward); the step is
the slowest rank. Ours runs twice per overhead: not told (the planner assumes 2% of a full row) and
told the true overhead in tokens of linear work (``megatron.dynbatch.cost_microbatch_overhead``).
verl's budget sets its count, not a cap: cases where one of its micro-batches of several samples
is over the budget are counted (``verl over the budget``); ours never is. Workloads: random
held-out steps (GRPO groups, multi-turn, long tails, samples near the budget), dp 1-64, pp 1, 2 or
4 (vpp 1 or 2), tp 1 or 2, budgets 4k-16k, 1-32 samples a rank.

Run: ``.venv/bin/python -m benchmarks.verl_as_run [--cases 200] [--seed 1]``; with
``--planning-time``, the CPU one plan of a step takes at dp 8 to 512 instead.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.as_run import FAMILIES, _lengths
from benchmarks.baselines import BaselineFailure, verl_kk
from benchmarks.metrics import (
    as_run_main,
    as_run_search,
    draw_layout,
    packed_step,
    ratio_lines,
    ratio_table,
    sharded_planning_time,
)
from benchmarks.skyrl_as_run import true_cost
from megatron_dynbatch.integrations.verl.engine import plan_verl_batch, verl_planner_config
from megatron_dynbatch.planning.spec import round_up

__all__ = ["VerlCase", "random_case", "run_case"]

DP_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Slower than verl's own by more than this counts as verl being faster.
TOLERANCE = 0.005
NAMES = {"ours": "ours / verl", "told": "ours told / verl"}


@dataclass(frozen=True)
class VerlCase:
    """One verl batch: its samples, layout and ``ppo_max_token_len_per_gpu``."""

    label: str
    lengths: List[int]
    dp: int
    pp: int
    vpp: int
    tp: int
    cap: int


def random_case(rng: random.Random, index: int) -> VerlCase:
    """The ``index``-th case drawn from ``rng`` (deterministic for a seed)."""
    family = FAMILIES[index % len(FAMILIES)]
    dp, pp, tp, cap = draw_layout(rng, DP_SIZES)
    vpp = rng.choice((1, 2)) if pp > 1 else 1
    per_rank = rng.randint(1, 32)
    seed = rng.randrange(1 << 30)
    # verl's batch is a multiple of dp (its dispatch chunks it evenly); a rank needs at least as
    # many samples as the interleaved group (verl asserts it).
    per_rank = max(per_rank, pp if vpp > 1 else 1)
    drawn = list(_lengths(family, dp * per_rank, cap, seed).lengths)
    # A family may draw a few samples fewer or more (whole GRPO groups): repeat or cut to size.
    lengths = (drawn * (dp * per_rank))[: dp * per_rank]
    label = f"#{index} {family} n={len(lengths)} dp{dp} pp{pp} vpp{vpp} tp{tp} cap{cap} seed{seed}"
    return VerlCase(label, lengths, dp, pp, vpp, tp, cap)


def verl_ranks(case: VerlCase) -> List[List[List[int]]]:
    """verl's micro-batches per rank, as global sample indices (its driver's shards)."""
    multiple = case.pp if case.vpp > 1 else 1
    if os.environ.get("VERL_SRC"):
        from benchmarks.peers import real_verl

        ranks, _ = real_verl(
            case.lengths, dp_size=case.dp, token_cap=case.cap, microbatch_multiple=multiple
        )
        return ranks
    schedule = verl_kk(
        case.lengths, dp_size=case.dp, token_cap=case.cap, microbatch_multiple=multiple
    )
    return [[list(mb) for mb in rank if mb] for rank in schedule]


def verl_rows(case: VerlCase, ranks: Sequence[Sequence[Sequence[int]]]) -> List[List[List[int]]]:
    """verl's micro-batches as the padded sizes of their samples."""
    return [[[round_up(case.lengths[i], case.tp) for i in mb] for mb in rank] for rank in ranks]


def our_rows(
    case: VerlCase, shards: Sequence[Sequence[int]], overhead: Optional[float] = None
) -> List[List[List[int]]]:
    """Our micro-batches per rank as the patched engine runs them (a placeholder: a copy of the
    rank's shortest sample)."""
    lengths = [[case.lengths[i] for i in shard] for shard in shards]
    config = verl_planner_config(
        case.cap,
        pp_size=case.pp,
        vpp_size=case.vpp,
        microbatch_group_size_per_vp_stage=case.pp,
        tp_size=case.tp,
        cp_size=1,
        packed=True,
        microbatch_overhead=overhead,
    )
    plan = plan_verl_batch(lengths, config)
    out = []
    for r, shard in enumerate(lengths):
        rows = [[round_up(shard[i], case.tp) for i in mb] for mb in plan.ranks[r]]
        rows += [[round_up(min(shard), case.tp)]] * plan.placeholders(r)
        out.append(rows)
    return out


def over_cap(case: VerlCase, rows: Sequence[Sequence[Sequence[int]]]) -> int:
    """Micro-batches of several samples over the budget."""
    return sum(1 for rank in rows for mb in rank if len(mb) > 1 and sum(mb) > case.cap)


def run_case(case: VerlCase, overheads: Sequence[float], crossover: float) -> Dict[str, Any]:
    """Ours (not told, told) against verl's own micro-batching, per overhead."""
    try:
        ranks = verl_ranks(case)
    except BaselineFailure as failure:
        # verl refuses the batch (e.g. a rank with fewer samples than the interleaved group);
        # ours runs it (tests/unit/test_verl_plan.py), but there is nothing to compare against.
        return {
            "case": case.label,
            "ratios": {fraction: {} for fraction in overheads},
            "ours_over_cap": 0,
            "verl_over_cap": 0,
            "verl_refused": str(failure),
        }
    shards = [sorted(i for mb in rank for i in mb) for rank in ranks]
    theirs, ours = verl_rows(case, ranks), our_rows(case, shards)
    result: Dict[str, Any] = {
        "case": case.label,
        "ratios": {},
        "ours_over_cap": over_cap(case, ours),
        "verl_over_cap": over_cap(case, theirs),
        "verl_refused": None,
    }
    for fraction in overheads:
        cost = true_cost(case, fraction, crossover)
        told = our_rows(case, shards, cost.microbatch_overhead / cost.token_weight)
        result["ours_over_cap"] += over_cap(case, told)
        verl = packed_step(theirs, cost, case.pp, case.vpp)
        result["ratios"][fraction] = {
            "ours": packed_step(ours, cost, case.pp, case.vpp) / verl,
            "told": packed_step(told, cost, case.pp, case.vpp) / verl,
        }
    return result


def search(num_cases: int, seed: int, overheads: Sequence[float], crossover: float):
    return as_run_search(
        random_case,
        run_case,
        num_cases,
        seed,
        overheads,
        crossover,
        list(NAMES),
        TOLERANCE,
        lambda cases: {
            "verl_source": os.environ.get("VERL_SRC") or "stand-in (benchmarks.baselines)",
            "verl_over_cap_cases": sum(1 for c in cases if c["verl_over_cap"]),
            "verl_refused": sum(1 for c in cases if c["verl_refused"]),
            # The goal is against a cap-respecting peer: verl where it kept the budget.
            "within_budget": ratio_table(
                [c for c in cases if not c["verl_over_cap"] and not c["verl_refused"]],
                overheads,
                list(NAMES),
                TOLERANCE,
            ),
        },
    )


def format_summary(summary: Dict[str, Any]) -> str:
    lines = [
        f"{summary['num_cases']} random verl batches (seed {summary['seed']}, true attention "
        f"L^2/{summary['crossover']:g}; verl's code: {summary['verl_source']}); verl refuses "
        f"{summary['verl_refused']}, goes over the budget in {summary['verl_over_cap_cases']}; ours over the budget with more than "
        f"one sample: {summary['ours_over_cap']}"
    ]
    lines += ratio_lines(summary["by_overhead"], NAMES, "verl")
    lines.append("Where verl kept every micro-batch within the budget:")
    lines += ratio_lines(summary["within_budget"], NAMES, "verl")
    return "\n".join(lines)


def planning_time() -> str:
    """CPU of one :func:`plan_verl_batch` (what every rank computes each step)."""

    def plan(lengths: List[List[int]], pp: int, vpp: int):
        config = verl_planner_config(
            16384,
            pp_size=pp,
            vpp_size=vpp,
            microbatch_group_size_per_vp_stage=pp,
            tp_size=1,
            cp_size=1,
            packed=True,
        )
        return plan_verl_batch(lengths, config)

    return sharded_planning_time(plan)


def main(argv: Optional[List[str]] = None) -> int:
    return as_run_main(argv, __doc__.split("\n\n")[0], search, format_summary, 200, planning_time)


if __name__ == "__main__":
    raise SystemExit(main())
