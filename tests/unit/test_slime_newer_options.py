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


@pytest.mark.parametrize("bad", ["no", None, 2, 0.5])
def test_sample_is_multimodal_entries_must_be_bools(bad):
    """A probe: "no" was read as multimodal (a non-empty string) and None as text-only."""
    args = slime_args(max_tokens_per_gpu=1024, multimodal_aware_packing="separate")
    flags = [False] * 7 + [bad]
    with pytest.raises(DPScheduleError, match=rf"sample_is_multimodal\[7\]={bad!r} is not a bool"):
        _schedule(args, sample_is_multimodal=flags)
    # numpy's bools and 0 / 1 are bools to slime too.
    import numpy as np

    for ok in ([0, 1] * 4, list(np.zeros(8, dtype=bool))):
        _schedule(slime_args(max_tokens_per_gpu=1024), sample_is_multimodal=ok)


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


@pytest.mark.parametrize(
    "budget, margin, parallel, oversize, fix",
    [
        # Each was told to raise --max-tokens-per-gpu to the share the margin leaves (8, 2, 600),
        # which the margin cut again: the same refusal.
        (10, 0.5, dict(tensor_model_parallel_size=8), "allow", 16),
        (10, 0.1, dict(cp_size=4), "allow", 20),
    ],
)
def test_a_budget_refusal_under_the_safety_margin_names_a_budget_that_works(
    budget, margin, parallel, oversize, fix
):
    cp = parallel.pop("cp_size", 1)
    lengths = [100, 200, 300, 400, 500, 600]

    def schedule(tokens):
        args = slime_args(
            max_tokens_per_gpu=tokens,
            packing_safety_margin=margin,
            oversize_samples=oversize,
            **parallel,
        )
        return build_dp_schedule(
            args,
            slime_tp(dp_size=2, cp_size=cp),
            lengths,
            global_batch_size=len(lengths),
            rollout_indices=list(range(len(lengths))),
        )

    with pytest.raises(DynBatchValueError, match=f"to at least {fix}[,. ]") as refused:
        schedule(budget)
    assert "--packing-safety-margin" in str(refused.value)
    schedule(fix)  # the named budget plans
    with pytest.raises(DynBatchValueError, match=f"to at least {fix}[,. ]"):
        schedule(fix - 1)


def _margin_schedule(lengths, budget, margin=0.5, oversize="allow"):
    args = slime_args(
        max_tokens_per_gpu=budget, packing_safety_margin=margin, oversize_samples=oversize
    )
    return build_dp_schedule(
        args,
        slime_tp(dp_size=2),
        lengths,
        global_batch_size=len(lengths),
        rollout_indices=list(range(len(lengths))),
    )


