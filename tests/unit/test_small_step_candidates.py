"""Small steps (issue 45): more constructions scored beside the shape search's own, the fastest
kept; never slower than the planner without them, never behind the peers' partitions in the
issue's two examples, deterministic, and every plan still passes check_plan."""

import dataclasses
import itertools
import random
from contextlib import contextmanager
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.as_run import SlimeCase, _lengths, run_case
from benchmarks.baselines import verl_kk
from benchmarks.metrics import EVAL_COST, evaluate, ideal_step_time, step_time
from benchmarks.search import _family
from megatron_dynbatch.planning import (
    CostModel,
    ParallelLayout,
    PlannerConfig,
    SampleSet,
    check_plan,
    plan_schedule,
)
from megatron_dynbatch.planning import planner as planner_module
from megatron_dynbatch.planning.candidates import (
    balanced_rows,
    exact_rows_affordable,
    exact_split,
    first_fit,
    first_fit_bins,
    is_small_step,
    least_rounding,
    modified_first_fit,
    small_step_candidates,
)
from megatron_dynbatch.planning.packing import profile_pack
from megatron_dynbatch.planning.shape import choose_shape
from tests._support import assert_never_slower, planner_without, replayed_step_time

pytestmark = pytest.mark.unit


@contextmanager
def todays_planner():
    """The planner as it was before the small-step candidates (the shape search alone)."""

    def without(problem):
        return choose_shape(dataclasses.replace(problem, disable_more_candidates=True))

    with mock.patch.object(planner_module, "choose_shape", without):
        yield


def _config(cap, dp, pp, vpp, overhead, rows):
    cost = CostModel(
        token_weight=1.0, attention_weight=1.0 / 24576, microbatch_overhead=overhead * cap
    )
    return PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp),
        cost=cost,
        variable_row_lengths=rows is not None,
        row_multiple=rows or 64,
        oversize_samples="allow",
    )


def _random_step(seed, dp, per_rank, layout, cap, overhead, rows, spread):
    """A random small step: long-tailed lengths under the cap, and its planner config."""
    rng = random.Random(seed)
    lengths = [min(cap, max(1, int(rng.lognormvariate(6.5, spread)))) for _ in range(dp * per_rank)]
    pp, vpp = layout
    return lengths, _config(cap, dp, pp, vpp, overhead, rows)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**30),
    dp=st.sampled_from([1, 2, 3, 4, 8, 16]),
    per_rank=st.integers(1, 8),
    layout=st.sampled_from([(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]),
    cap=st.sampled_from([2048, 4096, 8192]),
    overhead=st.sampled_from([0.0, 0.01, 0.05]),
    rows=st.sampled_from([None, 64, 128]),
    spread=st.sampled_from([0.3, 0.8, 1.4]),
)
def test_never_slower_than_todays_planner_on_random_small_steps(
    seed, dp, per_rank, layout, cap, overhead, rows, spread
):
    lengths, config = _random_step(seed, dp, per_rank, layout, cap, overhead, rows, spread)
    new = plan_schedule(lengths, config=config)
    with todays_planner():
        old = plan_schedule(lengths, config=config)
    samples = SampleSet.build(lengths)
    check_plan(new, samples, config)
    # The planner's own prediction never gets worse ...
    new_step, old_step = new.steps[0], old.steps[0]
    # ... and neither does the step replayed on its own rows (a hair of float noise aside: the
    # planner scores a uniform row at its packing's fullest bin before sample moves shorten it).
    assert replayed_step_time(new_step, lengths, config) <= replayed_step_time(
        old_step, lengths, config
    ) * (1 + 1e-4)


def test_the_candidates_find_a_faster_step_somewhere():
    """The hypothesis test above could pass with the candidates never chosen; here they win."""
    faster = 0
    for seed in range(30):
        rng = random.Random(seed)
        lengths = [rng.randint(100, 3000) for _ in range(10)]
        config = _config(8192, 2, 1, 1, 0.01, 128)
        new = replayed_step_time(plan_schedule(lengths, config=config).steps[0], lengths, config)
        with todays_planner():
            old = replayed_step_time(
                plan_schedule(lengths, config=config).steps[0], lengths, config
            )
        faster += new < old * (1 - 1e-4)
    assert faster >= 3


def test_plans_are_reproducible():
    rng = random.Random(5)
    lengths = [rng.randint(50, 4000) for _ in range(48)]
    config = _config(4096, 8, 2, 1, 0.01, 64)
    assert plan_schedule(lengths, config=config) == plan_schedule(lengths, config=config)


