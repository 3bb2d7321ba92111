"""The public helpers ``round_up`` and ``sample_multiple`` refuse what they cannot compute, by name
(a probe of the Python API: ``round_up(5, 0)`` was a ZeroDivisionError, ``round_up(5, -2)`` gave
4, ``sample_multiple(0, 1)`` gave 0 and ``sample_multiple("2", 1)`` gave ``"2"``)."""

import numpy
import pytest

from megatron_dynbatch import DynBatchValueError, round_up, sample_multiple

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("multiple", [0, -2, "2", 1.5, True, None])
def test_round_up_refuses_a_multiple_below_one_or_not_whole(multiple):
    with pytest.raises(DynBatchValueError, match=f"multiple={multiple!r} must be a whole number"):
        round_up(5, multiple)


def test_round_up_rounds():
    assert [round_up(v, 4) for v in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert round_up(5, numpy.int64(4)) == 8


@pytest.mark.parametrize("tp, cp", [(0, 1), (-1, 1), ("2", 1), (1, 0), (1, 2.0)])
def test_sample_multiple_refuses_sizes_below_one_or_not_whole(tp, cp):
    with pytest.raises(DynBatchValueError, match="must be a whole number >= 1"):
        sample_multiple(tp, cp)


def test_sample_multiple():
    assert (sample_multiple(2, 4), sample_multiple(4, 1), sample_multiple(1, 1)) == (16, 4, 1)


def test_a_missing_or_wrong_config_or_sample_set_is_refused_by_name():
    """The same probe: each of these was an AttributeError far inside."""
    from megatron_dynbatch import PlannerConfig, SampleSet, check_plan, plan_samples, plan_schedule
    from megatron_dynbatch.integrations.hosts import VERL, plan_host_step

    config = PlannerConfig(max_tokens_per_gpu=64)
    samples = SampleSet.build([5, 3])
    plan = plan_schedule([5, 3], config=config)
    for call, where in (
        (lambda: check_plan(plan, samples, None), "check_plan"),
        (lambda: plan_samples(samples, None), "plan_samples"),
        (lambda: plan_host_step(VERL, [[5], [3]], None), "plan_host_step"),
    ):
        with pytest.raises(DynBatchValueError, match=f"{where}: config must be a PlannerConfig"):
            call()
    with pytest.raises(DynBatchValueError, match="samples must be the SampleSet the Plan"):
        check_plan(plan, [5, 3], config)
    check_plan(plan, samples, config)  # the fix named
    with pytest.raises(DynBatchValueError, match="memory=5 must be a MemoryLimit"):
        PlannerConfig(max_tokens_per_gpu=64, memory=5)


def test_materialize_names_the_fix_that_works_for_keys_it_cannot_use():
    """A probe: "input_ids" without "tokens" was told to declare a FieldSpec (then refused for
    the missing "tokens"); string keys were "not given"; metadata was told to get a FieldSpec,
    which holds tensors only."""
    import torch

    from megatron_dynbatch import BatchSchema, PlannerConfig, materialize_microbatches
    from megatron_dynbatch import plan_schedule as plan_lengths

    step = plan_lengths([5, 3], config=PlannerConfig(max_tokens_per_gpu=16)).steps[0]

    def materialize(samples):
        return materialize_microbatches(
            step, 0, samples, BatchSchema(), layout="packed", sample_multiple=1
        )

    with pytest.raises(DynBatchValueError, match=r"no 'tokens' key .*rename input_ids to tokens"):
        materialize({0: {"input_ids": torch.arange(5)}, 1: {"input_ids": torch.arange(3)}})
    with pytest.raises(DynBatchValueError, match="keyed by str .*by the plan's int sample index"):
        materialize({"0": {"tokens": torch.arange(5)}, "1": {"tokens": torch.arange(3)}})
    sample = {"tokens": torch.arange(5), "meta": "x", "w": torch.ones(5)}
    with pytest.raises(
        DynBatchValueError, match=r"add a FieldSpec for \['w'\] or drop them; drop \['meta'\]"
    ):
        materialize({0: sample, 1: {"tokens": torch.arange(3)}})
    materialize({0: {"tokens": torch.arange(5)}, 1: {"tokens": torch.arange(3)}})  # the fixes


def test_ranks_planner_refuses_a_scheduler_it_cannot_call():
    """A probe: a two-argument scheduler was a bare TypeError at the first plan."""
    from megatron_dynbatch.planning.registry import ranks_planner

    with pytest.raises(
        DynBatchValueError, match=r"cannot be called as scheduler\(lengths, rollout"
    ):
        ranks_planner(lambda lengths, config: [[list(range(len(lengths)))]])
    with pytest.raises(DynBatchValueError, match="must be callable"):
        ranks_planner(3)
    ranks_planner(lambda lengths, keys, config: [[list(range(len(lengths)))]])
