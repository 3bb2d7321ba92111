"""NeMo-RL steps as its runtime runs them: our plan (``policy.megatron_cfg.dynbatch``) against
NeMo-RL's own sequence packing at PP 2 and its own dynamic batching at PP 1.

Ours is what the patched ``Policy._shard_for_train`` hands the workers
(:func:`megatron_dynbatch.integrations.nemo_rl.plan.plan_nemo_rl_shards`, from the policy config
through :func:`~megatron_dynbatch.integrations.nemo_rl.plan.nemo_rl_planner_config`), run by
NeMo-RL's sequence-packing runtime: each micro-batch one THD row of its samples (each padded to
``make_sequence_length_divisible_by``); at PP > 1 every row of a rank padded to that rank's largest
pack (``_get_pack_sequence_parameters_for_megatron``: ``pad_full_seq_to``), at PP 1 each row its own
length; a placeholder micro-batch is one padded token.

NeMo-RL's sequence packing: its packer (``modified_first_fit_decreasing``, what its configs ship;
``min_bin_count = bin_count_multiple = dp``) over the padded lengths, bins dealt round robin
(``bins[r::dp]``), rows padded as above. NeMo-RL's dynamic batching (PP 1 only: ``Policy``
asserts it): each global batch sorted by length and strided over the DP ranks, micro-batches cut
where ``rows x longest (rounded up to sequence_length_round)`` would pass the budget, the same
cuts on every rank; each micro-batch runs as ``[rows, S]`` with causal attention over the row.
The packer is NeMo-RL's own code when ``NEMO_RL_SRC`` names a checkout (else
:func:`benchmarks.baselines.nemo_rl_mffd`, which ``python -m benchmarks.peers`` checks against
it); the dynamic batching is :func:`nemo_rl_dynamic_batching` below, written from
``BatchedDataDict.shard_by_batch_size`` (with ``NEMO_RL_SRC`` set, every case also runs NeMo-RL's
own ``shard_by_batch_size`` and fails if the two differ).

Scored alike: linear work on every computed position, attention per segment (packed) or over the
row (padded), plus a fixed cost per micro-batch of 0, 1% or 5% of a full row at the budget; each
DP rank's micro-batches replayed through Megatron's 1F1B order
(:func:`megatron_dynbatch.planning.simulate.pipeline_makespan`, backward 2 x forward); the step is
the slowest rank. Workloads: random held-out steps (GRPO groups, multi-turn, long tails, samples
near the budget), dp 1-32, make_sequence_length_divisible_by 1 or 2 (tp), budgets 4k-16k.

Ours runs twice per overhead: not told (the planner assumes 2% of a full row), and told the true
overhead in tokens of linear work (``policy.megatron_cfg.dynbatch.cost_microbatch_overhead``, as
a calibrated run would set it).

Run: ``.venv/bin/python -m benchmarks.nemo_rl_as_run [--cases 60] [--seed 1]``.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.as_run import FAMILIES, _lengths
from benchmarks.baselines import BaselineFailure, nemo_rl_mffd
from benchmarks.metrics import as_run_main, as_run_search, ratio_lines
from megatron_dynbatch.integrations.nemo_rl.plan import (
    nemo_rl_planner_config,
    padded_lengths,
    plan_nemo_rl_shards,
)
from megatron_dynbatch.planning import CostModel
from megatron_dynbatch.planning.cost import microbatch_cost
from megatron_dynbatch.planning.simulate import pipeline_makespan
from megatron_dynbatch.planning.spec import round_up
from megatron_dynbatch.runtime.placeholders import PLACEHOLDER_ATTENDED_TOKENS

__all__ = ["NemoRlCase", "nemo_rl_dynamic_batching", "random_case", "run_case"]

DP_SIZES = (1, 2, 4, 8, 16, 32)
CAPS = (4096, 8192, 16384)
#: ``policy.dynamic_batching.sequence_length_round`` in NeMo-RL's shipped configs.
SEQUENCE_LENGTH_ROUND = 64
#: The ratios printed: ours planned as NeMo-RL runs it with the overhead not told (the planner
#: assumes 2% of a full row), and told the true one
#: (``policy.megatron_cfg.dynbatch.cost_microbatch_overhead``).
NAMES = {
    "pp2_vs_packing": "PP 2, ours / NeMo-RL sequence packing",
    "pp2_vs_packing_told": "PP 2, ours told / NeMo-RL sequence packing",
    "pp1_vs_dynamic": "PP 1, ours / NeMo-RL dynamic batching",
    "pp1_vs_dynamic_told": "PP 1, ours told / NeMo-RL dynamic batching",
}
#: Slower than NeMo-RL's own by more than this counts as NeMo-RL being faster.
TOLERANCE = 0.005


@dataclass(frozen=True)
class NemoRlCase:
    """One NeMo-RL training step: its samples, DP size, padding multiple and budget."""

    label: str
    lengths: List[int]
    dp: int
    pad_multiple: int
    train_mb_tokens: int


def random_case(rng: random.Random, index: int) -> NemoRlCase:
    """The ``index``-th case drawn from ``rng`` (deterministic for a seed)."""
    family = FAMILIES[index % len(FAMILIES)]
    dp = rng.choice(DP_SIZES)
    tp = rng.choice((1, 2))
    cap = rng.choice(CAPS)
    per_rank = rng.randint(1, 32)
    seed = rng.randrange(1 << 30)
    lengths = list(_lengths(family, dp * per_rank, cap, seed).lengths)
    # NeMo-RL's sharding needs the batch to divide by dp: drop the remainder.
    lengths = lengths[: len(lengths) - len(lengths) % dp] or [cap // 2] * dp
    label = f"#{index} {family} n={len(lengths)} dp{dp} pad{tp} cap{cap} seed{seed}"
    return NemoRlCase(label, lengths, dp, tp, cap)


def _policy_cfg(case: NemoRlCase, pp: int, overhead: Optional[float] = None) -> Dict[str, Any]:
    megatron_cfg: Dict[str, Any] = {"enabled": True, "pipeline_model_parallel_size": pp}
    if overhead is not None:
        megatron_cfg["dynbatch"] = {"cost_microbatch_overhead": overhead}
    return {
        "make_sequence_length_divisible_by": case.pad_multiple,
        "sequence_packing": {"enabled": True, "train_mb_tokens": case.train_mb_tokens},
        "megatron_cfg": megatron_cfg,
    }


def _packed_costs(packs, pp: int, cost: CostModel) -> List[List[float]]:
    """Each rank's micro-batch costs as NeMo-RL's packing runtime runs ``packs`` (per rank, per
    micro-batch, the padded segment sizes): at PP > 1 every row is the rank's largest pack."""
    out = []
    for rank in packs:
        widest = max((sum(sizes) for sizes in rank), default=0)
        out.append(
            [
                microbatch_cost(
                    cost, "packed", widest if pp > 1 else sum(sizes), 1, sizes, [0] * len(sizes)
                )
                for sizes in rank
            ]
        )
    return out


