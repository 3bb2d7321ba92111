"""The Megatron-LM calibration driver in one process, on a simulated clock: it varies the budget
while calibrating, fits the weights behind the measured times, plans the next batches with them
under the configured budget, writes the sidecar files, and a resumed run reuses the fit. Its state
is one ``Calibrator`` per run (owned by the run's hooks object), never Megatron's ``args``."""

import argparse
import copy
import dataclasses
import inspect
import json
import random
import re
import sys

import pytest

from megatron_dynbatch.config import load_yaml_config
from megatron_dynbatch.integrations.megatron_lm import calibration as calib
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    add_dynamic_batch_args,
    dynbatch_config_from_args,
    parallel_layout_from_args,
)
from megatron_dynbatch.planning import plan_schedule
from megatron_dynbatch.planning.calibration import Calibration, predict_seconds
from megatron_dynbatch.planning.memory import MIB, MemoryLimit, MemoryModel
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.spec import ParallelLayout

pytestmark = pytest.mark.unit

TRUE = (2e-6, 3e-9, 4e-3)
STEP_SECONDS = 0.05


class _Batch:
    def __init__(self, lengths):
        self._lengths = lengths

    def lengths(self):
        return list(self._lengths)


def _args(tmp_path, **extra):
    parser = add_dynamic_batch_args(argparse.ArgumentParser())
    args = parser.parse_args(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024"])
    args.dynamic_batch_layout = "packed"
    args.dynamic_batch_cost_token_weight = 1.0
    args.dynamic_batch_cost_attention_weight = 0.0
    args.dynamic_batch_cost_response_weight = 0.0
    args.dynamic_batch_oversize_samples = "error"
    args.seq_length = 256
    args.pipeline_model_parallel_size = 2
    args.data_parallel_size = 1
    args.save = str(tmp_path)
    args.eval_interval = None
    args.save_interval = None
    for key, value in extra.items():
        setattr(args, key, value)
    return args


def _train(args, monkeypatch, iterations, first=0, calibrator=None, record=None, clock=None):
    """Drive ``calibrator`` as ``DynamicBatchHooks.prepare`` does; the clock advances by the true
    time. Returns the budgets and plan fingerprints of the steps, and the calibrator.

    Batch ``i``'s lengths depend on ``i`` alone, so a resumed run sees the straight run's batches.
    Fails if anything in ``args`` but the iteration number (which Megatron's loop sets) changed.
    """
    calibrator = calib.Calibrator() if calibrator is None else calibrator
    clock = [0.0] if clock is None else clock
    monkeypatch.setattr(calib.time, "perf_counter", lambda: clock[0])
    budgets, plans = [], []
    for i in range(first, first + iterations):
        args.curr_iteration = i
        before = copy.deepcopy(vars(args))
        calibrator.resume(args)
        layout = parallel_layout_from_args(args)
        rng = random.Random(i)
        batch = _Batch([rng.randint(20, 256) for _ in range(32)])
        # What the hooks plan with: the run's config with calibration's changes (never in args).
        config = calibrator.calibrated_config(dynbatch_config_from_args(args))
        plan = plan_schedule(batch.lengths(), config=config.planner_config(layout))
        budgets.append(config.max_tokens_per_gpu)
        plans.append(plan.fingerprint())
        if record is not None:
            record.append((config.cost_microbatch_overhead, plan.steps[0].num_microbatches))
        calibrator.observe_train_step(args, batch, plan, 0)
        assert vars(args) == before, "calibration wrote into Megatron's args"
        shapes = calibrator.pending
        clock[0] += 1.0 if shapes is None else predict_seconds(shapes, TRUE, STEP_SECONDS)
    return budgets, plans, calibrator


def test_calibrates_applies_and_writes(tmp_path, monkeypatch):
    args = _args(tmp_path)
    record = []
    budgets, _, calibrator = _train(args, monkeypatch, 16, record=record)
    fit = calibrator.fit
    assert fit is not None and fit.observations == calib.DEFAULT_CALIBRATION_STEPS
    assert fit.weights == pytest.approx(TRUE, rel=1e-3)
    assert fit.step_seconds == pytest.approx(STEP_SECONDS, rel=1e-3)
    # The budget never varies (every calibration step is planned under the configured one): the
    # planner's overhead does, in turn (iteration n, 1-based: factor n % 3), and with it the
    # micro-batch counts; then the fit's overhead.
    assert set(budgets) == {1024}
    prior = calibrator._prior(args).overhead
    overheads = [o for o, _ in record]
    assert overheads[1:4] == pytest.approx([prior * f for f in (0.25, 1.0, 4.0)])
    assert len({m for _, m in record[2:10]}) >= 2, record
    assert overheads[-1] == pytest.approx(TRUE[2] / TRUE[0], rel=1e-3)
    assert fit.unidentified == ()
    planned = calibrator.calibrated_config(dynbatch_config_from_args(args))
    assert planned.max_tokens_per_gpu == 1024 and planned.cost_token_weight == 1.0
    assert planned.cost_microbatch_overhead == pytest.approx(TRUE[2] / TRUE[0], rel=1e-3)
    # Nothing was written into Megatron's arguments (_train checks every step, every attribute).
    assert args.max_tokens_per_gpu == 1024
    assert args.dynamic_batch_cost_microbatch_overhead is None
    values = load_yaml_config(tmp_path / calib.CALIBRATION_YAML)
    assert values["cost_attention_weight"] == pytest.approx(TRUE[1] / TRUE[0], rel=1e-3)
    saved = json.loads((tmp_path / calib.CALIBRATION_JSON).read_text())
    assert len(saved["steps"]) == calib.DEFAULT_CALIBRATION_STEPS
    assert "predicted/measured" in calibrator.log_string()


def test_a_fit_of_no_work_shows_no_predicted_time(tmp_path, monkeypatch):
    """A refused fit whose weights all came out 0 (seen on an H100 with noisy steps) predicts 0 s
    for a real step: the iteration line and TensorBoard then show no prediction, not 0.0."""
    _, _, calibrator = _train(_args(tmp_path), monkeypatch, 16)
    assert "predicted/measured" in calibrator.log_string() and calibrator.scalars()
    calibrator.fit = dataclasses.replace(
        calibrator.fit,
        token_weight=0.0,
        attention_weight=0.0,
        microbatch_overhead=0.0,
        step_seconds=0.0,
    )
    calibrator._timing = None
    assert calibrator.log_string() == " step time predicted: none (fit refused) |"
    assert calibrator.scalars() == {}


def test_two_hooks_objects_share_no_calibration(tmp_path, monkeypatch):
    """Each run's hooks object owns its calibration: one run calibrating (varied budgets, then a
    fit) changes nothing another run in the same process plans with, and a new run after
    ``reset_dynamic_batch_state`` starts without the old fit."""
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()  # the hooks import megatron.core, which needs the triton stand-in here
    from megatron_dynbatch.integrations.megatron_lm import hooks as training_hooks

    first_args, second_args = _args(tmp_path / "first"), _args(tmp_path / "second")
    first = training_hooks.DynamicBatchHooks(first_args, dynbatch_config_from_args(first_args))
    second = training_hooks.DynamicBatchHooks(second_args, dynbatch_config_from_args(second_args))
    assert first.calibration is not second.calibration
    _train(first_args, monkeypatch, 2, calibrator=first.calibration)
    # Mid-calibration the first run plans iteration 3 with the prior's overhead made explicit;
    # the second plans with its configured config.
    assert first._calibrated(False) != first.config
    assert first._calibrated(False).max_tokens_per_gpu == 1024
    assert second._calibrated(False) == second.config
    _train(first_args, monkeypatch, 14, first=2, calibrator=first.calibration)
    assert first.calibration.fit is not None
    assert first._calibrated(False).cost_microbatch_overhead == pytest.approx(
        TRUE[2] / TRUE[0], rel=1e-3
    )
    assert second.calibration.fit is None and second.calibration.observations == []
    assert second.calibration.overrides == {} and second.calibration.log_string() == ""
    assert second._calibrated(False) == second.config
    # The second run calibrates from its own steps, unaffected by the first's fit.
    record = []
    _train(second_args, monkeypatch, 4, calibrator=second.calibration, record=record)
    prior = second.calibration._prior(second_args).overhead
    assert [o for o, _ in record][1:4] == pytest.approx([prior * f for f in (0.25, 1.0, 4.0)])
    # A new run (through the module's hooks) gets a new calibrator.
    training_hooks.reset_dynamic_batch_state()
    try:
        fresh = training_hooks.hooks_for(first_args)
        assert fresh.calibration is not first.calibration and fresh.calibration.fit is None
        assert fresh._calibrated(False) == fresh.config
    finally:
        training_hooks.reset_dynamic_batch_state()


def test_a_resumed_run_plans_like_the_straight_run(tmp_path, monkeypatch):
    straight = _args(tmp_path)
    _, straight_plans, straight_calibrator = _train(straight, monkeypatch, 16)
    straight_overhead = straight_calibrator.calibrated_config(
        dynbatch_config_from_args(straight)
    ).cost_microbatch_overhead
    resumed = _args(tmp_path / "resumed", load=str(tmp_path), iteration=12)
    _, resumed_plans, resumed_calibrator = _train(resumed, monkeypatch, 4, first=12)
    # The saved fit from its first step, no second calibration, and the straight run's plans.
    resumed_overhead = resumed_calibrator.calibrated_config(
        dynbatch_config_from_args(resumed)
    ).cost_microbatch_overhead
    assert resumed_overhead == straight_overhead is not None
    assert resumed_calibrator.observations == []
    assert resumed_plans == straight_plans[12:]
    # Resumed before calibration ended (no sidecar yet): the budget follows the iteration number,
    # so the resumed run still plans as the straight run did.
    for first in (4, 5, 6):
        early = _args(tmp_path / "early", load=str(tmp_path / "nothing"), iteration=first)
        _, early_plans, _ = _train(early, monkeypatch, 3, first=first)
        assert early_plans == straight_plans[first : first + 3], first


def test_off_with_zero_steps(tmp_path, monkeypatch):
    args = _args(tmp_path, dynamic_batch_calibration_steps=0)
    budgets, _, calibrator = _train(args, monkeypatch, 12)
    assert set(budgets) == {1024} and calibrator.fit is None
    assert not (tmp_path / calib.CALIBRATION_JSON).exists()


def test_observations_price_the_attention_the_planner_prices(tmp_path, monkeypatch):
    """Megatron's local implementation (the CPU path) runs a dense mask: the fit must price rows
    the same way the planner does, not as THD segments (the flag itself is unset)."""
    args = _args(tmp_path, transformer_impl="local")
    assert args.dynamic_batch_cost_attention is None
    _, _, calibrator = _train(args, monkeypatch, 4)
    assert calibrator.pending.attention == "dense"
    assert dynbatch_config_from_args(args).cost_attention == "dense"
    # transformer-engine by default: THD segments
    _, _, calibrator = _train(_args(tmp_path), monkeypatch, 4)
    assert calibrator.pending.attention == "segment"


#: The tiny GPT of launch/train_gpt_dynbatch.sh as Megatron's arguments give it.
TINY_GPT = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=257,
    transformer_impl="local",
)


