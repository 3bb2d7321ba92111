"""The planner's guarantees, checked by one invariant checker over many input families."""

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import (
    CostModel,
    OversizeSampleWarning,
    ParallelLayout,
    PlanInvariantError,
    PlannerConfig,
    SampleSet,
    check_plan,
    plan_schedule,
)
from megatron_dynbatch.planning.spec import ceil_div, round_up

pytestmark = pytest.mark.unit


def _plan_and_check(lengths, rollout_ids=None, prompt_lengths=None, **config_kwargs):
    config = PlannerConfig(**config_kwargs)
    samples = SampleSet.build(lengths, rollout_ids, prompt_lengths)
    with pytest.warns(OversizeSampleWarning) if _any_oversize(samples, config) else _no_warning():
        plan = plan_schedule(lengths, rollout_ids, prompt_lengths, config=config)
    check_plan(plan, samples, config)
    return plan


class _no_warning:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error", OversizeSampleWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _any_oversize(samples, config):
    m = config.parallel.sample_multiple
    return any(round_up(length, m) > config.token_cap for length in samples.lengths)


@st.composite
def planning_cases(draw):
    dp = draw(st.integers(1, 8))
    pp = draw(st.integers(1, 4))
    vpp = draw(st.integers(1, 3)) if pp >= 2 else 1
    group = draw(st.one_of(st.none(), st.integers(pp, pp + 3)))
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 2]))
    cap = draw(st.integers(64, 4096))
    num_rollouts = draw(st.integers(1, 40))
    sizes = draw(st.lists(st.integers(1, 6), min_size=num_rollouts, max_size=num_rollouts))
    # Lengths up to 1.5x the cap, so oversize samples appear too.
    upper = max(1, int(cap * cp * 1.5))
    lengths, rollouts = [], []
    for r, size in enumerate(sizes):
        for _ in range(size):
            lengths.append(draw(st.integers(1, upper)))
            rollouts.append(draw(st.sampled_from([r, f"r{r}"])) if r % 3 else r)
    prompts = [draw(st.integers(0, length)) for length in lengths]
    per_step = draw(st.one_of(st.none(), st.integers(1, 12)))
    layout = draw(st.sampled_from(["packed", "padded"]))
    # Row-wise attention (dense, causal) gives packed micro-batches of B > 1 rows.
    cost = CostModel(
        attention_weight=draw(st.sampled_from([0.0, 1.0 / 384])),
        attention=draw(st.sampled_from([None, "causal", "dense"])),
    )
    parallel = ParallelLayout(
        dp_size=dp,
        pp_size=pp,
        vpp_size=vpp,
        microbatch_group_size_per_vp_stage=group,
        tp_size=tp,
        cp_size=cp,
    )
    return (
        lengths,
        rollouts,
        prompts,
        dict(
            max_tokens_per_gpu=cap,
            parallel=parallel,
            rollouts_per_step=per_step,
            layout=layout,
            cost=cost,
        ),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planning_cases())
