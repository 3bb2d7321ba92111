"""The planner registry: one registry, one signature, one result type (a Plan).

The hosts plan through ``run_planner`` (the planner ``PlannerConfig.planner`` names), ``plan
--planner NAME`` looks the name up in the same registry, and the upstream baselines of
benchmarks/baselines.py register there; with the default planner every host's output is exactly
``plan_schedule``'s.
"""

import argparse
import dataclasses
import json
import random
import sys
import warnings

import pytest

import benchmarks.baselines as baselines
from megatron_dynbatch.config import DynBatchConfig, load_yaml_config
from megatron_dynbatch.errors import DynBatchTypeError, DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    add_dynamic_batch_args,
    validate_dynamic_batch_args,
)
from megatron_dynbatch.planning import (
    ParallelLayout,
    PlanInvariantError,
    PlannerConfig,
    SampleSet,
    check_plan,
    get_planner,
    plan_samples,
    plan_schedule,
    planner_names,
    register_planner,
    run_planner,
)
from megatron_dynbatch.planning.fixed import plan_fixed_microbatches
from megatron_dynbatch.planning.registry import plan_from_ranks, ranks_planner
from megatron_dynbatch.planning.sharded import plan_sharded_step
from megatron_dynbatch.planning.spec import DEFAULT_PLANNER, CostModel
from megatron_dynbatch.tools.cli import main
from tests._support import megatron_lm_args

pytestmark = pytest.mark.unit

