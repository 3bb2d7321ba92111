"""One protocol the runtime consumes for every plan kind (issue 38 item 4).

A Plan (plan_schedule), a ShardedPlan (plan_sharded_step, verl / SkyRL) and slime's DPSchedule
(build_dp_schedule) each implement planning.schedule.Schedule; the plan checker and the
materializer accept each through its scheduled_steps(), and each kind's public form is unchanged.
"""

import dataclasses
import random

import pytest
import torch

from megatron_dynbatch.adapters.slime import build_dp_schedule
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import (
    ParallelLayout,
    PlanInvariantError,
    PlannerConfig,
    SampleSet,
    check_plan,
    plan_schedule,
)
from megatron_dynbatch.planning.schedule import Schedule, ScheduledStep
from megatron_dynbatch.planning.sharded import plan_sharded_step
from megatron_dynbatch.runtime.materialize import materialize_microbatches
from megatron_dynbatch.runtime.schema import BatchSchema
from tests._support import slime_args, slime_tp

pytestmark = pytest.mark.unit

RNG = random.Random(4)
LENGTHS = [RNG.randint(20, 700) for _ in range(24)]
IDS = [i // 2 for i in range(24)]
CAP = 1024


def _plan():
    config = PlannerConfig(
        max_tokens_per_gpu=CAP, parallel=ParallelLayout(dp_size=2), rollouts_per_step=6
    )
    return plan_schedule(LENGTHS, IDS, config=config), SampleSet.build(LENGTHS, IDS), config


def _sharded():
    lengths = [LENGTHS[:10], LENGTHS[10:13], []]
    config = PlannerConfig(max_tokens_per_gpu=CAP)
    return plan_sharded_step(lengths, config), lengths, config


def _slime(cp=1):
    args = slime_args(max_tokens_per_gpu=CAP)
    schedule = build_dp_schedule(
        args, slime_tp(dp_size=2, cp_size=cp), LENGTHS, global_batch_size=6, rollout_indices=IDS
    )
    config = PlannerConfig(max_tokens_per_gpu=CAP, parallel=ParallelLayout(dp_size=2, cp_size=cp))
    return schedule, SampleSet.build(LENGTHS, IDS), config


def _samples(indices, lengths):
    return {i: {"tokens": torch.arange(1, lengths[i] + 1) % 50} for i in indices}


KINDS = {"Plan": _plan, "ShardedPlan": _sharded, "DPSchedule": _slime}


@pytest.mark.parametrize("kind", KINDS)
def test_every_plan_kind_is_a_schedule_the_checker_accepts(kind):
    plan, samples, config = KINDS[kind]()
    assert isinstance(plan, Schedule)
    steps = plan.scheduled_steps()
    assert steps and all(isinstance(step, ScheduledStep) for step in steps)
    for step in steps:
        assert {len(rank) for rank in step.ranks} == {step.num_microbatches}
    check_plan(plan, samples, config)


def test_the_views_say_what_each_plan_kind_schedules():
    plan, _, _ = _plan()
    for step, view in zip(plan.steps, plan.scheduled_steps(), strict=True):
        assert (view.ranks, view.seq_length, view.num_microbatches) == (
            step.ranks,
            step.seq_length,
            step.num_microbatches,
        )
    sharded, lengths, _ = _sharded()
    [view] = sharded.scheduled_steps()
    assert view.seq_length is None and view.micro_batch_size == sharded.rows
    for r, rank in enumerate(view.ranks):
        assert rank[: len(sharded.ranks[r])] == sharded.ranks[r]
        assert rank[len(sharded.ranks[r]) :] == ((),) * sharded.placeholders(r)
    schedule, _, _ = _slime()
    partitions, micro_batch_indices, num_microbatches, _ = schedule  # slime's 4-tuple, unchanged
    views = schedule.scheduled_steps()
    assert [view.num_microbatches for view in views] == num_microbatches
    for r in range(2):
        flat = [mb for view in views for mb in view.ranks[r]]
        assert flat == [tuple(partitions[r][j] for j in mb) for mb in micro_batch_indices[r]]
        rows = [row for view in views for row in view.row_lengths[r]]
        assert rows == schedule.row_lengths[r]


def test_the_checker_finds_a_broken_slime_schedule_through_the_protocol():
    schedule, samples, config = _slime()
    # Drop a sample: slime would never train it.
    victim = next(mb for mb in schedule.micro_batch_indices[0] if len(mb) > 1)
    dropped = victim.pop()
    with pytest.raises(
        PlanInvariantError, match=r"never scheduled \[" + str(schedule[0][0][dropped])
    ):
        check_plan(schedule, samples, config)
    # A row too short for its samples.
    schedule, samples, config = _slime()
    k = next(m for m, mb in enumerate(schedule.micro_batch_indices[1]) if mb)
    schedule.row_lengths[1][k] = 1
    with pytest.raises(PlanInvariantError, match=r"do not fit its row of 1"):
        check_plan(schedule, samples, config)
    with pytest.raises(PlanInvariantError, match="implements no scheduled_steps"):
        check_plan(object(), samples, config)


def test_with_context_parallelism_slime_rows_are_one_cp_ranks_share():
    schedule, samples, config = _slime(cp=2)
    check_plan(schedule, samples, config)
    [view, *_] = schedule.scheduled_steps()
    assert view.rows_per_cp_rank
    whole = view.whole_rows(2)
    assert whole.row_lengths[0][0] == 2 * view.row_lengths[0][0]
    with pytest.raises(DynBatchValueError, match=r"pass step\.whole_rows\(cp_size\)"):
        materialize_microbatches(view, 0, {}, BatchSchema(), layout="packed", sample_multiple=1)


@pytest.mark.parametrize("kind", KINDS)
def test_the_materializer_builds_every_plan_kinds_micro_batches(kind):
    plan, samples, config = KINDS[kind]()
    view = plan.scheduled_steps()[0].whole_rows(config.parallel.cp_size)
    multiple = config.parallel.sample_multiple
    for rank in range(len(view.ranks)):
        lengths = samples[rank] if kind == "ShardedPlan" else samples.lengths
        members = [i for mb in view.rank_microbatches(rank) for i in mb]
        batches = materialize_microbatches(
            view,
            rank,
            _samples(members, lengths),
            BatchSchema(),
            layout="packed",
            sample_multiple=multiple,
        )
        assert len(batches) == view.num_microbatches
        for m, (mb, batch) in enumerate(zip(view.rank_microbatches(rank), batches, strict=True)):
            indices = batch["sample_index"][batch["sample_index"] >= 0]
            assert sorted(set(indices.tolist())) == sorted(mb)
            assert batch["loss_mask"].sum() == sum(lengths[i] - 1 for i in mb)
            row = view.row_length(rank, m)
            if row is not None:
                assert batch["tokens"].shape == (1, row)
        if kind == "Plan":
            # Through the protocol or the StepPlan directly: the same tensors.
            direct = materialize_microbatches(
                plan.steps[0],
                rank,
                _samples(members, lengths),
                BatchSchema(),
                layout="packed",
                sample_multiple=multiple,
            )
            for a, b in zip(batches, direct, strict=True):
                assert all(torch.equal(a[key], b[key]) for key in a)
        if kind == "ShardedPlan" and members:
            # Rows fit this rank's fullest micro-batch: no placeholder-only rank sets them.
            fullest = max(sum(lengths[i] for i in mb) for mb in view.rank_microbatches(rank))
            assert batches[0]["tokens"].shape[1] == fullest


def test_public_forms_are_unchanged():
    plan, _, _ = _plan()
    assert set(plan.to_dict()) == {
        "layout",
        "sample_multiple",
        "token_cap",
        "dp_size",
        "steps",
        "stats",
    }
    schedule, _, _ = _slime()
    assert len(tuple(schedule)) == 4
    assert dataclasses.is_dataclass(plan) and not hasattr(plan, "ranks")


def test_a_padded_host_gets_the_sharded_plans_rows_of_its_longest_sample():
    sharded, lengths, _ = _sharded()
    [view] = sharded.scheduled_steps()
    members = [i for mb in view.rank_microbatches(0) for i in mb]
    batches = materialize_microbatches(
        view, 0, _samples(members, lengths[0]), BatchSchema(), layout="padded", sample_multiple=8
    )
    longest = max(-(-lengths[0][i] // 8) * 8 for i in members)
    assert {tuple(b["tokens"].shape) for b in batches} == {(sharded.rows, longest)}