def test_every_guarantee_holds_on_random_inputs(case):
    lengths, rollouts, prompts, config_kwargs = case
    plan = _plan_and_check(lengths, rollouts, prompts, **config_kwargs)
    again = plan_schedule(lengths, rollouts, prompts, config=PlannerConfig(**config_kwargs))
    assert again.to_dict() == plan.to_dict()
    assert again.fingerprint() == plan.fingerprint()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 2000), min_size=1, max_size=300),
    st.integers(1, 16),
    st.sampled_from([1, 2, 4]),
)
def test_packing_stays_close_to_the_lower_bound(lengths, dp, mult_pp):
    """The fewest micro-batches per rank within one (aligned) step of the token lower bound."""
    cap = 4096
    parallel = ParallelLayout(dp_size=dp, pp_size=mult_pp, vpp_size=2 if mult_pp > 1 else 1)
    plan = _plan_and_check(lengths, max_tokens_per_gpu=cap, parallel=parallel)
    step = plan.steps[0]
    multiple = parallel.microbatch_multiple
    bound_per_rank = round_up(max(1, ceil_div(step.lower_bound_microbatches, dp)), multiple)
    # Samples <= cap/2 pack near-perfectly; allow the bin-packing slack of large items.
    big = sum(1 for x in lengths if x > cap // 2)
    slack = ceil_div(big, dp) + multiple
    assert step.min_microbatches <= bound_per_rank + slack
    assert step.min_microbatches <= step.num_microbatches


def test_seed_dp4_514_single_sample_microbatches_keeps_every_rollout():
    """slime #2065: 512 rollouts, 2 fan out to 2 samples -> 514 samples that each fill a micro-batch.

    slime dropped 2 trailing rollouts to reach a multiple of 4; we keep all 514 and add 2 placeholders.
    """
    lengths = [20000] * 514
    rollouts = list(range(510)) + [510, 510, 511, 511]
    plan = _plan_and_check(
        lengths, rollouts, max_tokens_per_gpu=32768, parallel=ParallelLayout(dp_size=4)
    )
    step = plan.steps[0]
    assert step.num_microbatches == 129
    assert plan.stats.num_placeholders == 2
    assert plan.stats.num_samples == 514
    # Interleaving at dp 4 with group 4: 132 per rank, everything still kept.
    plan = _plan_and_check(
        lengths,
        rollouts,
        max_tokens_per_gpu=32768,
        parallel=ParallelLayout(dp_size=4, pp_size=4, vpp_size=2),
    )
    assert plan.steps[0].num_microbatches == 132
    assert plan.stats.num_placeholders == 4 * 132 - 514


@pytest.mark.parametrize(
    "rollout_sizes", [[3, 2, 3, 1, 2], [1, 1, 4, 1, 3, 1]], ids=["ragged", "no-aligned-prefix"]
)
def test_seed_ragged_rollouts_at_dp4_train_every_sample(rollout_sizes):
    """slime #2065's residual: no rollout prefix tiles by 4; slime raised, we pad with placeholders."""
    rollouts = [r for r, size in enumerate(rollout_sizes) for _ in range(size)]
    lengths = [30000] * len(rollouts)
    for parallel in (ParallelLayout(dp_size=4), ParallelLayout(dp_size=4, pp_size=2, vpp_size=2)):
        plan = _plan_and_check(lengths, rollouts, max_tokens_per_gpu=32768, parallel=parallel)
        assert plan.stats.num_samples == len(lengths)
        assert sum(len(mb) for s in plan.steps for r in s.ranks for mb in r) == len(lengths)


def test_fewer_samples_than_ranks_gives_placeholder_only_ranks():
    plan = _plan_and_check(
        [100, 200],
        max_tokens_per_gpu=1024,
        parallel=ParallelLayout(dp_size=4, pp_size=2, vpp_size=2),
    )
    step = plan.steps[0]
    assert step.num_microbatches == 2  # one interleaving group
    only_placeholders = [r for r in step.ranks if all(not mb for mb in r)]
    assert len(only_placeholders) == 2
    assert step.num_placeholders == 4 * 2 - 2


def test_last_partial_step_is_trained_and_rollouts_stay_whole():
    rollouts = ["a", "a", "b", "c", "c", "c", "d", "e", "e"]
    lengths = [10, 20, 30, 40, 50, 60, 70, 80, 90]
    plan = _plan_and_check(
        lengths,
        rollouts,
        max_tokens_per_gpu=64,
        rollouts_per_step=2,
        parallel=ParallelLayout(dp_size=2),
    )
    assert [s.num_rollouts for s in plan.steps] == [2, 2, 1]
    assert plan.steps[2].sample_indices() == (7, 8)
    assert plan.steps[0].sample_indices() == (0, 1, 2)


def test_noncontiguous_rollout_ids_are_grouped_in_order_of_first_appearance():
    rollouts = [1, 2, 1, 3, 2]
    plan = _plan_and_check([5, 6, 7, 8, 9], rollouts, max_tokens_per_gpu=100, rollouts_per_step=2)
    assert plan.steps[0].sample_indices() == (0, 1, 2, 4)
    assert plan.steps[1].sample_indices() == (3,)


def test_string_and_int_rollout_ids_are_different_rollouts():
    plan = _plan_and_check([5, 6], ["1", 1], max_tokens_per_gpu=100, rollouts_per_step=1)
    assert len(plan.steps) == 2


def test_oversize_sample_runs_alone_and_is_reported():
    lengths = [100, 5000, 200, 300]
    plan = _plan_and_check(lengths, max_tokens_per_gpu=1000, parallel=ParallelLayout(dp_size=2))
    assert plan.stats.oversize_samples == (1,)
    mbs = [mb for rank in plan.steps[0].ranks for mb in rank]
    assert (1,) in mbs
    assert all(sum(lengths[i] for i in mb) <= 1000 for mb in mbs if mb != (1,))


def test_cap_counts_tp_cp_padding_per_sample():
    # tp=2, cp=2 -> every sample padded to a multiple of 8; cap = 16 * 2 = 32.
    lengths = [1] * 8
    plan = _plan_and_check(
        lengths, max_tokens_per_gpu=16, parallel=ParallelLayout(tp_size=2, cp_size=2)
    )
    assert plan.sample_multiple == 8
    for mb in plan.steps[0].ranks[0]:
        assert len(mb) * 8 <= 32
    assert plan.steps[0].num_microbatches == 2


def test_padded_layout_footprint_is_rows_times_length():
    lengths = [100, 90, 80, 70, 60, 50]
    plan = _plan_and_check(lengths, max_tokens_per_gpu=250, layout="padded")
    step = plan.steps[0]
    assert step.seq_length == 100
    assert step.micro_batch_size * step.seq_length <= 250
    assert step.micro_batch_size == 2 and step.num_microbatches == 3


def test_attention_cost_model_balances_quadratic_work():
    """Two long and sixty short samples: equal tokens per rank is not equal attention work."""
    lengths = [3000, 3000] + [100] * 60
    quadratic = CostModel(token_weight=1.0, attention_weight=1.0 / 64)

    def attention_imbalance(plan):
        per_rank = [
            sum(quadratic.cost(lengths[i], lengths[i]) for mb in rank for i in mb)
            for rank in plan.steps[0].ranks
        ]
        return max(per_rank) * len(per_rank) / sum(per_rank)

    kwargs = dict(max_tokens_per_gpu=8192, parallel=ParallelLayout(dp_size=2))
    tokens_only = _plan_and_check(lengths, **kwargs)
    attention = _plan_and_check(lengths, cost=quadratic, **kwargs)
    assert attention.steps[0].dp_imbalance_cost == pytest.approx(attention_imbalance(attention))
    assert attention_imbalance(attention) <= attention_imbalance(tokens_only) + 1e-12
    assert attention_imbalance(attention) < 1.01


def test_long_tailed_dp64_balance_is_tight():
    random.seed(7)
    lengths = [min(16384, max(1, int(random.lognormvariate(7.0, 1.0)))) for _ in range(4096)]
    plan = _plan_and_check(lengths, max_tokens_per_gpu=16384, parallel=ParallelLayout(dp_size=64))
    assert plan.stats.dp_imbalance <= 1.02


def test_pipeline_order_puts_placeholders_at_the_ends():
    plan = _plan_and_check(
        [1000, 1000, 1000],
        max_tokens_per_gpu=1000,
        parallel=ParallelLayout(
            dp_size=1, pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=4
        ),
    )
    rank = plan.steps[0].ranks[0]
    assert len(rank) == 4 and rank[0] == ()


def test_invariant_checker_catches_a_lost_sample():
    config = PlannerConfig(max_tokens_per_gpu=100, parallel=ParallelLayout(dp_size=2))
    lengths = [10, 20, 30, 40]
    plan = plan_schedule(lengths, config=config)
    step = plan.steps[0]
    broken_ranks = (tuple(mb[1:] if mb else mb for mb in step.ranks[0]),) + step.ranks[1:]
    broken = dataclasses.replace(plan, steps=(dataclasses.replace(step, ranks=broken_ranks),))
    with pytest.raises(PlanInvariantError, match="never scheduled"):
        check_plan(broken, SampleSet.build(lengths), config)


@pytest.mark.parametrize("rollouts_per_step", [None, 2])
def test_invariant_checker_catches_wrong_real_tokens(rollouts_per_step):
    config = PlannerConfig(
        max_tokens_per_gpu=100,
        parallel=ParallelLayout(dp_size=2),
        rollouts_per_step=rollouts_per_step,
    )
    lengths = [10, 20, 30, 40]
    plan = plan_schedule(lengths, config=config)
    check_plan(plan, SampleSet.build(lengths), config)
    step = plan.steps[-1]
    wrong = dataclasses.replace(step, real_tokens=step.real_tokens + 1)
    broken = dataclasses.replace(plan, steps=plan.steps[:-1] + (wrong,))
    with pytest.raises(PlanInvariantError, match="real_tokens=.*its samples hold"):
        check_plan(broken, SampleSet.build(lengths), config)


def test_invariant_checker_catches_unequal_microbatch_counts():
    config = PlannerConfig(max_tokens_per_gpu=100, parallel=ParallelLayout(dp_size=2))
    lengths = [10, 20, 30, 40]
    plan = plan_schedule(lengths, config=config)
    step = plan.steps[0]
    broken_ranks = (step.ranks[0] + ((),), step.ranks[1])
    broken = dataclasses.replace(plan, steps=(dataclasses.replace(step, ranks=broken_ranks),))
    with pytest.raises(PlanInvariantError, match="expected 1"):
        check_plan(broken, SampleSet.build(lengths), config)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: plan_schedule([], config=PlannerConfig(max_tokens_per_gpu=10)), "no samples"),
        (lambda: plan_schedule([5, 0], config=PlannerConfig(max_tokens_per_gpu=10)), "sample 1: 0"),
        (
            lambda: plan_schedule([5, -3], config=PlannerConfig(max_tokens_per_gpu=10)),
            "sample 1: -3",
        ),
        (lambda: plan_schedule([5, 2.5], config=PlannerConfig(max_tokens_per_gpu=10)), "2.5"),
        (lambda: plan_schedule([5, True], config=PlannerConfig(max_tokens_per_gpu=10)), "True"),
        (
            lambda: plan_schedule([5, 6], [1], config=PlannerConfig(max_tokens_per_gpu=10)),
            "1 rollout ids for 2",
        ),
        (
            lambda: plan_schedule([5], [1.5], config=PlannerConfig(max_tokens_per_gpu=10)),
            "rollout id 1.5",
        ),
        (
            lambda: plan_schedule([5], None, [6], config=PlannerConfig(max_tokens_per_gpu=10)),
            "prompt_length=6",
        ),
        (
            lambda: plan_schedule([5], None, [1, 2], config=PlannerConfig(max_tokens_per_gpu=10)),
            "2 prompt lengths",
        ),
        (lambda: PlannerConfig(max_tokens_per_gpu=0), "max_tokens_per_gpu=0"),
        (
            lambda: PlannerConfig(
                max_tokens_per_gpu=3, parallel=ParallelLayout(tp_size=2, cp_size=4)
            ),
            "smaller than one padded sample",
        ),
        (lambda: PlannerConfig(max_tokens_per_gpu=10, rollouts_per_step=0), "rollouts_per_step=0"),
        (lambda: PlannerConfig(max_tokens_per_gpu=10, layout="thd"), "layout='thd'"),
        (lambda: ParallelLayout(dp_size=0), "dp_size=0"),
        (lambda: ParallelLayout(pp_size=0), "pp_size=0"),
        (lambda: ParallelLayout(vpp_size=0), "vpp_size=0"),
        (lambda: ParallelLayout(pp_size=1, vpp_size=2), "needs pp_size >= 2"),
        (
            lambda: ParallelLayout(pp_size=4, vpp_size=2, microbatch_group_size_per_vp_stage=2),
            "smaller than pp_size=4",
        ),
        (lambda: CostModel(attention_weight=-1.0), "attention_weight=-1.0"),
    ],
)
def test_bad_input_raises_value_error_naming_the_value(call, message):
    with pytest.raises(DynBatchValueError) as info:
        call()
    assert message in str(info.value)


