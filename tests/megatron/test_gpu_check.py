"""The prepared GPU check (``benchmarks/gpu_check.py``) runs on the CPU with ``--tiny``, as CI runs it.

It launches Megatron-LM's entry through ``launch/train_gpt_dynbatch.sh`` in every arm of the GPU
check (fixed, stock, stock with document masking, dynamic packed and padded at the stock run's
measured memory; without CUDA these already run in fp32 on the reference attention, so the fp32
loss check reads fixed and dynamic packed), runs the kernel check, and prints the same table: the same code path a GPU machine takes, with a 2-layer model in fp32 and the reference
attention in place of torch-varlen (which needs CUDA). If the script rots (a renamed flag, a log
line it no longer finds), this fails.
"""

import subprocess
import sys

import pytest

from tests._support import REPO

pytestmark = pytest.mark.torchrun


def test_gpu_check_runs_tiny_on_cpu(tmp_path):
    report = tmp_path / "gpu.md"
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--tiny", "--out", str(tmp_path / "run")]
        + ["--documents", "600", "--train-iters", "3", "--jobs", "2", "--report", str(report)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert "`--dynamic-batch-attention reference`" in text, text
    for arm in ("fixed", "stock", "stock-masked", "dynamic-packed", "dynamic-padded"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {arm} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        # time, real tokens/s, vs best stock, computed tokens, peak measured: all measured.
        assert all(c not in ("nan", "") for c in cells[1:6]), row
    # The dynamic arms predict their peak; the kernel check ran (on CPU with its stand-in).
    assert "| dynamic-packed |" in text and "Kernel check (SDPA per segment (CPU stand-in" in text
    assert "**passed**" in text, text
    # The loss agreement is parsed from both runs' iteration lines, not assumed.
    worst = float(
        text.split("fp32 runs (reference attention): largest relative difference ")[1].split()[0]
    )
    assert worst <= 1e-5, text