def test_slime_as_it_runs_is_not_ahead_on_the_issues_one_rank_example():
    """Issue 45: 32 long-tailed samples on one rank, cap 4,096, no pipeline: slime's first fit as
    slime runs it was up to 6% faster than ours as slime runs it (seed 50, tp 2: 1.0595)."""
    samples = _lengths("long_tail", 32, 4096, 50)
    case = SlimeCase("issue 45", samples, 1, 1, 1, 2, 1, 4096)
    result = run_case(case, (0.0, 0.01, 0.05))
    assert max(result["ratios"].values()) <= 1.005


def _ours_and_verl(samples, dp, cap, overhead, rows):
    """Step / ideal of ours and of verl's Karmarkar-Karp, both on rows of their own loads."""
    parallel = ParallelLayout(dp_size=dp, pp_size=1)
    cost = CostModel(
        token_weight=1.0,
        attention_weight=EVAL_COST.attention_weight,
        microbatch_overhead=overhead * EVAL_COST.full_row_cost(cap),
    )
    config = PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=parallel,
        cost=cost,
        variable_row_lengths=True,
        row_multiple=rows,
        oversize_samples="allow",
    )

    def scored(ranks):
        m = evaluate(ranks, samples.lengths, token_cap=cap, cost=cost, row_multiple=rows)
        assert not m["over_cap_microbatches"]
        return step_time(m["microbatch_costs"], parallel) / ideal_step_time(
            samples.lengths, parallel, cost
        )

    step = plan_schedule(samples.lengths, samples.rollout_ids, config=config).steps[0]
    ours = scored([[list(mb) for mb in rank] for rank in step.ranks])
    return ours, scored(verl_kk(samples.lengths, dp_size=dp, token_cap=cap))


def test_verl_kk_is_not_ahead_at_four_samples_a_rank():
    """Issue 45: 512 short samples at dp 128, pp 1 (four a rank): verl's Karmarkar-Karp was ahead
    of ours (here by 0.34%: 1.0410 against 1.0375, seed 3, rows of 64 tokens); now level."""
    ours, theirs = _ours_and_verl(_family("uniform", 512, 8192, 3), 128, 8192, 0.01, 64)
    assert ours <= theirs * (1 + 1e-9)


def test_verl_kk_is_not_ahead_at_eight_samples_a_rank():
    """64 GRPO samples at dp 8, pp 1: verl's split into one more micro-batch a rank was 1.0%
    ahead (1.0343 against 1.0242) where ours kept the fewest."""
    ours, theirs = _ours_and_verl(_family("grpo", 64, 16384, 530553845), 8, 16384, 0.0, 128)
    assert ours <= theirs * 1.005


def test_one_row_a_step_tries_the_count_where_rows_first_reach_the_longest_sample():
    """174 samples of 11,975 tokens and 138 of 3,291 at dp 24, pp 4, cap 16,384, one row a step:
    the searched counts stopped at 9 a rank, where the mean row is under the longest sample but
    whole samples pack into rows of 13,164; verl's differencing (capped) took 10 rows of 11,975
    and was 1.0% ahead. Count 10 is searched too, and ours is 1.3% ahead of verl."""
    from benchmarks.lengths import LengthSet
    from benchmarks.small_steps import _ours, _score, overhead_cost

    lengths = [11975] * 174 + [3291] * 138
    random.Random(0).shuffle(lengths)
    samples = LengthSet(lengths, [i // 4 for i in range(len(lengths))], None)
    parallel = ParallelLayout(dp_size=24, pp_size=4)
    cost = overhead_cost(16384, 0.05)
    theirs = verl_kk(lengths, dp_size=24, token_cap=16384, keep_cap=True)
    verl, over = _score(theirs, samples, parallel, 16384, cost, None)
    assert not over
    assert _ours(samples, parallel, 16384, cost, None) < verl * 0.99


def test_exact_split_is_optimal_on_tiny_inputs():
    for seed in range(40):
        rng = random.Random(seed)
        n, dp = rng.randint(1, 8), rng.randint(2, 3)
        weights = [float(rng.randint(1, 50)) for _ in range(n)]
        split = exact_split(range(n), weights, dp)
        assert sorted(i for part in split for i in part) == list(range(n))
        best = min(
            max(sum(weights[i] for i in range(n) if assign[i] == r) for r in range(dp))
            for assign in itertools.product(range(dp), repeat=n)
        )
        assert max(sum(weights[i] for i in part) for part in split) == best


def test_first_fit_matches_the_plain_scan_and_splits_to_the_count():
    for seed in range(30):
        rng = random.Random(seed)
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 60))]
        order = list(range(len(sizes)))
        plain = []
        for i in order:
            for members in plain:
                if sum(sizes[j] for j in members) + sizes[i] <= 100:
                    members.append(i)
                    break
            else:
                plain.append([i])
        assert first_fit(order, sizes, 100) == plain
        bins = first_fit_bins(order, sizes, 100, len(plain) + 3)
        assert bins is not None and len(bins) == len(plain) + 3
        assert sorted(i for members in bins for i in members) == order
        assert all(sum(sizes[i] for i in members) <= 100 for members in bins)
        assert first_fit_bins(order, sizes, 100, len(plain) - 1) is None


