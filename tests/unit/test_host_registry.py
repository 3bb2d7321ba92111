"""A trainer outside the package registers its own host record; errors then use its keys."""

import dataclasses
import re
import warnings

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations import hosts
from megatron_dynbatch.integrations.hosts import HOSTS, Host, host_config, register_host
from megatron_dynbatch.planning import OversizeSampleWarning, ParallelLayout
from megatron_dynbatch.planning.sharded import plan_sharded_step

pytestmark = pytest.mark.unit


def _toy(name="toy-registry", **changes):
    fields = dict(
        name=name,
        switch="toy.dynamic=true",
        fallback="toy.dynamic=false",
        options={
            "tokens_per_mb": "max_tokens_per_gpu",
            "logprob_tokens": "log_probs_max_tokens_per_gpu",
        },
        keys={
            "max_tokens_per_gpu": "toy.tokens_per_mb",
            "log_probs_max_tokens_per_gpu": "toy.logprob_tokens",
        },
        planning="global",
        oversize="error",
        layout_flags={"pp_size": "toy.pp", "dp_size": "toy.dp"},
    )
    fields.update(changes)
    return Host(**fields)


@pytest.fixture
def registered():
    host = register_host(_toy())
    yield host
    HOSTS.pop(host.name)


def test_a_registered_host_is_in_the_table_and_plans(registered):
    assert HOSTS["toy-registry"] is registered
    config = host_config(registered, {"tokens_per_mb": 96}, ParallelLayout(pp_size=2))
    assert config.max_tokens_per_gpu == 96 and config.parallel.pp_size == 2


def test_its_errors_name_its_own_keys(registered):
    with pytest.raises(DynBatchValueError, match=r"toy\.tokens_per_mb=0 must be > 0"):
        host_config(registered, {"tokens_per_mb": 0}, ParallelLayout())
    with pytest.raises(DynBatchValueError, match=r"toy\.dynamic=true needs a token budget"):
        host_config(registered, {}, ParallelLayout())
    # A planner error that names a parallel size names it by the host's option, in its place.
    with pytest.raises(DynBatchValueError, match=r"^toy\.pp=3 does not divide the layers$"):
        with registered.flags():
            raise DynBatchValueError("pp_size=3 does not divide the layers")


def test_a_second_record_of_one_name_is_refused_unless_replaced(registered):
    with pytest.raises(DynBatchValueError, match="already registered"):
        register_host(_toy(switch="toy.other=true"))
    # The same record again is harmless (a module imported twice).
    assert register_host(_toy()) == registered
    replaced = register_host(_toy(switch="toy.other=true"), replace=True)
    assert HOSTS["toy-registry"] is replaced


def test_only_host_records_are_registered():
    with pytest.raises(
        DynBatchValueError, match="needs a megatron_dynbatch.integrations.hosts.Host"
    ):
        register_host({"name": "toy"})


def test_layout_flags_not_named_keep_megatron_lm_flags():
    host = _toy()
    assert host.layout_flags["pp_size"] == "toy.pp"
    assert host.layout_flags["vpp_size"] == hosts.LAYOUT_FLAGS["Megatron-LM"]["vpp_size"]


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(keys={}), "must name its budget key"),
        (dict(options={"tokens": "max_tokenz"}), "unknown config fields ['max_tokenz']"),
        (dict(planning="glob"), "planning='glob' is not one of ('global', 'sharded')"),
        (dict(oversize="drop"), "oversize='drop' is not one of"),
        (dict(layout_flags={"pipeline": "toy.pp"}), "unknown sizes ['pipeline']"),
        # A probe: a record with no option for the budget was a bare StopIteration at planning.
        (dict(options={}), "options must map its budget option to 'max_tokens_per_gpu'"),
    ],
)
def test_a_bad_host_record_is_refused_by_name_not_asserted(changes, named):
    # These were asserts: an AssertionError (an invariant of ours) for a trainer's own record,
    # and gone under python -O; planning="glob" and oversize="drop" were taken.
    with pytest.raises(DynBatchValueError, match=re.escape(named)):
        _toy(**changes)


def test_the_host_entry_points_refuse_the_wrong_kind_of_plan_by_name():
    from megatron_dynbatch.integrations.hosts import VERL, plan_host_step

    with pytest.raises(DynBatchValueError, match="dp_size=1"):
        host_config(VERL, {"max_token_len_per_gpu": 64}, ParallelLayout(dp_size=2))
    config = host_config(_toy(), {"tokens_per_mb": 64}, ParallelLayout())
    with pytest.raises(DynBatchValueError, match="plan_schedule"):
        plan_host_step(_toy(), [[5, 6]], config)
    verl = host_config(VERL, {"max_token_len_per_gpu": 64}, ParallelLayout())
    for bad in ([5, 6], [[5, float("nan")]], [[5, float("inf")]]):
        with pytest.raises(DynBatchValueError, match="verl: "):
            plan_host_step(VERL, bad, verl)