def _step(costs: Sequence[Sequence[float]], pp: int) -> float:
    return max(pipeline_makespan(list(rank), pp) for rank in costs)


def ours(case: NemoRlCase, pp: int, overhead: Optional[float] = None) -> List[List[List[int]]]:
    """Our micro-batches per rank (padded segment sizes), as the patched ``_shard_for_train``
    plans them (one global batch); ``overhead``: ``policy.megatron_cfg.dynbatch.
    cost_microbatch_overhead`` (tokens of linear work), or not told."""
    config = nemo_rl_planner_config(
        _policy_cfg(case, pp, overhead), dp_size=case.dp, forward_only=False
    )
    shards = plan_nemo_rl_shards(case.lengths, config, pad_multiple=case.pad_multiple)
    padded = padded_lengths(case.lengths, case.pad_multiple)
    placeholder = round_up(PLACEHOLDER_ATTENDED_TOKENS, case.pad_multiple)
    packs = []
    for rows, [spans] in zip(shards.rows, shards.micro_batch_indices, strict=True):
        packs.append(
            [[placeholder if i is None else padded[i] for i in rows[s:e]] for s, e in spans]
        )
    return packs


def nemo_rl_packing(case: NemoRlCase) -> List[List[List[int]]]:
    """NeMo-RL's sequence packing: its packer's bins, dealt round robin (padded segment sizes)."""
    padded = padded_lengths(case.lengths, case.pad_multiple)
    if os.environ.get("NEMO_RL_SRC"):
        from benchmarks.peers import real_nemo_rl

        ranks = real_nemo_rl(padded, dp_size=case.dp, token_cap=case.train_mb_tokens)
    else:
        ranks = nemo_rl_mffd(padded, dp_size=case.dp, token_cap=case.train_mb_tokens)
    return [[[padded[i] for i in mb] for mb in rank] for rank in ranks]


