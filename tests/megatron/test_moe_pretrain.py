"""A tiny MoE through ``launch/train_gpt_dynbatch.sh``: with the z-loss on, dynamic equals fixed.

The demo's launcher as a user runs it (2 CPU processes, pp 2, mock documents), with Megatron-LM's
MoE flags (4 experts, top-2, all-to-all dispatcher) and ``--moe-z-loss-coeff 0.01``: dynamic
batching (packed rows, padding tails) and fixed micro-batches (``--document-samples``: every
document padded to ``--seq-length``) train the same samples, and both now hand Megatron's routers
the padding mask, so the per-token z-loss covers the same real tokens. lm loss within 1e-5
(relative) and identical learning rates at every iteration. The logged ``z_loss`` is Megatron's
mean of per-micro-batch means, a grouping-dependent report, and is not compared.
"""

from functools import partial

import pytest

from tests._support import (
    REPO,
    TORCHRUN_TIMEOUT_S,
    assert_same_training,
    compare_runs,
    run_shell,
    side_by_side,
)

pytestmark = pytest.mark.torchrun

_MOE = [
    "--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4,
    "--seq-length", 128, "--max-position-embeddings", 128, "--vocab-size", 128,
    "--micro-batch-size", 2, "--global-batch-size", 8, "--train-iters", 3,
    "--eval-iters", 0, "--eval-interval", 1000, "--seed", 7,
    "--num-experts", 4, "--moe-router-topk", 2, "--moe-token-dispatcher-type", "alltoall",
    "--disable-bias-linear", "--moe-z-loss-coeff", "0.01",
]  # fmt: skip


def _train(batching: str, log_path) -> dict:
    env = {
        "BATCHING": batching,
        "MAX_TOKENS_PER_GPU": "256",
        "GPUS_PER_NODE": "2",
    }  # no MASTER_PORT: the launch script's --standalone binds a port the kernel assigns
    command = "bash launch/train_gpt_dynbatch.sh " + " ".join(str(a) for a in _MOE)
    log = run_shell(command, REPO, log_path, env=env, timeout_s=TORCHRUN_TIMEOUT_S)
    return compare_runs.parse_text(log)


def test_moe_with_z_loss_trains_like_fixed_micro_batches(tmp_path):
    dynamic, fixed = side_by_side(  # two launches side by side
        [partial(_train, mode, tmp_path / f"{mode}.log") for mode in ("dynamic", "fixed")]
    )
    # The dynamic run packs rows (fewer computed tokens than fixed's padded ones) and pads them.
    assert any(record["computed"] > record["real"] for record in dynamic["iterations"].values())
    assert_same_training(dynamic, fixed, tolerance=1e-5)
