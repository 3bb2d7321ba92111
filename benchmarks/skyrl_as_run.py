"""SkyRL steps as its runtime runs them: ours (``trainer.use_dynamic_batch_size``) against SkyRL's
own token-based micro-batching, on the shards SkyRL's dispatch hands each DP rank.

SkyRL's dispatch pads a mini-batch to a multiple of dp with loss-masked copies of its sample 0 and
cuts it into ``dp`` contiguous chunks; samples stay on their rank. SkyRL's own runtime
(``TokenBasedBatchIterator``, ``trainer.max_tokens_per_microbatch``) packs each chunk with its
``Balanced`` packer and appends padding micro-batches up to the largest count
(:func:`benchmarks.baselines.skyrl_balanced`; SkyRL's own packer file when ``SKYRL_SRC`` names a
checkout, :func:`benchmarks.peers.real_skyrl`); its Megatron worker then tops every micro-batch of
the rank up to the rank's fullest with one-token rows (``_pad_microbatch_to_size``). Ours is what the patched worker runs:
:func:`megatron_dynbatch.integrations.skyrl.plan.plan_skyrl_minibatch` on the same chunks, every
micro-batch ``B`` rows (a row it lacks is a one-token placeholder row), placeholder micro-batches
of ``B`` such rows.

Both are scored alike on each rank, with padding removed before the model as SkyRL's THD path
does: linear work on every sample's tokens (each padded to the tensor-parallel size), attention
per sample at ``L**2 / crossover``, plus a fixed cost per micro-batch of 0, 1% or 5% of a full row
at the budget; each rank's micro-batches replayed through Megatron's 1F1B order
(:func:`megatron_dynbatch.planning.simulate.pipeline_makespan`, backward 2 x forward); the step is
the slowest rank. Ours runs twice per overhead: not told (the planner assumes 2% of a full row)
and told the true overhead in tokens of linear work
(``trainer.dynamic_batch_cost_microbatch_overhead``, as a calibrated run sets it). Workloads:
random held-out steps (GRPO groups, multi-turn, long tails, samples near the budget), dp 1-16,
pp 1, 2 or 4 (vpp 1), tp 1 or 2, budgets 4k-16k, 1-32 samples a rank.

Run: ``.venv/bin/python -m benchmarks.skyrl_as_run [--cases 200] [--seed 1] [--per-rank 1,32]``;
``--per-rank LO,HI`` draws LO-HI samples a rank instead (``--per-rank 33,400``: ranks of hundreds
of samples, whose micro-batches pack many short ones and run many placeholder rows); with
``--planning-time``, the CPU one plan of a mini-batch takes at dp 8 to 512 instead.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.as_run import FAMILIES, _lengths
from benchmarks.baselines import skyrl_balanced
from benchmarks.metrics import (
    as_run_main,
    as_run_search,
    draw_layout,
    packed_step,
    ratio_lines,
    sharded_planning_time,
)
from megatron_dynbatch.integrations.skyrl.plan import plan_skyrl_minibatch
from megatron_dynbatch.planning import CostModel
from megatron_dynbatch.planning.spec import round_up

__all__ = ["SkyrlCase", "random_case", "run_case"]

DP_SIZES = (1, 2, 4, 8, 16)
#: Samples a rank, drawn uniformly from this range (``--per-rank`` draws from another).
PER_RANK = (1, 32)
#: Slower than SkyRL's own by more than this counts as SkyRL being faster.
TOLERANCE = 0.005
NAMES = {"ours": "ours / SkyRL", "told": "ours told / SkyRL"}


@dataclass(frozen=True)
class SkyrlCase:
    """One SkyRL mini-batch: its samples, layout and ``max_tokens_per_microbatch``."""

    label: str
    lengths: List[int]
    dp: int
    pp: int
    tp: int
    cap: int


def random_case(
    rng: random.Random, index: int, per_rank_range: Tuple[int, int] = PER_RANK
) -> SkyrlCase:
    """The ``index``-th case drawn from ``rng`` (deterministic for a seed), each rank drawing
    from ``per_rank_range`` samples."""
    family = FAMILIES[index % len(FAMILIES)]
    dp, pp, tp, cap = draw_layout(rng, DP_SIZES)
    per_rank = rng.randint(*per_rank_range)
    seed = rng.randrange(1 << 30)
    # Not always a multiple of dp: SkyRL's dispatch pads with copies of sample 0.
    count = max(1, dp * per_rank - rng.randrange(dp))
    lengths = list(_lengths(family, count, cap, seed).lengths)
    label = f"#{index} {family} n={len(lengths)} dp{dp} pp{pp} tp{tp} cap{cap} seed{seed}"
    return SkyrlCase(label, lengths, dp, pp, tp, cap)


def _shards(case: SkyrlCase) -> List[List[int]]:
    """Each DP rank's sample lengths as SkyRL's dispatch cuts them (copies of sample 0 padding)."""
    every = case.lengths + [case.lengths[0]] * ((-len(case.lengths)) % case.dp)
    chunk = len(every) // case.dp
    return [every[r * chunk : (r + 1) * chunk] for r in range(case.dp)]


def skyrl_rows(case: SkyrlCase) -> List[List[List[int]]]:
    """SkyRL's own micro-batches per rank, as padded sizes of their rows (a one-token row: the
    alignment)."""
    shards = _shards(case)
    every = [length for shard in shards for length in shard]
    if os.environ.get("SKYRL_SRC"):
        from benchmarks.peers import real_skyrl

        ranks = real_skyrl(case.lengths, dp_size=case.dp, token_cap=case.cap)
    else:
        ranks = skyrl_balanced(case.lengths, dp_size=case.dp, token_cap=case.cap)
    out = []
    for rank in ranks:
        # _pad_microbatch_to_size: every micro-batch of the rank (a padding one too) is topped
        # up to the rank's fullest with one-token rows.
        rows = max(len(mb) for mb in rank) or 1
        out.append([[round_up(every[i], case.tp) for i in mb] for mb in rank])
        out[-1] = [mb + [case.tp] * (rows - len(mb)) for mb in out[-1]]
    return out


def our_rows(case: SkyrlCase, overhead: Optional[float] = None) -> List[List[List[int]]]:
    """Our micro-batches per rank as the patched worker runs them (``B`` rows each)."""
    shards = _shards(case)
    plan = plan_skyrl_minibatch(
        shards, case.cap, pp_size=case.pp, tp_size=case.tp, microbatch_overhead=overhead
    )
    out = []
    for r, shard in enumerate(shards):
        rows = [[round_up(shard[i], case.tp) for i in mb] for mb in plan.ranks[r]]
        rows += [[] for _ in range(plan.placeholders(r))]
        out.append([mb + [case.tp] * (plan.rows - len(mb)) for mb in rows])
    return out


def over_cap(case: SkyrlCase, rows: Sequence[Sequence[Sequence[int]]]) -> int:
    """Micro-batches of ours over the budget with more than one real sample (placeholder rows
    are ``tp`` tokens; a sample alone may carry its placeholder rows over, as SkyRL's own)."""
    return sum(
        1
        for rank in rows
        for mb in rank
        if sum(1 for size in mb if size > case.tp) > 1 and sum(mb) > case.cap
    )


def true_cost(case: SkyrlCase, overhead_fraction: float, crossover: float) -> CostModel:
    """Linear work plus attention ``L**2 / crossover`` per sample, plus a per-micro-batch cost of
    ``overhead_fraction`` of a full row at the budget."""
    base = CostModel(token_weight=1.0, attention_weight=1.0 / crossover if crossover else 0.0)
    return CostModel(
        token_weight=base.token_weight,
        attention_weight=base.attention_weight,
        microbatch_overhead=overhead_fraction * base.full_row_cost(case.cap),
    )


def run_case(case: SkyrlCase, overheads: Sequence[float], crossover: float) -> Dict[str, Any]:
    """Ours (not told, told) against SkyRL's own micro-batching, per overhead."""
    theirs, ours = skyrl_rows(case), our_rows(case)
    result: Dict[str, Any] = {"case": case.label, "ratios": {}, "ours_over_cap": 0}
    for fraction in overheads:
        cost = true_cost(case, fraction, crossover)
        told = our_rows(case, cost.microbatch_overhead / cost.token_weight)
        result["ours_over_cap"] += over_cap(case, ours) + over_cap(case, told)
        skyrl = packed_step(theirs, cost, case.pp)
        result["ratios"][fraction] = {
            "ours": packed_step(ours, cost, case.pp) / skyrl,
            "told": packed_step(told, cost, case.pp) / skyrl,
        }
    return result


def search(
    num_cases: int,
    seed: int,
    overheads: Sequence[float],
    crossover: float,
    per_rank_range: Tuple[int, int] = PER_RANK,
):
    return as_run_search(
        functools.partial(random_case, per_rank_range=per_rank_range),
        run_case,
        num_cases,
        seed,
        overheads,
        crossover,
        list(NAMES),
        TOLERANCE,
        lambda cases: {
            "skyrl_source": os.environ.get("SKYRL_SRC") or "stand-in (benchmarks.baselines)"
        },
    )


def format_summary(summary: Dict[str, Any]) -> str:
    lines = [
        f"{summary['num_cases']} random SkyRL mini-batches (seed {summary['seed']}, true attention "
        f"L^2/{summary['crossover']:g}; SkyRL's packer: {summary['skyrl_source']}); ours over the "
        f"budget with more than one sample: {summary['ours_over_cap']}"
    ]
    lines += ratio_lines(summary["by_overhead"], NAMES, "SkyRL")
    return "\n".join(lines)


def planning_time() -> str:
    """CPU of one :func:`plan_skyrl_minibatch` (what every rank computes each mini-batch)."""
    return sharded_planning_time(
        lambda lengths, pp, vpp: plan_skyrl_minibatch(lengths, 16384, pp_size=pp, vpp_size=vpp)
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--per-rank",
        default=None,
        metavar="LO,HI",
        help=f"samples a rank, drawn from LO-HI (default {PER_RANK[0]},{PER_RANK[1]})",
    )
    known, rest = parser.parse_known_args(argv)
    drawn = search
    if known.per_rank:
        low, high = (int(x) for x in known.per_rank.split(","))
        drawn = functools.partial(search, per_rank_range=(low, high))
    description = __doc__.split("\n\n")[0]
    return as_run_main(rest, description, drawn, format_summary, 200, planning_time, (parser,))


if __name__ == "__main__":
    raise SystemExit(main())
