"""Tests of the re-implemented baseline schedulers, the metrics and the length generators.

One invariant check runs over every baseline and every input family: each sample lands exactly once
(or the baseline raises its documented :class:`BaselineFailure`), every DP rank runs the same number
of micro-batches, a multiple of ``microbatch_multiple``. Small hand-worked cases pin each upstream
behaviour the docstrings describe.
"""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks.baselines import (
    BASELINES,
    BaselineFailure,
    BaselineSchedule,
    fixed_mbs,
    karmarkar_karp,
    nemo_rl_ffd,
    nemo_rl_mffd,
    next_fit,
    skyrl_balanced,
    slime_first_fit,
    verl_kk,
    verl_workload,
)
from benchmarks.lengths import (
    bimodal_lengths,
    grpo_lengths,
    lognormal_lengths,
    multi_turn_lengths,
    uniform_lengths,
)
from benchmarks.metrics import evaluate
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import CostModel

pytestmark = pytest.mark.unit

# Baselines whose packers never put two samples over the cap together (verl's KK balances workload
# and only uses the cap to choose the count, so it is exempt).
CAP_RESPECTING = {
    "next_fit",
    "slime_first_fit",
    "skyrl_balanced",
    "nemo_rl_ffd",
    "nemo_rl_mffd",
    "fixed_mbs",
}


def _families(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 80)
    yield lognormal_lengths(n, median=800, sigma=1.0, max_len=8192, seed=seed), None
    yield bimodal_lengths(n, short_mean=300, long_mean=5000, max_len=8192, seed=seed), None
    yield uniform_lengths(n, low=1, high=4096, seed=seed), None
    grpo = grpo_lengths(rng.randint(1, 10), rng.choice([1, 4, 8]), max_len=8192, seed=seed)
    yield grpo.lengths, grpo.rollout_ids
    turns = multi_turn_lengths(rng.randint(1, 10), max_len=8192, seed=seed)
    yield turns.lengths, turns.rollout_ids


def _check_schedule(name, schedule, lengths, dp_size, multiple, cap):
    assert isinstance(schedule, BaselineSchedule) and isinstance(schedule, list)
    assert len(schedule) == dp_size
    counts = {len(rank) for rank in schedule}
    assert len(counts) == 1, f"{name}: unequal micro-batch counts {counts}"
    assert counts.pop() % multiple == 0
    flat = sorted(i for rank in schedule for mb in rank for i in mb)
    everything = len(lengths) + len(schedule.dummy_lengths)
    assert flat == list(range(everything)), f"{name}: not every sample exactly once"
    empties = sum(1 for rank in schedule for mb in rank if not mb)
    assert empties == schedule.upstream_placeholders + schedule.harness_placeholders
    metrics = evaluate(
        schedule,
        lengths,
        token_cap=cap,
        layout="padded" if name == "fixed_mbs" else "packed",
        dummy_lengths=schedule.dummy_lengths,
    )
    assert metrics["coverage_ok"] and metrics["equal_counts"]
    if name in CAP_RESPECTING:
        assert (
            metrics["over_cap_microbatches"] == 0
        ), f"{name}: a multi-sample micro-batch over the cap"


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_baseline_covers_every_sample_once_or_fails_loudly(name):
    for seed in range(8):  # one property over seeds: a loop, the baseline stays a parameter
        _check_baseline(name, seed)


def _check_baseline(name, seed):
    fn = BASELINES[name]
    rng = random.Random(1000 + seed)
    for lengths, rollout_ids in _families(seed):
        for dp_size, multiple in itertools.product([1, 2, 3, 4, 8], [1, 2, 4]):
            cap = rng.choice([2048, 4096, 8192, 16384])
            try:
                schedule = fn(
                    lengths,
                    dp_size=dp_size,
                    token_cap=cap,
                    microbatch_multiple=multiple,
                    rollout_ids=rollout_ids,
                )
            except BaselineFailure as failure:
                assert failure.baseline == name
                continue
            _check_schedule(name, schedule, lengths, dp_size, multiple, cap)


def test_baselines_succeed_on_a_typical_grpo_step():
    grpo = grpo_lengths(64, 8, max_len=8192, seed=7)
    for name, fn in BASELINES.items():
        for multiple in (1, 4):
            schedule = fn(
                grpo.lengths,
                dp_size=4,
                token_cap=16384,
                microbatch_multiple=multiple,
                rollout_ids=grpo.rollout_ids,
            )
            _check_schedule(name, schedule, grpo.lengths, 4, multiple, 16384)


