"""The Megatron-LM entry under torchrun: refusals at argument time, and TensorBoard figures.

Bad arguments (issue 19): every Megatron 0.19 batch-size feature that cannot mean "samples per
step" is refused, our flags without ``--use-dynamic-batch-size`` are refused, every budget is
checked against ``--seq-length`` at start-up, and a bad value is one line (rank 0 only, no
argparse usage, no traceback, before Megatron prints its arguments). TensorBoard: Megatron's own
writer gets the ``dynbatch/*`` scalars of every iteration, read back with tensorboard's
``EventAccumulator``; so does Megatron's W&B writer (``--wandb-project``), through a recording
stand-in for the ``wandb`` client, which is not installed here.
"""

import pathlib
import re

import pytest

from tests._support import LAUNCH, REPO, parse_ok, torchrun

pytestmark = pytest.mark.torchrun

# Tiny GPT on mock documents (seq 128), two ranks (pp 2): every refusal must be one line.
_BASE = [
    "--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4,
    "--seq-length", 128, "--max-position-embeddings", 128,
    "--micro-batch-size", 1, "--global-batch-size", 8, "--train-iters", 2, "--eval-iters", 0,
    "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 128,
    "--log-interval", 1, "--calculate-per-token-loss", "--hidden-dropout", 0,
    "--attention-dropout", 0, "--seed", 7, "--pipeline-model-parallel-size", 2,
]  # fmt: skip
_DYNAMIC = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", 256]


def _without(args, flag, values=1):
    i = args.index(flag)
    return args[:i] + args[i + 1 + values :]


_REFUSALS = {
    # Megatron 0.19's batch ramp: it would keep the batch at one sample and log the schedule's.
    "step-batch-size-schedule": (
        _without(_BASE, "--global-batch-size") + _DYNAMIC + ["--step-batch-size-schedule", "0:8"],
        "--use-dynamic-batch-size cannot be combined with --step-batch-size-schedule",
    ),
    # Our budget without the switch would silently run fixed micro-batches.
    "stray-budget": (
        _BASE + ["--max-tokens-per-gpu", 256],
        "--max-tokens-per-gpu given without --use-dynamic-batch-size",
    ),
    # The evaluation (log-prob) budget below --seq-length: found now, not at the first evaluation.
    "eval-budget": (
        _BASE + _DYNAMIC + ["--log-probs-max-tokens-per-gpu", 64],
        "--log-probs-max-tokens-per-gpu 64 is smaller than --seq-length 128",
    ),
}

# Runs the launch script's set-up once, then its main() once per case (each stops with SystemExit
# at argument time), printing each exit status: one process instead of one launch per refusal.
_DRIVER = """
import json, runpy, sys
runpy.run_path(sys.argv[1], run_name="setup")
from megatron_dynbatch.integrations.megatron_lm.pretrain_gpt import main
for name, argv in json.loads(sys.argv[2]).items():
    print(f"=== {name}", file=sys.stderr, flush=True)
    try:
        main(argv)
    except SystemExit as stop:
        print(f"=== exit {stop.code}", file=sys.stderr, flush=True)
"""


def _assert_one_line(log, expected, *, count=1, launcher=False):
    errors = [line for line in log.splitlines() if ": error:" in line]
    assert len(errors) == count and expected in errors[0], log[-3000:]
    # No usage dump, no argument dump (refused before Megatron prints them), no traceback.
    assert "usage:" not in log and "arguments ------" not in log, log[-3000:]
    assert f'File "{REPO / "megatron_dynbatch"}' not in log, log[-3000:]
    # torchrun reports a failed worker with its own traceback (of the launcher, not the worker).
    assert launcher or "Traceback" not in log, log[-3000:]
    assert not re.search(r"^\[rank\d\]:.*Traceback", log, flags=re.M), log[-3000:]


def test_batch_size_features_and_budgets_are_refused_at_argument_time(tmp_path):
    import json
    import subprocess
    import sys

    cases = {name: [str(a) for a in args] for name, (args, _) in _REFUSALS.items()}
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(LAUNCH), json.dumps(cases)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    (tmp_path / "refusals.log").write_text(result.stdout)
    assert result.returncode == 0, result.stdout[-3000:]
    found = re.findall(r"=== (\S+)\n(.*?)=== exit (\d+)", result.stdout, flags=re.S)
    assert sorted(name for name, _, _ in found) == sorted(_REFUSALS), result.stdout[-3000:]
    for name, body, code in found:
        assert code == "2", (name, body)
        _assert_one_line(body, _REFUSALS[name][1])


