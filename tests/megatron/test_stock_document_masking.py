"""Megatron's stock document-masked path trains on CPU at pp 2 through the reference attention.

``BATCHING=stock ... --dataloader-inter-document-masking``: megatron-core's ``GPTDataset``
returns ``cu_seqlens`` per window and the stock forward step hands the model THD
``PackedSeqParams``, which Megatron's local ``DotProductAttention`` refuses ("Packed sequence is
not supported by DotProductAttention"). With ``--dynamic-batch-attention auto`` on CPU the launch
installs the reference THD attention for those rows (torch-varlen on a GPU), so the stock arm a
user would compare with trains here too.
"""

import math
import re

import pytest

from tests._support import REPO, TORCHRUN_TIMEOUT_S, compare_runs, run_shell

pytestmark = pytest.mark.torchrun

_TINY = [
    "--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4,
    "--seq-length", 128, "--max-position-embeddings", 128, "--vocab-size", 128,
    "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 2,
    "--eval-iters", 0, "--eval-interval", 1000, "--seed", 7,
    "--dataloader-inter-document-masking",
]  # fmt: skip


def test_stock_with_document_masking_trains_at_pp2_on_cpu(tmp_path):
    # No MASTER_PORT: the launch script then rendezvouses on a port the kernel assigns as it
    # binds (a port picked free here and bound later could be taken in between).
    env = {"BATCHING": "stock", "GPUS_PER_NODE": "2"}
    command = "bash launch/train_gpt_dynbatch.sh " + " ".join(str(a) for a in _TINY)
    log = run_shell(command, REPO, tmp_path / "stock.log", env=env, timeout_s=TORCHRUN_TIMEOUT_S)
    assert "> core attention: reference" in log, log[-3000:]
    # The rows reached the attention as THD: a packed row of 2 x 128 tokens, several documents.
    packed = re.search(
        r"reference THD attention: a packed row of (\d+) tokens, (\d+) segments", log
    )
    assert packed and int(packed.group(1)) == 256 and int(packed.group(2)) > 1, log[-3000:]
    iterations = compare_runs.parse_text(log)["iterations"]
    assert sorted(iterations) == [1, 2], log[-3000:]
    assert all(math.isfinite(record["loss"]) for record in iterations.values())
