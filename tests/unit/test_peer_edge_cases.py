"""Edge cases from other schedulers' tests and bug reports, through our three public interfaces.

Each case names its source (docs/edge_cases.md has the table) and runs through one interface:
``megatron-dynbatch plan --json`` (the entry's ``main``; one case through a real subprocess),
slime's ``build_dp_schedule(args, train_parallel_config, total_lengths, global_batch_size=,
rollout_indices=)``, or Megatron-LM's ``validate_dynamic_batch_args``. The outcome is either a
schedule that keeps every sample exactly once, gives every DP rank the same micro-batch count (a
multiple of the interleaving group) and keeps the token cap (only a lone sample may exceed it), or
a ``DynBatchError`` whose message matches ``expect``. Anything else (a bare Python exception, a
lost sample) fails.
"""

import contextlib
import io
import json
import pathlib
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from megatron_dynbatch.adapters.slime import build_dp_schedule
from megatron_dynbatch.errors import DynBatchError
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    validate_dynamic_batch_args,
)
from megatron_dynbatch.tools.cli import main
from tests._support import TINY_SLIME_MODEL, megatron_lm_args

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]

OK = "ok"

# -- slime's build_dp_schedule ------------------------------------------------------------------


def _slime_args(**overrides):
    """A namespace like slime's tests' ``make_args`` (benchmarks/bench_slime_schedule.py)."""
    values = dict(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=64,
        micro_batch_size=1,
        balance_data=False,
        balance_by_flops=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        data_pad_size_multiplier=1,
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _layout(dp=1, cp=1, vpp=1, group=1):
    return {
        "dp_size": dp,
        "cp_size": cp,
        "vpp_size": vpp,
        "microbatch_group_size_per_vp_stage": group,
    }


_MODEL = TINY_SLIME_MODEL
_L4, _I4 = [10, 20, 30, 40], [0, 1, 2, 3]

# (source, id, args, layout, lengths, global_batch_size, rollout_indices, expect)
SLIME_CASES = [
    (
        "slime test_dp_schedule",
        "dynamic uniform",
        _slime_args(max_tokens_per_gpu=10),
        _layout(2),
        [5] * 8,
        8,
        list(range(8)),
        OK,
    ),
    (
        "slime test_dp_schedule",
        "oversized lands alone",
        _slime_args(max_tokens_per_gpu=10),
        _layout(2),
        [15] + [3] * 7,
        8,
        list(range(8)),
        OK,
    ),
    (
        "slime test_dp_schedule",
        "vpp rounds to group",
        _slime_args(max_tokens_per_gpu=8, pipeline_model_parallel_size=2),
        _layout(2, vpp=2, group=2),
        [4] * 32,
        16,
        list(range(32)),
        OK,
    ),
    (
        "slime test_dp_schedule",
        "rollouts kept together",
        _slime_args(max_tokens_per_gpu=12),
        _layout(1),
        [3] * 9,
        1,
        [0, 0, 0, 1, 1, 2, 2, 2, 2],
        OK,
    ),
    (
        "slime test_dp_schedule",
        "fewer rollouts than gbs",
        _slime_args(max_tokens_per_gpu=12),
        _layout(1),
        [3] * 6,
        4,
        [0, 0, 1, 1, 2, 2],
        OK,
    ),
    (
        "slime test_dp_schedule",
        "static balance with model dims",
        _slime_args(use_dynamic_batch_size=False, balance_data=True, **_MODEL),
        _layout(2),
        [1, 2, 3, 4, 5, 7, 9, 10],
        8,
        list(range(8)),
        OK,
    ),
    (
        "slime test_dp_schedule",
        "static balance, no model dims",
        _slime_args(use_dynamic_batch_size=False, balance_data=True),
        _layout(2),
        _L4,
        4,
        _I4,
        "balance-data.*missing or None: num_layers",
    ),
    (
        "slime test_dp_schedule",
        "static count not aligned",
        _slime_args(use_dynamic_batch_size=False),
        _layout(3),
        _L4,
        4,
        _I4,
        "not a multiple of dp_size",
    ),
    (
        "slime PR #2065",
        "514 singletons at dp 4",
        _slime_args(max_tokens_per_gpu=10),
        _layout(4),
        [10] * 514,
        514,
        list(range(514)),
        OK,
    ),
    (
        "slime PR #2065",
        "514 singletons, dp 4, vpp group 2",
        _slime_args(max_tokens_per_gpu=10, pipeline_model_parallel_size=2),
        _layout(4, vpp=2, group=2),
        [10] * 514,
        514,
        list(range(514)),
        OK,
    ),
    (
        "slime PR #1860",
        "one sample, dp 8, vpp group 4",
        _slime_args(pipeline_model_parallel_size=2),
        _layout(8, vpp=2, group=4),
        [5],
        1,
        [0],
        OK,
    ),
    ("slime PR #1860", "dp larger than the samples", _slime_args(), _layout(64), _L4, 4, _I4, OK),
    (
        "SkyRL #1483",
        "multi-turn: uneven samples per rollout, gbs not dividing",
        _slime_args(max_tokens_per_gpu=32),
        _layout(2),
        [9, 3, 7, 30, 2, 2, 5],
        2,
        [0, 0, 1, 2, 2, 2, 3],
        OK,
    ),
    (
        "SkyRL token batching",
        "all items equal, exactly the cap",
        _slime_args(max_tokens_per_gpu=10),
        _layout(1),
        [10] * 7,
        7,
        list(range(7)),
        OK,
    ),
    (
        "SkyRL token batching",
        "single oversized sequence",
        _slime_args(max_tokens_per_gpu=50),
        _layout(2),
        [100],
        1,
        [0],
        OK,
    ),
    (
        "verl seqlen balancing",
        "groups of a uid stay in one step",
        _slime_args(max_tokens_per_gpu=400),
        _layout(4),
        [100] * 4 + [200] * 4 + [150] * 4 + [50] * 4,
        2,
        [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4,
        OK,
    ),
    (
        "verl seqlen balancing",
        "lengths as a torch tensor",
        _slime_args(),
        _layout(2),
        torch.tensor(_L4),
        4,
        _I4,
        OK,
    ),
    (
        "verl seqlen balancing",
        "lengths as numpy int32",
        _slime_args(),
        _layout(2),
        list(np.array(_L4, dtype=np.int32)),
        4,
        _I4,
        OK,
    ),
    (
        "verl seqlen balancing",
        "lengths as numpy floats",
        _slime_args(),
        _layout(2),
        np.array(_L4, dtype=float),
        4,
        _I4,
        r"total_lengths\[0\]=.*not an integer",
    ),
    (
        "issues",
        "zero-length sample",
        _slime_args(),
        _layout(2),
        [0, 20, 30, 40],
        4,
        _I4,
        r"total_lengths\[0\]=0 must be >= 1",
    ),
    ("issues", "empty batch", _slime_args(), _layout(2), [], 1, [], "total_lengths is empty"),
    (
        "issues",
        "length above 2**40",
        _slime_args(),
        _layout(2),
        [2**41, 1, 1, 1],
        4,
        _I4,
        "above the supported maximum",
    ),
    ("issues", "string rollout ids", _slime_args(), _layout(2), _L4, 2, ["a", "a", "b", "c"], OK),
    ("issues", "negative rollout ids", _slime_args(), _layout(2), _L4, 2, [-1, -1, -2, -3], OK),
    (
        "issues",
        "tuple rollout ids",
        _slime_args(),
        _layout(2),
        _L4,
        2,
        [(0, 1)] * 4,
        r"rollout_indices\[0\]=\(0, 1\)",
    ),
    (
        "issues",
        "rollout ids as a torch tensor",
        _slime_args(),
        _layout(2),
        _L4,
        4,
        torch.tensor(_I4),
        OK,
    ),
    (
        "issues",
        "fewer ids than lengths",
        _slime_args(),
        _layout(2),
        _L4,
        4,
        [0, 1],
        "got 2 rollout_indices for 4",
    ),
    (
        "issues",
        "global_batch_size 0",
        _slime_args(),
        _layout(2),
        _L4,
        0,
        _I4,
        "global_batch_size=0 must be >= 1",
    ),
    ("issues", "dp_size as a string", _slime_args(), _layout("2"), _L4, 4, _I4, r"dp_size'\]='2'"),
    (
        "issues",
        "no token budget",
        _slime_args(max_tokens_per_gpu=None),
        _layout(2),
        _L4,
        4,
        _I4,
        "--max-tokens-per-gpu",
    ),
    (
        "issues",
        "a budget under one padded sample",
        _slime_args(max_tokens_per_gpu=1, tensor_model_parallel_size=2),
        _layout(2),
        _L4,
        4,
        _I4,
        "smaller than one padded sample",
    ),
    (
        "issues",
        "interleaving group below pp",
        _slime_args(pipeline_model_parallel_size=4),
        _layout(2, vpp=2, group=2),
        _L4,
        4,
        _I4,
        "microbatch_group_size_per_vp_stage=2 is smaller than pp_size=4",
    ),
    (
        "issues",
        "args passed as a dict",
        {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 64},
        _layout(2),
        _L4,
        4,
        _I4,
        "args=dict must be slime's argument namespace",
    ),
    (
        "issues",
        "over the cap only once padded (tp 2)",
        _slime_args(max_tokens_per_gpu=7, tensor_model_parallel_size=2, oversize_samples="error"),
        _layout(1),
        [7, 3],
        2,
        [0, 1],
        r"7 tokens \(8 padded to a multiple of 2\)",
    ),
    (
        "verl PR #7553",
        "[7] x 8 under a cap of 8: no pair shares a micro-batch",
        _slime_args(max_tokens_per_gpu=8),
        _layout(2),
        [7] * 8,
        8,
        list(range(8)),
        OK,
    ),
    (
        "verl PR #5511",
        "5 long and 5 short samples, dp 2: equal counts",
        _slime_args(max_tokens_per_gpu=100),
        _layout(2),
        [95] * 5 + [20] * 5,
        10,
        list(range(10)),
        OK,
    ),
    (
        "EasyR1 #11012",
        "a rank with fewer samples than the count",
        _slime_args(max_tokens_per_gpu=100),
        _layout(4),
        [100] * 9 + [3] * 2,
        11,
        list(range(11)),
        OK,
    ),
    (
        "slime #1838",
        "trailing empty partitions become placeholders",
        _slime_args(max_tokens_per_gpu=64, pipeline_model_parallel_size=2),
        _layout(4, vpp=2, group=2),
        [60, 50, 5, 5, 5],
        5,
        list(range(5)),
        OK,
    ),
    (
        "slime PR #866",
        "the budget is max_tokens_per_gpu x cp",
        _slime_args(max_tokens_per_gpu=64, oversize_samples="error"),
        _layout(2, cp=2),
        [100, 120, 28],
        3,
        [0, 1, 2],
        OK,
    ),
    (
        "miles PR #2197",
        "static: 5 samples, mbs 2, dp 2",
        _slime_args(use_dynamic_batch_size=False, micro_batch_size=2),
        _layout(2),
        [5] * 5,
        5,
        list(range(5)),
        "num_mbs \\(3\\) is not a multiple of dp_size \\* mb_group \\(2\\)",
    ),
    (
        "Trinity-RFT #398",
        "a sample over the budget under error",
        _slime_args(max_tokens_per_gpu=64, oversize_samples="error"),
        _layout(2),
        [65, 3],
        2,
        [0, 1],
        "at least 65",
    ),
    (
        "NeMo-RL BatchedDataDict",
        "long sequences each alone over 2 shards",
        _slime_args(max_tokens_per_gpu=1024),
        _layout(2),
        [900, 850, 1000, 950],
        4,
        _I4,
        OK,
    ),
    (
        "NeMo-RL packing tests",
        "mixed sizes at dp 4",
        _slime_args(max_tokens_per_gpu=100),
        _layout(4),
        [10, 50, 100, 20, 80, 30, 70, 40, 60, 90],
        10,
        list(range(10)),
        OK,
    ),
    (
        "verl seqlen balancing",
        "lengths as a bool tensor",
        _slime_args(),
        _layout(2),
        torch.tensor([True] * 4),
        4,
        _I4,
        r"total_lengths\[0\]=tensor\(True\)",
    ),
    (
        "verl seqlen balancing",
        "lengths as an [N, 1] tensor",
        _slime_args(),
        _layout(2),
        torch.tensor([[n] for n in _L4]),
        4,
        _I4,
        r"total_lengths\[0\]=tensor\(\[10\]\)",
    ),
    (
        "verl seqlen balancing",
        "lengths as a 0-d tensor",
        _slime_args(),
        _layout(1),
        torch.tensor(5),
        1,
        [0],
        "total_lengths must be a sequence",
    ),
    (
        "issues",
        "lengths as a set",
        _slime_args(),
        _layout(2),
        {10, 20},
        2,
        [0, 1],
        "total_lengths must be a sequence .* got set",
    ),
    (
        "issues",
        "rollout ids as a set",
        _slime_args(),
        _layout(2),
        [10, 20],
        2,
        {0, 1},
        "rollout_indices must be a sequence .* got set",
    ),
]


def _check_slime(schedule, lengths, ids, dp, group, cap):
    partitions, micro_batch_indices, num_microbatches, global_batch_sizes = schedule
    seen = []
    for r in range(dp):
        assert len(micro_batch_indices[r]) == sum(num_microbatches)
        flat = [i for mb in micro_batch_indices[r] for i in mb]
        assert flat == list(range(len(partitions[r])))
        seen += partitions[r]
        for mb in micro_batch_indices[r]:
            if sum(lengths[partitions[r][i]] for i in mb) > cap:
                assert len(mb) == 1, "only a lone sample may exceed the cap"
    assert all(n % group == 0 for n in num_microbatches)
    assert sorted(seen) == list(range(len(lengths))), "every sample exactly once"
    assert sum(global_batch_sizes) == len(set(ids))


@pytest.mark.parametrize(
    "source, name, args, layout, lengths, gbs, ids, expect",
    SLIME_CASES,
    ids=[f"{c[0]}: {c[1]}" for c in SLIME_CASES],
)
def test_slime_build_dp_schedule(source, name, args, layout, lengths, gbs, ids, expect):
    call = lambda: build_dp_schedule(  # noqa: E731
        args, layout, lengths, global_batch_size=gbs, rollout_indices=ids
    )
    if expect != OK:
        with pytest.raises(DynBatchError, match=expect):
            call()
        return
    schedule = call()
    plain = [int(n) for n in lengths]
    group = layout["microbatch_group_size_per_vp_stage"] if layout["vpp_size"] > 1 else 1
    cap = args.max_tokens_per_gpu * layout["cp_size"]
    _check_slime(
        schedule,
        plain,
        [int(i) if hasattr(i, "item") else i for i in ids],
        layout["dp_size"],
        group,
        cap,
    )


# -- megatron-dynbatch plan --json --------------------------------------------------------------

_CAP = ["--max-tokens-per-gpu", "64"]
_MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]

# (source, id, SAMPLES.json value, flags, expect)
CLI_CASES = [
    ("SkyRL token batching", "basic packing", [10, 10, 5, 5], ["--max-tokens-per-gpu", "15"], OK),
    (
        "SkyRL token batching",
        "single large item",
        [10, 1, 1, 1, 1, 1],
        ["--max-tokens-per-gpu", "10"],
        OK,
    ),
    (
        "SkyRL token batching",
        "oversized, allowed",
        [100, 10, 10],
        ["--max-tokens-per-gpu", "50", "--oversize-samples", "allow"],
        OK,
    ),
    (
        "SkyRL token batching",
        "oversized, truncated",
        [100, 10, 10],
        ["--max-tokens-per-gpu", "50", "--oversize-samples", "truncate", "--dp-size", "2"],
        OK,
    ),
    (
        "SkyRL token batching",
        "oversized, refused",
        [100, 10, 10],
        ["--max-tokens-per-gpu", "50", "--oversize-samples", "error"],
        "sample 0: 100 tokens",
    ),
    (
        "verl seqlen balancing",
        "same micro-batch count over dp 8",
        list(range(1, 41)),
        ["--max-tokens-per-gpu", "60", "--dp-size", "8"],
        OK,
    ),
    (
        "verl seqlen balancing",
        "vpp divisibility (pp 2, vpp 2, group 3)",
        [5] * 5,
        _CAP + ["--pp-size", "2", "--vpp-size", "2", "--microbatch-group-size-per-vp-stage", "3"],
        OK,
    ),
    (
        "verl seqlen balancing",
        "one sample over dp 8 with vpp",
        [5],
        _CAP + ["--dp-size", "8", "--pp-size", "2", "--vpp-size", "2"],
        OK,
    ),
    (
        "NeMo-RL packing",
        "bins a multiple of dp, tp x cp padding",
        [63, 64, 65],
        _CAP + ["--tp-size", "4", "--cp-size", "2", "--oversize-samples", "allow"],
        OK,
    ),
    (
        "NeMo-RL packing",
        "GRPO groups with prompt lengths",
        [{"length": 30, "rollout": "g0", "prompt_length": 10}] * 4
        + [{"prompt_length": 5, "response_length": 50, "rollout": "g1"}] * 4,
        _CAP + ["--dp-size", "2", "--rollouts-per-step", "1"],
        OK,
    ),
    (
        "SkyRL #1483",
        "rollouts per step not dividing",
        [5, 5, 5, 5, 5],
        _CAP + ["--rollouts-per-step", "2", "--dp-size", "2"],
        OK,
    ),
    ("issues", "all lengths equal to the cap", [64, 64, 64], _CAP + ["--dp-size", "2"], OK),
    ("issues", "empty SAMPLES.json", [], _CAP, "no samples"),
    ("issues", "a JSON object, not an array", {}, _CAP, "must hold a JSON array"),
    ("issues", "zero-length sample", [0], _CAP, "integers >= 1"),
    ("issues", "float length", [2.0], _CAP, "integers >= 1"),
    (
        "issues",
        "bool rollout id",
        [{"length": 3, "rollout": True}],
        _CAP,
        "rollout id True has type bool",
    ),
    ("issues", "dp 0", [5], _CAP + ["--dp-size", "0"], "--dp-size=0 must be >= 1"),
    # A probe of plan / verify: the refused cap named no value, and the fixed planner's
    # refusal named a policy the user never passed.
    (
        "probe",
        "an oversize refusal names the cap that holds the sample",
        [100, 101, 20],
        ["--tp-size", "2", "--max-tokens-per-gpu", "101", "--oversize-samples", "error"],
        r"\(102 padded to a multiple of 2\)\. Raise --max-tokens-per-gpu to at least 102,",
    ),
    (
        "probe",
        "the fixed planner's refusal names the cap that holds the longest",
        [40, 300],
        _CAP + ["--dynamic-batch-planner", "fixed", "--dynamic-batch-layout", "padded"],
        r"the oversize policy, here allow, applies to planner 'dynbatch' only\); raise "
        r"--max-tokens-per-gpu to at least 300 or",
    ),
    (
        "issues",
        "absurd dp forcing placeholders",
        [5],
        _CAP + ["--dp-size", "100000"],
        "limit 65536",
    ),
    (
        "issues",
        "vpp without pp",
        [5],
        _CAP + ["--vpp-size", "2"],
        "--vpp-size=2 needs --pp-size >= 2",
    ),
    (
        "issues",
        "padded layout with the model flags",
        [5, 6],
        _CAP + ["--layout", "padded", *_MODEL_FLAGS],
        OK,
    ),
    (
        "issues",
        "--variable-seq-lengths with --layout padded",
        [5, 6],
        _CAP + ["--layout", "padded", "--variable-seq-lengths"],
        "--variable-seq-lengths needs --layout packed",
    ),
    (
        "issues",
        "negative cost weight names the CLI flag",
        [5],
        _CAP + ["--cost-attention-weight", "-1"],
        r"--cost-attention-weight=-1\.0 must be >= 0\.$",
    ),
    (
        "issues",
        "--min-gain 2 names the CLI flag",
        [5],
        _CAP + ["--min-gain", "2"],
        r"^megatron-dynbatch plan: error: --min-gain=2",
    ),
    (
        "issues",
        "a memory budget under one micro-batch names --max-memory-gib alone",
        [5],
        _CAP + [*_MODEL_FLAGS, "--max-memory-gib", "0.000001"],
        "error: the memory budget .* raise --max-memory-gib",
    ),
    (
        "Megatron-LM",
        "hidden size not a multiple of the heads",
        [5],
        _CAP + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "3"],
        "hidden_size=64 is not a multiple of num_attention_heads=3",
    ),
    (
        "Megatron-LM",
        "--fp16 and --bf16 together",
        [5],
        _CAP + [*_MODEL_FLAGS, "--fp16", "--bf16"],
        "--fp16 and --bf16 both given",
    ),
    (
        "issues",
        "--max-memory-gib 0",
        [5],
        _CAP + [*_MODEL_FLAGS, "--max-memory-gib", "0"],
        "--max-memory-gib 0.0 must be a number of GiB > 0",
    ),
    (
        "issues",
        "--max-memory-gib nan",
        [5],
        _CAP + [*_MODEL_FLAGS, "--max-memory-gib", "nan"],
        "--max-memory-gib nan must be",
    ),
    (
        "issues",
        "--planner ':'",
        [5],
        _CAP + ["--planner", ":"],
        "must be 'module:name' with both parts",
    ),
    (
        "issues",
        "tp 2 pads a cap-length sample over the cap",
        [7, 3],
        ["--max-tokens-per-gpu", "7", "--tp-size", "2", "--oversize-samples", "error"],
        r"7 tokens \(8 padded to a multiple of 2\)",
    ),
    (
        "verl PR #7553",
        "[7] x 8 under a cap of 8",
        [7] * 8,
        ["--max-tokens-per-gpu", "8", "--dp-size", "2"],
        OK,
    ),
    (
        "NeMo labs-molt #52",
        "padded footprint B x S within the cap",
        [10, 30, 31, 60, 2, 2],
        _CAP + ["--layout", "padded", "--dp-size", "2"],
        OK,
    ),
    (
        "issues",
        "--planner fixed with --oversize-samples truncate",
        [1000000, 5, 5],
        _CAP + ["--planner", "fixed", "--layout", "padded", "--oversize-samples", "truncate"],
        "applies to planner 'dynbatch' only",
    ),
    ("NeMo-RL packing tests", "single item", [50], ["--max-tokens-per-gpu", "100"], OK),
    ("NeMo-RL packing tests", "all the same size", [30] * 5, ["--max-tokens-per-gpu", "100"], OK),
    (
        "NeMo-RL packing tests",
        "every item at the capacity",
        [100] * 3,
        ["--max-tokens-per-gpu", "100"] + ["--dp-size", "2"],
        OK,
    ),
    (
        "NeMo-RL packing tests",
        "mixed sizes",
        [10, 50, 100, 20, 80, 30, 70, 40, 60, 90],
        ["--max-tokens-per-gpu", "100"] + ["--dp-size", "4"],
        OK,
    ),
    (
        "NeMo-RL packing tests",
        "an item over the capacity, error",
        [50, 150, 70],
        ["--max-tokens-per-gpu", "100"] + ["--oversize-samples", "error"],
        "sample 1: 150 tokens",
    ),
    (
        "NeMo-RL BatchedDataDict",
        "long sequences each alone over 2 shards",
        [900, 850, 1000, 950],
        ["--max-tokens-per-gpu", "1024", "--dp-size", "2"],
        OK,
    ),
]


