"""What each rank reads through the Megatron-LM hook, on 4 gloo ranks with Megatron's groups.

Every rank plans from the batch's lengths; only the first and last pipeline stages load samples,
and only their own DP rank's share; validation batches are planned forward-only under the
log-prob budget.
"""

import pytest

from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks

pytestmark = pytest.mark.gloo

LENGTHS = [30, 7, 51, 12, 19, 44, 3, 26, 9, 60, 15, 33]


def _args(**overrides):
    import argparse

    from megatron_dynbatch.integrations.megatron_lm.arguments import add_dynamic_batch_args

    # Calibration (on by default) varies the first steps' shapes; tested in test_calibration_*.
    args = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"]
        + ["--dynamic-batch-calibration-steps", "0"]
    )
    args.calculate_per_token_loss = True
    args.global_batch_size = len(LENGTHS)
    args.eval_global_batch_size = len(LENGTHS)
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def _lazy_batch(loaded):
    import torch

    from megatron_dynbatch.runtime.batches import LazyRolloutBatch

    def load(index):
        loaded.append(index)
        return {"tokens": torch.arange(1, LENGTHS[index] + 1)}

    return LazyRolloutBatch(sample_lengths=LENGTHS, load_sample=load)


def _expected_shapes(args):
    """(M, B, S) of the training step (64-token budget) and of validation (128, forward-only)."""
    from megatron_dynbatch.integrations.megatron_lm.arguments import (
        dynbatch_config_from_args,
        parallel_layout_from_args,
    )
    from megatron_dynbatch.planning import plan_schedule

    config = dynbatch_config_from_args(args)
    layout = parallel_layout_from_args(args, vpp_size=1)
    shapes = []
    for forward_only in (False, True):
        planner = config.planner_config(layout, forward_only=forward_only)
        assert planner.max_tokens_per_gpu == (128 if forward_only else 64)
        [step] = plan_schedule(LENGTHS, config=planner).steps
        shapes.append((step.num_microbatches, step.micro_batch_size, step.seq_length))
    return shapes


def _reads_body(pp_size):
    import torch
    from megatron.core import parallel_state

    from megatron_dynbatch.integrations.megatron_lm import hooks as training_hooks

    args = _args(
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        pipeline_model_parallel_size=pp_size,
        log_probs_max_tokens_per_gpu=128,
    )
    model = [torch.nn.Linear(1, 1)]
    # Megatron's train loop, whose module the hook feeds its FLOPs count (imported by the launch
    # script under the shim that gives Python 3.11 typing.override).
    from megatron_dynbatch.cpu.training_shim import provide_typing_override

    provide_typing_override()
    from megatron.training.training import consume_seqlen_stats_in_iteration

    training_hooks.reset_dynamic_batch_state()
    loaded = []
    step = training_hooks.prepare_train_step(args, iter([_lazy_batch(loaded)]), model)
    eval_loaded = []
    evaluation = training_hooks.prepare_eval_step(args, iter([_lazy_batch(eval_loaded)]), model)
    # A forward-only pass (log-probs of a rollout batch) takes the batch itself, not an iterator,
    # and leaves the training state alone.
    logprob_loaded = []
    logprobs = training_hooks.prepare_forward_only_step(args, _lazy_batch(logprob_loaded), model)
    train_state_kept = training_hooks.last_train_step() is step
    # What Megatron's train loop reads after train_step for its FLOPs (--log-throughput, and
    # num_floating_point_operations_so_far in checkpoints): the step's real lengths, summed over
    # the world once per DP rank; the validation and forward-only passes add nothing.
    flops_lengths = consume_seqlen_stats_in_iteration()
    training_hooks.reset_dynamic_batch_state()
    tokens_ok = all(
        int(mb["tokens"][mb["sample_index"] == i][0]) == 1
        for mb in step.microbatches
        for i in set(mb["sample_index"].flatten().tolist()) - {-1}
    )
    return {
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "own": sorted(step.sample_indices),
        "loaded": sorted(loaded),
        "eval_own": sorted(evaluation.sample_indices),
        "eval_loaded": sorted(eval_loaded),
        "shape": (step.num_microbatches, step.micro_batch_size, step.seq_length),
        "eval_shape": (
            evaluation.num_microbatches,
            evaluation.micro_batch_size,
            evaluation.seq_length,
        ),
        "logprob_own": sorted(logprobs.sample_indices),
        "logprob_loaded": sorted(logprob_loaded),
        "logprob_shape": (
            logprobs.num_microbatches,
            logprobs.micro_batch_size,
            logprobs.seq_length,
        ),
        "train_state_kept": train_state_kept,
        "expected_shapes": _expected_shapes(args),
        "tokens_ok": tokens_ok,
        "flops_lengths": flops_lengths,
    }