def test_a_bad_value_is_one_line_from_rank_0_under_torchrun(tmp_path):
    args = _BASE + ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "lots"]
    rc, log, _ = torchrun(2, LAUNCH, args, log_path=tmp_path / "bad.log")
    assert rc != 0 and " iteration        1/" not in log
    # argparse's own message, once for both ranks, without its ~780-line usage.
    _assert_one_line(log, "argument --max-tokens-per-gpu: invalid int value: 'lots'", launcher=True)


# W&B's client is not installed here (it talks to a server); this stand-in takes the calls Megatron
# makes on its wandb writer (global_vars._set_wandb_writer: init, config.update, log, finish) and
# records them, so the test sees what Megatron's own writer hands to W&B.
_WANDB_STAND_IN = """
import json, os

class _Config(dict):
    def update(self, values=None, **kwargs):
        dict.update(self, values or {}, **kwargs)

config = _Config()
run = None

def _record(entry):
    with open(os.environ["WANDB_STAND_IN_LOG"], "a") as handle:
        # Megatron logs some values as one-element tensors, which wandb accepts.
        handle.write(json.dumps(entry, default=float) + "\\n")

def init(**kwargs):
    _record({"init": kwargs.get("project")})

def log(values, step=None):
    _record({"step": step, "values": values})

def finish():
    _record({"finish": True})
"""


def test_tensorboard_and_wandb_get_the_dynamic_batching_scalars(tmp_path):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tensorboard"
    stand_in = tmp_path / "stand_in" / "wandb"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(_WANDB_STAND_IN)
    wandb_log = tmp_path / "wandb.jsonl"
    args = _BASE + _DYNAMIC + ["--tensorboard-dir", board, "--tensorboard-log-interval", 1]
    args += ["--wandb-project", "dynbatch", "--wandb-exp-name", "t", "--wandb-save-dir", tmp_path]
    env = {"PYTHONPATH": f"{stand_in.parent}:{REPO}", "WANDB_STAND_IN_LOG": str(wandb_log)}
    rc, log, _ = torchrun(2, LAUNCH, args, env=env, log_path=tmp_path / "train.log")
    parsed = parse_ok(rc, log)
    assert sorted(parsed["iterations"]) == [1, 2]
    files = sorted(pathlib.Path(board).rglob("events.out.tfevents.*"))
    assert files, f"no event files under {board}:\n{log[-3000:]}"
    scalars = {}
    for path in files:
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(
                (event.step, event.value) for event in accumulator.Scalars(tag)
            )
    ours = {tag: sorted(values) for tag, values in scalars.items() if tag.startswith("dynbatch/")}
    for tag in (
        "micro-batches per rank",
        "row length",
        "real tokens",
        "computed tokens",
        "fill",
        "dp imbalance",
        "placeholders",
        "planning seconds",
    ):
        assert [step for step, _ in ours.get(f"dynbatch/{tag}", [])] == [1, 2], (tag, ours)
    # The figures are the ones the iteration line prints (patch 0003), step by step.
    printed = re.findall(
        r"micro-batches/rank: (\d+) \[1x(\d+)\] \| real tokens: (\d+) \| computed tokens: (\d+)",
        log,
    )
    assert len(printed) == 2, log[-3000:]
    for step, (count, row, real, computed) in enumerate(printed, start=1):
        at = {tag: dict(values)[step] for tag, values in ours.items()}
        assert at["dynbatch/micro-batches per rank"] == int(count)
        assert at["dynbatch/row length"] == int(row)
        assert at["dynbatch/real tokens"] == int(real)
        assert at["dynbatch/computed tokens"] == int(computed)
        assert at["dynbatch/fill"] == pytest.approx(int(real) / int(computed), rel=1e-6)
        assert at["dynbatch/dp imbalance"] >= 1.0 and at["dynbatch/planning seconds"] >= 0.0
    # Megatron's own scalars are still there (its writer, not a second one).
    assert "batch-size" in scalars
    # W&B (on the last rank, as Megatron sets it up) got the same figures at the same steps.
    records = [json.loads(line) for line in wandb_log.read_text().splitlines()]
    assert records[0] == {"init": "dynbatch"} and records[-1] == {"finish": True}, records[:3]
    logged = {}
    for entry in records:
        for tag, value in entry.get("values", {}).items():
            logged.setdefault(tag, {})[entry["step"]] = value
    assert "batch-size" in logged, sorted(logged)
    for tag, values in ours.items():
        assert logged.get(tag) == pytest.approx(dict(values), rel=1e-6), (tag, logged.get(tag))
