"""A trainer calling the sharded planner directly (the public way in, docs/integrating.md): what
it cannot take is refused by name, errors name the DP rank, and padded rows keep the cap."""

import pytest
import torch

from megatron_dynbatch import BatchSchema, PlannerConfig, materialize_microbatches
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import ParallelLayout
from megatron_dynbatch.planning.sharded import plan_sharded_step

pytestmark = pytest.mark.unit


def test_truncate_is_refused_not_ignored():
    # The sample of 100 tokens was neither cut nor reported: all 100 trained over a cap of 64.
    with pytest.raises(DynBatchValueError, match="sharded plan trains each rank's samples whole"):
        plan_sharded_step(
            [[100, 5]], PlannerConfig(max_tokens_per_gpu=64, oversize_samples="truncate")
        )
    allowed = plan_sharded_step(
        [[100, 5]], PlannerConfig(max_tokens_per_gpu=64, oversize_samples="allow")
    )
    assert allowed.oversize == ((0, 0),)


def test_errors_name_the_dp_rank_of_the_sample():
    config = PlannerConfig(max_tokens_per_gpu=64, oversize_samples="error")
    with pytest.raises(DynBatchValueError, match=r"^DP rank 1: .*sample 0: -6"):
        plan_sharded_step([[5], [-6]], config)
    with pytest.raises(DynBatchValueError, match=r"^DP rank 0: .*sample 1: 100 tokens"):
        plan_sharded_step([[5, 100], [6]], config)


@pytest.mark.parametrize("lengths", [[5, 6], [], "56", {0: [5]}])
def test_lengths_that_are_not_one_list_per_rank_are_refused(lengths):
    with pytest.raises(DynBatchValueError, match="one list of sample lengths per DP rank"):
        plan_sharded_step(lengths, PlannerConfig(max_tokens_per_gpu=64))


def test_a_config_of_several_ranks_is_refused_by_name():
    config = PlannerConfig(max_tokens_per_gpu=64, parallel=ParallelLayout(dp_size=2))
    with pytest.raises(DynBatchValueError, match="dp_size=1"):
        plan_sharded_step([[5], [6]], config)


def test_padded_rows_of_a_rank_are_its_own_not_the_fullest_ranks():
    # Rank 0 packs two samples of 30 a micro-batch (rows 2); rank 1 one of 60. Rank 1 ran
    # [2 x 60] = 120 tokens against a cap of 64, for one sample.
    lengths = [[30, 30], [60]]
    plan = plan_sharded_step(lengths, PlannerConfig(max_tokens_per_gpu=64, layout="padded"))
    [step] = plan.scheduled_steps()
    for rank, own in enumerate(lengths):
        samples = {i: {"tokens": torch.arange(n) % 7} for i, n in enumerate(own)}
        batches = materialize_microbatches(
            step, rank, samples, BatchSchema(), layout="padded", sample_multiple=1
        )
        for batch in batches:
            rows, length = batch["tokens"].shape
            assert rows * length <= 64, (rank, rows, length)


def test_a_sample_longer_than_planned_is_refused_not_widened_past_the_cap():
    # Planned as two samples of 5 tokens, given two of 60: one packed row of 120 under a cap of
    # 64, silently (the global path refuses the same mismatch).
    plan = plan_sharded_step([[5, 5]], PlannerConfig(max_tokens_per_gpu=64))
    [step] = plan.scheduled_steps()
    given = {i: {"tokens": torch.zeros(60, dtype=torch.long)} for i in range(2)}
    with pytest.raises(DynBatchValueError, match="sample 0 has 60 tokens but was planned with 5"):
        materialize_microbatches(step, 0, given, BatchSchema(), layout="packed", sample_multiple=1)
    right = {i: {"tokens": torch.zeros(5, dtype=torch.long)} for i in range(2)}
    [batch] = materialize_microbatches(
        step, 0, right, BatchSchema(), layout="packed", sample_multiple=1
    )
    assert batch["tokens"].shape == (1, 10)


def test_ranks_given_as_arrays_or_tensors_plan_as_lists():
    # A probe: per-rank numpy arrays and torch tensors (attention_mask.sum(-1)) were a bare
    # "truth value of an array is ambiguous" (a RuntimeError for torch), a 2-D tensor too.
    import numpy as np

    from megatron_dynbatch.integrations.hosts import VERL, host_config, plan_host_step
    from megatron_dynbatch.integrations.verl.engine import plan_verl_batch

    config = PlannerConfig(max_tokens_per_gpu=64)
    expected = plan_sharded_step([[10, 20], [5]], config)
    for ranks in (
        [np.array([10, 20]), np.array([5])],
        [torch.tensor([10, 20]), torch.tensor([5])],
    ):
        assert plan_sharded_step(ranks, config) == expected
    empty = plan_sharded_step([np.array([10, 20]), np.array([], dtype=np.int64)], config)
    assert empty == plan_sharded_step([[10, 20], []], config)
    square = plan_sharded_step(torch.tensor([[10, 20], [5, 6]]), config)
    assert square == plan_sharded_step([[10, 20], [5, 6]], config)
    verl = host_config(VERL, {"max_token_len_per_gpu": 64}, ParallelLayout())
    tensors = [torch.tensor([10, 20]), torch.tensor([5])]
    assert plan_verl_batch(tensors, verl).ranks == plan_verl_batch([[10, 20], [5]], verl).ranks
    assert plan_host_step(VERL, np.array([[10, 20], [5, 6]]), verl).ranks == square.ranks
    with pytest.raises(DynBatchValueError, match="config must be a PlannerConfig"):
        plan_sharded_step([[10]], None)


def test_samples_given_as_a_list_are_refused_with_the_fix_that_works():
    # A probe: a list "held" no sample index, and the refusal told a caller who passed every
    # sample to pass every sample.
    from megatron_dynbatch.planning import plan_schedule

    plan = plan_schedule([3, 4, 1], config=PlannerConfig(max_tokens_per_gpu=8))
    samples = [{"tokens": torch.arange(1, n + 1)} for n in (3, 4, 1)]
    kwargs = dict(layout=plan.layout, sample_multiple=plan.sample_multiple)
    with pytest.raises(DynBatchValueError, match=r"dict\(enumerate\(samples\)\)"):
        materialize_microbatches(plan.steps[0], 0, samples, BatchSchema(), **kwargs)
    built = materialize_microbatches(
        plan.steps[0], 0, dict(enumerate(samples)), BatchSchema(), **kwargs
    )
    assert len(built) == plan.steps[0].num_microbatches


def test_plan_samples_given_plain_lengths_names_the_way_in():
    from megatron_dynbatch.planning import SampleSet, plan_samples

    config = PlannerConfig(max_tokens_per_gpu=64)
    with pytest.raises(DynBatchValueError, match=r"SampleSet\.build\(lengths\)"):
        plan_samples([3, 4], config)
    assert plan_samples(SampleSet.build([3, 4]), config).steps