def test_every_construction_keeps_the_cap_and_every_sample():
    rng = random.Random(3)
    sizes = [rng.randint(10, 900) for _ in range(40)]
    weights = [s + s * s / 24576 for s in sizes]
    for dp, per_rank in ((2, 3), (4, 2), (5, 4), (1, 6)):
        for name, ranks, _ in small_step_candidates(range(40), sizes, weights, 1024, dp, per_rank):
            assert len(ranks) == dp and all(len(rank) == per_rank for rank in ranks), name
            placed = sorted(i for rank in ranks for mb in rank for i in mb)
            assert placed == list(range(40)), name
            assert all(sum(sizes[i] for i in mb) <= 1024 for rank in ranks for mb in rank), name


def test_large_steps_are_not_small():
    assert is_small_step(512, 128) and is_small_step(40, 1)
    assert not is_small_step(16384, 512) and not is_small_step(4000, 16)


def test_ramped_micro_batches_shrink_the_bubble_of_a_gpu_regime_step():
    """Issue 45 item 2: 512 GRPO samples of a 7B model at dp 16, pp 4 (H100-like costs): the
    pipeline's fill and drain run short rows. Before: 1.425 of the bound (bubble 0.391)."""
    from benchmarks import gpu_regime

    case = next(c for c in gpu_regime.cases(0) if c.label == "7b grpo vpp1 dp16")
    cost = gpu_regime.true_cost(case, gpu_regime.Assumptions())
    new = gpu_regime._told(case, cost)
    with todays_planner():
        old = gpu_regime._told(case, cost)
    assert new["step"] < old["step"] * 0.95
    assert new["bubble"] < old["bubble"] * 0.8
    assert not new["over_cap"]


def test_profile_pack_keeps_the_cap_every_sample_and_the_profile():
    rng = random.Random(11)
    sizes = [rng.randint(50, 3000) for _ in range(200)]
    order = sorted(range(200), key=lambda i: (-sizes[i], i))
    profile = [0.2, 0.5, 1.0, 1.0, 1.0, 1.0, 0.6, 0.3]
    share = sum(sizes) / 4 / sum(profile)
    targets = [[p * share for p in profile]] * 4
    bins, loads = profile_pack(sizes, order, targets, 16384)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(load <= 16384 for load in loads)
    assert loads == [sum(sizes[i] for i in b) for b in bins]
    for r in range(4):
        rank = loads[r * 8 : (r + 1) * 8]
        assert rank[0] < min(rank[2:6]) and rank[-1] < min(rank[2:6])
    # Ranks stay even: within one large sample of each other.
    totals = [sum(loads[r * 8 : (r + 1) * 8]) for r in range(4)]
    assert max(totals) - min(totals) <= max(sizes)
    # A sample that fits no bin: no packing.
    assert profile_pack([5000], [0], [[100.0]], 4096) is None


def _profile_pack_by_scan(sizes, order, targets, cap):
    """profile_pack's documented rule, one sample at a time over every group and bin."""
    per = len(targets[0])
    bins = [[] for _ in range(len(targets) * per)]
    loads = [0] * len(bins)
    room = [float(sum(row)) for row in targets]
    bin_room = [float(t) for row in targets for t in row]
    for i in order:
        fitting = [
            [k for k in range(r * per, (r + 1) * per) if loads[k] + sizes[i] <= cap]
            for r in range(len(targets))
        ]
        groups = [r for r in range(len(targets)) if fitting[r]]
        if not groups:
            return None
        r = max(groups, key=lambda g: (room[g], -g))
        b = max(fitting[r], key=lambda k: (bin_room[k], -k))
        bins[b].append(i)
        loads[b] += sizes[i]
        bin_room[b] -= sizes[i]
        room[r] -= sizes[i]
    return bins, loads