def test_calibration_steps_cost_about_what_the_steps_they_replace_cost(tmp_path, monkeypatch):
    """Issue 42: a calibration step must cost at most a few percent over the step it replaces (the
    earlier shapes, e.g. one row of 483 tokens a micro-batch, ran at twice the step time). Every
    shape is the planner's own plan under the configured budget with a larger or smaller
    overhead; with the physical default as the truth, each costs within 5% of the default's plan,
    and the attention weight comes back after calibration."""
    args = _args(
        tmp_path,
        dynamic_batch_cost_attention_weight=None,
        dynamic_batch_cost_token_weight=None,
        **TINY_GPT,
    )
    from megatron_dynbatch.integrations.megatron_lm.arguments import physical_cost_from_args

    default = dynbatch_config_from_args(args)
    physical = physical_cost_from_args(args, default.cost_attention)
    true = (physical.token_seconds, physical.attention_seconds, physical.overhead_seconds)
    calibrator = calib.Calibrator()
    clock = [0.0]
    monkeypatch.setattr(calib.time, "perf_counter", lambda: clock[0])
    layout = parallel_layout_from_args(args)
    worst = 0.0
    for i in range(12):
        args.curr_iteration = i
        calibrator.resume(args)
        rng = random.Random(i)
        # The long/short mix: documents cut at --seq-length beside short ones.
        batch = _Batch([256 if rng.random() < 0.5 else rng.randint(20, 120) for _ in range(32)])
        planned = calibrator.calibrated_config(default)
        plan = plan_schedule(batch.lengths(), config=planned.planner_config(layout))
        calibrator.observe_train_step(args, batch, plan, 0)
        measured = predict_seconds(calibrator.pending, true, STEP_SECONDS)
        reference = plan_schedule(batch.lengths(), config=default.planner_config(layout))
        shapes = calibrator._observation_of(batch, reference, 0, args)
        worst = max(worst, measured / predict_seconds(shapes, true, STEP_SECONDS))
        clock[0] += measured
    assert worst <= 1.05, worst
    assert calibrator.fit is not None and calibrator.applied, calibrator.fit
    assert all(w > 0 for w in calibrator.fit.weights), calibrator.fit
    assert calibrator.calibrated_config(default).max_tokens_per_gpu == 1024


