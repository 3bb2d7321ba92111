"""The slime-style adapter: plans a rollout batch, feeds iterators, scatters outputs back."""

import pytest
import torch

from megatron_dynbatch.adapters.slime import DynamicBatching
from megatron_dynbatch.config import DynBatchConfig
from megatron_dynbatch.planning import ParallelLayout
from megatron_dynbatch.runtime import split_outputs


def _rollout_data(seed=0, groups=6, per_group=4):
    gen = torch.Generator().manual_seed(seed)
    data = {
        k: []
        for k in (
            "tokens",
            "total_lengths",
            "response_lengths",
            "loss_masks",
            "advantages",
            "rewards",
            "rollout_ids",
        )
    }
    for g in range(groups):
        prompt = int(torch.randint(3, 10, (1,), generator=gen))
        for _ in range(per_group):
            response = int(torch.randint(1, 60, (1,), generator=gen))
            total = prompt + response
            data["tokens"].append(torch.randint(0, 100, (total,), generator=gen).tolist())
            data["total_lengths"].append(total)
            data["response_lengths"].append(response)
            mask = (torch.rand(response, generator=gen) > 0.2).float()
            data["loss_masks"].append(mask)
            data["advantages"].append(torch.randn(response, generator=gen))
            data["rewards"].append(float(torch.randn((), generator=gen)))
            data["rollout_ids"].append(f"prompt-{g}")
    return data


def _batching(dp=2, vpp=1, **kwargs):
    parallel = ParallelLayout(dp_size=dp, pp_size=2 if vpp > 1 else 1, vpp_size=vpp)
    return DynamicBatching(
        DynBatchConfig(
            max_tokens_per_gpu=96, log_probs_max_tokens_per_gpu=192, rollouts_per_step=2
        ),
        parallel,
        response_keys=("advantages",),
        sample_keys=("rewards",),
        **kwargs,
    )


@pytest.mark.parametrize("vpp", [1, 2])
def test_every_sample_trains_once_with_aligned_response_values(vpp):
    data = _rollout_data()
    batching = _batching(vpp=vpp)
    plan = batching.plan(data)
    assert len(plan.steps) == 3  # 6 prompt groups, 2 per optimizer step
    seen = []
    for step in range(len(plan.steps)):
        for dp_rank in range(2):
            iterators, num_microbatches = batching.data_iterators(
                data, plan, step, dp_rank, num_model_chunks=vpp
            )
            microbatches = list(iterators[0] if vpp > 1 else iterators)
            assert len(microbatches) == num_microbatches == plan.steps[step].num_microbatches
            shape = batching.schedule_shape(plan, step)
            for mb in microbatches:
                assert mb["tokens"].shape == (shape["micro_batch_size"], shape["seq_length"])
                for row in range(mb["tokens"].shape[0]):
                    for j in range(mb["tokens"].shape[1]):
                        i = int(mb["sample_index"][row, j])
                        if i < 0 or mb["loss_mask"][row, j] == 0:
                            continue
                        # Position j predicts token j+1 of sample i, a response token.
                        start = int((mb["sample_index"][row] == i).nonzero()[0])
                        token = j - start + 1
                        prompt = data["total_lengths"][i] - data["response_lengths"][i]
                        assert token >= prompt
                        assert mb["labels"][row, j] == data["tokens"][i][token]
                        assert mb["advantages"][row, j] == data["advantages"][i][token - prompt]
                        assert mb["loss_mask"][row, j] == data["loss_masks"][i][token - prompt]
                        assert mb["rewards"][row, j] == pytest.approx(data["rewards"][i])
                seen.extend(int(i) for i in mb["sample_index"].unique() if i >= 0)
    assert sorted(seen) == list(range(len(data["tokens"])))


def test_forward_only_outputs_come_back_in_rollout_order_cut_to_responses():
    data = _rollout_data(seed=3)
    batching = _batching()
    plan = batching.plan(data, forward_only=True)
    assert len(plan.steps) == 1 and plan.token_cap == 192
    gathered = []
    for dp_rank in range(2):
        iterator, _ = batching.data_iterators(data, plan, 0, dp_rank)
        per_rank = {}
        for mb in iterator:
            # A fake model output: the label itself, so the scatter is checkable.
            per_rank.update(split_outputs(mb, mb["labels"].float()))
        gathered.append(per_rank)
    outputs = batching.response_outputs(data, gathered)
    for i, out in enumerate(outputs):
        response = data["response_lengths"][i]
        assert out.shape == (response,)
        assert out.tolist() == [float(t) for t in data["tokens"][i][-response:]]


def test_missing_or_duplicated_outputs_raise():
    data = _rollout_data(groups=1, per_group=2)
    batching = _batching(dp=1)
    fake = {0: torch.zeros(data["total_lengths"][0])}
    with pytest.raises(ValueError, match="missing"):
        batching.response_outputs(data, fake)
    both = {0: torch.zeros(data["total_lengths"][0]), 1: torch.zeros(data["total_lengths"][1])}
    with pytest.raises(ValueError):
        batching.response_outputs(data, [both, {1: both[1]}])


def test_bad_rollout_data_names_the_problem():
    data = _rollout_data(groups=1, per_group=2)
    data["advantages"][1] = data["advantages"][1][:-1]
    batching = _batching(dp=1)
    plan = batching.plan(data)
    with pytest.raises(ValueError, match="advantages"):
        batching.data_iterators(data, plan, 0, 0)
    data = _rollout_data(groups=1, per_group=2)
    data["total_lengths"][0] += 1
    with pytest.raises(ValueError, match="total_lengths"):
        batching.plan(data)
    data = _rollout_data(groups=1, per_group=3)
    del data["rollout_ids"]
    with pytest.raises(ValueError, match="samples_per_rollout=2"):
        _batching(dp=1, samples_per_rollout=2).plan(data)
