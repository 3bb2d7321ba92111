"""The slime-style adapter: plans a rollout batch, feeds iterators, scatters outputs back."""

import pytest
import torch

from megatron_dynbatch.adapters.slime import DynamicBatching
from megatron_dynbatch.config import DynBatchConfig
from megatron_dynbatch.planning import ParallelLayout
from megatron_dynbatch.runtime import split_outputs

pytestmark = pytest.mark.unit


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


# -- bad input (issue 10 item 7): one ValueError naming the value and the fix ----------------


def _one_group():
    return _rollout_data(groups=1, per_group=2)


def _set(key, index, value):
    def change(data):
        data[key][index] = value

    return change


@pytest.mark.parametrize(
    "change, match",
    [
        (_set("total_lengths", 0, None), r"total_lengths\[0\]=None"),
        (_set("total_lengths", 0, 6.9), r"total_lengths\[0\]=6.9 \(float\) is not an integer"),
        (_set("total_lengths", 0, "6"), r"total_lengths\[0\]='6'"),
        (_set("total_lengths", 0, True), "bool"),
        (_set("response_lengths", 1, 2.5), r"response_lengths\[1\]=2.5"),
        (_set("response_lengths", 1, -1), r"response_lengths\[1\]=-1 must be >= 0"),
        (lambda d: d.pop("tokens"), "rollout_data has no 'tokens'"),
        (lambda d: d.__setitem__("rollout_ids", "ab"), "must be a list of one id per sample"),
        (_set("rollout_ids", 0, 1.5), r"rollout_ids\[0\]=1.5"),
    ],
)
def test_bad_rollout_data_is_a_value_error_at_planning(change, match):
    data = _one_group()
    change(data)
    with pytest.raises(ValueError, match=match):
        _batching(dp=1).plan(data)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.pop("advantages"), "rollout_data has no 'advantages'"),
        (lambda d: d.pop("rewards"), "rollout_data has no 'rewards'"),
        (lambda d: d["advantages"].pop(), r"rollout_data\['advantages'\] has 1 entries"),
        (_set("tokens", 0, None), "tokens"),
    ],
)
def test_missing_keys_are_value_errors_when_materializing(change, match):
    data = _one_group()
    batching = _batching(dp=1)
    plan = batching.plan(data)
    change(data)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        batching.data_iterators(data, plan, 0, 0)
    assert issubclass(info.type, ValueError)


def test_float_and_negative_token_ids_are_rejected():
    batching = _batching(dp=1)
    data = _one_group()
    data["tokens"][0] = [float(t) + 0.5 for t in data["tokens"][0]]
    plan = batching.plan(data)
    with pytest.raises(ValueError, match="token ids must be integers"):
        batching.data_iterators(data, plan, 0, 0)
    data = _one_group()
    data["tokens"][1][0] = -3
    with pytest.raises(ValueError, match="token id -3 is negative"):
        batching.data_iterators(data, batching.plan(data), 0, 0)


def test_step_and_rank_out_of_range_are_value_errors():
    data = _one_group()
    batching = _batching(dp=1)
    plan = batching.plan(data)
    with pytest.raises(ValueError, match=r"step=5 is out of range: the plan has 1 step"):
        batching.data_iterators(data, plan, 5, 0)
    with pytest.raises(ValueError, match=r"step=-1 must be >= 0"):
        batching.schedule_shape(plan, -1)
    with pytest.raises(ValueError, match="dp_rank=3"):
        batching.data_iterators(data, plan, 0, 3)


@pytest.mark.parametrize(
    "value, match",
    [
        ("3", r"samples_per_rollout='3' \(str\) is not an integer"),
        (True, "samples_per_rollout=True is a bool"),
        (2.0, r"samples_per_rollout=2.0 \(float\)"),
        (0, "samples_per_rollout=0 must be >= 1"),
    ],
)
def test_samples_per_rollout_must_be_an_integer(value, match):
    with pytest.raises(ValueError, match=match):
        _batching(dp=1, samples_per_rollout=value)


def test_numpy_and_torch_integers_are_accepted():
    import numpy as np

    data = _one_group()
    data["total_lengths"] = [np.int64(x) for x in data["total_lengths"]]
    data["response_lengths"] = [torch.tensor(x) for x in data["response_lengths"]]
    del data["rollout_ids"]
    batching = _batching(dp=1, samples_per_rollout=np.int32(2))
    plan = batching.plan(data)
    iterator, num_microbatches = batching.data_iterators(data, plan, np.int64(0), torch.tensor(0))
    assert len(list(iterator)) == num_microbatches