@pytest.mark.parametrize("budget", [256, 512, 768])
def test_a_budget_under_four_seq_lengths_skips_calibration_at_once(
    tmp_path, monkeypatch, capsys, budget
):
    """Issue 29: at --max-tokens-per-gpu 2 x --seq-length the varied shapes collapse onto
    --seq-length and 8 iterations fit "0 us per token"; the run now says why on its first step and
    plans every step with the configured budget and weights, writing nothing."""
    args = _args(tmp_path, max_tokens_per_gpu=budget)
    budgets, _, calibrator = _train(args, monkeypatch, 12)
    assert set(budgets) == {budget}
    assert calibrator.observations == [] and calibrator.fit is None
    assert not (tmp_path / calib.CALIBRATION_JSON).exists()
    assert not (tmp_path / calib.CALIBRATION_YAML).exists()
    out = capsys.readouterr().out
    assert out.count("dynamic-batch calibration skipped") == 1, out
    assert f"--max-tokens-per-gpu {budget} is less than 4 x --seq-length 256" in out
    # No fit and configured weights (no seconds): the line says there is no prediction.
    assert calibrator.log_string() == " step time predicted: none (no fit) |"


def test_a_run_too_short_to_fit_skips_calibration_and_names_a_count_that_fits(
    tmp_path, monkeypatch, capsys
):
    """A probe: a run (or each piece of one resumed every few iterations) shorter than the
    warm-up and the measured steps planned at calibration's varied budgets, fitted nothing and
    said nothing. Now it plans with the configured budget, says why, and the count it names
    calibrates within the run."""
    args = _args(tmp_path, train_iters=9)
    budgets, _, calibrator = _train(args, monkeypatch, 9)
    assert set(budgets) == {1024} and calibrator.observations == [], budgets
    assert calibrator.fit is None and calibrator.overrides == {}, calibrator.overrides
    out = capsys.readouterr().out
    assert out.count("dynamic-batch calibration skipped") == 1, out
    assert "this run has 9 iteration(s) left (from iteration 0, --train-iters 9)" in out, out
    named = re.search(r"--dynamic-batch-calibration-steps (\d+) fits in it", out)
    assert named, out
    args = _args(tmp_path / "fits", train_iters=9)
    args.dynamic_batch_calibration_steps = int(named.group(1))
    _, _, calibrator = _train(args, monkeypatch, 9)
    assert calibrator.fit is not None and calibrator.applied, calibrator.skipped
    assert "calibration skipped" not in capsys.readouterr().out
    # Resumed in pieces of --exit-interval 6: each piece is too short, and says so.
    args = _args(tmp_path / "pieces", exit_interval=6)
    _, _, calibrator = _train(args, monkeypatch, 4, first=12)
    assert calibrator.observations == [] and calibrator.skipped, calibrator.skipped
    assert "6 iteration(s) left (from iteration 12, --exit-interval 6)" in calibrator.skipped
    # Megatron exits at a phase transition too.
    args = _args(tmp_path / "phases", phase_transition_iterations=[5, 40])
    _, _, calibrator = _train(args, monkeypatch, 4)
    assert "5 iteration(s) left (from iteration 0, --phase-transition-iterations 5)" in (
        calibrator.skipped or ""
    ), calibrator.skipped
    # Long enough: calibrates as before.
    args = _args(tmp_path / "long", train_iters=40)
    _, _, calibrator = _train(args, monkeypatch, 14)
    assert calibrator.skipped is None and calibrator.fit is not None


