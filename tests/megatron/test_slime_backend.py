"""slime's patched Megatron backend pieces that run without a slime checkout (one gloo process).

The whole patched slime runs in test_slime_patched.py (given SLIME_DIR); this covers the log-prob
pass's planning in CI: its packed rows stay within --log-probs-max-tokens-per-gpu; a training step
refuses interleaving at pp 2 without overlapped p2p (it would hang) before any p2p.
"""

import types

import pytest
import torch
import torch.distributed as dist

from megatron_dynbatch.integrations.slime.backend import agree_on_step, forward_only_iterators
from megatron_dynbatch.mcore.agreement import StepAgreementError

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


def _args(budget):
    return types.SimpleNamespace(
        max_tokens_per_gpu=budget,
        log_probs_max_tokens_per_gpu=budget,
        pipeline_model_parallel_size=1,
        tensor_model_parallel_size=1,
        data_pad_size_multiplier=128,
        oversize_samples="error",
    )


def _first_iterator(lengths, budget):
    from megatron_dynbatch.integrations.slime.backend import SlimeDataIterator

    data = _rollout_data(lengths)
    stock = SlimeDataIterator(data, [list(range(len(lengths)))], [10**6])
    [iterator], [count] = forward_only_iterators(_args(budget), [stock])
    return iterator, count


@pytest.mark.usefixtures("one_process_group")
def test_log_prob_rows_stay_within_the_budget_when_alignment_would_break_it():
    # A 1,000-token budget is not a multiple of slime's 128: a 999-token row stays 999, not 1,024.
    iterator, count = _first_iterator([990, 400, 500, 300, 999, 20], 1000)
    assert count == len(iterator.micro_batch_indices) >= 3
    assert max(iterator.row_lengths) <= 1000 and 999 in iterator.row_lengths
    # Where the alignment fits the budget it is kept, as slime's get_batch pads.
    short, _ = _first_iterator([99, 40, 50, 30, 99, 20], 1000)
    assert all(row % 128 == 0 and row <= 1000 for row in short.row_lengths)


@pytest.mark.usefixtures("one_process_group")
def test_a_rank_without_samples_gets_placeholders_within_the_budget():
    iterator, count = _first_iterator([], 64)
    assert count >= 1 and iterator.micro_batch_indices == [[]] * count
    assert all(1 <= row <= 64 for row in iterator.row_lengths)


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
