"""No step runs placeholder slots that every DP rank has to spare (a probe from peers' bug
reports: torchtitan #3938, TRL #6092, slime #1926 kept micro-batches beyond need). A construction
could leave bins empty on every rank, even at dp 1; the count is the fullest rank's real
micro-batches, rounded up to the micro-batch multiple, wherever that replays faster."""

import json
import random
import subprocess
import sys

import pytest

from megatron_dynbatch.planning import CostModel, ParallelLayout, PlannerConfig, plan_schedule
from megatron_dynbatch.planning.cost import microbatch_cost
from megatron_dynbatch.planning.simulate import simulate_step
from megatron_dynbatch.planning.spec import round_up

pytestmark = pytest.mark.unit

# 18 samples at dp 1, pp 4, cp 2 under 1,000 tokens a GPU (rows of up to 2,000): the tent of 14
# slots held 12 micro-batches and two 64-token placeholders.
DP1_LENGTHS = [211, 2000, 461, 429, 134, 536, 681, 172, 259, 1619, 99, 627, 2000, 959, 153, 1177]
DP1_LENGTHS += [74, 658]


def _spare(step, multiple):
    real = [sum(1 for mb in rank if mb) for rank in step.ranks]
    return step.num_microbatches - round_up(max(real), multiple)


def _replayed(step, lengths, config):
    """The step as it runs, on its own rows, by the event simulator (not the planner's scoring)."""
    model, parallel = config.cost, config.parallel
    sizes = [round_up(n, parallel.sample_multiple) for n in lengths]
    ranks = [
        [
            microbatch_cost(model, "packed", row, 1, [sizes[i] for i in mb], [0] * len(mb))
            for mb, row in zip(rank, rows, strict=True)
        ]
        for rank, rows in zip(step.ranks, step.row_lengths, strict=True)
    ]
    group = parallel.group_size if parallel.vpp_size > 1 else None
    return simulate_step(ranks, parallel.pp_size, parallel.vpp_size, group).step_time


def test_plan_at_dp_1_runs_no_placeholder():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_dynbatch", "plan", "-", "--json", "--dp-size", "1"]
        + ["--pp-size", "4", "--cp-size", "2", "--max-tokens-per-gpu", "1000"]
        + ["--variable-seq-lengths"],
        input=json.dumps(DP1_LENGTHS),
        capture_output=True,
        text=True,
        check=True,
    )
    step = json.loads(out.stdout)["steps"][0]
    assert step["num_placeholders"] == 0, step["ranks"]
    assert step["num_microbatches"] == 12


@pytest.mark.parametrize("seed", range(48))
def test_no_step_keeps_slots_every_rank_spares(seed):
    rng = random.Random(seed)
    dp, pp, vpp = rng.choice([1, 2, 4]), rng.choice([2, 4]), rng.choice([1, 2])
    config = PlannerConfig(
        max_tokens_per_gpu=rng.choice([1000, 2048, 4096]),
        parallel=ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp, cp_size=rng.choice([1, 2])),
        cost=CostModel(microbatch_overhead=rng.choice([20.0, 40.0, 100.0])),
        variable_row_lengths=True,
        row_multiple=64,
    )
    cap = config.max_tokens_per_gpu * config.parallel.cp_size
    lengths = [rng.randint(20, cap) for _ in range(rng.randint(6, 24) * dp)]
    for step in plan_schedule(lengths, config=config).steps:
        spare = _spare(step, config.parallel.microbatch_multiple)
        assert spare == 0, (spare, step.ranks)
        assert _replayed(step, lengths, config) > 0