def test_rollouts_per_step_skips_calibration_at_once(tmp_path, monkeypatch, capsys):
    args = _args(tmp_path, rollouts_per_step=32)
    _, _, calibrator = _train(args, monkeypatch, 12)
    assert calibrator.observations == []
    assert "calibration skipped: with --rollouts-per-step" in capsys.readouterr().out


def test_calibration_module_holds_no_run_state():
    """The state lives in Calibrator instances only: no module-level mutable object, no global."""
    mutable = {
        name: type(value).__name__
        for name, value in vars(calib).items()
        if not name.startswith("__")
        and (
            isinstance(value, (list, dict, set, bytearray))
            or (hasattr(value, "__dict__") and type(value).__module__ == calib.__name__)
        )
    }
    assert mutable == {}
    assert "global " not in inspect.getsource(calib)


def _noisy_clock(monkeypatch, seed):
    """Step times 10% off at random (another job on the machine), seeded."""
    from megatron_dynbatch.planning import calibration as planning_calibration

    noise = random.Random(seed)
    exact = planning_calibration.predict_seconds  # not this module's name: it may be patched

    def noisy(shapes, weights, step):
        return exact(shapes, weights, step) * noise.choice((0.9, 1.0, 1.1))

    monkeypatch.setattr(sys.modules[__name__], "predict_seconds", noisy)