RNG = random.Random(38)
LENGTHS = [RNG.randint(10, 900) for _ in range(40)]
ROLLOUTS = [i // 4 for i in range(40)]
GROUPED = ParallelLayout(dp_size=2, pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2)


def _config(**kwargs):
    values = dict(max_tokens_per_gpu=1024, parallel=ParallelLayout(dp_size=2), rollouts_per_step=3)
    values.update(kwargs)
    return PlannerConfig(**values)


def _one_per_microbatch(lengths, keys, config):
    """A deliberately simple scheduler: one sample a micro-batch, dealt round robin."""
    dp = config.parallel.dp_size
    ranks = [[[i] for i in range(r, len(lengths), dp)] for r in range(dp)]
    count = max(map(len, ranks))
    count += -count % config.parallel.microbatch_multiple
    return [rank + [[]] * (count - len(rank)) for rank in ranks]


register_planner("test_one_per_microbatch", ranks_planner(_one_per_microbatch), replace=True)


def test_the_registry_names_the_built_in_planners_and_refuses_unknown_names():
    assert DEFAULT_PLANNER == "dynbatch" and PlannerConfig(max_tokens_per_gpu=8).planner == (
        "dynbatch"
    )
    assert {"dynbatch", "fixed"} <= set(planner_names())
    with pytest.raises(DynBatchValueError, match=r"no planner named 'nope'.*'dynbatch'"):
        get_planner("nope")
    with pytest.raises(DynBatchValueError, match="'no_such_module' cannot be imported"):
        get_planner("no_such_module:x")
    with pytest.raises(DynBatchValueError, match="'fixed' is already registered"):
        register_planner("fixed", lambda samples, config: None)
    with pytest.raises(DynBatchTypeError, match="must be callable"):
        register_planner("not_callable", 3)
    with pytest.raises(DynBatchValueError, match="planner=''"):
        PlannerConfig(max_tokens_per_gpu=8, planner="")
    with pytest.raises(DynBatchTypeError, match="PlannerConfig"):
        run_planner(SampleSet.build([1]), {"max_tokens_per_gpu": 8})


def _drops_the_first(lengths, keys, config):
    """A broken scheduler: sample 0 is never scheduled."""
    return _one_per_microbatch(lengths[1:], keys, config) if len(lengths) > 1 else [[[]]]


def _all_in_one(lengths, keys, config):
    """A broken scheduler: every sample in one micro-batch of rank 0, whatever the cap."""
    return [[list(range(len(lengths)))]] + [[[]] for _ in range(config.parallel.dp_size - 1)]


def _ungrouped(lengths, keys, config):
    """A broken scheduler: one sample a micro-batch, an odd count (the interleaving group is 2)."""
    dp = config.parallel.dp_size
    ranks = [[[i] for i in range(r, len(lengths), dp)] for r in range(dp)]
    count = max(map(len, ranks))
    count += 1 - count % 2
    return [rank + [[]] * (count - len(rank)) for rank in ranks]


def test_a_schedulers_indices_that_are_no_samples_are_a_broken_plan_not_a_traceback():
    """A probe: an index out of range or a string was a bare IndexError / TypeError, no
    micro-batch at all a ZeroDivisionError, and -1 or True were silently read as samples."""
    samples = SampleSet.build(LENGTHS, ROLLOUTS)

    def returning(ranks_of):
        def scheduler(lengths, keys, config):
            return ranks_of(len(lengths))

        return scheduler

    cases = {
        "test_out_of_range": (lambda n: [[[i] for i in range(n + 1)]], r"\[\d+\]"),
        "test_negative": (lambda n: [[[-1]] + [[i] for i in range(1, n)]], r"\[-1\]"),
        "test_bool": (lambda n: [[[True]] + [[i] for i in range(2, n)]], r"\[True\]"),
        "test_string": (lambda n: [[["0"]] + [[i] for i in range(1, n)]], r"\['0'\]"),
        "test_float": (lambda n: [[[float(i)] for i in range(n)]], r"\[0\.0, "),
        "test_nothing": (lambda n: [[]], "no micro-batch for its"),
        "test_not_ranks": (lambda n: None, "NoneType 'None', not ranks of micro-batches"),
    }
    for name, (ranks_of, found) in cases.items():
        register_planner(name, ranks_planner(returning(ranks_of)), replace=True)
        config = _config(rollouts_per_step=None, planner=name)
        with pytest.raises(PlanInvariantError, match=f"planner '{name}': its scheduler returned"):
            run_planner(samples, config)
        with pytest.raises(PlanInvariantError, match=found):
            run_planner(samples, config)


def test_a_registered_planners_plan_is_checked_before_any_host_runs_it(capsys, tmp_path):
    """run_planner, which every host, plan and verify call, holds a planner registered from
    outside to the guarantees ours keep (a probe found a planner's dropped sample trained by no
    one, with every interface silent but slime's); the built-in planners pass the same check."""
    for name, scheduler in (
        ("test_drops_the_first", _drops_the_first),
        ("test_all_in_one", _all_in_one),
        ("test_ungrouped", _ungrouped),
    ):
        register_planner(name, ranks_planner(scheduler), replace=True)
    samples = SampleSet.build(LENGTHS, ROLLOUTS)
    cases = (
        ("test_drops_the_first", _config(), r"samples never scheduled \[[\d, ]+\]"),
        ("test_all_in_one", _config(rollouts_per_step=None), "exceed the cap 1024"),
        (
            "test_ungrouped",
            _config(parallel=GROUPED, rollouts_per_step=None),
            "not one positive multiple of 2",
        ),
    )
    for name, config, found in cases:
        config = dataclasses.replace(config, planner=name)
        with pytest.raises(PlanInvariantError, match=f"planner '{name}' made a plan that breaks"):
            run_planner(samples, config)
        with pytest.raises(PlanInvariantError, match=found):
            run_planner(samples, config)
    # A planner that keeps them is not refused, and ours pass the same check.
    for name in ("test_one_per_microbatch", "dynbatch", "dynbatch-thorough"):
        config = _config(parallel=GROUPED, planner=name)
        check_plan(run_planner(samples, config), samples, config)
    # The commands answer in one line (plan printed the plan; verify printed every rank's
    # traceback), verify before it starts any rank.
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(LENGTHS))
    flags = ["--max-tokens-per-gpu", "1024", "--dp-size", "2", "--json"]
    for argv, said in (
        (["plan", str(path)], "plan: error: --dynamic-batch-planner test_drops_the_first: planner"),
        (["verify", "--samples", str(path)], "verify: error: planner 'test_drops_the_first' made"),
    ):
        code = main(argv + flags + ["--dynamic-batch-planner", "test_drops_the_first"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and err.startswith("megatron-dynbatch " + said), err


def test_a_planner_module_in_the_working_directory_is_found_by_the_console_script(
    tmp_path, monkeypatch
):
    """``--dynamic-batch-planner benchmarks.baselines:verl_kk`` from a checkout, as the help
    says: the console script has no working directory on its path (``python -m`` has)."""
    (tmp_path / "cwd_planners.py").write_text(
        "from megatron_dynbatch.planning.registry import get_planner, register_planner\n"
        "register_planner('cwd_default', get_planner('dynbatch'), replace=True)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert get_planner("cwd_planners:cwd_default") is get_planner("dynbatch")
    assert sys.path[-1] == str(tmp_path)  # appended: never shadows an installed module
    with pytest.raises(DynBatchValueError, match="'cwd_missing' cannot be imported"):
        get_planner("cwd_missing:x")


@pytest.mark.parametrize("parallel", [ParallelLayout(dp_size=2), GROUPED])
@pytest.mark.parametrize("variable", [False, True])
def test_the_default_planner_is_exactly_plan_schedule(parallel, variable):
    config = _config(parallel=parallel, variable_row_lengths=variable)
    prompts = [length // 3 for length in LENGTHS]
    mine = run_planner(SampleSet.build(LENGTHS, ROLLOUTS, prompts), config)
    assert mine == plan_schedule(LENGTHS, ROLLOUTS, prompts, config=config)


def test_fixed_is_megatrons_fixed_batching_under_the_budget():
    config = _config(layout="padded", planner="fixed", max_tokens_per_gpu=2048)
    samples = SampleSet.build(LENGTHS, ROLLOUTS)
    plan = run_planner(samples, config)
    check_plan(plan, samples, config)
    longest = max(LENGTHS)
    expected = plan_fixed_microbatches(
        LENGTHS,
        ROLLOUTS,
        dp_size=2,
        micro_batch_size=2048 // longest,
        seq_length=longest,
        rollouts_per_step=3,
        token_cap=2048,  # the budget's cap, as the plan reports it
    )
    assert plan == expected and plan.steps[0].micro_batch_size == 2
    with pytest.raises(DynBatchValueError, match="--dynamic-batch-layout padded"):
        run_planner(samples, dataclasses.replace(config, layout="packed"))
    with pytest.raises(DynBatchValueError, match="over the token cap 512"):
        run_planner(samples, dataclasses.replace(config, max_tokens_per_gpu=512))


def test_fixed_reports_its_step_as_every_planner_does():
    """idle ranks, the cost figures and the lower bound of a fixed plan read as the same ranks
    described by plan_from_ranks (a probe found fixed reporting no idle rank, the token ratio as
    its cost figures and ceil(samples / micro_batch_size) as the bound)."""
    cost = CostModel(response_weight=1.0, attention_weight=0.01)
    config = _config(
        layout="padded", planner="fixed", max_tokens_per_gpu=64, rollouts_per_step=None, cost=cost
    )
    for lengths, prompts in (([10, 60], [4, 20]), ([40, 5, 5], None), ([50, 7, 9], [40, 0, 3])):
        samples = SampleSet.build(lengths, prompt_lengths=prompts)
        plan = run_planner(samples, config)
        check_plan(plan, samples, config)
        described = plan_from_ranks(
            [[[list(mb) for mb in rank] for rank in plan.steps[0].ranks]],
            samples,
            config,
            layout="padded",
        )
        ours, theirs = plan.steps[0], described.steps[0]
        assert (ours.seq_length, ours.micro_batch_size) == (
            theirs.seq_length,
            theirs.micro_batch_size,
        )
        for field in (
            "idle_ranks",
            "dp_imbalance",
            "dp_imbalance_cost",
            "dp_imbalance_computed",
            "lower_bound_microbatches",
            "fill",
        ):
            assert getattr(ours, field) == pytest.approx(getattr(theirs, field)), (lengths, field)
    assert run_planner(SampleSet.build([10]), config).stats.idle_ranks == 1
    assert run_planner(SampleSet.build([40, 5, 5]), config).steps[0].lower_bound_microbatches == 1


def test_plan_from_ranks_fill_with_variable_rows_counts_the_rows_it_computes():
    samples = SampleSet.build([1000, 10])
    config = _config(rollouts_per_step=None, variable_row_lengths=True)
    plan = plan_from_ranks([[[[0]], [[1]]]], samples, config)
    rows = plan.steps[0].row_lengths
    assert rows and sum(map(sum, rows)) < 2 * plan.steps[0].seq_length
    assert plan.steps[0].fill == pytest.approx(1010 / sum(map(sum, rows)))
    assert plan.steps[0].fill == pytest.approx(plan.stats.fill)
    assert plan_schedule([1000, 10], config=config).steps[0].fill == pytest.approx(
        plan.steps[0].fill
    )


def test_plan_from_ranks_computed_imbalance_with_variable_rows_prices_each_row():
    """A probe: the longest row priced every micro-batch, so a rank of one 1,000-token row and a
    rank of one 10-token row reported dp_imbalance_computed 1.0."""
    from megatron_dynbatch.planning.cost import microbatch_cost

    samples = SampleSet.build([1000, 10])
    config = _config(rollouts_per_step=None, variable_row_lengths=True)
    step = plan_from_ranks([[[[0]], [[1]]]], samples, config).steps[0]
    costs = [
        microbatch_cost(config.cost, "packed", row, 1, [size], [0])
        for row, size in zip(
            (step.row_lengths[0][0], step.row_lengths[1][0]), (1000, 10), strict=True
        )
    ]
    assert step.dp_imbalance_computed == pytest.approx(max(costs) / (sum(costs) / 2))
    assert step.dp_imbalance_computed > 1.5


@pytest.mark.parametrize("name", sorted(baselines.BASELINES))
def test_every_baseline_is_a_planner_whose_plan_is_its_schedule(name):
    """Each step of the Plan holds exactly the baseline's ranks for that step's samples, and the
    plan checker accepts it wherever the baseline keeps the cap (packed rows of a token packer)."""
    parallel = GROUPED if name != "next_fit" else ParallelLayout(dp_size=2)
    config = _config(parallel=parallel, planner=name)
    samples = SampleSet.build(LENGTHS, ROLLOUTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = run_planner(samples, config)
    assert get_planner(name) is get_planner(f"benchmarks.baselines:{name}")
    for (_, items), step in zip(samples.steps(3), plan.steps, strict=True):
        raw = baselines.BASELINES[name](
            [LENGTHS[i] for i in items],
            dp_size=2,
            token_cap=1024,
            microbatch_multiple=parallel.microbatch_multiple,
            rollout_ids=[ROLLOUTS[i] for i in items],
        )
        local = [[[items[j] for j in mb if j < len(items)] for mb in rank] for rank in raw]
        assert [[list(mb) for mb in rank] for rank in step.ranks] == local
    over_cap = any(
        sum(LENGTHS[i] for i in mb) > 1024 for s in plan.steps for rank in s.ranks for mb in rank
    )
    if not over_cap:
        check_plan(plan, samples, config)
    assert plan.layout == ("padded" if name == "fixed_mbs" else "packed")


def test_plan_from_ranks_describes_an_over_cap_schedule_and_refuses_unequal_counts():
    samples = SampleSet.build([600, 600, 100])
    config = _config(rollouts_per_step=None)
    plan = plan_from_ranks([[[[0, 1]], [[2]]]], samples, config)
    step = plan.steps[0]
    assert (step.seq_length, step.micro_batch_size, step.num_microbatches) == (1200, 1, 1)
    assert step.lower_bound_microbatches == 2 and step.real_tokens == 1300
    assert plan.stats.fill == pytest.approx(1300 / (2 * 1200))
    with pytest.raises(
        PlanInvariantError, match="packed footprint 1x1200=1200 exceeds the cap 1024"
    ):
        check_plan(plan, samples, config)
    with pytest.raises(DynBatchValueError, match=r"micro-batch counts \[1, 2\]"):
        plan_from_ranks([[[[0]], [[1], [2]]]], samples, config)


def test_a_registered_planner_reaches_the_hosts_through_the_config():
    """The sharded hosts (verl, SkyRL) plan each rank's samples with the config's planner."""
    lengths = [[100, 200, 300], [50]]
    config = PlannerConfig(max_tokens_per_gpu=1024, planner="test_one_per_microbatch")
    sharded = plan_sharded_step(lengths, config)
    assert sharded.ranks == (((0,), (1,), (2,)), ((0,),))
    assert plan_sharded_step(lengths, dataclasses.replace(config, planner="dynbatch")).ranks == (
        ((0, 1, 2),),
        ((0,),),
    )


def test_plan_planner_picks_a_planner_by_name(tmp_path, capsys):
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(LENGTHS))
    common = ["plan", str(path), "--max-tokens-per-gpu", "1024", "--dp-size", "2", "--json"]
    assert main([*common, "--planner", "benchmarks.baselines:slime_first_fit"]) == 0
    printed = json.loads(capsys.readouterr().out)
    config = _config(rollouts_per_step=None, planner="slime_first_fit")
    assert printed == run_planner(SampleSet.build(LENGTHS), config).to_dict()
    assert main([*common, "--planner", "fixed"]) == 2
    assert "--layout padded" in capsys.readouterr().err
    assert main([*common, "--planner", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no planner named 'nope'" in err and "(--planner)" in err  # the spelling typed


def test_the_fixed_planners_refusals_name_every_change_it_needs_at_once(tmp_path, capsys):
    """Probes: with --variable-seq-lengths the layout refusal named padded, which the variable
    rows then refused (and back); with a sample over the cap, the layout then the cap, one at a
    time; under --oversize-samples error it named 'dynbatch', which refused the sample too."""
    path = tmp_path / "samples.json"
    path.write_text("[10, 20, 70]")
    plan = ["plan", str(path), "--max-tokens-per-gpu", "64", "--json"]
    fixed = [*plan, "--dynamic-batch-planner", "fixed"]
    assert main([*fixed, "--variable-seq-lengths"]) == 2
    err = capsys.readouterr().err
    assert "padded and drop --variable-seq-lengths" in err, err
    assert "and raise --max-tokens-per-gpu to at least 70" in err, err
    padded = [*fixed, "--dynamic-batch-layout", "padded"]
    assert main([*padded, "--max-tokens-per-gpu", "70"]) == 0  # both named fixes: plans
    capsys.readouterr()
    for layout in ([], ["--dynamic-batch-layout", "padded"]):  # a re-probe: packed too
        assert main([*fixed, *layout, "--oversize-samples", "error"]) == 2
        err = capsys.readouterr().err
        assert "pick planner 'dynbatch' with --oversize-samples allow" in err, err
    for policy in ("allow", "truncate"):
        assert main([*plan, "--oversize-samples", policy]) == 0
        capsys.readouterr()


# -- a user picks the planner of a real run --------------------------------------------------------


def _megatron_run_config(argv):
    """What a Megatron-LM run plans with: our flags parsed and validated as the entry does."""
    args = megatron_lm_args(["--use-dynamic-batch-size", *argv])
    config = validate_dynamic_batch_args(args)
    return config, config.planner_config(ParallelLayout(dp_size=2))


def test_megatron_lm_flag_and_yaml_choose_the_planner_the_run_plans_with(tmp_path):
    config, planner_config = _megatron_run_config(["--max-tokens-per-gpu", "1024"])
    assert (config.planner, planner_config.planner) == (DEFAULT_PLANNER, DEFAULT_PLANNER)

    argv = ["--max-tokens-per-gpu", "1024", "--dynamic-batch-layout", "padded"]
    config, planner_config = _megatron_run_config([*argv, "--dynamic-batch-planner", "fixed"])
    assert (config.planner, planner_config.planner) == ("fixed", "fixed")
    samples = SampleSet.build(LENGTHS)
    assert run_planner(samples, planner_config) == get_planner("fixed")(samples, planner_config)
    # plan_schedule, the lengths-in entry, plans with the planner the config names too.
    assert plan_schedule(LENGTHS, config=planner_config) == run_planner(samples, planner_config)
    assert run_planner(samples, planner_config) != plan_samples(samples, planner_config)

    path = tmp_path / "dynbatch.yaml"
    path.write_text("planner: test_one_per_microbatch\n")
    config, planner_config = _megatron_run_config(
        ["--max-tokens-per-gpu", "1024"]
        + [
            "--dynamic-batch-config",
            str(path),
        ]
    )
    assert planner_config.planner == "test_one_per_microbatch"
    # The forward-only config plans with the same planner.
    assert config.planner_config(GROUPED, forward_only=True).planner == "test_one_per_microbatch"
    # A flag given on the command line overrides the YAML, as for every other key.
    config, planner_config = _megatron_run_config(
        ["--max-tokens-per-gpu", "1024", "--dynamic-batch-config", str(path)]
        + ["--dynamic-batch-planner", "dynbatch"]
    )
    assert planner_config.planner == "dynbatch"


def test_an_unknown_planner_is_refused_at_start_up_naming_the_flag(tmp_path):
    with pytest.raises(DynBatchValueError, match=r"--dynamic-batch-planner.*'nope'.*registered"):
        _megatron_run_config(["--max-tokens-per-gpu", "1024", "--dynamic-batch-planner", "nope"])
    with pytest.raises(DynBatchValueError, match=r"--dynamic-batch-planner.*cannot be imported"):
        DynBatchConfig(max_tokens_per_gpu=1024, planner="no_such_module_xyz:thing")
    with pytest.raises(DynBatchValueError, match=r"planner is --dynamic-batch-planner"):
        DynBatchConfig(max_tokens_per_gpu=1024, planner="")
    path = tmp_path / "dynbatch.yaml"
    path.write_text("max_tokens_per_gpu: 1024\nplanner: nope\n")
    with pytest.raises(DynBatchValueError, match=r"planner='nope' \(--dynamic-batch-planner\)"):
        load_yaml_config(path)
    # A module that registers planners when imported is named as module:name.
    config = DynBatchConfig(max_tokens_per_gpu=1024, planner="benchmarks.baselines:verl_kk")
    assert get_planner(config.planner_config(ParallelLayout()).planner) is get_planner("verl_kk")


def test_the_megatron_lm_hooks_plan_each_step_with_the_chosen_planner(tmp_path):
    """What a Megatron-LM run's hooks plan a step with (``DynamicBatchHooks._plan``, called by
    ``prepare`` for every training step) under ``--dynamic-batch-planner``."""
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()  # the hooks import megatron.core, which needs the triton stand-in here
    from megatron_dynbatch.integrations.megatron_lm.hooks import DynamicBatchHooks

    class Batch:
        rollout_ids = None

        def lengths(self):
            return list(LENGTHS)

        def prompt_lengths(self):
            return [0] * len(LENGTHS)

    layout = ParallelLayout(dp_size=2)
    plans = {}
    for name in ("dynbatch", "fixed"):
        argv = ["--max-tokens-per-gpu", "1024", "--dynamic-batch-layout", "padded"]
        argv += ["--dynamic-batch-planner", name, "--dynamic-batch-calibration-steps", "0"]
        parser = add_dynamic_batch_args(argparse.ArgumentParser(allow_abbrev=False))
        args = parser.parse_args(["--use-dynamic-batch-size", *argv])
        args.save = str(tmp_path)
        config, planner = _megatron_run_config(argv)
        hooks = DynamicBatchHooks(args, config)
        plans[name], _ = hooks._plan(Batch(), layout, False)
        assert plans[name] == run_planner(SampleSet.build(LENGTHS), planner)
    assert plans["fixed"] == get_planner("fixed")(
        SampleSet.build(LENGTHS), _megatron_run_config(argv)[1]
    )
    assert plans["fixed"] != plans["dynbatch"]