def _run_plan(tmp_path, samples, flags):
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(samples))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", str(path), "--json", *flags])
    return code, out.getvalue(), err.getvalue()


def _check_plan(report, lengths, group):
    cap, seen = report["token_cap"], []
    for step in report["steps"]:
        count = step["num_microbatches"]
        assert len(step["ranks"]) == report["dp_size"]
        assert all(len(rank) == count for rank in step["ranks"]) and count % group == 0
        cut = set(step["truncated_samples"])
        for rank in step["ranks"]:
            for mb in rank:
                seen += mb
                if sum(lengths[i] for i in mb) > cap and not cut:
                    assert len(mb) == 1, "only a lone sample may exceed the cap"
    assert sorted(seen) == list(range(len(lengths))), "every sample exactly once"


@pytest.mark.parametrize(
    "source, name, samples, flags, expect", CLI_CASES, ids=[f"{c[0]}: {c[1]}" for c in CLI_CASES]
)
def test_cli_plan(tmp_path, source, name, samples, flags, expect):
    code, out, err = _run_plan(tmp_path, samples, flags)
    if expect != OK:
        assert code == 2 and out == ""
        lines = [line for line in err.splitlines() if not line.startswith("warning:")]
        assert len(lines) == 1, err
        assert re.search(expect, lines[0]), lines[0]
        return
    assert code == 0, err
    lengths = [
        (
            s
            if isinstance(s, int)
            else s.get("length", s.get("prompt_length", 0) + s.get("response_length", 0))
        )
        for s in samples
    ]
    values = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--")}
    vpp = int(values.get("--vpp-size", 1))
    group = int(values.get("--microbatch-group-size-per-vp-stage", values.get("--pp-size", 1)))
    _check_plan(json.loads(out), lengths, group if vpp > 1 else 1)