def test_a_fit_over_its_error_bound_measures_more_then_is_not_used(tmp_path, monkeypatch, capsys):
    """Issue 37: a noisy fit (30-35% median error) was applied and kept. Over the bound it measures
    as many steps again; still over, the configured model plans on, and the log says so. (Steps
    10% off and a 1% bound: the default bound, 20%, against the 30-35% of the issue, is the same
    comparison.)"""
    # Every fifth iteration validates (not measured): a round's fit is made once, on its last step.
    args = _args(tmp_path, dynamic_batch_calibration_max_error=0.01, eval_interval=5)
    configured = dynbatch_config_from_args(args)
    _noisy_clock(monkeypatch, 5)
    budgets, _, calibrator = _train(args, monkeypatch, 28)
    out = capsys.readouterr().out
    steps = calib.DEFAULT_CALIBRATION_STEPS
    assert out.count("not used yet: its median error") == 1, out
    assert f"measuring {steps} more steps" in out and out.count("; not used: ") == 1, out
    assert calibrator.fit is not None and calibrator.fit.observations > steps
    assert calibrator.fit.relative_error > 0.01 and not calibrator.applied
    assert "not used: its median error" in out and "planning keeps the configured cost model" in out
    assert calibrator.calibrated_config(configured) == configured
    saved = json.loads((tmp_path / calib.CALIBRATION_JSON).read_text())
    assert saved["applied"] is False and not (tmp_path / calib.CALIBRATION_YAML).exists()
    assert set(budgets[-3:]) == {1024}
    # The same steps under the default bound: the fit is used after the first round.
    loose = _args(tmp_path / "loose")
    _noisy_clock(monkeypatch, 5)
    _, _, calibrator = _train(loose, monkeypatch, 14)
    assert calibrator.applied and calibrator.fit.observations == steps
    assert calibrator.calibrated_config(configured) != configured


def test_the_fits_own_time_is_no_measured_steps(tmp_path, monkeypatch, capsys):
    """The H200 run of 2026-11-28: the first round's fit took 1.7 s inside the next step's window,
    so the second round fitted a step 2.5x its neighbours. A fit's time is never a step's."""
    args = _args(tmp_path, dynamic_batch_calibration_max_error=0.01)
    _noisy_clock(monkeypatch, 5)  # the first round's fit is over the bound: a second round
    clock = [0.0]
    fit = calib.fit_cost_model

    def slow_fit(*a, **k):
        clock[0] += 5.0  # a fit that takes 100x a step
        return fit(*a, **k)

    monkeypatch.setattr(calib, "fit_cost_model", slow_fit)
    _, _, calibrator = _train(args, monkeypatch, 24, clock=clock)
    assert "not used yet" in capsys.readouterr().out
    seconds = [o.seconds for o in calibrator.observations]
    assert len(seconds) == 2 * calib.DEFAULT_CALIBRATION_STEPS
    assert max(seconds) < 1.0, seconds


@pytest.mark.parametrize(
    "change, said",
    [
        ({"pipeline_model_parallel_size": 1, "data_parallel_size": 2}, "--pp-size 2 -> 1"),
        ({"max_tokens_per_gpu": 2048}, "--max-tokens-per-gpu 1024 -> 2048"),
        ({"hidden_size": 128}, "--hidden-size None -> 128"),
        ({"dynamic_batch_recalibrate": True}, "--dynamic-batch-recalibrate given"),
    ],
)
def test_a_saved_fit_is_reused_only_for_its_layout_budget_and_model(
    tmp_path, monkeypatch, capsys, change, said
):
    """Issue 37: a fit saved at pp 2 was reused after --load at dp 2, silently. Another layout,
    budget or model (or --dynamic-batch-recalibrate) calibrates again, saying why."""
    _train(_args(tmp_path), monkeypatch, 12)
    assert (
        json.loads((tmp_path / calib.CALIBRATION_JSON).read_text())["measured_on"]["pp_size"] == 2
    )
    capsys.readouterr()
    same = _args(tmp_path / "same", load=str(tmp_path), iteration=12)
    _, _, calibrator = _train(same, monkeypatch, 2, first=12)
    assert "calibration loaded from" in capsys.readouterr().out and calibrator.observations == []
    other = _args(tmp_path / "other", load=str(tmp_path), iteration=12, **change)
    _, _, calibrator = _train(other, monkeypatch, 12, first=12)
    out = capsys.readouterr().out
    assert "not reused" in out and said in out and "calibrating again" in out, out
    assert calibrator.fit is not None and len(calibrator.observations) >= 8
    assert (
        json.loads((tmp_path / "other" / calib.CALIBRATION_JSON).read_text())["measured_on"][
            "pp_size"
        ]
        == other.pipeline_model_parallel_size
    )


