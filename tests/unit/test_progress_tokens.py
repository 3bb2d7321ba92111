"""``--log-progress`` with document samples: progress.txt counts the samples' own tokens."""

import time
from types import SimpleNamespace

import pytest

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim
from megatron_dynbatch.cpu.training_shim import provide_typing_override

apply_cpu_shim()
provide_typing_override()  # megatron.training uses Python 3.12's typing.override

from megatron.training import global_vars, training  # noqa: E402

from megatron_dynbatch.integrations.megatron_lm.progress import count_progress_tokens  # noqa: E402

pytestmark = pytest.mark.unit


class _Split:
    """Samples of 1,000,000 tokens each; records what it was asked."""

    def __init__(self):
        self.asked = []

    def tokens_in_first(self, count):
        self.asked.append(count)
        return count * 1_000_000


def test_progress_log_counts_the_consumed_samples_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(training, "append_to_progress_log", training.append_to_progress_log)
    args = SimpleNamespace(
        save=str(tmp_path), consumed_train_samples=3_000, seq_length=4_096, async_save=False,
        num_floating_point_operations_so_far=0.0, world_size=1,
    )  # fmt: skip
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    monkeypatch.setattr(training, "_TRAIN_START_TIME", time.time() - 1.0)
    training.append_to_progress_log(str(tmp_path), "Starting job")
    split = _Split()
    assert count_progress_tokens(split, lambda: args)
    assert not count_progress_tokens(split, lambda: args)  # wrapped once
    # Megatron's own function, as its train loop calls it at a checkpoint.
    training.compute_throughputs_and_append_to_progress_log(7, 1e12)
    line = (tmp_path / "progress.txt").read_text().splitlines()[-1]
    # 3,000 samples of 10**6 tokens: 3.00 billion, where Megatron counts 3,000 x 4,096 (0.01).
    assert "Iteration: 7" in line and line.endswith("Tokens (in billions): 3.00"), line
    assert split.asked == [3_000]
    # A line without the field is written as it is.
    training.append_to_progress_log(str(tmp_path), "Starting job")
    assert (tmp_path / "progress.txt").read_text().splitlines()[-1].endswith("Starting job")
