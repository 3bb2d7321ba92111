"""The Megatron-LM entry's output on bad input (issue 29), in one process.

Under torchrun every failing rank reports: the first to claim a message in torchrun's attempt
directory prints it, the others with the same message do not, every rank writes torchrun's error
file (its report's "Root Cause" then shows the line), and SIGTERM cannot cut the report short. A
bare ``assert`` (Megatron's ``assert args.save_interval is not None``) becomes its quoted source.
The launches themselves are in ``tests/megatron/test_megatron_lm_entry.py``.
"""

import json
import signal

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm import console

pytestmark = pytest.mark.unit


def _torchrun_env(monkeypatch, tmp_path, rank):
    """The environment torchrun gives local rank ``rank``: its error file under the attempt dir."""
    error_file = tmp_path / "attempt_0" / str(rank) / "error.json"
    error_file.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    return error_file


def test_an_error_every_rank_has_is_printed_once_and_reported_by_every_rank(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr("sys.argv", ["pretrain_gpt_dynbatch.py"])
    files = []
    for rank in (1, 0):  # rank 1 gets there first
        files.append(_torchrun_env(monkeypatch, tmp_path, rank))
        with pytest.raises(SystemExit) as stop:
            console.fail(ValueError("unrecognized arguments: --max-token-per-gpu 1024"))
        assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "pretrain_gpt_dynbatch.py: error: [rank 1] unrecognized arguments: "
        "--max-token-per-gpu 1024\n"
    )
    for rank, path in zip((1, 0), files, strict=True):
        message = json.loads(path.read_text())["message"]
        assert message["extraInfo"]["py_callstack"] == (
            f"pretrain_gpt_dynbatch.py: error: [rank {rank}] unrecognized arguments: "
            "--max-token-per-gpu 1024"
        )
        assert int(message["extraInfo"]["timestamp"]) > 0
    # A different error on the other rank is its own line.
    _torchrun_env(monkeypatch, tmp_path, 0)
    with pytest.raises(SystemExit):
        console.fail("a different error", code=1)
    assert (
        capsys.readouterr().err == "pretrain_gpt_dynbatch.py: error: [rank 0] a different error\n"
    )


def test_sigterm_is_ignored_while_the_line_is_written(tmp_path, monkeypatch):
    _torchrun_env(monkeypatch, tmp_path, 0)
    seen = []
    monkeypatch.setattr(console, "_first_to_claim", lambda text: seen.append(
        signal.getsignal(signal.SIGTERM)) or True)  # fmt: skip
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            console.fail("x")
        assert seen == [signal.SIG_IGN]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_torchrun_one_process_prints_without_a_rank(monkeypatch, capsys):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt_dynbatch.py"])
    for _ in range(2):  # no shared directory: every call prints
        with pytest.raises(SystemExit):
            console.fail("bad")
    assert capsys.readouterr().err == "pretrain_gpt_dynbatch.py: error: bad\n" * 2


# A bare assert as Megatron's validate_args has it (a file of its own: pytest rewrites the asserts
# of test modules, which would give this one a message).
_MEGATRON_CHECK = """
def validate_args(args):
    if args.save is not None:
        assert args.save_interval is not None
"""


_MEGATRON_MESSAGE_CHECK = """
def validate_args(args):
    if args.train_iters and not args.skip_train:
        # If we use iteration-based training, make sure the
        # sample-based options are off.
        assert args.train_samples is None, \\
            'expected iteration-based training'
"""


def _megatron_check_failure(tmp_path, source: str, name: str, **args) -> AssertionError:
    """The AssertionError of ``source``'s ``validate_args(args)``, run from a file laid out as
    Megatron's ``megatron/training/arguments.py``."""
    import importlib.util
    import types

    path = tmp_path / "megatron" / "training" / "arguments.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(AssertionError) as caught:
        module.validate_args(types.SimpleNamespace(**args))
    return caught.value


def test_a_megatron_message_that_names_no_flag_gets_the_flags_its_check_reads(tmp_path):
    """``--train-iters 4 --train-samples 64`` printed only "expected iteration-based training"
    (Megatron's message; a probe of the launch script)."""
    error = _megatron_check_failure(
        tmp_path,
        _MEGATRON_MESSAGE_CHECK,
        "fake_megatron_arguments_2",
        train_iters=4,
        skip_train=False,
        train_samples=64,
    )
    text = console.error_text(error)
    assert text.startswith("expected iteration-based training (Megatron's check `assert ")
    assert text.endswith("failed; check --train-samples)"), text
    # A message that names its flags, or an assert of ours, is left as it is.
    assert console.error_text(AssertionError("give --seq-length")) == "give --seq-length"
    assert console.error_text(AssertionError("an invariant")) == "an invariant"


def test_a_bare_assert_is_quoted_with_the_flags_it_reads(tmp_path):
    error = _megatron_check_failure(
        tmp_path, _MEGATRON_CHECK, "fake_megatron_arguments", save="ckpt", save_interval=None
    )
    assert str(error) == ""  # what used to print: "pretrain_gpt_dynbatch.py: error: "
    assert console.error_text(error) == (
        "Megatron's check `assert args.save_interval is not None` (megatron/training/arguments.py, "
        "line 4) failed; check --save-interval"
    )
    assert console.error_text(ValueError("a\n  b")) == "a b"


_MEGATRON_EVAL_CHECK = """
def validate_args(args):
    assert args.eval_global_batch_size % (args.eval_micro_batch_size * args.data_parallel_size) == 0, \\
        'eval_global_batch_size must be divisible'
"""


def test_a_quoted_check_names_only_flags_that_exist_and_those_derived_ones_come_from(tmp_path):
    """A probe: ``--micro-batch-size 3`` at dp 2 was told to "check --eval-global-batch-size,
    --eval-micro-batch-size, --data-parallel-size": no parser takes the last, and the flag the
    user gave (which ``eval_micro_batch_size`` defaults to) was not named."""
    error = _megatron_check_failure(
        tmp_path,
        _MEGATRON_EVAL_CHECK,
        "fake_megatron_arguments_3",
        eval_global_batch_size=8,
        eval_micro_batch_size=3,
        data_parallel_size=2,
    )
    text = console.error_text(error)
    assert "--data-parallel-size" not in text, text
    for flag in ("--eval-micro-batch-size", "--micro-batch-size", "--tensor-model-parallel-size"):
        assert flag in text, text


def test_a_dataloader_workers_error_is_its_own_message_without_the_traceback():
    """A probe (--document-samples, a token id over the vocabulary in document 150): torch's
    "Caught ... in DataLoader worker process 1. Original Traceback ..." filled the one line."""
    message = (
        "Caught DynBatchValueError in DataLoader worker process 1.\nOriginal Traceback (most "
        'recent call last):\n  File "/torch/utils/data/_utils/worker.py", line 374, in '
        "_worker_loop\n    data = fetcher.fetch(index)\n           ^^^^^^^^^^^^^^^^^^^^\n"
        "megatron_dynbatch.errors.DynBatchValueError: document 150 holds token id 226; pass "
        "--vocab-size 227 or more\n"
    )
    text = console.error_text(DynBatchValueError(message))
    assert text == "document 150 holds token id 226; pass --vocab-size 227 or more", text


def test_print_rank_0_prints_on_rank_0_only_before_process_groups(monkeypatch, capsys):
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        console.print_rank_0(f"from {rank}")
    assert capsys.readouterr().out == "from 0\n"