def test_calibrate_reads_the_file_a_run_writes(tmp_path, monkeypatch, capsys):
    """Issue 37: `megatron-dynbatch calibrate <save>/dynbatch_calibration.json` refused it."""
    from megatron_dynbatch.tools.cli import main

    _, _, calibrator = _train(_args(tmp_path), monkeypatch, 12)
    capsys.readouterr()
    assert main(["calibrate", str(tmp_path / calib.CALIBRATION_JSON), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)["calibration"]
    assert again["token_weight"] == pytest.approx(calibrator.fit.token_weight, rel=1e-6)


def test_the_arguments_are_parsed_once_per_run(tmp_path, monkeypatch):
    """Issue 38: the config was resolved five times a run (the YAML re-read each time); now once,
    by the argument check, and the hooks and their calibration use that config."""
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()
    from megatron_dynbatch.integrations.megatron_lm import arguments
    from megatron_dynbatch.integrations.megatron_lm import hooks as training_hooks

    calls = []
    parse = arguments.dynbatch_config_from_args

    def counted(args):
        calls.append(args)
        return parse(args)

    monkeypatch.setattr(arguments, "dynbatch_config_from_args", counted)
    _train(_args(tmp_path), monkeypatch, 12)  # writes a fit for the resumed run below
    for extra in ({}, {"load": str(tmp_path), "iteration": 12}, {"transformer_impl": "local"}):
        calls.clear()
        args = _args(tmp_path / "run", calculate_per_token_loss=True, global_batch_size=32, **extra)
        try:
            run = training_hooks.configure(args)
            first = int(extra.get("iteration", 0))
            _train(args, monkeypatch, 12, first=first, calibrator=run.calibration)
            assert run.calibration.config is run.config
            assert training_hooks.hooks_for(args) is run
        finally:
            training_hooks.reset_dynamic_batch_state()
        assert len(calls) == 1, (extra, len(calls))


def test_the_fit_gives_tensorboard_the_iteration_lines_figures(tmp_path, monkeypatch):
    """Issue 37: predicted and measured step time and the fit's error as TensorBoard scalars, the
    same figures the iteration line prints."""
    calibrator = calib.Calibrator()
    assert calibrator.scalars() == {} and calibrator.log_string() == ""
    _, _, calibrator = _train(_args(tmp_path), monkeypatch, 14, calibrator=calibrator)
    scalars = calibrator.scalars()
    assert scalars["dynbatch/calibration error"] == calibrator.fit.relative_error
    line = calibrator.log_string()
    shown = f"{scalars['dynbatch/step time predicted (ms)']:.1f}/"
    shown += f"{scalars['dynbatch/step time measured (ms)']:.1f}"
    assert f"predicted/measured (ms): {shown} (fit) |" in line, (line, scalars)


def test_what_a_fit_was_measured_on_reads_megatrons_later_writes_the_same(tmp_path):
    """Megatron's memory report sets num_query_groups to the head count after the first iteration
    (without GQA): a resumed run of the same model, read before that, must match the saved fit."""
    config = dynbatch_config_from_args(_args(tmp_path))
    before = _args(tmp_path, num_attention_heads=4, num_query_groups=1)
    after = _args(tmp_path, num_attention_heads=4, num_query_groups=4)
    assert calib.measured_on(before, config) == calib.measured_on(after, config)
    grouped = _args(tmp_path, num_attention_heads=4, num_query_groups=2, group_query_attention=True)
    assert calib.measured_on(grouped, config)["num_query_groups"] == 2


def _memory_limit(mib):
    """A memory budget of the tiny GPT of launch/train_gpt_dynbatch.sh (4 layers of 64, pp 2,
    local attention): at 36 MiB its longest one-row micro-batch is 628 tokens and it holds four
    rows of 256, so a token budget of 4096 never binds."""
    dims = ModelDims(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=257,
        parallel=ParallelLayout(pp_size=2),
    )
    return MemoryLimit(model=MemoryModel(dims=dims, attention="dense"), budget_bytes=mib * MIB)


@pytest.mark.parametrize(
    ("token_budget", "true"),
    [
        (4096, (2e-7, 1e-8, 2e-3)),
        # Only --max-memory-gib: the token budget is unbounded.
        (None, (2e-7, 1e-8, 2e-3)),
        # Attention-bound, as on CPU: no token work the fit could tell from the step constant.
        (4096, (0.0, 1e-8, 2e-3)),
    ],
)
def test_under_a_memory_budget_calibration_plans_within_it_and_fits_no_zero_weight(
    tmp_path, monkeypatch, token_budget, true
):
    """Under --max-memory-gib every calibration step is planned within the memory budget (the
    earlier shapes ran one long row a micro-batch at up to twice the step time), and the fit is
    of scales of the model: every weight above 0, even where the truth has no token work (issue
    42: "0 us per token ... could not separate token_weight, attention_weight")."""
    args = _args(
        tmp_path,
        transformer_impl="local",
        max_tokens_per_gpu=token_budget,
        max_memory_gib=36 / 1024,
        dynamic_batch_cost_attention_weight=None,
        dynamic_batch_cost_token_weight=None,
        **{k: v for k, v in TINY_GPT.items() if k != "transformer_impl"},
    )
    limit = _memory_limit(36)
    layout = parallel_layout_from_args(args)
    calibrator = calib.Calibrator()
    clock = [0.0]
    monkeypatch.setattr(calib.time, "perf_counter", lambda: clock[0])
    shapes = []
    for i in range(14):
        args.curr_iteration = i
        calibrator.resume(args)
        rng = random.Random(i)
        batch = _Batch([256 if rng.random() < 0.5 else rng.randint(20, 120) for _ in range(32)])
        config = calibrator.calibrated_config(dynbatch_config_from_args(args))
        plan = plan_schedule(batch.lengths(), config=config.planner_config(layout, memory=limit))
        step = plan.steps[0]
        shapes.append((step.num_microbatches, step.micro_batch_size, step.seq_length))
        calibrator.observe_train_step(args, batch, plan, 0)
        clock[0] += predict_seconds(calibrator.pending, true, STEP_SECONDS)
    # Every step within the memory budget: no row longer than its rows of that count allow.
    assert all(s <= limit.row_cap(b) for _, b, s in shapes), shapes
    assert len(set(shapes[2:10])) >= 2, shapes  # the overhead's factors varied the plans
    fit = calibrator.fit
    assert fit is not None and calibrator.applied, fit
    assert all(w > 0 for w in fit.weights), fit
    # Where the truth has token work its split is the model's, scaled: the steps tell the rest.
    assert fit.relative_error < (0.01 if true[0] else 0.05), fit


def test_a_fit_without_a_term_the_model_has_is_refused(tmp_path):
    """An accepted fit has no weight of 0 for a term the model has (issue 42): without token work
    (least squares put it into the per-step constant on the tiny GPT on CPU), without the
    per-micro-batch overhead, or without attention where the model prices it, it is refused, on
    every attention kind."""
    fit = Calibration(
        token_weight=2e-7,
        attention_weight=1e-8,
        microbatch_overhead=2e-3,
        step_seconds=0.0,
        observations=8,
        relative_error=0.05,
        form="scales",
    )
    model = dict(**TINY_GPT, dynamic_batch_cost_attention_weight=None)
    for impl in ("local", "transformer_engine"):
        args = _args(tmp_path, **{**model, "transformer_impl": impl})
        assert calib.Calibrator()._usable(fit, args) == (True, "")
        for name in ("token_weight", "attention_weight", "microbatch_overhead"):
            usable, why = calib.Calibrator()._usable(dataclasses.replace(fit, **{name: 0.0}), args)
            assert not usable and "it has no" in why, (impl, name, why)
    # A model without attention (the weight configured 0) needs none.
    no_attention = _args(tmp_path, transformer_impl="local")
    assert calib.Calibrator()._usable(dataclasses.replace(fit, attention_weight=0.0), no_attention)[
        0
    ]


def test_a_fit_whose_constant_took_the_step_is_refused(tmp_path):
    """On a busy machine a fit put 15 s of a 3 s step into the per-step constant and almost
    nothing into the work: every weight above 0, yet the scale is noise. It is refused."""
    fit = Calibration(
        token_weight=3e-10,
        attention_weight=9e-13,
        microbatch_overhead=3e-8,
        step_seconds=15.0,
        observations=8,
        relative_error=0.1,
        form="physical",
    )
    calibrator = calib.Calibrator()
    args = _args(tmp_path, transformer_impl="local")
    calibrator.observations = [
        calib.Observation(seconds=3.0, seq_length=256, ranks=[[[256]]]) for _ in range(8)
    ]
    usable, why = calibrator._usable(fit, args)
    assert not usable and "per-step constant" in why
    assert calibrator._usable(dataclasses.replace(fit, step_seconds=0.5), args)[0]


def test_a_fit_no_better_than_the_default_model_is_not_applied(tmp_path):
    """Issue 42: under noise a fit must never replace the default with something worse. On steps
    the default explains at its best scale (plus a per-step constant), a fit that predicts them
    exactly is applied; one whose overhead is 10x off is refused, naming both errors."""
    args = _args(
        tmp_path,
        dynamic_batch_cost_attention_weight=None,
        dynamic_batch_cost_token_weight=None,
        **TINY_GPT,
    )
    calibrator = calib.Calibrator()
    default = calibrator._model_seconds(args)
    assert default is not None
    counts = (4, 6, 8, 11, 16, 5, 7, 9)
    calibrator.observations = [
        calib.Observation(
            seconds=1.5 * predict_seconds(shape, default) + STEP_SECONDS,
            seq_length=256,
            micro_batch_size=max(1, 32 // m),
            layout="padded",
            attention="dense",
            pp_size=2,
            ranks=shape.ranks,
        )
        for m in counts
        for shape in [
            calib.Observation(
                seconds=1.0,
                seq_length=256,
                micro_batch_size=max(1, 32 // m),
                layout="padded",
                attention="dense",
                pp_size=2,
                ranks=[[[256] * max(1, 32 // m)] * m],
            )
        ]
    ]
    exact = Calibration(
        token_weight=1.5 * default[0],
        attention_weight=1.5 * default[1],
        microbatch_overhead=1.5 * default[2],
        step_seconds=STEP_SECONDS,
        observations=len(counts),
        relative_error=0.0,
        form="scales",
    )
    assert calibrator._usable(exact, args) == (True, "")
    off = dataclasses.replace(exact, microbatch_overhead=15 * default[2], relative_error=0.01)
    usable, why = calibrator._usable(off, args)
    assert not usable and "no better than the default model" in why, why


def test_the_iteration_line_names_where_the_prediction_comes_from(tmp_path, monkeypatch):
    """Issue 42: the iteration line says whether the step time predicted comes from an applied
    fit, the configured model (the default, in its assumed seconds) or nothing (configured relative
    weights give no seconds), with calibration off, applied and refused alike."""
    default = dict(
        dynamic_batch_cost_attention_weight=None, dynamic_batch_cost_token_weight=None, **TINY_GPT
    )
    line = {}
    for name, extra in (("weights", {}), ("default", default)):
        for steps in (0, calib.DEFAULT_CALIBRATION_STEPS):
            args = _args(
                tmp_path / f"{name}{steps}", dynamic_batch_calibration_steps=steps, **extra
            )
            _, _, calibrator = _train(args, monkeypatch, 16 if steps else 3)
            line[name, steps] = calibrator.log_string()
            if steps:
                assert calibrator.fit is not None
                if calibrator.applied:
                    assert line[name, steps].endswith(" (fit) |"), line
                calibrator.applied, calibrator._timing = False, None  # as if refused
                line[name, "refused"] = calibrator.log_string()
    assert line["weights", 0] == " step time predicted: none (no fit) |"
    assert line["weights", "refused"] == " step time predicted: none (fit refused) |"
    assert line["default", 0].endswith(" (model) |") and "predicted/measured" in line["default", 0]
    assert line["default", "refused"].endswith(" (model) |")
    assert line["weights", calib.DEFAULT_CALIBRATION_STEPS].endswith(" (fit) |")


def test_only_a_measured_overhead_lifts_the_gain_threshold(tmp_path):
    """A fit that scales the whole model ("physical": its overhead in the default's proportion)
    keeps the default's gain threshold: its overhead is still the estimate. A fit that measured
    the overhead ("scales") plans without one, unless one was given."""
    args = _args(
        tmp_path,
        dynamic_batch_cost_attention_weight=None,
        dynamic_batch_cost_token_weight=None,
        **TINY_GPT,
    )
    fit = Calibration(
        token_weight=2e-5,
        attention_weight=6e-8,
        microbatch_overhead=2e-3,
        step_seconds=0.0,
        observations=8,
        relative_error=0.1,
        form="scales",
    )
    for form, lifted in (("scales", True), ("physical", False)):
        calibrator = calib.Calibrator()
        calibrator._apply(dataclasses.replace(fit, form=form), args)
        planned = calibrator.calibrated_config(dynbatch_config_from_args(args))
        assert (planned.min_gain == 0.0) == lifted, (form, planned.min_gain)


def test_moe_loss_logs_divide_by_the_real_microbatches_a_rank_ran():
    # A probe: one placeholder in two micro-batches logged every MoE loss at about half (the
    # patched training_log divided the per-micro-batch sums by every micro-batch, placeholders
    # included, which record no loss).
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()  # the hooks import megatron.core, which needs the triton stand-in here
    from megatron_dynbatch.integrations.megatron_lm.hooks import (
        DynamicStep,
        loss_logging_microbatches,
    )

    def step(num_microbatches, num_placeholders, dp_size):
        return DynamicStep(
            num_microbatches=num_microbatches,
            seq_length=8,
            micro_batch_size=1,
            data_iterator=None,
            microbatches=(),
            sample_indices=(),
            num_samples=1,
            num_rollouts=1,
            real_tokens=8,
            computed_tokens=8,
            step_index=0,
            plan_fingerprint="",
            loaded_samples=0,
            num_placeholders=num_placeholders,
            dp_size=dp_size,
        )

    assert loss_logging_microbatches(step(2, 1, 1)) == 1
    assert loss_logging_microbatches(step(4, 2, 2)) == 3  # ranks ran 4 and 2 real: 3 on average
    assert loss_logging_microbatches(step(3, 0, 4)) == 3