def test_each_pass_checks_its_own_budget_under_its_own_key(registered):
    # An integrator's probe: the forward-only config checked the training budget (4) under the
    # log-prob key, and raising that key, as the message said, changed nothing.
    layout = ParallelLayout(tp_size=4, cp_size=2)  # samples padded to multiples of 16: 8 a GPU
    values = {"tokens_per_mb": 4, "logprob_tokens": 64}
    config = host_config(registered, values, layout, forward_only=True)
    assert config.max_tokens_per_gpu == 64 and config.budget_flag == "toy.logprob_tokens"
    with pytest.raises(DynBatchValueError, match=r"raise toy\.tokens_per_mb to at least 8"):
        host_config(registered, values, layout)
    fixed = host_config(registered, values, ParallelLayout())
    assert fixed.budget_flag == "toy.tokens_per_mb"
    with pytest.raises(DynBatchValueError, match=r"raise toy\.logprob_tokens to at least 8"):
        host_config(
            registered, {"tokens_per_mb": 64, "logprob_tokens": 2}, layout, forward_only=True
        )
    # The log-prob budget's own type errors name its key, in either pass.
    for forward_only in (False, True):
        with pytest.raises(DynBatchValueError, match=r"^toy\.logprob_tokens=1\.5 must be a whole"):
            host_config(
                registered,
                {"tokens_per_mb": 64, "logprob_tokens": 1.5},
                layout,
                forward_only=forward_only,
            )


def test_the_planners_own_messages_name_the_hosts_budget_key(registered):
    from megatron_dynbatch.planning import plan_schedule

    config = host_config(registered, {"tokens_per_mb": 64}, ParallelLayout())
    with pytest.raises(DynBatchValueError, match=r"Raise toy\.tokens_per_mb") as error:
        plan_schedule([10, 100], config=config)
    assert "--max-tokens-per-gpu" not in str(error.value)


def test_a_flat_list_of_lengths_is_refused_by_name(registered):
    from megatron_dynbatch.integrations.hosts import check_host_oversize

    config = host_config(registered, {"tokens_per_mb": 64}, ParallelLayout())
    with pytest.raises(DynBatchValueError, match=r"one list per DP rank"):
        check_host_oversize(registered, [40, 300], config)


def test_a_setting_named_by_its_option_alone_is_named_so_in_errors():
    # An integrator's probe: "rollouts_per_step=0 must be >= 1; omit --rollouts-per-step", our
    # field and our flag, for a host whose users set it as an option without a key.
    options = {"tokens_per_mb": "max_tokens_per_gpu", "per_step": "rollouts_per_step"}
    host = _toy(name="toy-options", options=options)
    with pytest.raises(
        DynBatchValueError, match=r"^per_step=0 must be >= 1; omit per_step "
    ) as error:
        host_config(host, {"tokens_per_mb": 64, "per_step": 0}, ParallelLayout())
    assert "--rollouts-per-step" not in str(error.value)


def test_a_sharded_hosts_config_refuses_what_its_first_step_would_in_its_own_words():
    # A probe: a sharded host took oversize 'truncate' and a planner of the other layout here and
    # refused them at the first step, naming our flags; the truncate the refusal offered was
    # refused in turn.
    options = {"tokens_per_mb": "max_tokens_per_gpu", "policy": "oversize_samples"}
    shardy = _toy(name="shardy", planning="sharded", oversize="option", options=options)
    with pytest.raises(DynBatchValueError, match=r"^shardy: policy='truncate' is refused") as no:
        host_config(shardy, {"tokens_per_mb": 64, "policy": "truncate"}, ParallelLayout())
    assert "policy='allow' or 'error'" in str(no.value)
    config = host_config(shardy, {"tokens_per_mb": 64, "policy": "error"}, ParallelLayout())
    with pytest.raises(DynBatchValueError, match=r"or set policy='allow' \(run alone") as refused:
        plan_sharded_step([[100], [3]], config)
    assert "truncate" not in str(refused.value) and "--oversize-samples" not in str(refused.value)
    with pytest.warns(OversizeSampleWarning) as warned:
        plan_sharded_step([[100], [3]], dataclasses.replace(config, oversize_samples="allow"))
    assert all("truncate" not in str(w.message) for w in warned)
    # Each rank plans its own rows: the long row is that rank's, not every GPU's.
    assert all("on that rank" in str(w.message) for w in warned)
    with pytest.raises(DynBatchValueError, match="plans padded rows only"):
        host_config(
            _toy(options={**_toy().options, "planner": "planner"}),
            {"tokens_per_mb": 64, "planner": "fixed"},
            ParallelLayout(),
            fixed={"layout": "packed"},
        )