def nemo_rl_dynamic_batching(
    lengths: Sequence[int], dp: int, token_cap: int, sequence_length_round: int
) -> List[List[List[int]]]:
    """NeMo-RL's dynamic batching of one global batch: per rank, per micro-batch, its samples.

    Sorted by length and strided over the ranks (rank ``r`` holds sorted positions ``r, r + dp,
    ...``); position ``j`` of every rank counts with the longest of the ranks' ``j``-th samples,
    rounded up to ``sequence_length_round`` and clamped to the batch's width; a micro-batch grows
    while ``rows x its longest`` stays within the budget, with the same cuts on every rank.
    """
    width = max(lengths)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    shards = [order[r::dp] for r in range(dp)]
    per_position = [
        min(round_up(max(lengths[s[j]] for s in shards), sequence_length_round), width)
        for j in range(len(shards[0]))
    ]
    cuts, start, longest = [], 0, 0
    for j, length in enumerate(per_position):
        grown = max(longest, length)
        if j > start and (j - start + 1) * grown > token_cap:
            cuts.append((start, j))
            start, grown = j, length
        longest = grown
    cuts.append((start, len(per_position)))
    return [[shard[s:e] for s, e in cuts] for shard in shards]


def _real_dynamic_batching(case: NemoRlCase) -> List[List[List[int]]]:
    """NeMo-RL's own ``shard_by_batch_size`` with ``dynamic_batching_args`` (``NEMO_RL_SRC``)."""
    import torch

    from megatron_dynbatch.tools.testing.host_stubs import install_stubs

    root = os.environ["NEMO_RL_SRC"]
    if root not in sys.path:
        sys.path.insert(0, root)
    install_stubs(("requests", "transformers", "ray"))
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    n, width = len(case.lengths), max(case.lengths)
    data = BatchedDataDict(
        input_ids=torch.zeros((n, width), dtype=torch.int8),
        input_lengths=torch.tensor(case.lengths),
        index=list(range(n)),
    )
    shards, _ = data.shard_by_batch_size(
        case.dp,
        dynamic_batching_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_round": SEQUENCE_LENGTH_ROUND,
            "max_tokens_per_microbatch": case.train_mb_tokens,
        },
    )
    return [[s["index"][a:b] for a, b in s.micro_batch_indices[0]] for s in shards]


