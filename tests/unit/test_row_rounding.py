"""Rows of their own length rounded up less (issue 45): samples swapped between two micro-batches
of a rank where the two rows then round up by fewer tokens (planning/shape.py
``_less_rounding``)."""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from benchmarks.baselines import BASELINES
from benchmarks.lengths import LengthSet
from benchmarks.small_steps import _ours, _score, overhead_cost
from megatron_dynbatch.planning import (
    ParallelLayout,
    PlannerConfig,
    SampleSet,
    check_plan,
    plan_schedule,
)
from megatron_dynbatch.planning import shape as shape_module
from tests._support import planner_without, replayed_step_time

pytestmark = pytest.mark.unit


def rounded_as_packed():
    # And without the sorted orders and first fit decreasing that come after (applied to the
    # choice, rounded or not: first fit decreasing tries counts up to the choice's, so a choice of
    # fewer micro-batches can take a count it would have found away from it).
    return planner_without("_less_rounding", "_reordered", "_decreasing")


def test_pairs_of_equal_lengths_round_up_less_than_mixed_pairs():
    """``small_steps --wide --seed 27``: 330 samples of 1,841 tokens and 310 of 1,406 at dp 16,
    no pipeline, rows of 128-token multiples, 5% overhead. Mixed pairs (3,247 tokens, a row of
    3,328) left NeMo-RL's packing 0.95% ahead; pairs of equal lengths (rows of 3,712 and 2,816)
    put ours ahead."""
    rng = random.Random(27)
    lengths = [1841] * 330 + [1406] * 310
    rng.shuffle(lengths)
    samples = LengthSet(lengths, None, None)
    parallel = ParallelLayout(dp_size=16)
    cost = overhead_cost(4096, 0.05)
    new = _ours(samples, parallel, 4096, cost, 128)
    with rounded_as_packed():
        old = _ours(samples, parallel, 4096, cost, 128)
    theirs = BASELINES["nemo_rl_mffd"](
        lengths, dp_size=16, token_cap=4096, microbatch_multiple=1, rollout_ids=None
    )
    nemo_rl, over = _score(theirs, samples, parallel, 4096, cost, 128)
    assert not over
    assert old > nemo_rl * 1.005
    assert new < nemo_rl


def test_small_samples_move_between_rows_until_one_rounds_up_less():
    """``small_steps --wide --seed 47``: 639 samples of 1-16 tokens at dp 16, pp 4 x vpp 4, rows
    of 64-token multiples, 5% overhead: four rows of about 85 tokens a rank each round up to 128.
    No one swap shortens a row; moving samples from one row to the other until it fits 64 does.
    slime's first fit (rows of 128, 128, 64, 64) was 3% ahead; ours is ahead of it."""
    rng = random.Random(47)
    lengths = [rng.randint(1, 16) for _ in range(639)]
    samples = LengthSet(lengths, [i // 8 for i in range(639)], None)
    parallel = ParallelLayout(dp_size=16, pp_size=4, vpp_size=4)
    cost = overhead_cost(1024, 0.05)
    new = _ours(samples, parallel, 1024, cost, 64)
    with rounded_as_packed():
        old = _ours(samples, parallel, 1024, cost, 64)
    theirs = BASELINES["slime_first_fit"](
        lengths,
        dp_size=16,
        token_cap=1024,
        microbatch_multiple=parallel.microbatch_multiple,
        rollout_ids=samples.rollout_ids,
    )
    slime, over = _score(theirs, samples, parallel, 1024, cost, 64)
    assert not over
    assert old > slime * 1.02
    assert new < slime


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**30),
    dp=st.sampled_from([1, 2, 3, 8]),
    per_rank=st.integers(1, 40),
    layout=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    cap=st.sampled_from([1024, 4096]),
    multiple=st.sampled_from([8, 64, 128]),
    kinds=st.integers(1, 3),
)
# First fit decreasing, left on in the plan before, found a count of 24 the rounded choice of 12
# no longer reached (0.11% faster).
@example(seed=2911390, dp=2, per_rank=39, layout=(4, 2), cap=1024, multiple=128, kinds=3)
def test_rounding_less_never_slows_a_step(seed, dp, per_rank, layout, cap, multiple, kinds):
    """Samples swap only where the step gets faster: never slower, replayed, each plan
    check_plan-clean, every row within the cap."""
    rng = random.Random(seed)
    choices = [rng.randint(1, cap // 2) for _ in range(kinds)]
    lengths = [rng.choice(choices) for _ in range(dp * per_rank)]
    pp, vpp = layout
    config = PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp),
        cost=overhead_cost(cap, 0.02),
        variable_row_lengths=True,
        row_multiple=multiple,
    )
    new = plan_schedule(lengths, config=config)
    with rounded_as_packed():
        old = plan_schedule(lengths, config=config)
    check_plan(new, SampleSet.build(lengths), config)
    step = new.steps[0]
    assert all(row <= cap for rows in step.row_lengths for row in rows)
    assert replayed_step_time(step, lengths, config) <= replayed_step_time(
        old.steps[0], lengths, config
    ) * (1 + 1e-9)


def test_fewer_fuller_rows_are_rounded_too():
    """241 samples of 1-16 tokens at dp 6, pp 2 x vpp 4, rows of 128, 1% overhead: the choice ran
    four rows of about 86 tokens a rank, each rounded to 128; the two-row count, balanced by work
    into rows of about 173 (each rounded to 256), lost to it. Rounded too, two rows of about 217
    and 128 tokens (256 and 128) run 5.6% faster and win, ahead of slime's first fit."""
    lengths = [1 + (7 * i) % 16 for i in range(241)]
    samples = LengthSet(lengths, [i // 8 for i in range(241)], None)
    parallel = ParallelLayout(dp_size=6, pp_size=2, vpp_size=4)
    cost = overhead_cost(1024, 0.01)
    new = _ours(samples, parallel, 1024, cost, 128)
    with mock.patch.object(shape_module, "_ROUNDING_REACH", -1.0):
        old = _ours(samples, parallel, 1024, cost, 128)
    theirs = BASELINES["slime_first_fit"](lengths, dp_size=6, token_cap=1024, microbatch_multiple=2)
    slime, over = _score(theirs, samples, parallel, 1024, cost, 128)
    assert not over
    assert new < old * 0.95
    assert new < slime


def test_a_step_over_the_ramps_gets_less_rounding_at_its_fewest_count():
    """783 samples of 448 tokens and 753 of 382 at dp 64, pp 4 x vpp 4, cap 1,024, rows of 128,
    1% overhead (more samples than the ramps reach): the fewest count, 12 a rank, packed mixed
    pairs (830 tokens in rows of 896), so 24 single rows won; equal pairs (896 and 768) at 12 a
    rank are 5% faster, as NeMo-RL's first fit decreasing packs them."""
    lengths = [448] * 783 + [382] * 753
    random.Random(184).shuffle(lengths)
    samples = LengthSet(lengths, [i // 8 for i in range(len(lengths))], None)
    parallel = ParallelLayout(dp_size=64, pp_size=4, vpp_size=4)
    cost = overhead_cost(1024, 0.01)
    ours = _ours(samples, parallel, 1024, cost, 128)
    theirs = BASELINES["nemo_rl_ffd"](
        lengths, dp_size=64, token_cap=1024, microbatch_multiple=parallel.microbatch_multiple
    )
    ffd, over = _score(theirs, samples, parallel, 1024, cost, 128)
    assert not over
    assert ours <= ffd * 1.001
