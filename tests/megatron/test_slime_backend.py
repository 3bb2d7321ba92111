"""slime's patched Megatron backend pieces that run without a slime checkout (one gloo process).

The whole patched slime runs in test_slime_patched.py (given SLIME_DIR); this covers the log-prob
pass in CI, from the schedule the rollout side ships: its packed rows stay within
--log-probs-max-tokens-per-gpu, a rank without samples runs as many micro-batches as its peers
(with one phantom sample), routing replay runs the training micro-batches; and a training step
refuses interleaving at pp 2 without overlapped p2p (it would hang) before any p2p.
"""

import types

import pytest
import torch
import torch.distributed as dist

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

# megatron.core's schedules import triton-backed modules unless the CPU shim redirects them; a
# run of this file alone must not depend on another module having applied it first.
apply_cpu_shim()

from megatron_dynbatch.adapters.slime import build_dp_schedule  # noqa: E402
from megatron_dynbatch.integrations.slime.backend import (  # noqa: E402
    agree_on_step,
    data_iterators,
    forward_only_iterators,
)
from megatron_dynbatch.mcore.agreement import StepAgreementError  # noqa: E402

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _rollout_data(lengths, response=5):
    return {
        "tokens": [torch.arange(1, n + 1) for n in lengths],
        "total_lengths": list(lengths),
        "response_lengths": [response] * len(lengths),
        "loss_masks": [torch.ones(response, dtype=torch.int)] * len(lengths),
    }


def _args(budget, log_budget=None):
    return types.SimpleNamespace(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=budget,
        log_probs_max_tokens_per_gpu=log_budget,
        pipeline_model_parallel_size=1,
        tensor_model_parallel_size=1,
        data_pad_size_multiplier=128,
        oversize_samples="error",
    )


def _rank_data(args, lengths, dp_size, rank):
    """What the patched rollout side ships to ``rank``: its samples and the schedule's fields."""
    schedule = build_dp_schedule(
        args,
        {"dp_size": dp_size},
        lengths,
        global_batch_size=len(lengths),
        rollout_indices=list(range(len(lengths))),
    )
    partition = schedule.partitions[rank]
    data = _rollout_data([lengths[i] for i in partition])
    data["partition"] = list(partition)
    data["rewards"] = [1.0] * len(partition)
    data["rollout_mask_sums"] = torch.full((len(partition),), 5.0)
    data["num_microbatches"] = schedule.num_microbatches
    data["global_batch_sizes"] = schedule.global_batch_sizes
    data["micro_batch_indices"] = schedule.micro_batch_indices[rank]
    data.update(schedule.rank_fields(rank))
    return data, schedule


def _log_prob_pass(args, lengths, dp_size=1, rank=0):
    data, schedule = _rank_data(args, lengths, dp_size, rank)
    iterators = data_iterators(data, 1, 1)
    # The schedule's keys left rollout_data (slime would log them as metrics).
    assert not any(key.startswith("dynbatch_") for key in data)
    [iterator], [count] = forward_only_iterators(args, iterators)
    return iterator, count, data, schedule


@pytest.mark.usefixtures("one_process_group")
def test_log_prob_rows_stay_within_the_budget_when_alignment_would_break_it():
    # A 1,000-token budget is not a multiple of slime's 128: a 999-token row stays 999, not 1,024.
    iterator, count, _, _ = _log_prob_pass(_args(1000), [990, 400, 500, 300, 999, 20])
    assert count == len(iterator.micro_batch_indices) >= 3
    assert max(iterator.row_lengths) <= 1000 and 999 in iterator.row_lengths
    # Where the alignment fits the budget it is kept, as slime's get_batch pads.
    short, _, _, _ = _log_prob_pass(_args(1000), [99, 40, 50, 30, 99, 20])
    assert all(row % 128 == 0 and row <= 1000 for row in short.row_lengths)
    # A larger log-prob budget packs the pass into fewer micro-batches than training.
    wide, wide_count, data, _ = _log_prob_pass(_args(1000, 4096), [990, 400, 500, 300, 999, 20])
    assert wide_count < sum(data["num_microbatches"]) and max(wide.row_lengths) <= 4096