def test_cli_through_the_real_entry(tmp_path):
    """The installed entry point (``python -m megatron_dynbatch``) behaves as ``main`` does."""
    path = tmp_path / "samples.json"
    path.write_text("[5, 6]")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dynbatch", "plan", str(path), "--json", *_CAP]
        + ["--layout", "padded", *_MODEL_FLAGS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,  # this checkout's package, wherever pytest was started
    )
    assert proc.returncode == 0, proc.stderr
    _check_plan(json.loads(proc.stdout), [5, 6], 1)


# -- Megatron-LM's validate_dynamic_batch_args --------------------------------------------------


def _megatron_args(argv, **validated):
    given = dict(global_batch_size=8, micro_batch_size=1, seq_length=64)
    given.update(validated)
    return megatron_lm_args(["--use-dynamic-batch-size", *argv], **given)


# (source, id, argv after --use-dynamic-batch-size, what Megatron derived, expect)
MEGATRON_CASES = [
    ("Megatron-LM", "budget and seq length fit", _CAP, {}, OK),
    (
        "Megatron-LM",
        "budget under --seq-length",
        _CAP,
        {"seq_length": 128},
        "raise --max-tokens-per-gpu to at least 128",
    ),
    (
        "Megatron-LM",
        "vpp 2 with pp 2",
        _CAP,
        {"virtual_pipeline_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        OK,
    ),
    (
        "Megatron-LM",
        "group below pp",
        _CAP,
        {
            "virtual_pipeline_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "microbatch_group_size_per_vp_stage": 1,
        },
        "smaller than pp_size=2",
    ),
    (
        "verl dp divisibility",
        "global batch not a multiple of dp",
        _CAP,
        {"global_batch_size": 7},
        "multiple of 2",
    ),
    (
        "issues",
        "--micro-batch-size 0",
        _CAP,
        {"micro_batch_size": 0},
        "--micro-batch-size=0 must be >= 1",
    ),
    ("issues", "data-parallel size 0", _CAP, {"data_parallel_size": 0}, "dp_size=0 must be >= 1"),
    (
        "issues",
        "global batch size as a string",
        _CAP,
        {"global_batch_size": "8"},
        r"--global-batch-size='8' \(str\) is not an integer",
    ),
    (
        "issues",
        "--dynamic-batch-planner ':'",
        _CAP + ["--dynamic-batch-planner", ":"],
        {},
        "must be 'module:name'",
    ),
    ("issues", "no token budget", [], {}, "max_tokens_per_gpu is not set"),
    ("issues", "--max-memory-gib nan", ["--max-memory-gib", "nan"], {}, "max_memory_gib=nan"),
    (
        "issues",
        "--dynamic-batch-planner fixed with the packed layout",
        _CAP + ["--dynamic-batch-planner", "fixed"],
        {},
        "--dynamic-batch-planner fixed plans padded rows only.*--dynamic-batch-layout padded",
    ),
    (
        "probe",
        "--rollouts-per-step with a global batch that does not split over DP: change both",
        _CAP + ["--rollouts-per-step", "7"],
        {"global_batch_size": 7, "data_parallel_size": 2},
        r"--global-batch-size to a multiple of 2, e\.g\. 6 or 8, and --rollouts-per-step 7 to",
    ),
    (
        "probe",
        "a cost term that overflows is refused at start-up, naming its own flag",
        _CAP + ["--dynamic-batch-cost-attention-weight", "1e300"],
        {},
        r"attention_weight is the one too large: e\.g\. --dynamic-batch-cost-attention-weight 4e-5",
    ),
    (
        "probe",
        "an overflowing micro-batch overhead names its flag, not the attention weight",
        _CAP + ["--dynamic-batch-cost-microbatch-overhead", "1e308"],
        {},
        r"microbatch_overhead is the one too large: e\.g\. --dynamic-batch-cost-microbatch-overhead",
    ),
    (
        "issues",
        "--dynamic-batch-planner fixed with --dynamic-batch-layout padded",
        _CAP + ["--dynamic-batch-planner", "fixed", "--dynamic-batch-layout", "padded"],
        {},
        OK,
    ),
]


@pytest.mark.parametrize(
    "source, name, argv, validated, expect",
    MEGATRON_CASES,
    ids=[f"{c[0]}: {c[1]}" for c in MEGATRON_CASES],
)
def test_megatron_lm_arguments(source, name, argv, validated, expect):
    args = _megatron_args(argv, **validated)
    if expect != OK:
        with pytest.raises(DynBatchError, match=expect):
            validate_dynamic_batch_args(args)
        return
    assert validate_dynamic_batch_args(args) is not None


@pytest.mark.parametrize("samples, kind", [({}, "dict"), ("abc", "str")])
def test_verify_refuses_a_json_object_or_string_as_samples(samples, kind):
    """``verify --samples`` with ``{}`` said "no samples" and with ``"abc"`` read 'a', 'b', 'c'
    as samples; both are the wrong JSON type, refused before any rank starts."""
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig
    from megatron_dynbatch.tools.verify.spec import build_spec

    config = PlannerConfig(max_tokens_per_gpu=64, parallel=ParallelLayout())
    with pytest.raises(
        DynBatchError, match=f"must hold a JSON array of lengths or objects, got {kind}"
    ):
        build_spec(config, loss="token-mean", samples=samples)


def test_the_oversize_warning_shows_the_padded_length_once(tmp_path):
    """A 7-token sample is over a cap of 7 at tp 2 because it pads to 8: the warning says so."""
    flags = ["--max-tokens-per-gpu", "7", "--tp-size", "2", "--oversize-samples", "allow"]
    code, out, err = _run_plan(tmp_path, [7, 3], flags)
    assert code == 0, err
    assert "0 (7 tokens, 8 padded to a multiple of 2)" in err
    _check_plan(json.loads(out), [8, 4], 1)
