"""slime's ``--max-memory-gib`` through slime's own argument parsing, patched by ``patches/slime``.

With ``SLIME_DIR`` (a slime checkout at the commit named in ``patches/slime/README.md``), in one
gloo worker: slime's ``megatron_parse_args`` (Megatron's parser with slime's arguments, the
patched ``arguments.py`` registering ``--max-memory-gib``) parses a command line; the rollout side's
schedule (``megatron_dynbatch.adapters.slime.build_dp_schedule``, what patch 0001 calls) plans
under the budget it parsed, with more micro-batches than without it and every step predicted
within it; the trainer side takes the shipped predictions (``data_iterators``) and
``agree_on_step`` logs each step's predicted peak (on CPU: the measurement skipped, said so); a
budget too small for the longest sample stops with slime's flag and the smallest budget that works.
The stock checkout does not know the flag (Megatron's parser drops it, ``ignore_unknown_args``).

What is not slime's here: the modules slime imports for serving and logging are stubbed (as in
``test_slime_patched.py``; ``transformers`` too: slime reads a Hugging Face config only with
``--hf-checkpoint``), and ``typing.override`` is provided on Python 3.11 for ``megatron.training``.
"""

import os
import sys

import pytest

from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks
from tests._support import SLIME_STUBBED, patched_copy, stock_copy

pytestmark = pytest.mark.slime

SLIME_DIR = os.environ.get("SLIME_DIR")
STUBBED = SLIME_STUBBED + ("transformers",)
#: A tiny GPT at pp 2 (Megatron's flags, as a slime launch script gives them).
MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "256", "--vocab-size", "128", "--seq-length", "4096",
    "--max-position-embeddings", "4096", "--position-embedding-type", "rope",
    "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--rollout-batch-size", "4",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
]  # fmt: skip
#: Two steps of samples that the token budget alone packs into 4 micro-batches a step; under
#: 0.03 GiB (about 2,400 tokens a row on this model) they take 6.
LENGTHS = [1500, 1400, 1300, 1200, 1100, 1000, 1500, 1400, 1300, 1200, 1100, 1000]
ROLLOUTS = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


@pytest.fixture(scope="module")
def stock_slime(tmp_path_factory):
    return stock_copy(SLIME_DIR, "slime", tmp_path_factory.mktemp("slime_stock"))


@pytest.fixture(scope="module")
def patched_slime(tmp_path_factory, stock_slime):
    return patched_copy(stock_slime, "slime", tmp_path_factory.mktemp("slime_patched"))


def _parse(slime_root, argv):
    """slime's own parse of ``argv`` (Megatron's parser plus slime's arguments)."""
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim
    from megatron_dynbatch.cpu.training_shim import provide_typing_override
    from megatron_dynbatch.tools.testing.host_stubs import install_stubs

    apply_cpu_shim()  # megatron.core without triton (the worker's Layout applied it already)
    provide_typing_override()
    install_stubs(STUBBED)
    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        del sys.modules[name]
    sys.path.insert(0, slime_root)
    try:
        from slime.backends.megatron_utils.arguments import megatron_parse_args
        from slime.utils.arguments import get_slime_extra_args_provider

        saved, sys.argv = sys.argv, ["train.py", *argv]
        try:
            return megatron_parse_args(get_slime_extra_args_provider(), skip_hf_validate=True)
        finally:
            sys.argv = saved
    finally:
        sys.path.remove(slime_root)


def _rollout_data(schedule, lengths):
    """DP rank 0's rollout data as patch 0001 ships it (slime's keys plus ``rank_fields``)."""
    import torch

    partition = schedule.partitions[0]
    totals = [lengths[i] for i in partition]
    return {
        "partition": partition,
        "micro_batch_indices": schedule.micro_batch_indices[0],
        "num_microbatches": schedule.num_microbatches,
        "tokens": [torch.zeros(n, dtype=torch.long) for n in totals],
        "total_lengths": totals,
        "response_lengths": [n - 1 for n in totals],
        "loss_masks": [torch.ones(n - 1, dtype=torch.int) for n in totals],
        **schedule.rank_fields(0),
    }


def _body(slime_root, argv, patched):
    from megatron_dynbatch.errors import DynBatchValueError

    args = _parse(slime_root, argv)
    if not patched:
        return {"parsed": hasattr(args, "max_memory_gib")}
    from megatron_dynbatch.adapters.slime import build_dp_schedule
    from megatron_dynbatch.integrations.slime.backend import agree_on_step, data_iterators
    from megatron_dynbatch.integrations.slime.step_memory import STEP_PEAKS

    tp = {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}

    def build(gib):
        args.max_memory_gib = gib
        return build_dp_schedule(args, tp, LENGTHS, global_batch_size=2, rollout_indices=ROLLOUTS)

    parsed = args.max_memory_gib
    bounded, unbounded = build(parsed), build(None)
    steps = len(bounded.num_microbatches)
    result = {
        "parsed": parsed,
        "budget": bounded.memory.budget_bytes,
        "peaks": [max(max(rank[s]) for rank in bounded.memory.per_rank) for s in range(steps)],
        "counts": (sum(bounded.num_microbatches), sum(unbounded.num_microbatches)),
        "trained": sorted(i for p in bounded.partitions for i in p),
    }
    iterators = data_iterators(_rollout_data(bounded, LENGTHS), vpp_size=1, cp_size=1)
    STEP_PEAKS.lines.clear()
    for step, count in enumerate(bounded.num_microbatches):
        agree_on_step(args, iterators, count, step)
        iterators[0].offset += count  # slime's forward-backward consumes the step
    STEP_PEAKS.close()
    result["lines"] = list(STEP_PEAKS.lines)
    try:
        build(0.001)
    except DynBatchValueError as error:
        result["error"] = str(error)
    return result


def test_max_memory_gib_parses_in_slime_and_bounds_the_plan(stock_slime, patched_slime):
    argv = [*MODEL, "--max-memory-gib", "0.03"]
    [stock] = run_on_ranks(1, _body, stock_slime, argv, False, layout=Layout())
    assert stock == {"parsed": False}  # stock slime does not know the flag
    [mine] = run_on_ranks(1, _body, patched_slime, argv, True, layout=Layout())
    assert mine["parsed"] == 0.03 and mine["budget"] == int(0.03 * 2**30)
    assert max(mine["peaks"]) <= mine["budget"], mine
    bounded, unbounded = mine["counts"]
    assert bounded > unbounded, mine  # the budget bound the plan: more, smaller micro-batches
    assert mine["trained"] == list(range(len(LENGTHS)))
    lines = mine["lines"]
    assert len(lines) == len(mine["peaks"]), lines
    assert all("measured: skipped (no CUDA" in line for line in lines), lines
    assert "slime step 0: peak memory predicted (MiB)" in lines[0]
    assert "memory budget (MiB): 31" in lines[0]
    assert mine["error"].startswith("--max-memory-gib 0.001 is too small for one sample of 1500")
    assert "raise --max-memory-gib to at least" in mine["error"]
