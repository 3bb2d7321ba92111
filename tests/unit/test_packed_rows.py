"""Packed micro-batches of B > 1 rows (issue 18): the planner chooses M, B and S together, and
fixed micro-batches' own [B x S] shape is always among its candidates."""

import dataclasses
import random

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
from megatron_dynbatch.planning.cost import step_microbatch_costs
from megatron_dynbatch.planning.fixed import plan_fixed_microbatches
from megatron_dynbatch.planning.invariants import PlanInvariantError
from megatron_dynbatch.planning.simulate import pipeline_makespan

pytestmark = pytest.mark.unit

#: The local implementation's attention (a dense masked S x S a row), hidden size 64.
DENSE = CostModel(attention_weight=1.0 / (6 * 64), attention="dense", microbatch_overhead=50.0)


def _step_time(plan, lengths, model, parallel):
    """The simulated time of the plan's first step, scored by the same cost model for both."""
    costs = step_microbatch_costs(
        plan.steps[0],
        layout=plan.layout,
        lengths=lengths,
        prompt_lengths=[0] * len(lengths),
        sample_multiple=plan.sample_multiple,
        model=model,
    )
    return max(
        pipeline_makespan(rank, parallel.pp_size, parallel.vpp_size, parallel.group_size)
        for rank in costs
    )


def test_dense_attention_chooses_four_rows_of_256_over_one_of_1024():
    """32 documents of up to 256 tokens, a 1,024-token budget: under a dense mask one row of 1,024
    pays 4x the attention of four rows of 256, so without a pipeline (where more micro-batches
    shrink no bubble) the plan is fixed's own [4 x 256] shape; with per-segment attention (THD)
    one row per micro-batch stays."""
    rng = random.Random(0)
    lengths = [rng.choice([256, rng.randint(150, 256)]) for _ in range(32)]
    parallel = ParallelLayout()
    config = PlannerConfig(max_tokens_per_gpu=1024, parallel=parallel, cost=DENSE)
    plan = plan_schedule(lengths, config=config)
    check_plan(plan, SampleSet.build(lengths), config)
    step = plan.steps[0]
    assert (step.micro_batch_size, step.seq_length) == (4, 256)
    assert step.packed_rows and all(len(rows) == 4 for rank in step.packed_rows for rows in rank)
    one_row = dataclasses.replace(config, cost=dataclasses.replace(DENSE, attention="segment"))
    assert plan_schedule(lengths, config=one_row).steps[0].micro_batch_size == 1
    # Scored by the dense model, the [1 x 1024] packing is far slower than the chosen plan.
    assert _step_time(plan_schedule(lengths, config=one_row), lengths, DENSE, parallel) > (
        1.5 * _step_time(plan, lengths, DENSE, parallel)
    )