@pytest.mark.usefixtures("one_process_group")
def test_a_rank_without_samples_runs_as_many_log_prob_micro_batches_as_its_peers():
    args = _args(64)
    lengths = [60, 50]
    counts = []
    for rank in range(4):
        iterator, count, data, schedule = _log_prob_pass(args, lengths, 4, rank)
        counts.append(count)
        if not schedule.partitions[rank]:
            # One phantom sample (position -1, loss mask 0) in the first micro-batch; placeholders.
            assert data["partition"] == [-1] and int(data["loss_masks"][0].sum()) == 0
            assert iterator.micro_batch_indices == [[0]] + [[]] * (count - 1)
            assert data["micro_batch_indices"][0] == [0]
            assert len(data["rewards"]) == 1 and data["rollout_mask_sums"].tolist() == [0.0]
    assert len(set(counts)) == 1, counts


def test_an_empty_rank_leaves_the_schedule_it_was_given_unchanged():
    # The patched rollout side ships partitions[r] and micro_batch_indices[r] as they are (one
    # process: no Ray copy); get_data_iterator on the rank without samples must not write its
    # phantom into them (it turned partitions[3] from [] into [-1]).
    import copy

    args = _args(64)
    lengths = [60, 50]
    schedule = build_dp_schedule(
        args, {"dp_size": 4}, lengths, global_batch_size=2, rollout_indices=[0, 1]
    )
    empty = next(r for r, p in enumerate(schedule.partitions) if not p)
    before = copy.deepcopy((schedule.partitions, schedule.micro_batch_indices))
    data = _rollout_data([])
    data["partition"] = schedule.partitions[empty]
    data["rewards"] = []
    data["rollout_mask_sums"] = torch.zeros(0)
    data["num_microbatches"] = schedule.num_microbatches
    data["global_batch_sizes"] = schedule.global_batch_sizes
    data["micro_batch_indices"] = schedule.micro_batch_indices[empty]
    data.update(schedule.rank_fields(empty))
    [iterator] = data_iterators(data, 1, 1)
    assert data["partition"] == [-1] and iterator.micro_batch_indices[0] == [0]
    assert (schedule.partitions, schedule.micro_batch_indices) == before


@pytest.mark.usefixtures("one_process_group")
def test_routing_replay_log_prob_pass_runs_the_training_micro_batches():
    args = _args(1000, 4096)
    args.use_routing_replay = True
    iterator, count, data, _ = _log_prob_pass(args, [990, 400, 500, 300, 999, 20])
    assert iterator.micro_batch_indices == data["micro_batch_indices"]
    assert count == sum(data["num_microbatches"])


@pytest.mark.usefixtures("one_process_group")
def test_interleaving_at_pp2_without_overlapped_p2p_is_refused_before_the_step():
    from megatron_dynbatch.integrations.slime.backend import SlimeDataIterator

    data = _rollout_data([30, 20])
    iterators = [SlimeDataIterator(data, [[0], [1]], [64, 64]) for _ in range(2)]
    args = _args(64)
    args.pipeline_model_parallel_size = 2
    args.overlap_p2p_comm = False
    with pytest.raises(StepAgreementError, match="no-overlap-p2p-communication"):
        agree_on_step(args, iterators, 2, 0)
    # Megatron-LM's default (overlap on) passes the check and reaches the data checks.
    args.overlap_p2p_comm = True
    try:
        agree_on_step(args, iterators, 2, 0)
    except StepAgreementError as error:
        assert "overlap" not in str(error)


def test_the_phantom_is_the_placeholder_sample_of_its_length():
    # One builder: the phantom of an empty rank carries, key by key, what a placeholder
    # micro-batch of the same length carries (same dtypes, no data), plus zeros for scalars.
    from megatron_dynbatch.integrations.slime.empty_rank import add_phantom_sample
    from megatron_dynbatch.integrations.slime.placeholders import placeholder_sample

    keys = ["tokens", "total_lengths", "response_lengths", "loss_masks", "advantages"]
    keys += ["log_probs", "partition", "rollout_top_p_token_offsets", "rewards"]
    data = {key: [] for key in keys}
    data["rollout_mask_sums"] = torch.zeros(0)
    data["micro_batch_indices"] = [[], []]
    add_phantom_sample(data, None)
    placeholder = placeholder_sample({key: [] for key in keys}, keys, 2)
    for key in keys:
        (phantom,) = data[key]
        if isinstance(phantom, torch.Tensor):
            assert phantom.dtype == placeholder[key].dtype and torch.equal(
                phantom, placeholder[key]
            ), key
            assert not phantom.any(), key
        else:
            assert phantom == placeholder[key], key
    assert data["partition"] == [-1] and data["rewards"] == [0]
    assert data["rollout_top_p_token_offsets"][0].shape == (2,)
    assert data["micro_batch_indices"] == [[0], []]
