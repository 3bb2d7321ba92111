"""Newer slime's ``build_dp_schedule`` options (after the pinned commit 624b824a8): the
``sample_is_multimodal=`` keyword and ``args.multimodal_aware_packing``, ``args.global_batch_tokens``
and ``args.packing_safety_margin``. Each is either planned by or refused by name, never ignored."""

import pytest

from megatron_dynbatch.adapters.slime import DPScheduleError, build_dp_schedule
from megatron_dynbatch.errors import DynBatchValueError
from tests._support import slime_args, slime_tp

pytestmark = pytest.mark.unit

LENGTHS = [900, 300, 700, 120, 640, 80, 450, 1000]
IDS = [0, 0, 1, 1, 2, 2, 3, 3]


def _schedule(args, **kwargs):
    return build_dp_schedule(
        args, slime_tp(dp_size=2), LENGTHS, global_batch_size=2, rollout_indices=IDS, **kwargs
    )


def test_sample_is_multimodal_is_accepted_where_slime_would_not_separate():
    plain = _schedule(slime_args(max_tokens_per_gpu=1024))
    for mode, flags in (("off", [True, False] * 4), ("separate", [False] * 8)):
        args = slime_args(max_tokens_per_gpu=1024, multimodal_aware_packing=mode)
        assert tuple(_schedule(args, sample_is_multimodal=flags)) == tuple(plain)
    with pytest.raises(DPScheduleError, match="one bool per sample"):
        _schedule(slime_args(max_tokens_per_gpu=1024), sample_is_multimodal=[True])


@pytest.mark.parametrize("mode", ["separate", "separate_raw"])
def test_separating_multimodal_samples_is_refused_by_name(mode):
    args = slime_args(max_tokens_per_gpu=1024, multimodal_aware_packing=mode)
    with pytest.raises(DynBatchValueError, match=f"--multimodal-aware-packing {mode} .* off"):
        _schedule(args, sample_is_multimodal=[True] + [False] * 7)


def test_steps_by_tokens_are_refused_by_name():
    with pytest.raises(DynBatchValueError, match="--global-batch-tokens 4096"):
        _schedule(slime_args(max_tokens_per_gpu=1024, global_batch_tokens=4096))


def test_the_packing_safety_margin_caps_every_micro_batch():
    args = slime_args(max_tokens_per_gpu=1024, packing_safety_margin=0.5)
    schedule = _schedule(args)
    for rank, mbs in zip(schedule.partitions, schedule.micro_batch_indices, strict=True):
        for mb in mbs:
            tokens = [LENGTHS[rank[i]] for i in mb]
            assert len(tokens) == 1 or sum(tokens) <= 512, tokens
    assert sorted(i for rank in schedule.partitions for i in rank) == list(range(len(LENGTHS)))
    for bad in (0, 1.5, "0.9", True):
        with pytest.raises(DynBatchValueError, match="--packing-safety-margin"):
            _schedule(slime_args(max_tokens_per_gpu=1024, packing_safety_margin=bad))


def test_an_empty_rollout_batch_names_slimes_options():
    with pytest.raises(DPScheduleError, match="--rollout-batch-size"):
        build_dp_schedule(
            slime_args(), slime_tp(dp_size=2), [], global_batch_size=1, rollout_indices=[]
        )