def test_short_documents_pack_several_to_a_row_of_b_rows():
    """Short documents: rows of 256 hold several each, so fill rises far above fixed's."""
    rng = random.Random(1)
    lengths = [rng.randint(10, 120) for _ in range(64)]
    config = PlannerConfig(max_tokens_per_gpu=1024, parallel=ParallelLayout(pp_size=2), cost=DENSE)
    plan = plan_schedule(lengths, config=config)
    check_plan(plan, SampleSet.build(lengths), config)
    step = plan.steps[0]
    assert step.micro_batch_size > 1
    assert max(c for rank in step.packed_rows for rows in rank for c in rows) > 1
    fixed = plan_fixed_microbatches(lengths, dp_size=1, micro_batch_size=4, seq_length=256)
    assert step.fill > 1.5 * fixed.steps[0].fill


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 96),
    mbs=st.sampled_from([1, 2, 4, 8]),
    seq=st.sampled_from([64, 128, 256]),
    dp=st.integers(1, 4),
    pp=st.sampled_from([1, 2, 4]),
    kind=st.sampled_from(["dense", "causal"]),
    overhead=st.sampled_from([0.0, 30.0, 500.0]),
    seed=st.integers(0, 2**31),
)
# A construction fitting fewer micro-batches than the search's packings (14 against 15): the
# plan's fewest must say so (check_plan: min_microbatches <= num_microbatches).
@example(n=33, mbs=2, seq=64, dp=1, pp=1, kind="dense", overhead=500.0, seed=1906)
def test_never_predicted_slower_than_fixed_at_the_same_memory(
    n, mbs, seq, dp, pp, kind, overhead, seed
):
    """Fixed's [mbs x seq] shape (one sample a row) is always a candidate at a budget of
    mbs * seq: scored by the planner's own cost model, the plan is never slower (min_gain 0: a
    given overhead is trusted)."""
    rng = random.Random(seed)
    # Mostly documents cut near seq, where fixed's fill is high and one-row packing loses to it.
    lengths = [
        rng.randint(seq * 7 // 8, seq) if rng.random() < 0.7 else rng.randint(1, seq)
        for _ in range(n)
    ]
    model = CostModel(attention_weight=1.0 / 384, attention=kind, microbatch_overhead=overhead)
    parallel = ParallelLayout(dp_size=dp, pp_size=pp)
    config = PlannerConfig(max_tokens_per_gpu=mbs * seq, parallel=parallel, cost=model)
    plan = plan_schedule(lengths, config=config)
    check_plan(plan, SampleSet.build(lengths), config)
    fixed = plan_fixed_microbatches(lengths, dp_size=dp, micro_batch_size=mbs, seq_length=seq)
    ours = _step_time(plan, lengths, model, parallel)
    theirs = _step_time(fixed, lengths, model, parallel)
    assert ours <= theirs * (1 + 1e-9), (plan.steps[0], ours, theirs)
    assert plan.stats.max_microbatch_tokens <= mbs * seq


def test_segment_attention_plans_are_unchanged():
    """Per-segment attention (the default for packed rows) never gets B > 1 rows: THD costs a
    row of B * S holding the same samples no more, and the planner's work stays as it was."""
    rng = random.Random(2)
    lengths = [rng.randint(1, 200) for _ in range(500)]
    config = PlannerConfig(max_tokens_per_gpu=1024, parallel=ParallelLayout(dp_size=4, pp_size=2))
    plan = plan_schedule(lengths, config=config)
    assert all(s.micro_batch_size == 1 and not s.packed_rows for s in plan.steps)


def _dense_plan():
    lengths = [100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 5, 5]
    config = PlannerConfig(max_tokens_per_gpu=512, cost=DENSE)
    plan = plan_schedule(lengths, config=config)
    assert plan.steps[0].micro_batch_size > 1
    return lengths, config, plan


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda step: dict(packed_rows=()), "micro_batch_size=.* and no packed_rows"),
        (
            lambda step: dict(
                packed_rows=tuple(
                    tuple(rows[:-1] + (rows[-1] + 1,) for rows in rank) for rank in step.packed_rows
                )
            ),
            "do not split its",
        ),
        (lambda step: dict(seq_length=step.seq_length // 2), "row .* exceed seq_length"),
        (lambda step: dict(micro_batch_size=step.micro_batch_size + 8), "footprint .* exceeds"),
    ],
)
def test_invariant_checker_catches_broken_packed_rows(breakage, message):
    lengths, config, plan = _dense_plan()
    step = plan.steps[0]
    broken = dataclasses.replace(plan, steps=(dataclasses.replace(step, **breakage(step)),))
    with pytest.raises(PlanInvariantError, match=message):
        check_plan(broken, SampleSet.build(lengths), config)


def test_packed_rows_change_the_fingerprint_and_round_trip_in_the_json():
    lengths, config, plan = _dense_plan()
    step = plan.steps[0]
    data = plan.to_dict()["steps"][0]
    assert data["packed_rows"] == [[list(rows) for rows in rank] for rank in step.packed_rows]
    # The same micro-batches split into rows differently: another plan.
    rows = step.packed_rows[0][0]
    moved = (rows[0] - 1, rows[1] + 1) + rows[2:] if rows[0] > 0 else (rows[0] + 1, rows[1] - 1)
    other = ((moved,) + step.packed_rows[0][1:],) + step.packed_rows[1:]
    changed = dataclasses.replace(plan, steps=(dataclasses.replace(step, packed_rows=other),))
    assert changed.fingerprint() != plan.fingerprint()