def test_a_group_below_pp_without_interleaving_is_megatrons_to_ignore():
    # Megatron reads the group only in the interleaved schedule (and refuses one below pp there);
    # at vpp 1 it accepts any value, so the plan does too and aligns to nothing.
    parallel = ParallelLayout(dp_size=2, pp_size=4, microbatch_group_size_per_vp_stage=2)
    assert parallel.microbatch_multiple == 1
    plan = plan_schedule(
        [5, 9, 3, 7, 30], config=PlannerConfig(max_tokens_per_gpu=16, parallel=parallel)
    )
    [step] = plan.steps
    assert sorted(i for r in range(2) for mb in step.rank_microbatches(r) for i in mb) == list(
        range(5)
    )


@pytest.mark.parametrize(
    "layout, variable", [("packed", True), ("packed", False), ("padded", False)]
)
def test_min_microbatches_is_a_floor_on_the_count(layout, variable):
    # A sharded step's rank runs the count another rank sets: planned for it, not below it.
    config = PlannerConfig(max_tokens_per_gpu=100, layout=layout, variable_row_lengths=variable)
    lengths = [10] * 8
    assert plan_schedule(lengths, config=config).steps[0].num_microbatches == 1
    floored = dataclasses.replace(config, min_microbatches=4)
    [step] = plan_schedule(lengths, config=floored).steps
    assert step.num_microbatches >= 4
    assert sorted(i for mb in step.ranks[0] for i in mb) == list(range(8))
    with pytest.raises(DynBatchValueError, match="min_microbatches"):
        dataclasses.replace(config, min_microbatches=0)
