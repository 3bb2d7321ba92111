"""The next batch's plan made in a background thread (``--dynamic-batch-plan-ahead``): kept only
under the config the step plans with, the same plan as planning then, errors raised where the
step that needs the batch runs."""

import dataclasses
import threading

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.plan_ahead import PlanAhead
from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, SampleSet
from megatron_dynbatch.planning.registry import run_planner

pytestmark = pytest.mark.unit


@dataclasses.dataclass
class _Batch:
    sample_lengths: list
    rollout_ids: object = None

    def lengths(self):
        return self.sample_lengths

    def prompt_lengths(self):
        return None


def _config(cap=64, dp=2, pp=2):
    return PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=ParallelLayout(dp_size=dp, pp_size=pp),
        oversize_samples="error",
    )


def _now(calls):
    def plan_now(batch):
        calls.append(batch)
        return run_planner(SampleSet.build(batch.lengths(), None, None), planning), 0.0

    planning = None

    def bind(config):
        nonlocal planning
        planning = config
        return plan_now

    return bind


LENGTHS = [30, 7, 51, 12, 19, 44, 3, 26, 9, 60, 15, 33]


def test_the_plan_made_ahead_is_the_plan_made_then_and_is_kept_under_the_same_config():
    batch, config = _Batch(LENGTHS), _config()
    ahead = PlanAhead(batch, config)
    calls = []
    taken, plan, seconds, kept = ahead.take(_config(), _now(calls)(config))
    assert taken is batch and kept and not calls and seconds >= 0
    assert plan == run_planner(SampleSet.build(LENGTHS, None, None), config)


def test_another_config_plans_again_with_it():
    batch = _Batch(LENGTHS)
    ahead = PlanAhead(batch, _config(cap=64))
    calls = []
    other = _config(cap=128)
    taken, plan, _, kept = ahead.take(other, _now(calls)(other))
    assert taken is batch and not kept and calls == [batch]
    assert plan == run_planner(SampleSet.build(LENGTHS, None, None), other)


def test_a_planning_error_is_raised_by_the_step_that_takes_the_plan():
    # 200 tokens under a cap of 64 (oversize policy error): refused, on the taking thread.
    batch = _Batch([200, 10])
    ahead = PlanAhead(batch, _config())
    ahead.wait()
    with pytest.raises(DynBatchValueError, match="200"):
        ahead.take(_config(), _now([])(_config()))


def test_a_failed_read_is_raised_by_the_step_that_needs_the_batch():
    error = DynBatchValueError("the training data iterator is exhausted")
    ahead = PlanAhead.failed(error)
    ahead.wait()  # nothing to wait for
    with pytest.raises(DynBatchValueError, match="exhausted"):
        ahead.take(_config(), _now([])(_config()))


def test_the_plan_is_made_on_another_thread_and_taking_waits_for_it():
    started, release = threading.Event(), threading.Event()
    seen = []

    class _Slow(_Batch):
        def lengths(self):
            seen.append(threading.current_thread().name)
            started.set()
            release.wait(10)
            return self.sample_lengths

    ahead = PlanAhead(_Slow(LENGTHS), _config())
    assert started.wait(10)  # planning began without the caller
    assert seen == ["dynbatch-plan-ahead"]
    threading.Timer(0.2, release.set).start()
    _, plan, seconds, kept = ahead.take(_config(), _now([])(_config()))
    assert kept and seconds >= 0.1 and plan.steps
