"""The Megatron-LM calibration driver in one process, on a simulated clock: it varies the budget
while calibrating, fits the weights behind the measured times, plans the next batches with them
under the configured budget, writes the sidecar files, and a resumed run reuses the fit."""

import argparse
import json
import random

import pytest

from megatron_dynbatch.config import load_yaml_config
from megatron_dynbatch.integrations.megatron_lm import calibration as calib
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    add_dynamic_batch_args,
    dynbatch_config_from_args,
    parallel_layout_from_args,
)
from megatron_dynbatch.planning import plan_schedule
from megatron_dynbatch.planning.calibration import predict_seconds

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


def _train(args, monkeypatch, iterations, first=0):
    """Drive observe_train_step as prepare_train_step does; the clock advances by the true time.

    Batch ``i``'s lengths depend on ``i`` alone, so a resumed run sees the straight run's batches.
    """
    clock = [0.0]
    monkeypatch.setattr(calib.time, "perf_counter", lambda: clock[0])
    budgets, plans = [], []
    for i in range(first, first + iterations):
        args.curr_iteration = i
        calib.resume_calibration(args)
        layout = parallel_layout_from_args(args)
        rng = random.Random(i)
        batch = _Batch([rng.randint(20, 256) for _ in range(32)])
        # What the hooks plan with: the run's config with calibration's changes (never in args).
        config = calib.calibrated_config(dynbatch_config_from_args(args))
        plan = plan_schedule(batch.lengths(), config=config.planner_config(layout))
        budgets.append(config.max_tokens_per_gpu)
        plans.append(plan.fingerprint())
        calib.observe_train_step(args, batch, plan, 0)
        shapes = calib.calibration_state().pending
        clock[0] += 1.0 if shapes is None else predict_seconds(shapes, TRUE, STEP_SECONDS)
    return budgets, plans


def test_calibrates_applies_and_writes(tmp_path, monkeypatch):
    calib.reset_calibration_state()
    args = _args(tmp_path)
    budgets, _ = _train(args, monkeypatch, 16)
    fit = calib.calibration_state().fit
    assert fit is not None and fit.observations == calib.DEFAULT_CALIBRATION_STEPS
    assert fit.weights == pytest.approx(TRUE, rel=1e-3)
    assert fit.step_seconds == pytest.approx(STEP_SECONDS, rel=1e-3)
    # Budgets varied while calibrating (never below --seq-length), then the configured one again.
    assert set(budgets[:10]) == {1024, 512, 256}
    assert budgets[:4] == [1024, 512, 256, 1024]  # iteration n (1-based): shape n % 4
    assert set(budgets[-4:]) == {1024}
    assert fit.unidentified == ()
    planned = calib.calibrated_config(dynbatch_config_from_args(args))
    assert planned.max_tokens_per_gpu == 1024 and planned.cost_token_weight == 1.0
    assert planned.cost_microbatch_overhead == pytest.approx(TRUE[2] / TRUE[0], rel=1e-3)
    # Nothing was written into Megatron's arguments.
    assert args.max_tokens_per_gpu == 1024
    assert args.dynamic_batch_cost_microbatch_overhead is None
    values = load_yaml_config(tmp_path / calib.CALIBRATION_YAML)
    assert values["cost_attention_weight"] == pytest.approx(TRUE[1] / TRUE[0], rel=1e-3)
    saved = json.loads((tmp_path / calib.CALIBRATION_JSON).read_text())
    assert len(saved["steps"]) == calib.DEFAULT_CALIBRATION_STEPS
    assert "predicted/measured" in calib.calibration_log_string()


def test_a_resumed_run_plans_like_the_straight_run(tmp_path, monkeypatch):
    calib.reset_calibration_state()
    straight = _args(tmp_path)
    _, straight_plans = _train(straight, monkeypatch, 16)
    straight_overhead = calib.calibrated_config(
        dynbatch_config_from_args(straight)
    ).cost_microbatch_overhead
    calib.reset_calibration_state()
    resumed = _args(tmp_path / "resumed", load=str(tmp_path), iteration=12)
    _, resumed_plans = _train(resumed, monkeypatch, 4, first=12)
    # The saved fit from its first step, no second calibration, and the straight run's plans.
    resumed_overhead = calib.calibrated_config(
        dynbatch_config_from_args(resumed)
    ).cost_microbatch_overhead
    assert resumed_overhead == straight_overhead is not None
    assert calib.calibration_state().observations == []
    assert resumed_plans == straight_plans[12:]
    # Resumed before calibration ended (no sidecar yet): the budget follows the iteration number,
    # so the resumed run still plans as the straight run did.
    calib.reset_calibration_state()
    for first in (4, 5, 6):
        calib.reset_calibration_state()
        early = _args(tmp_path / "early", load=str(tmp_path / "nothing"), iteration=first)
        _, early_plans = _train(early, monkeypatch, 3, first=first)
        assert early_plans == straight_plans[first : first + 3], first


