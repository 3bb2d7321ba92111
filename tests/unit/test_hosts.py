"""The host records and the one entry that plans a host's step (no trainer checkout needed)."""

import warnings

import pytest

from megatron_dynbatch.config import FLAGS
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import (
    HOSTS,
    SKYRL,
    SLIME,
    VERL,
    check_host_lengths,
    check_host_oversize,
    host_config,
    plan_host_step,
)
from megatron_dynbatch.planning import (
    OversizeSampleWarning,
    ParallelLayout,
    PlanInvariantError,
    check_plan,
)
from megatron_dynbatch.planning.sharded import ShardedPlan

pytestmark = pytest.mark.unit


def _budget_option(host):
    return next(o for o, f in host.options.items() if f == "max_tokens_per_gpu")


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_every_host_names_its_own_budget_key_in_a_budget_error(name):
    host = HOSTS[name]
    option = _budget_option(host)
    for bad, match in (
        (0, "must be > 0"),
        (2.5, "must be a whole number"),
        (None, "needs a token"),
    ):
        with pytest.raises(DynBatchValueError, match=match) as info:
            host_config(host, {option: bad}, ParallelLayout())
        assert host.keys["max_tokens_per_gpu"] in str(info.value)
    # A budget below the TP alignment: the fix names the host's key, never our flag.
    with pytest.raises(DynBatchValueError, match="smaller than one padded sample") as info:
        host_config(host, {option: 3}, ParallelLayout(tp_size=4))
    assert host.keys["max_tokens_per_gpu"] in str(info.value)
    if host.keys["max_tokens_per_gpu"] != FLAGS["max_tokens_per_gpu"]:
        assert FLAGS["max_tokens_per_gpu"] not in str(info.value)


@pytest.mark.parametrize("host", [SKYRL, VERL])
def test_lengths_are_checked_once_naming_rank_and_sample(host):
    assert check_host_lengths(host, [[3, 4], []]) == [[3, 4], []]
    with pytest.raises(DynBatchValueError, match="DP rank 1 sample 0 has 0 tokens"):
        check_host_lengths(host, [[3], [0]])
    with pytest.raises(DynBatchValueError, match="True"):
        check_host_lengths(host, [[True]])
    # Integers only, as `plan` reads a samples file: 5.0 was read as 5.
    for bad in (5.0, 5.5, "5"):
        with pytest.raises(DynBatchValueError, match="not an integer token count"):
            check_host_lengths(host, [[3], [bad]])
    np = pytest.importorskip("numpy")
    assert check_host_lengths(host, [np.array([3, 4], dtype=np.int32)]) == [[3, 4]]


def test_verl_refuses_a_sample_over_its_budget_naming_verls_key():
    config = host_config(VERL, {"max_token_len_per_gpu": 100}, ParallelLayout(tp_size=8))
    with pytest.raises(DynBatchValueError, match="ppo_max_token_len_per_gpu to at least 101"):
        check_host_oversize(VERL, [[50], [101]], config)


@pytest.mark.parametrize("host", [SKYRL, VERL])
def test_a_sample_exactly_at_the_budget_is_accepted_whatever_the_alignment(host):
    # 100 is no multiple of tp=8: the sample pads to 104, yet stock verl and SkyRL accept it
    # (they count real tokens); it runs alone.
    option = _budget_option(host)
    config = host_config(host, {option: 100}, ParallelLayout(tp_size=8))
    plan = plan_host_step(host, [[100, 20, 30], [8]], config)
    assert (0,) in plan.ranks[0]
    assert plan.oversize == ((0, 0),)


def test_slime_warns_or_refuses_by_its_own_option():
    parallel = ParallelLayout()
    config = host_config(SLIME, {"max_tokens_per_gpu": 10}, parallel)
    with pytest.warns(OversizeSampleWarning, match="--max-tokens-per-gpu"):
        check_host_oversize(SLIME, [[5, 11]], config)
    config = host_config(SLIME, {"max_tokens_per_gpu": 10, "oversize_samples": "error"}, parallel)
    with pytest.raises(DynBatchValueError, match="sample 1: 11 tokens"):
        check_host_oversize(SLIME, [[5, 11]], config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_host_oversize(SLIME, [[5, 9]], config) == []
    # Under truncate the plan cuts the sample: the warning said it ran whole (a host-API probe).
    config = host_config(
        SLIME, {"max_tokens_per_gpu": 10, "oversize_samples": "truncate"}, parallel
    )
    with pytest.warns(OversizeSampleWarning) as caught:
        check_host_oversize(SLIME, [[5, 11]], config)
    [said] = [str(w.message) for w in caught]
    assert (
        "Each is cut to the cap (--oversize-samples truncate): its tokens past 10 are not" in (said)
        and "runs alone" not in said
    ), said


def test_check_plan_checks_sharded_plans():
    config = host_config(SKYRL, {"max_tokens_per_microbatch": 10}, ParallelLayout(pp_size=2))
    lengths = [[4, 5, 6], [3]]
    plan = plan_host_step(SKYRL, lengths, config)
    check_plan(plan, lengths, config)
    broken = [
        ShardedPlan(ranks=(((0, 1, 2),), ((0,),)), num_microbatches=1, rows=3),  # over the cap
        ShardedPlan(ranks=(((0,), (1,)), ((0,),)), num_microbatches=2, rows=1),  # sample 2 lost
        ShardedPlan(ranks=(((0, 1), (2,)), ((0,),)), num_microbatches=1, rows=2),  # count < real
        ShardedPlan(ranks=(((0,), (1,), (2,)), ((0,),)), num_microbatches=3, rows=2),  # rows
    ]
    for bad in broken:
        with pytest.raises(PlanInvariantError):
            check_plan(bad, lengths, config)
    # Placeholder rows count against the cap when the host adds them to a micro-batch.
    tight = ShardedPlan(ranks=(((0, 1), (2,)), ((0,),)), num_microbatches=2, rows=3)
    with pytest.raises(PlanInvariantError, match="exceed the cap 10"):
        check_plan(tight, lengths, config, placeholder_row_tokens=2)