# ------------------------------------------------------------------ Karmarkar-Karp


def test_karmarkar_karp_partitions_every_item():
    for seed in range(10):
        rng = random.Random(seed)
        k = rng.randint(1, 6)
        values = [rng.randint(1, 1000) for _ in range(k * rng.randint(1, 10))]
        for equal_size in (False, True):
            parts = karmarkar_karp(values, k, equal_size)
            case = dict(seed=seed, k=k, equal_size=equal_size)
            assert len(parts) == k, case
            assert sorted(i for p in parts for i in p) == list(range(len(values))), case
            if equal_size:
                assert {len(p) for p in parts} == {len(values) // k}, case


def test_karmarkar_karp_two_way_example():
    # Two-way KK on 8,7,6,5,4: differences 8-7=1, 6-5=1, then {4},{1},{1} -> 4-1=3, 3-1=2: spread 2.
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert sums == [14, 16]


def test_karmarkar_karp_balances_better_than_round_robin():
    rng = random.Random(0)
    values = [rng.randint(1, 10_000) for _ in range(256)]
    parts = karmarkar_karp(values, 8, equal_size=True)
    sums = [sum(values[i] for i in p) for p in parts]
    strided = [sum(values[i] for i in range(r, 256, 8)) for r in range(8)]
    assert max(sums) - min(sums) < max(strided) - min(strided)


# ------------------------------------------------------------------ next_fit (Megatron-Core)


def test_next_fit_aligns_by_moving_last_samples_and_deals_round_robin():
    # Bins [0,1] [2,3] [4]; dp=2 needs 4 bins: [4] is single, so pop 3 from [2,3].
    schedule = next_fit([5, 5, 5, 5, 5], dp_size=2, token_cap=10)
    assert schedule == [[[0, 1], [4]], [[2], [3]]]


def test_next_fit_first_oversize_sample_gives_an_empty_micro_batch():
    schedule = next_fit([20, 5, 5], dp_size=1, token_cap=10)
    assert schedule == [[[], [0], [1, 2]]]
    assert schedule.upstream_placeholders == 1 and schedule.notes


def test_next_fit_fails_when_it_cannot_move_enough_samples():
    with pytest.raises(BaselineFailure, match="Not enough samples to move"):
        next_fit([5, 5, 5], dp_size=4, token_cap=100)


def test_next_fit_contiguous_pads_with_empty_bins():
    schedule = next_fit([6, 6, 6], dp_size=2, token_cap=10, distribution="contiguous")
    assert schedule == [[[0], [1]], [[2], []]]
    assert schedule.upstream_placeholders == 1


# ------------------------------------------------------------------ slime


def test_slime_groups_by_rollout_then_first_fit():
    # Rollout order 1 then 0 -> samples 0, 2, 1, 3; first fit with cap 10 keeps that order.
    schedule = slime_first_fit([6, 4, 4, 6], dp_size=1, token_cap=10, rollout_ids=[1, 0, 1, 0])
    assert schedule == [[[0, 2], [1, 3]]]


def test_slime_splits_largest_bin_to_align():
    # One bin [0,1,2,3] of 10 tokens; dp=2 splits it into token-balanced halves.
    schedule = slime_first_fit([4, 3, 2, 1], dp_size=2, token_cap=10)
    assert sorted(sorted(mb) for rank in schedule for mb in rank) == [[0, 3], [1, 2]]


def test_slime_fails_with_fewer_samples_than_ranks():
    with pytest.raises(BaselineFailure, match="dp_size"):
        slime_first_fit([5, 5], dp_size=4, token_cap=10)


def test_slime_balance_data_uses_equal_counts():
    lengths = lognormal_lengths(64, seed=2, max_len=4096)
    schedule = slime_first_fit(lengths, dp_size=4, token_cap=8192, balance_data=True)
    _check_schedule("slime_first_fit", schedule, lengths, 4, 1, 8192)


# ------------------------------------------------------------------ verl


def test_verl_micro_batch_count_is_the_max_over_ranks():
    lengths = lognormal_lengths(64, seed=3, max_len=4096)
    schedule = verl_kk(lengths, dp_size=4, token_cap=4096)
    per_rank = [sum(lengths[i] for mb in rank for i in mb) for rank in schedule]
    expected = max(-(-tokens // 4096) for tokens in per_rank)
    assert all(len(rank) == expected for rank in schedule)


def test_verl_may_exceed_the_cap():
    # KK balances the workload with ceil(tokens / cap) micro-batches: a tight cap cannot be met.
    lengths = [3000, 3000, 3000, 3000]  # 12000 tokens -> 3 micro-batches; one must hold two
    schedule = verl_kk(lengths, dp_size=1, token_cap=4000)
    assert len(schedule[0]) == 3
    assert max(sum(lengths[i] for i in mb) for mb in schedule[0]) == 6000


def test_verl_orders_light_micro_batches_at_both_ends():
    lengths = [100 * (i + 1) for i in range(12)]
    schedule = verl_kk(lengths, dp_size=1, token_cap=sum(lengths) // 6 + 1)
    loads = [sum(verl_workload(lengths[i]) for i in mb) for mb in schedule[0]]
    heaviest = loads.index(max(loads))
    assert 0 < heaviest < len(loads) - 1 or len(loads) <= 2


@pytest.mark.parametrize(
    "lengths, dp_size, cap, match",
    [
        ([10, 10, 10], 2, 100, "multiple of dp_size"),
        ([10, 200], 1, 100, "longest sequence"),
        ([10, 10], 1, 100, None),
    ],
)
def test_verl_failures(lengths, dp_size, cap, match):
    if match is None:
        # 20 tokens -> 1 micro-batch; rounding to 4 asks for more micro-batches than samples.
        with pytest.raises(BaselineFailure, match="micro-batches"):
            verl_kk(lengths, dp_size=dp_size, token_cap=cap, microbatch_multiple=4)
    else:
        with pytest.raises(BaselineFailure, match=match):
            verl_kk(lengths, dp_size=dp_size, token_cap=cap)


# ------------------------------------------------------------------ SkyRL


@pytest.mark.parametrize(
    "lengths, cap, num_bins",
    [([10, 10, 5, 5], 15, 2), ([10, 1, 1, 1, 1, 1], 10, 2), ([5, 5, 5, 5], 10, 2), ([10], 15, 1)],
)
def test_skyrl_balanced_packing(lengths, cap, num_bins):
    schedule = skyrl_balanced(lengths, dp_size=1, token_cap=cap)
    assert len(schedule[0]) == num_bins


def test_skyrl_pads_the_batch_with_copies_of_sample_0():
    schedule = skyrl_balanced([40, 10, 10], dp_size=2, token_cap=50)
    # (-3) % 2 = 1 copy of sample 0 (40 tokens) as index 3, on the last rank.
    assert schedule.dummy_lengths == (40,)
    assert sorted(i for mb in schedule[1] for i in mb) == [2, 3]
    metrics = evaluate(schedule, [40, 10, 10], token_cap=50, dummy_lengths=schedule.dummy_lengths)
    assert metrics["real_tokens"] == 60 and metrics["coverage_ok"]


def test_skyrl_oversize_sample_alone_and_ranks_padded():
    schedule = skyrl_balanced([100, 10, 10, 5], dp_size=2, token_cap=50)
    assert [0] in schedule[0]
    # Rank 0 holds [100, 10] -> 2 bins; rank 1 holds [10, 5] -> 1 bin + 1 padding micro-batch.
    assert schedule[1][-1] == [] and schedule.upstream_placeholders == 1


# ------------------------------------------------------------------ NeMo-RL


def test_nemo_ffd_sorts_decreasing_and_meets_min_bins():
    schedule = nemo_rl_ffd([3, 3, 3, 3], dp_size=2, token_cap=10)
    assert sorted(len(mb) for rank in schedule for mb in rank) == [1, 3]


@pytest.mark.parametrize("fn", [nemo_rl_ffd, nemo_rl_mffd])
def test_nemo_rejects_oversize_uneven_batches_and_too_few_samples(fn):
    with pytest.raises(BaselineFailure, match="exceeds bin capacity"):
        fn([3, 30], dp_size=1, token_cap=10)
    # shard_by_batch_size asserts batch % dp == 0: a multi-turn mix of 3 samples at dp 2.
    with pytest.raises(BaselineFailure, match="not a multiple of shards"):
        fn([3, 3, 3], dp_size=2, token_cap=10)
    with pytest.raises(BaselineFailure, match="cannot create"):
        fn([3, 3], dp_size=2, token_cap=10, microbatch_multiple=2)


def test_nemo_mffd_pairs_large_with_medium_items():
    # C=12: 7 is large, 5 medium, 3 small; MFFD opens a bin per large item and adds a medium one.
    schedule = nemo_rl_mffd([7, 5, 3, 3], dp_size=1, token_cap=12)
    assert sorted(sorted(mb) for mb in schedule[0]) == [[0, 1], [2, 3]]


# ------------------------------------------------------------------ fixed micro-batch size


def test_fixed_mbs_layout_and_placeholders():
    lengths = [100] * 10
    schedule = fixed_mbs(lengths, dp_size=2, token_cap=250)  # B = 2
    assert schedule.micro_batch_size == 2
    assert schedule[0] == [[0, 1], [4, 5], [8, 9]]
    assert schedule[1] == [[2, 3], [6, 7], []]
    assert schedule.harness_placeholders == 1 and schedule.notes


def test_fixed_mbs_fails_when_no_row_fits():
    with pytest.raises(BaselineFailure, match="exceeds token_cap"):
        fixed_mbs([100, 300], dp_size=1, token_cap=250)


def test_baselines_validate_their_arguments():
    with pytest.raises(DynBatchValueError, match="dp_size"):
        next_fit([1, 2], dp_size=0, token_cap=10)
    with pytest.raises(DynBatchValueError, match="rollout_ids"):
        slime_first_fit([1, 2], dp_size=1, token_cap=10, rollout_ids=[0])
    with pytest.raises(DynBatchValueError, match="lengths"):
        nemo_rl_ffd([1, 0], dp_size=1, token_cap=10)


# ------------------------------------------------------------------ metrics


def test_evaluate_packed_numbers():
    lengths = [6, 4, 3, 3, 20]
    ranks = [[[0, 1], [4]], [[2, 3], []]]
    m = evaluate(ranks, lengths, token_cap=10, cost=CostModel(token_weight=1.0))
    assert m["num_microbatches"] == 2 and m["num_placeholders"] == 1
    assert m["lower_bound_microbatches"] == 1 + 2  # one oversize + ceil(16 / 10)
    assert m["seq_length"] == 20 and m["fill"] == pytest.approx(36 / (2 * 2 * 20))
    assert m["over_cap_microbatches"] == 0 and m["oversize_samples"] == [4]
    assert m["rank_tokens"] == [30, 6] and m["dp_imbalance"] == pytest.approx(30 / 18)
    # Packed: linear work on all S=20 positions of every row, placeholders included.
    assert m["microbatch_costs"] == [[20.0, 20.0], [20.0, 20.0]]
    assert m["rank_costs"] == [40.0, 40.0] and m["dp_imbalance_cost"] == 1.0
    assert m["coverage_ok"]


def test_evaluate_padded_and_coverage_errors():
    lengths = [5, 8, 2]
    m = evaluate([[[0, 1], [1, 7]]], lengths, token_cap=12, layout="padded")
    assert m["micro_batch_size"] == 2 and m["seq_length"] == 8
    assert m["over_cap_microbatches"] == 1  # [0, 1] is 2 rows x 8 = 16 > 12
    assert not m["coverage_ok"]
    assert m["missing"] == [2] and m["duplicated"] == [1] and m["out_of_range"] == [7]


# ------------------------------------------------------------------ length generators


def test_generators_are_deterministic_and_in_range():
    assert lognormal_lengths(50, seed=4) == lognormal_lengths(50, seed=4)
    assert lognormal_lengths(50, seed=4) != lognormal_lengths(50, seed=5)
    assert all(16 <= x <= 16384 for x in lognormal_lengths(500, sigma=2.0, seed=1))
    assert all(10 <= x <= 20 for x in uniform_lengths(100, low=10, high=20))
    grpo = grpo_lengths(5, 4, max_len=4096, seed=2)
    assert grpo.rollout_ids == [p for p in range(5) for _ in range(4)]
    assert all(
        p < length <= 4096 for p, length in zip(grpo.prompt_lengths, grpo.lengths, strict=True)
    )
    turns = multi_turn_lengths(20, seed=3)
    assert turns == multi_turn_lengths(20, seed=3)
    assert len(turns.lengths) >= 20 and len(set(turns.rollout_ids)) == 20