def test_off_with_zero_steps(tmp_path, monkeypatch):
    calib.reset_calibration_state()
    args = _args(tmp_path, dynamic_batch_calibration_steps=0)
    budgets, _ = _train(args, monkeypatch, 12)
    assert set(budgets) == {1024} and calib.calibration_state().fit is None
    assert not (tmp_path / calib.CALIBRATION_JSON).exists()


def test_observations_price_the_attention_the_planner_prices(tmp_path, monkeypatch):
    """Megatron's local implementation (the CPU path) runs a dense mask: the fit must price rows
    the same way the planner does, not as THD segments (the flag itself is unset)."""
    calib.reset_calibration_state()
    args = _args(tmp_path, transformer_impl="local")
    assert args.dynamic_batch_cost_attention is None
    _train(args, monkeypatch, 4)
    assert calib.calibration_state().pending.attention == "dense"
    assert dynbatch_config_from_args(args).cost_attention == "dense"
    calib.reset_calibration_state()
    _train(_args(tmp_path), monkeypatch, 4)  # transformer-engine by default: THD segments
    assert calib.calibration_state().pending.attention == "segment"


def test_under_a_dense_mask_the_few_full_micro_batches_shape_has_short_rows(tmp_path, monkeypatch):
    """The calibration shape of few full micro-batches packs several short rows where a row pays
    S^2 whatever it holds (one row of the whole budget costs the dense mask 3-4x a step), while
    half the budget still runs one long row, so two row lengths are measured; the configured
    attention weight comes back after calibration unless the fit replaces it."""
    calib.reset_calibration_state()
    args = _args(tmp_path, transformer_impl="local")
    clock = [0.0]
    monkeypatch.setattr(calib.time, "perf_counter", lambda: clock[0])
    shapes = []
    for i in range(6):
        args.curr_iteration = i
        calib.resume_calibration(args)
        batch = _Batch([256] * 32)  # documents cut at --seq-length, as on the long-document mix
        planned = calib.calibrated_config(dynbatch_config_from_args(args))
        config = planned.planner_config(parallel_layout_from_args(args))
        step = plan_schedule(batch.lengths(), config=config).steps[0]
        shapes.append((planned.max_tokens_per_gpu, step.micro_batch_size, step.seq_length))
        calib.observe_train_step(args, batch, plan_schedule(batch.lengths(), config=config), 0)
        clock[0] += 1.0
    # Iteration n (1-based) plans shape n % 4: 1 few full micro-batches, 2 half the budget.
    assert shapes[0] == (1024, 4, 256) and shapes[4] == (1024, 4, 256)
    assert shapes[1] == (512, 1, 512)
    calib._restore(args)
    assert calib.calibrated_config(dynbatch_config_from_args(args)).cost_attention_weight == 0.0


@pytest.mark.parametrize("budget", [256, 512, 768])
def test_a_budget_under_four_seq_lengths_skips_calibration_at_once(
    tmp_path, monkeypatch, capsys, budget
):
    """Issue 29: at --max-tokens-per-gpu 2 x --seq-length the varied shapes collapse onto
    --seq-length and 8 iterations fit "0 us per token"; the run now says why on its first step and
    plans every step with the configured budget and weights, writing nothing."""
    calib.reset_calibration_state()
    args = _args(tmp_path, max_tokens_per_gpu=budget)
    budgets, _ = _train(args, monkeypatch, 12)
    assert set(budgets) == {budget}
    assert calib.calibration_state().observations == [] and calib.calibration_state().fit is None
    assert not (tmp_path / calib.CALIBRATION_JSON).exists()
    assert not (tmp_path / calib.CALIBRATION_YAML).exists()
    out = capsys.readouterr().out
    assert out.count("dynamic-batch calibration skipped") == 1, out
    assert f"--max-tokens-per-gpu {budget} is less than 4 x --seq-length 256" in out
    assert calib.calibration_log_string() == ""


def test_rollouts_per_step_skips_calibration_at_once(tmp_path, monkeypatch, capsys):
    calib.reset_calibration_state()
    args = _args(tmp_path, rollouts_per_step=32)
    _train(args, monkeypatch, 12)
    assert calib.calibration_state().observations == []
    assert "calibration skipped: with --rollouts-per-step" in capsys.readouterr().out
