"""Rank-wise first fit by decreasing size (issue 45): with rows of their own length, alike samples
that share a row round up least; scored after every other step and kept only where faster
(planning/shape.py ``_decreasing``, planning/candidates.py ``decreasing_candidates``)."""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.baselines import BASELINES
from benchmarks.lengths import LengthSet
from benchmarks.small_steps import _ours, _score, overhead_cost
from megatron_dynbatch.planning import ParallelLayout, PlannerConfig
from megatron_dynbatch.planning import shape as shape_module
from megatron_dynbatch.planning.candidates import decreasing_candidates
from tests._support import assert_never_slower

pytestmark = pytest.mark.unit


def _without():
    return mock.patch.object(shape_module, "_DECREASING_PER_RANK", 0)


def test_two_lengths_fit_five_rows_a_rank_where_balancing_chose_six():
    """80 samples of 295 tokens and 76 of 336 at dp 12, no pipeline, cap 1,024, rows rounded to
    64 (``small_steps --wide`` seed 49): ours ran six rows a rank, 1.2% behind NeMo-RL's modified
    first fit, whose rows of three alike samples round up by 11 and 16 tokens."""
    lengths = [295] * 80 + [336] * 76
    random.Random(49).shuffle(lengths)
    samples = LengthSet(lengths, [i // 4 for i in range(len(lengths))], None)
    parallel = ParallelLayout(dp_size=12)
    cost = overhead_cost(1024, 0.05)
    new = _ours(samples, parallel, 1024, cost, 64)
    with _without():
        old = _ours(samples, parallel, 1024, cost, 64)
    theirs = BASELINES["nemo_rl_mffd"](lengths, dp_size=12, token_cap=1024, microbatch_multiple=1)
    mffd, over = _score(theirs, samples, parallel, 1024, cost, 64)
    assert not over
    assert old > mffd * 1.005
    assert new <= mffd * 1.001


def test_every_decreasing_construction_keeps_the_cap_the_count_and_every_sample():
    rng = random.Random(3)
    for _ in range(50):
        dp, per_rank, cap = rng.randint(1, 6), rng.randint(1, 8), rng.choice([256, 1024])
        items = list(range(rng.randint(1, 40)))
        sizes = [rng.randint(1, cap) for _ in items]
        for _name, ranks, _keep in decreasing_candidates(
            items, sizes, [float(s) for s in sizes], cap, dp, per_rank
        ):
            assert len(ranks) == dp
            assert all(len(rank) == per_rank for rank in ranks)
            assert all(sum(sizes[i] for i in mb) <= cap for rank in ranks for mb in rank)
            assert sorted(i for rank in ranks for mb in rank for i in mb) == items


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**30),
    dp=st.sampled_from([1, 3, 12]),
    per_rank=st.integers(1, 16),
    layout=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    lengths_of=st.integers(1, 3),
    thorough=st.booleans(),
)
def test_decreasing_rows_never_slow_a_step(seed, dp, per_rank, layout, lengths_of, thorough):
    """The construction replaces the choice only where its step is faster: never slower, replayed
    on steps of one to three lengths (where alike samples can share rows) and some noise."""
    rng = random.Random(seed)
    kinds = [rng.randint(100, 700) for _ in range(lengths_of)]
    lengths = [
        rng.choice(kinds) if rng.random() < 0.8 else rng.randint(1, 1024)
        for _ in range(dp * per_rank)
    ]
    pp, vpp = layout
    config = PlannerConfig(
        max_tokens_per_gpu=1024,
        parallel=ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp),
        cost=overhead_cost(1024, rng.choice([0.0, 0.05])),
        variable_row_lengths=True,
        row_multiple=64,
        planner="dynbatch-thorough" if thorough else "dynbatch",
    )
    assert_never_slower(lengths, config, _without)