def test_profile_pack_places_every_sample_by_its_rule_when_bins_fill_to_the_cap():
    # Near the cap the bin with most room under its target often cannot take the sample: it goes
    # to the next bin that fits, and the bin passed over still takes later, smaller samples.
    rng = random.Random(5)
    for case in range(300):
        groups, per, cap = rng.randint(1, 4), rng.randint(1, 9), rng.choice([16, 100, 4096])
        sizes = [rng.randint(1, cap) for _ in range(rng.randint(1, 40))]
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        if case % 3 == 0:
            rng.shuffle(order)  # small samples first: bins fill before the large ones come
        targets = [[rng.uniform(0, cap) for _ in range(per)] for _ in range(groups)]
        expected = _profile_pack_by_scan(sizes, order, targets, cap)
        assert profile_pack(sizes, order, targets, cap) == expected, (case, sizes, targets, cap)


def test_least_rounding_is_exact_on_tiny_ranks():
    for seed in range(25):
        rng = random.Random(seed)
        n, per_rank, multiple, cap = rng.randint(1, 5), rng.randint(1, 4), 128, 4096
        sizes = [rng.randint(1, 2000) for _ in range(n)]
        rows = least_rounding(list(range(n)), sizes, cap, per_rank, multiple)

        def padded(mbs, sizes=sizes, multiple=multiple):
            return sum(
                -(-sum(sizes[i] for i in mb) // multiple) * multiple if mb else multiple
                for mb in mbs
            )

        best = None
        for assign in itertools.product(range(per_rank), repeat=n):
            mbs = [[i for i in range(n) if assign[i] == k] for k in range(per_rank)]
            if all(sum(sizes[i] for i in mb) <= cap for mb in mbs):
                best = padded(mbs) if best is None else min(best, padded(mbs))
        if best is None:
            assert rows is None
            continue
        assert len(rows) == per_rank
        assert sorted(i for mb in rows for i in mb) == list(range(n))
        assert all(sum(sizes[i] for i in mb) <= cap for mb in rows)
        assert padded(rows) == best


def planner_before_refinement():
    """The planner as it was before the per-rank refinement (planning/refine.py), and before what
    came after it: tents (scored unrefined, they would stand in for it), rows rounded up less and
    sorted orders and first fit decreasing (each applied to the choice, so to a different one
    without refinement)."""
    return planner_without("_refined", "tent_splits", "_less_rounding", "_reordered", "_decreasing")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**30),
    dp=st.sampled_from([1, 2, 4, 8]),
    per_rank=st.integers(2, 24),
    layout=st.sampled_from([(2, 1), (4, 1), (2, 2), (4, 2)]),
    cap=st.sampled_from([2048, 4096, 8192]),
    overhead=st.sampled_from([0.0, 0.01, 0.05]),
    rows=st.sampled_from([64, 128]),
    spread=st.sampled_from([0.3, 0.8, 1.4]),
)
def test_refinement_never_slower_than_the_planner_before_it(
    seed, dp, per_rank, layout, cap, overhead, rows, spread
):
    """Issue 45: samples moved within a rank and micro-batches reordered only where the slowest
    rank's pipeline gets faster; the step replayed by the simulator is never slower, every plan
    passes check_plan, and the plan is the same on every call (every rank derives it)."""
    lengths, config = _random_step(seed, dp, per_rank, layout, cap, overhead, rows, spread)
    new = assert_never_slower(lengths, config, planner_before_refinement, tolerance=1e-4)
    assert plan_schedule(lengths, config=config) == new


def test_refinement_shrinks_the_bubble_of_gpu_regime_steps():
    """It pays where a sample fills a whole row: on the interleaved dp 16 GRPO steps of the GPU
    regime (1.186 and 1.180 of the bound before it)."""
    from benchmarks import gpu_regime

    for label in ("7b grpo vpp2 dp16", "32b grpo vpp2 dp16"):
        case = next(c for c in gpu_regime.cases(0) if c.label == label)
        cost = gpu_regime.true_cost(case, gpu_regime.Assumptions())
        new = gpu_regime._told(case, cost)
        with planner_before_refinement():
            old = gpu_regime._told(case, cost)
        assert new["step"] < old["step"] * 0.995
        assert not new["over_cap"]