def test_each_dp_rank_loads_only_its_own_samples_on_first_and_last_stages():
    results = run_on_ranks(4, _reads_body, 2, layout=Layout(pp=2))  # dp 2 x pp 2
    by_dp = {}
    for result in results:
        # pp 2: every stage is first or last, so every rank loads its DP rank's samples, once.
        assert result["loaded"] == result["own"] and result["tokens_ok"]
        assert result["eval_loaded"] == result["eval_own"]
        assert result["logprob_loaded"] == result["logprob_own"] == result["eval_own"]
        assert result["logprob_shape"] == result["eval_shape"] and result["train_state_kept"]
        # Megatron counted every sample as --seq-length tokens: a probe's TFLOP/s 1.3-2x high.
        assert result["flops_lengths"] == (sum(LENGTHS), sum(n * n for n in LENGTHS)), result
        by_dp.setdefault(result["dp_rank"], []).append(result)
    assert sorted(by_dp) == [0, 1]
    for peers in by_dp.values():  # pipeline peers of one DP rank read the same samples
        assert peers[0]["own"] == peers[1]["own"] and peers[0]["shape"] == peers[1]["shape"]
    own = [set(by_dp[r][0]["own"]) for r in (0, 1)]
    assert not own[0] & own[1] and own[0] | own[1] == set(range(len(LENGTHS)))


def test_middle_pipeline_stages_read_no_sample():
    results = run_on_ranks(4, _reads_body, 4, layout=Layout(pp=4))  # dp 1 x pp 4
    shapes = {result["shape"] for result in results}
    assert len(shapes) == 1  # every stage plans the same step from the lengths
    for result in results:
        assert result["own"] == list(range(len(LENGTHS)))
        if result["pp_rank"] in (1, 2):
            assert result["loaded"] == result["eval_loaded"] == result["logprob_loaded"] == []
        else:
            assert result["loaded"] == result["own"] and result["tokens_ok"]
        # Validation is planned forward-only under --log-probs-max-tokens-per-gpu (128, not 64).
        assert [result["shape"], result["eval_shape"]] == result["expected_shapes"]
        assert result["shape"][2] <= 64 and result["eval_shape"][2] <= 128


def _fixed_rows_flops_body():
    import torch

    from megatron_dynbatch.cpu.training_shim import provide_typing_override

    provide_typing_override()
    from megatron.training.training import consume_seqlen_stats_in_iteration

    from megatron_dynbatch.integrations.megatron_lm.pretrain_gpt import count_fixed_row_lengths

    # Two fixed rows of 4 tokens: a 3-token and a 2-token document, padding -1.
    batch = {"sample_index": torch.tensor([[0, 0, 0, -1], [1, 1, -1, -1]])}
    model = torch.nn.Linear(1, 1)
    count_fixed_row_lengths(batch, model)
    trained = consume_seqlen_stats_in_iteration()
    model.vp_stage = 1  # a later model chunk of the same micro-batch: counted once, by chunk 0
    count_fixed_row_lengths(batch, model)
    model.vp_stage = 0
    model.eval()  # evaluation: not a training iteration's FLOPs
    count_fixed_row_lengths(batch, model)
    return {"trained": trained, "later": consume_seqlen_stats_in_iteration()}


def test_fixed_document_rows_give_megatrons_flops_count_their_real_tokens():
    """--document-samples: Megatron counted each padded row as --seq-length tokens (a probe: the
    fixed run's FLOPs 3.7x the dynamic run's for the same samples, its TFLOP/s twice the dynamic
    run's where it ran half as fast)."""
    [result] = run_on_ranks(1, _fixed_rows_flops_body, layout=Layout())
    assert result["trained"] == (5, 3 * 3 + 2 * 2), result
    assert result["later"] == (None, None), result
