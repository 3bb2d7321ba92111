"""Every refusal of the Megatron-LM argument check names a fix that works (issue 37).

Table-driven: each case is an argument namespace the check refuses, the refusal it must give, and
the fixes its message names, read back out of the message (so a message naming a wrong value, as
``--global-batch-size 31`` at dp 2 once did with "set --micro-batch-size 1", fails here). Each fix
is applied to the namespace and the check must then pass. In-process, through the same function
the patched ``parse_and_validate_args`` calls, so no launch per case.
"""

import argparse
import re

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    add_dynamic_batch_args,
    validate_dynamic_batch_args,
)

pytestmark = pytest.mark.unit


def _args(**values):
    """A namespace as Megatron's parser and ``validate_args`` leave it (dp 2), with our flags."""
    args = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args([])
    base = dict(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=256,
        seq_length=128,
        global_batch_size=8,
        micro_batch_size=1,
        data_parallel_size=2,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        calculate_per_token_loss=True,
    )
    for key, value in {**base, **values}.items():
        setattr(args, key, value)
    return args


def _set(**values):
    """A fix that sets the given values (``{group}`` is replaced by the message's match)."""

    def fix(args, match):
        for key, value in values.items():
            if isinstance(value, str) and value.startswith("{"):
                value = int(match.group(int(value[1:-1])))
            setattr(args, key, value)

    return fix