def _small_step_case(seed, label_seed):
    """One of ``benchmarks.small_steps``'s random steps: ``(samples, parallel, cap, cost, rows)``."""
    from benchmarks.small_steps import random_steps

    for label, samples, parallel, cap, cost, rows in random_steps(seed, 300):
        if f"seed{label_seed}" in label:
            return samples, parallel, cap, cost, rows
    raise AssertionError(f"no step seed{label_seed} in small_steps seed {seed}")


def test_a_constructions_own_split_survives_the_sample_moves():
    """Issue 45, small_steps seed 23: 64 GRPO samples at dp 16, pp 4, one row a step: the sample
    moves that even the ranks' work made verl's own split slower (0.77% behind verl: 2.9505
    against 2.9301 of the ideal); the construction as built is now scored too."""
    from benchmarks.small_steps import compare

    samples, parallel, cap, cost, rows = _small_step_case(23, 883972388)
    result = compare(samples, parallel, cap, cost, rows)[None]
    assert result["ours"] <= result["peer"][1] * (1 + 1e-9)


def test_the_fewest_count_is_tried_by_the_constructions():
    """Issue 45, small_steps seed 6: 384 uniform samples at dp 128, no pipeline, rows of their
    own: the shape search ran two micro-batches a rank where verl's split fits all three samples
    in one (0.84% behind: 1.0977 against 1.0885); the constructions now try the fewest counts."""
    from benchmarks.small_steps import compare

    samples, parallel, cap, cost, rows = _small_step_case(6, 23587118)
    result = compare(samples, parallel, cap, cost, rows)[rows]
    assert result["ours"] <= result["peer"][1] * (1 + 1e-9)


def test_balanced_rows_find_the_shortest_fullest_row_of_a_tiny_rank():
    """Differencing leaves 3,139 and 2,865 tokens; the best split of these six is 3,111 / 2,893
    (two samples against one, which a swap of one against one cannot reach)."""
    lengths = [1390, 1721, 1053, 383, 365, 1092]
    rows, _ = balanced_rows(range(6), lengths, 4096, 2)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert max(sum(lengths[i] for i in row) for row in rows) == 3111


def test_balanced_rows_start_from_multifit_where_differencing_stops_short():
    """small_steps seed 65: differencing (and the moves from it) leave a fullest row of 8,170
    tokens; best fit decreasing packs the same 16 samples into 10 rows of at most 7,912."""
    lengths = [3566, 2809, 4200, 3428, 7285, 2634, 3260, 6547, 1784, 2042, 4063, 6128, 7677]
    lengths += [6406, 3861, 6308]
    assert (
        max(sum(lengths[i] for i in row) for row in balanced_rows(range(16), lengths, 8192, 10)[0])
        == 8170
    )
    rows = balanced_rows(range(16), lengths, 8192, 10)[1]
    assert sorted(i for row in rows for i in row) == list(range(16))
    assert max(sum(lengths[i] for i in row) for row in rows) == 7912


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=24),
    per_rank=st.integers(1, 8),
    cap=st.sampled_from([4096, 8192]),
    multifit=st.booleans(),
)
def test_balanced_rows_keep_every_sample_and_the_cap_and_never_lengthen_the_fullest_row(
    lengths, per_rank, cap, multifit
):
    from megatron_dynbatch.planning.karmarkar_karp import karmarkar_karp

    members = list(range(len(lengths)))
    rows = balanced_rows(members, lengths, cap, per_rank)[multifit]
    if len(lengths) < per_rank:
        assert rows is None
        return
    parts = karmarkar_karp(lengths, per_rank, False, ties="index")
    differenced = max(sum(lengths[i] for i in part) for part in parts)
    if rows is None:  # only where differencing itself breaks the cap
        assert differenced > cap
        return
    assert len(rows) == per_rank
    assert sorted(i for row in rows for i in row) == members
    loads = [sum(lengths[i] for i in row) for row in rows]
    assert all(load <= cap for row, load in zip(rows, loads, strict=True) if len(row) > 1)
    assert max(loads) <= differenced


