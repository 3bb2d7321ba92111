"""The prepared GPU check (``benchmarks/gpu_check.py``) runs on the CPU with ``--tiny``, as CI runs it.

It launches Megatron-LM's entry twice through ``launch/train_gpt_dynbatch.sh`` (fixed, then dynamic
at the fixed run's measured memory), so this is the same code path a GPU machine takes, with a
2-layer model in fp32: if the script rots (a renamed flag, a log line it no longer finds), this fails.
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
        + ["--documents", "600", "--train-iters", "3", "--report", str(report)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert "| time per iteration (ms) |" in text and "dynamic / fixed time" in text, text
    assert "Loss, fp32 runs: largest relative difference" in text, text
    # The loss agreement is parsed from both runs' iteration lines, not assumed.
    worst = float(text.split("largest relative difference ")[1].split()[0])
    assert worst <= 1e-5, text
