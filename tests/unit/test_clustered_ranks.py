"""The thorough planner (``dynbatch-thorough``, issue 45): the large samples a few to a rank with
less of the rest (planning/cluster.py), samples moved from the slowest rank to the fastest ones
and a larger refinement budget (planning/refine.py). Never slower than the default planner on
random workloads, replayed by the simulator; deterministic; every plan passes check_plan."""

import dataclasses
import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_dynbatch.planning import (
    CostModel,
    ParallelLayout,
    PlannerConfig,
    SampleSet,
    check_plan,
    plan_schedule,
)
from megatron_dynbatch.planning.cluster import (
    _scaled,
    big_samples,
    rank_rows,
    split_by_targets,
)
from megatron_dynbatch.planning.simulate import (
    pipeline_makespan,
    simulate_interleaved,
)
from megatron_dynbatch.planning.spec import THOROUGH_PLANNER
from tests._support import replayed_step_time

pytestmark = pytest.mark.unit


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**30),
    dp=st.sampled_from([2, 4, 8, 16]),
    per_rank=st.integers(4, 40),
    layout=st.sampled_from([(2, 1), (4, 1), (2, 2), (4, 2)]),
    cap=st.sampled_from([4096, 16384]),
    overhead=st.sampled_from([0.0, 0.02, 0.05]),
    attention=st.sampled_from([0.0, 0.25, 1.0]),
    at_cap=st.sampled_from([0.0, 0.02, 0.1]),
)
# Drawn once (a CI-style run): the thorough planner 0.06% slower than the default, whose choice
# sorted heaviest first was faster; the thorough planner now scores the default's plan too.
@example(
    seed=18208,
    dp=16,
    per_rank=31,
    layout=(2, 2),
    cap=16384,
    overhead=0.05,
    attention=0.0,
    at_cap=0.02,
)
def test_never_slower_than_the_planner_before_on_random_workloads(
    seed, dp, per_rank, layout, cap, overhead, attention, at_cap
):
    """Long-tailed lengths, some at the cap (GRPO's clipped responses), variable rows under a
    pipeline: the thorough planner's replayed step is never slower than the default's."""
    rng = random.Random(seed)
    lengths = [
        cap if rng.random() < at_cap else min(cap, max(1, int(rng.lognormvariate(7.0, 1.0))))
        for _ in range(dp * per_rank)
    ]
    pp, vpp = layout
    config = PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp),
        cost=CostModel(
            token_weight=1.0,
            attention_weight=attention / cap,
            microbatch_overhead=overhead * cap,
        ),
        variable_row_lengths=True,
        row_multiple=64,
        oversize_samples="allow",
    )
    old = plan_schedule(lengths, config=config)
    thorough = dataclasses.replace(config, planner=THOROUGH_PLANNER)
    new = plan_schedule(lengths, config=thorough)
    assert plan_schedule(lengths, config=thorough) == new
    check_plan(new, SampleSet.build(lengths), thorough)
    assert new.steps[0].idle_ranks <= old.steps[0].idle_ranks
    assert replayed_step_time(new.steps[0], lengths, config) <= replayed_step_time(
        old.steps[0], lengths, config
    ) * (1 + 1e-9)


@pytest.mark.parametrize("label", ["7b grpo vpp1 dp16", "32b grpo vpp1 dp16"])
def test_clustering_shrinks_the_worst_gpu_regime_steps(label):
    """Where every rank holds a sample filling a whole row (1.280 and 1.267 of the bound with
    the default planner), the thorough one's step is faster by more than 1.5%, within the cap."""
    from benchmarks import gpu_regime

    case = next(c for c in gpu_regime.cases(0) if c.label == label)
    cost = gpu_regime.true_cost(case, gpu_regime.Assumptions())
    new = gpu_regime._told(case, cost, THOROUGH_PLANNER)
    old = gpu_regime._told(case, cost)
    assert new["step"] < old["step"] * 0.985
    assert not new["over_cap"]