@pytest.mark.parametrize("seed, step", [(22, 118651527), (29, 957858122), (65, 37501154)])
def test_one_row_a_step_on_one_rank_is_not_behind_a_peer(seed, step):
    """Issue 45, small_steps seeds 22 and 29: one rank, no pipeline, one row a step: next fit
    (0.82%) and SkyRL's balancing (0.57%) were ahead, their fullest row shorter than ours. Seed
    65 (16 GRPO samples in 10 rows, 5% overhead): SkyRL's balancing 2.36% ahead, its fullest row
    7,924 tokens against our 8,159; MULTIFIT now starts the row balancing (7,912)."""
    from benchmarks.small_steps import compare

    samples, parallel, cap, cost, rows = _small_step_case(seed, step)
    result = compare(samples, parallel, cap, cost, rows)[None]
    assert result["ours"] <= result["peer"][1] * (1 + 1e-9)


def test_own_rows_of_one_rank_of_eight_samples_round_least():
    """small_steps seed 75: 8 GRPO samples on one rank, no pipeline, 4 rows of their own length
    (64-token multiples), 1% overhead. Differencing and first fit left 121 tokens of rounding,
    SkyRL's balancing 57 (0.43% ahead); ranks of 7-8 samples now get the exact least rounding
    where it is cheap (:func:`exact_rows_affordable`)."""
    from benchmarks.small_steps import compare

    samples, parallel, cap, cost, rows = _small_step_case(75, 420273262)
    assert len(samples.lengths) == 8 and parallel.dp_size == 1 and rows == 64
    result = compare(samples, parallel, cap, cost, rows)[rows]
    assert result["ours"] <= result["peer"][1] * (1 + 1e-9), result


def test_exact_rows_are_searched_only_where_they_are_cheap():
    assert exact_rows_affordable([6] * 64, 8)  # up to six samples a rank: always, as before
    assert exact_rows_affordable([8], 4) and exact_rows_affordable([7, 7], 4)
    assert not exact_rows_affordable([8], 8)  # eight samples in 8 rows: too many subsets
    assert not exact_rows_affordable([8, 8], 4)
    assert not exact_rows_affordable([9], 1)


@pytest.mark.parametrize(
    "seed, step, why",
    [
        # 523 multi-turn samples at dp 64, pp 2 x vpp 2: slime's first fit was 3.65% ahead; the
        # rank holding a cap-filling sample now gives its other samples to faster ranks (refine).
        (10, 830150854, "refine"),
        # 64 GRPO samples at dp 8, no pipeline, 5% overhead: NeMo-RL's MFFD was 0.99% ahead with
        # two micro-batches a rank where ours ran three; its packing is now a construction.
        (14, 89683782, "mffd"),
    ],
)
def test_own_rows_not_behind_a_peer_at_300_cases_a_seed(seed, step, why):
    """Issue 45, ``benchmarks.small_steps --cases 300``: two steps past the first 150 of a seed."""
    from benchmarks.small_steps import compare

    samples, parallel, cap, cost, rows = _small_step_case(seed, step)
    result = compare(samples, parallel, cap, cost, rows)[rows]
    assert result["ours"] <= result["peer"][1] * 1.005, (why, result)


def test_a_placeholder_row_is_not_behind_a_peers_copied_sample():
    """Issue 45, small_steps ``--cases 300 --seed 19``: 3 multi-turn samples at dp 2, pp 4, one row
    a step, 5% overhead. One rank runs a placeholder beside its sample; as one THD segment of the
    whole row it cost ``S**2`` of attention, and SkyRL's dummy (a copy of a real sample) was 1.94%
    faster. The row's padding tail is now cut into short segments, as the cost model prices it."""
    from benchmarks.small_steps import compare

    samples, parallel, cap, cost, rows = _small_step_case(19, 831740104)
    result = compare(samples, parallel, cap, cost, rows)[None]
    assert result["ours"] <= result["peer"][1] * 1.005, result


def test_modified_first_fit_keeps_every_sample_and_the_cap():
    rng = random.Random(11)
    for _ in range(60):
        # Samples over a half, a third, a sixth of the cap and below: every pass has work.
        spans = ((51, 100), (34, 50), (17, 33), (1, 16))
        sizes = [rng.randint(*rng.choice(spans)) for _ in range(rng.randint(1, 80))]
        items = list(range(len(sizes)))
        bins = modified_first_fit(items, sizes, 100)
        assert sorted(i for members in bins for i in members) == items
        assert all(members and sum(sizes[i] for i in members) <= 100 for members in bins)
        # Never more bins than one a sample, and at least the total's share of the cap.
        assert -(-sum(sizes) // 100) <= len(bins) <= len(sizes)