# name: (namespace values, the refusal (regex, its groups read by the fixes), [fixes])
CASES = {
    "global batch not a multiple of dp": (
        dict(global_batch_size=31),
        r"set --global-batch-size to a multiple of 2, e\.g\. (\d+) or (\d+)\.",
        [_set(global_batch_size="{1}"), _set(global_batch_size="{2}")],
    ),
    "global batch not a multiple of dp, micro-batch size 3": (
        dict(global_batch_size=31, micro_batch_size=3),
        r"set --global-batch-size to a multiple of 2, e\.g\. (\d+) or (\d+), and "
        r"--micro-batch-size 1\.",
        [
            _set(global_batch_size="{1}", micro_batch_size=1),
            _set(global_batch_size="{2}", micro_batch_size=1),
        ],
    ),
    "micro-batch size not dividing the per-rank share": (
        dict(global_batch_size=8, micro_batch_size=3),
        r"set --micro-batch-size 1 \(or a divisor of (\d+)\)\.",
        [_set(micro_batch_size=1), _set(micro_batch_size="{1}")],
    ),
    "micro-batch size not dividing the validation share": (
        dict(global_batch_size=12, micro_batch_size=3, eval_global_batch_size=8),
        r"--eval-global-batch-size 8 .*set --micro-batch-size 1 \(or a divisor of (\d+)\)\.",
        [_set(micro_batch_size=1), _set(micro_batch_size="{1}")],
    ),
    "budget under --seq-length": (
        dict(max_tokens_per_gpu=64),
        r"raise --max-tokens-per-gpu to at least (\d+), lower --seq-length, or pass "
        r"--oversize-samples truncate .* or allow",
        [
            _set(max_tokens_per_gpu="{1}"),
            _set(seq_length=64),
            _set(oversize_samples="truncate"),
            _set(oversize_samples="allow"),
        ],
    ),
    "log-prob budget under --seq-length": (
        dict(log_probs_max_tokens_per_gpu=64),
        r"raise --log-probs-max-tokens-per-gpu to at least (\d+)",
        [_set(log_probs_max_tokens_per_gpu="{1}")],
    ),
    "our flag without the switch": (
        dict(use_dynamic_batch_size=False),
        r"--max-tokens-per-gpu given without --use-dynamic-batch-size, .* add "
        r"--use-dynamic-batch-size or drop them",
        [_set(use_dynamic_batch_size=True), _set(max_tokens_per_gpu=None)],
    ),
    "no budget": (
        dict(max_tokens_per_gpu=None),
        r"pass --max-tokens-per-gpu",
        [_set(max_tokens_per_gpu=256)],
    ),
    "per-token loss off": (
        dict(calculate_per_token_loss=False),
        r"add --calculate-per-token-loss",
        [_set(calculate_per_token_loss=True)],
    ),
    "rollouts per step and global batch differ": (
        dict(rollouts_per_step=4),
        r"set both to the rollouts per step, or drop --rollouts-per-step",
        [_set(global_batch_size=4), _set(rollouts_per_step=None)],
    ),
    "seq_aux_loss on packed rows": (
        dict(
            num_experts=4,
            moe_router_load_balancing_type="seq_aux_loss",
            moe_aux_loss_coeff=0.01,
            dynamic_batch_layout="packed",
        ),
        r"pass --dynamic-batch-layout padded .* or another load-balancing type",
        [_set(dynamic_batch_layout="padded"), _set(moe_router_load_balancing_type="aux_loss")],
    ),
    "variable rows on padded rows": (
        dict(dynamic_batch_layout="padded", dynamic_batch_variable_seq_lengths=True),
        r"--variable-seq-lengths needs --dynamic-batch-layout packed .*; drop one of them",
        [_set(dynamic_batch_layout=None), _set(dynamic_batch_variable_seq_lengths=False)],
    ),
    "budget under one padded sample": (
        dict(max_tokens_per_gpu=2, tensor_model_parallel_size=4, oversize_samples="allow"),
        r"raise --max-tokens-per-gpu to at least (\d+)",
        [_set(max_tokens_per_gpu="{1}")],
    ),
    "step batch-size schedule": (
        dict(step_batch_size_schedule="0:8"),
        r"give a fixed --global-batch-size \(samples per step\) instead",
        [_set(step_batch_size_schedule=None)],
    ),
    "batch-size ramp-up": (
        dict(rampup_batch_size=[4, 4, 100]),
        r"megatron-core 0.19 no longer ramps the batch up .*; remove --rampup-batch-size",
        [_set(rampup_batch_size=None)],
    ),
    "decrease batch size if needed": (
        dict(decrease_batch_size_if_needed=True),
        r"remove --decrease-batch-size-if-needed",
        [_set(decrease_batch_size_if_needed=False)],
    ),
    "iterations to skip": (
        dict(iterations_to_skip=[3]),
        r"remove --iterations-to-skip",
        [_set(iterations_to_skip=[])],
    ),
    "Megatron's RL step": (
        dict(perform_rl_step=True),
        r"remove --perform-rl-step",
        [_set(perform_rl_step=False)],
    ),
    "mock data and a data path": (
        dict(mock_data=True, data_path=["corpus_text_document"]),
        r"--mock-data and --data-path both given, .*; drop --mock-data to train on --data-path, "
        r"or drop --data-path to train on --mock-data\.",
        [_set(mock_data=False), _set(data_path=None)],
    ),
    # A probe: the refusal named only the per-token loss, and with it Megatron's DDP asserted.
    "per-token loss off, gradients averaged in the collective": (
        dict(calculate_per_token_loss=False, ddp_average_in_collective=True),
        r"add --calculate-per-token-loss \(and remove --ddp-average-in-collective",
        [_set(calculate_per_token_loss=True, ddp_average_in_collective=False)],
    ),
    "gradients averaged in the collective": (
        dict(ddp_average_in_collective=True),
        r"remove --ddp-average-in-collective",
        [_set(ddp_average_in_collective=False)],
    ),
    "hybrid context parallelism": (
        dict(hybrid_context_parallel=True),
        r"remove --hybrid-context-parallel",
        [_set(hybrid_context_parallel=False)],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_refusal_names_a_fix_that_works(name):
    values, refusal, fixes = CASES[name]
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(**values))
    message = str(refused.value)
    match = re.search(refusal, message)
    assert match, message
    for fix in fixes:
        args = _args(**values)
        fix(args, match)
        validate_dynamic_batch_args(args)  # gets past the check: no refusal at all


def test_the_issue_case_no_longer_names_the_micro_batch_size():
    """--global-batch-size 31 --micro-batch-size 1 at dp 2 said "set --micro-batch-size 1"."""
    with pytest.raises(DynBatchValueError, match="e.g. 30 or 32") as refused:
        validate_dynamic_batch_args(_args(global_batch_size=31))
    assert "set --micro-batch-size" not in str(refused.value)


@pytest.mark.parametrize(
    "values, least",
    [
        # tp 4 pads a 1002-token sample to 1004: "at least 1002" passed here and the first
        # 1002-token sample was refused by the planner.
        (dict(seq_length=1002, tensor_model_parallel_size=4, max_tokens_per_gpu=512), 1004),
        # cp 2: the planner's cap is the budget x cp, and each sample pads to tp x cp x 2.
        (dict(seq_length=4097, context_parallel_size=2, max_tokens_per_gpu=1024), 2050),
    ],
)
def test_the_budget_named_for_seq_length_plans_a_seq_length_sample(values, least):
    from megatron_dynbatch.integrations.megatron_lm.arguments import parallel_layout_from_args
    from megatron_dynbatch.planning import plan_schedule

    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(**values))
    message = str(refused.value)
    assert f"raise --max-tokens-per-gpu to at least {least}," in message, message
    config = validate_dynamic_batch_args(_args(**{**values, "max_tokens_per_gpu": least}))
    args = _args(**{**values, "max_tokens_per_gpu": least})
    planner = config.planner_config(parallel_layout_from_args(args))
    plan = plan_schedule([values["seq_length"]], config=planner)
    assert plan.stats.oversize_samples == ()
    # One token less is refused here, not at a step.
    with pytest.raises(DynBatchValueError, match=f"to at least {least},"):
        validate_dynamic_batch_args(_args(**{**values, "max_tokens_per_gpu": least - 1}))


def test_a_budget_that_holds_seq_length_over_context_parallel_ranks_is_accepted():
    """--seq-length 4096 at cp 2 with --max-tokens-per-gpu 2048: the planner's cap is 4096; the
    check compared 2048 with 4096 and refused a run that plans."""
    validate_dynamic_batch_args(
        _args(seq_length=4096, context_parallel_size=2, max_tokens_per_gpu=2048)
    )
