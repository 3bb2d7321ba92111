"""The log-prob passes' schedule that ``build_dp_schedule`` plans for slime (issue 20, item 3).

Before, each DP rank planned its log-prob pass alone, and 38 of 200 random inputs gave unequal
counts (dp 8 -> ``[8, 8, 7, 7, 7, 7, 7, 7]``): with expert parallelism the MoE all-to-all spans DP
ranks, so a rank could wait forever. Now the rollout side plans every rank's pass from the global
lengths and tops the counts up with placeholders. Checked on random inputs: equal counts on every
rank, every sample exactly once (on the rank that trains it), rows within
``--log-probs-max-tokens-per-gpu``, counts a multiple of the interleaving group; with routing
replay the log-prob pass is the training schedule.
"""

import random
import types

import pytest

from megatron_dynbatch.adapters.slime import build_dp_schedule
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.slime.config import (
    DATA_PAD_SIZE_MULTIPLIER,
    dynbatch_config_from_slime_args,
)
from megatron_dynbatch.planning.spec import check_int
from tests._support import slime_tp

pytestmark = pytest.mark.unit


def _args(**overrides):
    values = dict(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=512,
        log_probs_max_tokens_per_gpu=None,
        micro_batch_size=1,
        balance_data=False,
        balance_by_flops=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        data_pad_size_multiplier=None,
        oversize_samples="error",
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _random_case(rng):
    dp = rng.choice([1, 2, 3, 4, 8])
    vpp = rng.choice([1, 1, 2])
    pp = rng.choice([1, 2, 4]) if vpp == 1 else rng.choice([2, 4])
    group = pp if vpp > 1 else 1
    budget = rng.choice([256, 500, 1000, 2048])
    log_budget = rng.choice([None, budget, 2 * budget, budget + 37])
    num_rollouts = rng.randint(1, 24)
    per_rollout = rng.choice([1, 2, 4])
    lengths = [rng.randint(2, budget) for _ in range(num_rollouts * per_rollout)]
    ids = [i // per_rollout for i in range(len(lengths))]
    gbs = rng.randint(1, num_rollouts)
    args = _args(
        max_tokens_per_gpu=budget,
        log_probs_max_tokens_per_gpu=log_budget,
        pipeline_model_parallel_size=pp,
        data_pad_size_multiplier=rng.choice([None, 1, 64]),
    )
    tp = slime_tp(dp, 1, vpp, group)
    return args, tp, lengths, ids, gbs, group


def test_random_search_forward_only_counts_are_equal_on_every_dp_rank():
    rng = random.Random(20)
    for case in range(300):
        args, tp, lengths, ids, gbs, group = _random_case(rng)
        schedule = build_dp_schedule(args, tp, lengths, global_batch_size=gbs, rollout_indices=ids)
        forward = schedule.forward_only
        counts = [len(rank) for rank in forward.micro_batch_indices]
        assert len(set(counts)) == 1, (case, counts)
        assert counts[0] % group == 0, (case, counts, group)
        budget = args.log_probs_max_tokens_per_gpu or args.max_tokens_per_gpu
        assert forward.row_length <= budget, (case, forward.row_length, budget)
        for r, partition in enumerate(schedule.partitions):
            flat = sorted(i for mb in forward.micro_batch_indices[r] for i in mb)
            assert flat == list(range(len(partition))), (case, r)
            for mb in forward.micro_batch_indices[r]:
                assert sum(lengths[partition[i]] for i in mb) <= forward.row_length
            fields = schedule.rank_fields(r)
            assert len(fields["dynbatch_logprob_micro_batch_indices"]) == counts[0]


def test_a_rank_without_samples_gets_as_many_placeholders_as_its_peers():
    schedule = build_dp_schedule(
        _args(), {"dp_size": 4}, [300, 200], global_batch_size=2, rollout_indices=[0, 1]
    )
    forward = schedule.forward_only
    empty = [r for r, p in enumerate(schedule.partitions) if not p]
    assert empty, schedule.partitions
    for r in empty:
        assert forward.micro_batch_indices[r] == [[]] * forward.num_microbatches


def test_routing_replay_runs_the_log_prob_pass_on_the_training_micro_batches():
    lengths = [100, 400, 30, 250, 500, 60, 90, 310]
    args = _args(log_probs_max_tokens_per_gpu=4096, use_routing_replay=True)
    schedule = build_dp_schedule(
        args, {"dp_size": 2}, lengths, global_batch_size=4, rollout_indices=list(range(8))
    )
    assert schedule.forward_only is None
    assert set(schedule.rank_fields(0)) == {"dynbatch_seq_lengths", "dynbatch_row_lengths"}


def test_rollout_routing_replay_also_runs_the_log_prob_pass_on_the_training_micro_batches():
    # R3 records the rollout's routing per training micro-batch (fill_routing_replay) and replays
    # it in the log-prob pass too: that pass must run the same micro-batches.
    lengths = [100, 400, 30, 250, 500, 60, 90, 310]
    args = _args(
        log_probs_max_tokens_per_gpu=4096, use_routing_replay=True, use_rollout_routing_replay=True
    )
    schedule = build_dp_schedule(
        args, {"dp_size": 2}, lengths, global_batch_size=4, rollout_indices=list(range(8))
    )
    assert schedule.forward_only is None
    assert sorted(i for p in schedule.partitions for i in p) == list(range(8))


def test_the_log_prob_budget_error_names_the_log_prob_flag():
    args = _args(max_tokens_per_gpu=4096, log_probs_max_tokens_per_gpu=256)
    with pytest.raises(DynBatchValueError, match="--log-probs-max-tokens-per-gpu") as caught:
        build_dp_schedule(
            args, {"dp_size": 2}, [1000, 20], global_batch_size=2, rollout_indices=[0, 1]
        )
    assert "truncate" not in str(caught.value)


def test_one_config_from_slime_args_with_its_defaults():
    bare = types.SimpleNamespace(max_tokens_per_gpu=100)
    config = dynbatch_config_from_slime_args(bare)
    # slime's own unit tests build a namespace without --oversize-samples: slime's behaviour.
    assert config.oversize_samples == "allow" and config.layout == "packed"
    assert config.forward_only_max_tokens_per_gpu == 100
    assert DATA_PAD_SIZE_MULTIPLIER == 128
    with pytest.raises(DynBatchValueError, match="--max-tokens-per-gpu"):
        dynbatch_config_from_slime_args(types.SimpleNamespace(max_tokens_per_gpu=None))
    with pytest.raises(DynBatchValueError, match="log-probs-max-tokens-per-gpu"):
        dynbatch_config_from_slime_args(
            types.SimpleNamespace(max_tokens_per_gpu=100, log_probs_max_tokens_per_gpu=2.5)
        )
    for bad in (True, 6.9, "7"):
        with pytest.raises(DynBatchValueError, match="not an integer"):
            check_int("x", bad, 1, "fix it.")


def test_the_named_planner_plans_the_training_and_the_log_prob_passes():
    """``--dynamic-batch-planner NAME`` (patch 0005): the planner registered as NAME plans the
    training steps over every DP rank and each rank's log-prob pass; counts stay equal."""
    from megatron_dynbatch.planning import register_planner
    from megatron_dynbatch.planning.registry import get_planner

    calls = []

    def spy(samples, config):
        calls.append((len(samples), config.parallel.dp_size))
        return get_planner("dynbatch")(samples, config)

    register_planner("slime-spy", spy, replace=True)
    rng = random.Random(3)
    lengths = [rng.randint(20, 400) for _ in range(12)]
    args = _args(
        log_probs_max_tokens_per_gpu=1024,
        dynamic_batch_planner="slime-spy",
        pipeline_model_parallel_size=2,
    )
    schedule = build_dp_schedule(
        args, slime_tp(3, vpp_size=2, microbatch_group_size_per_vp_stage=2), lengths,
        global_batch_size=6, rollout_indices=list(range(12)),
    )  # fmt: skip
    # One training plan over 3 DP ranks, then one log-prob plan per rank of its own samples.
    assert calls[0] == (12, 3), calls
    assert sorted(calls[1:]) == sorted((len(p), 1) for p in schedule.partitions), calls
    forward = schedule.forward_only
    counts = {len(rank) for rank in forward.micro_batch_indices}
    assert len(counts) == 1 and counts.pop() % 2 == 0, forward.micro_batch_indices
    for r, partition in enumerate(schedule.partitions):
        flat = sorted(i for mb in forward.micro_batch_indices[r] for i in mb)
        assert flat == list(range(len(partition))), r
    # Without the option ours plans both passes: the spy is not called.
    calls.clear()
    build_dp_schedule(
        _args(log_probs_max_tokens_per_gpu=1024), slime_tp(3), lengths,
        global_batch_size=6, rollout_indices=list(range(12)),
    )  # fmt: skip
    assert calls == []