def _dynamic_costs(case: NemoRlCase, cost: CostModel) -> List[List[float]]:
    ranks = nemo_rl_dynamic_batching(
        case.lengths, case.dp, case.train_mb_tokens, SEQUENCE_LENGTH_ROUND
    )
    if os.environ.get("NEMO_RL_SRC"):
        real = _real_dynamic_batching(case)
        assert real == ranks, f"{case.label}: the stand-in differs from NeMo-RL's own"
    width = max(case.lengths)
    out = []
    for rank in ranks:
        costs = []
        for j, mb in enumerate(rank):
            # The micro-batch's S: the cut's longest position (over every rank), as NeMo-RL's.
            s = min(
                round_up(max(case.lengths[i] for r in ranks for i in r[j]), SEQUENCE_LENGTH_ROUND),
                width,
            )
            costs.append(microbatch_cost(cost, "padded", s, len(mb), [s] * len(mb), [0] * len(mb)))
        out.append(costs)
    return out


def true_cost(case: NemoRlCase, overhead_fraction: float, crossover: float) -> CostModel:
    """Linear work plus attention ``L**2 / crossover`` (per segment packed, per row padded), plus a
    per-micro-batch cost of ``overhead_fraction`` of a full row at the budget."""
    base = CostModel(token_weight=1.0, attention_weight=1.0 / crossover if crossover else 0.0)
    return CostModel(
        token_weight=base.token_weight,
        attention_weight=base.attention_weight,
        microbatch_overhead=overhead_fraction * base.full_row_cost(case.train_mb_tokens),
    )


def _over_cap(case: NemoRlCase, *plans: List[List[List[int]]]) -> int:
    """Micro-batches of ``plans`` (per rank, per micro-batch, padded segment sizes) over the
    budget."""
    return sum(
        1 for packs in plans for rank in packs for mb in rank if sum(mb) > case.train_mb_tokens
    )


def run_case(case: NemoRlCase, overheads: Sequence[float], crossover: float) -> Dict[str, Any]:
    """Ours (not told and told the overhead) against NeMo-RL's packing at PP 2 and its dynamic
    batching at PP 1."""
    result: Dict[str, Any] = {"case": case.label, "ratios": {}}
    ours2, ours1 = ours(case, 2), ours(case, 1)
    result["ours_over_cap"] = _over_cap(case, ours2, ours1)
    try:
        packing = nemo_rl_packing(case)
    except BaselineFailure as exc:
        packing = None
        result["packing"] = f"FAIL: {exc.reason}"
    for fraction in overheads:
        cost = true_cost(case, fraction, crossover)
        # Told the true overhead, in tokens of linear work, as a calibrated run tells it.
        told = cost.microbatch_overhead / cost.token_weight
        told2, told1 = ours(case, 2, told), ours(case, 1, told)
        result["ours_over_cap"] += _over_cap(case, told2, told1)
        theirs2 = None if packing is None else _step(_packed_costs(packing, 2, cost), 2)
        theirs1 = _step(_dynamic_costs(case, cost), 1)
        row = {}
        for suffix, pp2, pp1 in (("", ours2, ours1), ("_told", told2, told1)):
            if theirs2 is not None:
                row["pp2_vs_packing" + suffix] = _step(_packed_costs(pp2, 2, cost), 2) / theirs2
            row["pp1_vs_dynamic" + suffix] = _step(_packed_costs(pp1, 1, cost), 1) / theirs1
        result["ratios"][fraction] = row
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
            "nemo_rl_source": os.environ.get("NEMO_RL_SRC") or "stand-ins (benchmarks.baselines)",
            "packing_failed": sum(1 for c in cases if "packing" in c),
        },
    )


def format_summary(summary: Dict[str, Any]) -> str:
    lines = [
        f"{summary['num_cases']} random NeMo-RL steps (seed {summary['seed']}, true attention "
        f"L^2/{summary['crossover']:g}; NeMo-RL's code: {summary['nemo_rl_source']}); NeMo-RL's "
        f"packing fails in {summary['packing_failed']} (ours trains them); ours over the budget: "
        f"{summary['ours_over_cap']}"
    ]
    lines += ratio_lines(summary["by_overhead"], NAMES, "theirs")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    return as_run_main(argv, __doc__.split("\n\n")[0], search, format_summary, 60)


if __name__ == "__main__":
    sys.exit(main())