def test_a_sample_over_the_margins_share_but_within_the_budget_runs_alone_within_it():
    """A probe: budget 100 at margin 0.5, a 90-token sample ran a 128-token row (slime's 128
    alignment, over the budget), was warned about as over "the token cap 50
    (--max-tokens-per-gpu=50)", a value the user never gave, and refused under ``error`` with
    a fix of twice its length. It is within the budget: it runs alone in a row within it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report
        for oversize in ("allow", "error"):
            schedule = _margin_schedule([50, 20, 90], 100, oversize=oversize)
            rows = {
                schedule.partitions[r][mb[0]]: row
                for r, rank in enumerate(schedule.micro_batch_indices)
                for mb, row in zip(rank, schedule.row_lengths[r], strict=True)
                if len(mb) == 1
            }
            assert rows[2] == 90, schedule.row_lengths
            assert max(max(r) for r in schedule.row_lengths) <= 100
            # The log-prob pass computes on the training micro-batches (one budget).
            assert schedule.forward_only.row_lengths == schedule.row_lengths


def test_a_sample_over_the_budget_under_the_margin_is_refused_naming_its_length():
    """Over the budget itself, ``error`` refuses it naming a budget of its own length (it named
    twice that, the margin's share applied to a sample that runs alone)."""
    with pytest.raises(DynBatchValueError, match="to at least 600[,. ]") as refused:
        _margin_schedule([100, 200, 600], 500, oversize="error")
    assert "(--max-tokens-per-gpu=500)" in str(refused.value)
    _margin_schedule([100, 200, 600], 600, oversize="error")  # the named budget plans
    with pytest.warns(UserWarning, match=r"--max-tokens-per-gpu=500\): sample 2: 600"):
        _margin_schedule([100, 200, 600], 500, oversize="allow")


def test_a_log_prob_budget_refusal_names_the_log_prob_flag():
    """It told users to raise --max-tokens-per-gpu (already 1000), which changed nothing."""
    args = slime_args(max_tokens_per_gpu=1000, log_probs_max_tokens_per_gpu=1)
    with pytest.raises(
        DynBatchValueError, match="raise --log-probs-max-tokens-per-gpu to at least 2"
    ):
        build_dp_schedule(
            args, slime_tp(dp_size=2, cp_size=4), [100, 200, 300, 400], global_batch_size=4,
            rollout_indices=[0, 1, 2, 3],
        )  # fmt: skip
    args = slime_args(max_tokens_per_gpu=1000, log_probs_max_tokens_per_gpu=2)
    build_dp_schedule(
        args, slime_tp(dp_size=2, cp_size=4), [100, 200, 300, 400], global_batch_size=4,
        rollout_indices=[0, 1, 2, 3],
    )  # fmt: skip


def test_a_moe_layer_frequency_of_zero_is_refused_by_name():
    """slime's FLOPs estimate divides by it: a ZeroDivisionError from inside before."""
    args = slime_args(
        max_tokens_per_gpu=1024,
        num_experts=8,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_layer_freq=0,
    )
    with pytest.raises(DynBatchValueError, match="--moe-layer-freq 0 must be an integer >= 1"):
        _schedule(args)


def test_the_fixed_planner_is_refused_in_slimes_flags_without_slimes_argument_check():
    """build_dp_schedule called without slime's validate_args told users to pass
    --dynamic-batch-layout padded, which slime does not have."""
    args = slime_args(max_tokens_per_gpu=1024, dynamic_batch_planner="fixed")
    with pytest.raises(DynBatchValueError) as refused:
        _schedule(args)
    message = str(refused.value)
    assert "--dynamic-batch-planner fixed plans padded rows only" in message, message
    assert "--dynamic-batch-layout" not in message
    _schedule(slime_args(max_tokens_per_gpu=1024, dynamic_batch_planner="dynbatch"))


def test_a_sample_over_a_smaller_log_prob_budget_is_reported_in_its_flag():
    """A probe: under ``allow`` a 40-token sample ran its log-prob pass alone in a row of 128
    against --log-probs-max-tokens-per-gpu 16, with no word (training's budget held it)."""
    args = slime_args(max_tokens_per_gpu=64, log_probs_max_tokens_per_gpu=16)
    with pytest.warns(UserWarning, match=r"\(--log-probs-max-tokens-per-gpu=16\): sample 0: 40"):
        build_dp_schedule(
            args, slime_tp(dp_size=2), [40, 10, 10, 10], global_batch_size=4,
            rollout_indices=[0, 1, 2, 3],
        )  # fmt: skip


def test_under_the_margin_one_budget_is_still_one_budget_for_both_passes():
    """Re-probes: slime's validate_args sets the log-prob budget to --max-tokens-per-gpu in full,
    which is not the margin's share, so the log-prob pass repacked; with one row a step the rows
    were rounded up within the share (128 for a 90-token sample at budget 100)."""
    lengths = [30, 20, 25, 40, 10, 35, 15, 45]
    for log_probs in (None, 100):
        args = slime_args(
            max_tokens_per_gpu=100,
            packing_safety_margin=0.5,
            log_probs_max_tokens_per_gpu=log_probs,
        )
        schedule = build_dp_schedule(
            args, slime_tp(dp_size=2), lengths, global_batch_size=8,
            rollout_indices=list(range(8)),
        )  # fmt: skip
        assert schedule.forward_only.micro_batch_indices == schedule.micro_batch_indices
    uniform = slime_args(
        max_tokens_per_gpu=100, packing_safety_margin=0.5, variable_seq_lengths=False
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedule = build_dp_schedule(
            uniform, slime_tp(dp_size=2), [50, 20, 90], global_batch_size=3,
            rollout_indices=[0, 1, 2],
        )  # fmt: skip
    assert max(max(rows) for rows in schedule.row_lengths) <= 100, schedule.row_lengths


def test_routing_replay_says_a_smaller_log_prob_budget_cannot_bind():
    """A re-probe: under routing replay the log-prob pass runs the training micro-batches, and a
    smaller --log-probs-max-tokens-per-gpu was ignored without a word."""
    args = slime_args(
        max_tokens_per_gpu=64, log_probs_max_tokens_per_gpu=16, use_routing_replay=True
    )
    with pytest.warns(UserWarning, match=r"--log-probs-max-tokens-per-gpu 16 is below .* routing"):
        schedule = build_dp_schedule(
            args, slime_tp(dp_size=2), [40, 10, 10, 10], global_batch_size=4,
            rollout_indices=[0, 1, 2, 3],
        )  # fmt: skip
    assert schedule.forward_only is None
