"""Issue 45: not told the per-micro-batch overhead, a plan never loses to the trainers' own schedules
(slime's first fit, verl's differencing) by more than 0.5% at any overhead from none to 5% of a
full row."""

import dataclasses
import random

import pytest

from benchmarks import as_run
from benchmarks import search as random_search
from benchmarks.baselines import BaselineFailure, slime_first_fit, verl_kk
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import CostModel, ParallelLayout, PlannerConfig
from megatron_dynbatch.planning.candidates import peer_schedules
from megatron_dynbatch.planning.planner import _overhead_checks
from megatron_dynbatch.planning.spec import ASSUMED_OVERHEAD_CHECKS

pytestmark = pytest.mark.unit

#: Between the guard's check points and at them.
OVERHEADS = (0.0, 0.005, 0.01, 0.02, 0.025, 0.035, 0.045, 0.05)


def _as_run_case(seed, index):
    rng = random.Random(seed)
    for k in range(index + 1):
        case = as_run.random_case(rng, k)
    return case


@pytest.mark.parametrize("seed, index", [(3, 48), (6, 32), (9, 52), (21, 2), (30, 20)])
def test_not_told_the_overhead_slime_is_never_ahead_at_any_overhead(seed, index):
    """The five tiny one-rank pipelined steps of ``as_run`` seeds 0-49 where slime was ahead of
    ours not told the overhead (0.74% at none, 1.4-5.5% at 5%): two micro-batches were planned
    where slime's one is faster once the overhead is real, or four where slime's six are faster
    without one."""
    case = _as_run_case(seed, index)
    assert case.dp == 1 and case.pp == 2 and len(case.samples.lengths) <= 16, case.label
    result = as_run.run_case(case, OVERHEADS)
    for fraction, ratio in result["ratios"].items():
        assert ratio <= 1 + as_run.TOLERANCE, (case.label, fraction, ratio)


def test_small_steps_not_told_never_behind_slime_between_the_check_points():
    """Random small slime steps (at most 64 samples, or 8 a rank), scored by the benchmark's own
    simulator at overheads between the guard's check points as well as at them."""
    rng = random.Random(12)
    compared = 0
    for k in range(60):
        case = as_run.random_case(rng, k)
        n = len(case.samples.lengths)
        if n > 64 and n > 8 * case.dp:
            continue
        result = as_run.run_case(case, OVERHEADS)
        for fraction, ratio in result.get("ratios", {}).items():
            assert ratio <= 1 + as_run.TOLERANCE, (case.label, fraction, ratio)
        compared += "ratios" in result
    assert compared >= 10, compared


def test_told_the_overhead_the_plan_is_not_bent_towards_first_fit():
    """Told (or calibrated), the model is trusted: on the three-sample step of seed 21 told no
    overhead, a micro-batch a sample fills the pipeline (29% faster than slime's one), though more
    micro-batches would be slower at 5%."""
    case = _as_run_case(21, 2)
    cost = as_run.true_cost(case, 0.0)
    ranks, rows, _ = as_run.ours_as_run(case, cost.microbatch_overhead)
    ours = as_run.step_time(ranks, rows, case.samples.lengths, case, cost)
    theirs = as_run._slime_schedule(case)
    slime = as_run.step_time(
        theirs,
        as_run.slime_rows(theirs, case.samples.lengths, case),
        case.samples.lengths,
        case,
        cost,
    )
    assert len(ranks[0]) > len(theirs[0]) == 1
    assert ours < 0.8 * slime


def _config(**cost):
    return PlannerConfig(
        max_tokens_per_gpu=4096,
        parallel=ParallelLayout(pp_size=2),
        cost=CostModel(**cost),
        variable_row_lengths=True,
    )