def test_a_policy_named_by_its_option_alone_is_named_so_in_oversize_messages():
    # A probe: a registered host without a key for its oversize option was told
    # "or --oversize-samples allow", our flag.
    from megatron_dynbatch.integrations.hosts import check_host_oversize

    options = {"tokens_per_mb": "max_tokens_per_gpu", "policy": "oversize_samples"}
    keys = {"max_tokens_per_gpu": "s.tokens_per_mb"}
    host = _toy(
        name="policy-option", planning="sharded", oversize="option", options=options, keys=keys
    )
    config = host_config(host, {"tokens_per_mb": 64, "policy": "error"}, ParallelLayout())
    with pytest.raises(DynBatchValueError, match=r"or policy=allow \(each runs alone") as error:
        check_host_oversize(host, [[100], [3]], config)
    assert "--oversize-samples" not in str(error.value)
    allowed = host_config(host, {"tokens_per_mb": 64, "policy": "allow"}, ParallelLayout())
    with pytest.warns(OversizeSampleWarning, match=r"set policy=error to stop"):
        check_host_oversize(host, [[100], [3]], allowed)


@pytest.mark.parametrize("planning", ["global", "sharded"])
@pytest.mark.parametrize("policy", ["allow", "warn"])
def test_a_records_oversize_policy_is_the_planners_and_no_message_names_our_flag(planning, policy):
    # A probe (docs/integrating.md followed as written): a record with oversize="allow" had its
    # sample over the budget accepted by check_host_oversize, then refused by the planner and by
    # plan_host_step, naming --oversize-samples, which that trainer does not have.
    from megatron_dynbatch.integrations.hosts import check_host_oversize, plan_host_step
    from megatron_dynbatch.planning import plan_schedule

    host = _toy(name=f"toy-{policy}-{planning}", planning=planning, oversize=policy)
    config = host_config(host, {"tokens_per_mb": 64}, ParallelLayout(pp_size=2))
    assert config.oversize_samples == "allow" and config.oversize_flag is None
    with pytest.warns(OversizeSampleWarning) if policy == "warn" else _no_warning() as said:
        assert check_host_oversize(host, [[100, 10]], config) == [(0, 0)]
    with host.flags(), warnings.catch_warnings(record=True) as planned:
        warnings.simplefilter("always")
        if planning == "global":
            plan = plan_schedule([100, 10], config=config)
            assert plan.stats.oversize_samples == (0,)
        else:
            # plan_host_step leaves the words to check_host_oversize (silent for "allow"); the
            # plan reports the sample.
            plan = plan_host_step(host, [[100, 10], [5]], config)
            assert sorted(i for mb in plan.ranks[0] for i in mb) == [0, 1]
            assert plan.oversize == ((0, 0),)
    texts = [str(w.message) for w in [*(said or []), *planned]]
    assert texts or (planning, policy) == ("sharded", "allow")
    assert all("toy.tokens_per_mb" in t for t in texts if "exceed" in t)
    assert not any("oversize-samples" in t or "oversize_samples" in t for t in texts), texts


class _no_warning:
    """A context that records nothing (the "allow" record is silent in check_host_oversize)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_an_error_records_refusal_names_only_its_budget_key():
    from megatron_dynbatch.planning import plan_schedule

    host = _toy(name="toy-error-words")
    config = host_config(host, {"tokens_per_mb": 64}, ParallelLayout())
    assert config.oversize_samples == "error" and config.oversize_flag is None
    with pytest.raises(
        DynBatchValueError, match=r"Raise toy.tokens_per_mb to at least 100, or drop"
    ):
        plan_schedule([100, 10], config=config)
    config = host_config(host, {"tokens_per_mb": 100}, ParallelLayout())
    assert plan_schedule([100, 10], config=config).stats.oversize_samples == ()


@pytest.mark.parametrize("policy", ["error", "truncate"])
def test_a_record_that_allows_oversize_samples_but_fixes_another_planner_policy_is_refused(policy):
    with pytest.raises(DynBatchValueError, match=r"oversize='allow' runs a sample .* drop that"):
        _toy(name="toy-contradicts", oversize="allow", fixed={"oversize_samples": policy})