def test_rank_rows_keeps_every_sample_the_cap_and_the_large_ones_side_by_side():
    rng = random.Random(5)
    sizes = [rng.randint(50, 4000) for _ in range(60)] + [16000, 15800, 15500]
    bigs = [60, 61, 62]
    rest = list(range(60))
    for ramp in ((0.25, 5, 5), (0.1, 0.5, 0.5), (0.5, 1, 1)):
        rows = rank_rows(bigs, rest, sizes, 16384, 16, ramp)
        assert len(rows) == 16
        assert sorted(i for row in rows for i in row) == list(range(63))
        assert all(sum(sizes[i] for i in row) <= 16384 for row in rows)
        at = [k for k, row in enumerate(rows) if row and row[0] in bigs]
        assert [rows[k] for k in at] == [[60], [61], [62]]
        assert at == list(range(at[0], at[0] + 3))
        # The ramp's ends are its lightest rows.
        loads = [sum(sizes[i] for i in row) for k, row in enumerate(rows) if k not in at]
        assert loads[0] < max(loads) and loads[-1] < max(loads)
    # Too few micro-batches for three large samples and the rest: no rows.
    assert rank_rows(bigs, rest, sizes, 16384, 3, (0.25, 5, 5)) is None
    assert rank_rows(bigs, rest, sizes, 16384, 5, (0.25, 5, 5)) is None


def test_scaled_profile_adds_up_and_keeps_the_cap():
    for profile, total in (([0.1, 0.5, 1.0, 1.0, 0.3], 9000.0), ([1.0, 0.2], 20000.0)):
        loads = _scaled(profile, total, 16384)
        assert sum(loads) == pytest.approx(total)
        assert max(loads) <= 16384
        # The shape is kept below the cap.
        uncut = [(p, x) for p, x in zip(profile, loads, strict=True) if x < 16384]
        assert len({round(x / p, 6) for p, x in uncut}) == 1
    assert _scaled([0.5, 1.0], 40000.0, 16384) == [16384.0, 16384.0]


def test_split_by_targets_follows_uneven_targets():
    weights = [float(w) for w in range(1, 41)]
    members = split_by_targets(range(40), weights, [300.0, 200.0, 320.0], [[], [], []])
    assert sorted(i for rank in members for i in rank) == list(range(40))
    totals = [sum(weights[i] for i in rank) for rank in members]
    assert totals[1] < totals[0] < totals[2]
    assert max(abs(t - w) for t, w in zip(totals, (300, 200, 320), strict=True)) <= 40
    assert big_samples(range(40), weights, 0.9) == [39, 38, 37, 36, 35]


def test_pipeline_makespan_is_the_simulators_on_random_costs():
    """The one-pass replay (an order cached per shape) gives the event simulation's makespan."""
    rng = random.Random(9)
    checked = 0
    for _ in range(300):
        pp, vpp = rng.choice([2, 3, 4, 8]), rng.choice([1, 2, 3])
        group = pp + rng.choice([0, 1, 2]) if vpp > 1 else None
        m = rng.randint(1, 30)
        if vpp > 1 and (m < group or 0 < m % group < pp):
            continue
        fwd = [rng.random() for _ in range(m)]
        bwd = [2 * c for c in fwd]
        expected = simulate_interleaved(fwd, bwd, pp, vpp, group).makespan
        assert pipeline_makespan(fwd, pp, vpp, group) == pytest.approx(expected, rel=1e-12)
        checked += 1
    assert checked > 100


def test_relaxed_rank_tents_and_estimate():
    """benchmarks.gpu_regime_relaxed: its starting tents add up and keep the row's ceiling, and
    its estimate (a schedule it replays) is never below the bound."""
    from benchmarks import gpu_regime, gpu_regime_relaxed

    loads = gpu_regime_relaxed._tent(12, 5, 0.1, 30.0, 4.0)
    assert sum(loads) == pytest.approx(30.0)
    assert max(loads) <= 4.0 + 1e-9 and loads[5] == pytest.approx(max(loads))
    assert loads[0] < loads[4] and loads[-1] < loads[6]
    assert gpu_regime_relaxed._tent(3, 1, 0.5, 30.0, 4.0) is None
    case = next(c for c in gpu_regime.cases(0) if c.label == "7b grpo vpp1 dp16")
    with mock.patch.object(gpu_regime_relaxed, "STEPS", 20):
        assert gpu_regime_relaxed.relaxed_rank(case, 1) > 1.0