def test_the_overhead_is_assumed_only_where_the_model_leaves_it_unset():
    assumed = _config()
    told = _config(microbatch_overhead=0.0)
    assert assumed.overhead_assumed and not told.overhead_assumed
    # The model is resolved (an overhead filled in) yet a replaced config still knows it guessed.
    assert assumed.cost.microbatch_overhead > 0
    assert dataclasses.replace(assumed, max_tokens_per_gpu=8192).overhead_assumed
    assert _overhead_checks(told) == ()
    checks = _overhead_checks(assumed)
    full_row = assumed.cost.full_row_cost(4096)
    assert checks == tuple(f * full_row for f in ASSUMED_OVERHEAD_CHECKS)
    assert checks[0] == 0.0 and max(checks) == pytest.approx(0.05 * full_row)
    assert not _overhead_checks(dataclasses.replace(assumed, overhead_assumed=False))


def test_a_bad_overhead_assumed_is_refused():
    with pytest.raises(DynBatchValueError, match="overhead_assumed='yes'"):
        PlannerConfig(max_tokens_per_gpu=4096, overhead_assumed="yes")


@pytest.mark.parametrize(
    "seed, index, mode",
    [(0, 13, "default"), (0, 255, "default"), (2, 191, "default"), (2, 191, "calibrated")],
)
def test_verl_is_not_ahead_told_the_overhead_or_not(seed, index, mode):
    """``benchmarks.search``, one row a step. Not told (the shipped config), true overhead 5% of
    a row: ours planned four micro-batches a rank for the assumed 2%, and verl's two were 0.9%
    (seed 0 #13, 608 short samples at dp 32) and 3.0% (#255, 32 GRPO samples at dp 2) faster.
    Told or not (seed 2 #191, 96 bimodal samples at dp 8, pp 4, vpp 2: twelve a rank, more than
    the small-step constructions take): verl's differencing was 2.5% ahead at four micro-batches
    each, at every overhead."""
    rng = random.Random(seed)
    for k in range(index + 1):
        case = random_search.random_case(rng, k)
    for fraction in (0.0, 0.05):
        result = random_search.run_case(case, random_search.true_cost(case, fraction), mode)
        ours = result["ours"]["step"]
        verl = result["baselines"]["verl_kk"]
        assert verl["status"] == "ok" and not verl["over_cap"], verl
        assert ours <= verl["step"] * (1 + as_run.TOLERANCE), (case.label, fraction, ours, verl)


def test_the_peer_schedules_are_the_trainers_own():
    """First fit as slime's code builds it; differencing as verl's does (where verl keeps the cap
    at its own count); both keep every sample once, the cap, and equal counts on every rank."""
    rng = random.Random(5)
    matched = {"first-fit": 0, "differencing": 0}
    for _ in range(60):
        dp = rng.choice((1, 2, 4))
        multiple = rng.choice((1, 2))
        cap = 4096
        lengths = [
            rng.randint(16, cap) if rng.random() < 0.2 else rng.randint(16, 900)
            for _ in range(dp * rng.randint(1, 8))
        ]
        items = list(range(len(lengths)))
        weights = [float(n) for n in lengths]
        for name, ranks, per_rank in peer_schedules(items, lengths, weights, cap, dp, multiple):
            assert len(ranks) == dp and all(len(rank) == per_rank for rank in ranks)
            assert per_rank % multiple == 0
            members = sorted(i for rank in ranks for mb in rank for i in mb)
            assert members == items, name
            for rank in ranks:
                for mb in rank:
                    assert len(mb) <= 1 or sum(lengths[i] for i in mb) <= cap, (name, mb)
            try:
                theirs = (slime_first_fit if name == "first-fit" else verl_kk)(
                    lengths, dp_size=dp, token_cap=cap, microbatch_multiple=multiple
                )
            except BaselineFailure:
                continue
            own = [[sorted(mb) for mb in rank] for rank in ranks]
            if own == [[sorted(mb) for mb in rank] for rank in theirs]:
                matched[name] += 1
            elif name == "first-fit":
                pytest.fail(f"first fit differs from slime's: {own} vs {list(theirs)}")
    assert matched["first-fit"] >= 40 and matched["differencing"] >= 25, matched
