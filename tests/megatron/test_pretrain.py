"""Megatron-LM's ``pretrain()`` as a user runs it: the launch script under torchrun, stock arguments.

Every case starts ``launch/pretrain_gpt_dynbatch.py`` (or ``pretrain_user_iterator.py``, a user's own
data iterator through the same set-up) with ``torchrun`` on gloo, and reads Megatron's own iteration
lines. Dynamic batching is compared with Megatron's fixed micro-batches on the same samples
(``--document-samples``): loss within 1e-5 (relative) and the learning rate identical at every
iteration, validation loss equal. Layouts: pp 2 (README command, indexed dataset built by the
documented command), pp 2 x dp 2 (4 processes; against the fixed micro-batches at pp 2, which
train the same), tp 2 x pp 2, pp 2 x vpp 2 (on ``--sft`` JSONL conversations); plus the stock path (no flag), a batch of the wrong size from a user iterator, and
save / resume in the middle of a multi-step batch.
Launches are few and tiny (hidden 32-64, 2-4 layers, seq <= 256): each costs ~10 s of start-up.
"""

import re
import shlex
import sys
from functools import partial

import pytest

from tests._support import (
    LAUNCH,
    REPO,
    TORCHRUN_TIMEOUT_S,
    assert_same_training,
    compare_runs,
    megatron_lm_args,
    parse_ok,
    readme_block,
    run_shell,
    side_by_side,
    torchrun,
    torchrun_chains,
)

pytestmark = pytest.mark.torchrun

USER_SCRIPT = REPO / "tests" / "megatron" / "pretrain_user_iterator.py"


# Tiny GPT on mock documents (seq 128: long-tailed lengths, some documents cut into pieces).
_TINY = [
    "--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4,
    "--seq-length", 128, "--max-position-embeddings", 128,
    "--micro-batch-size", 2, "--global-batch-size", 8,
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", 1,
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 128,
    "--log-interval", 1, "--calculate-per-token-loss", "--hidden-dropout", 0,
    "--attention-dropout", 0, "--seed", 7,
]  # fmt: skip
_DYNAMIC = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", 256]
_FIXED = ["--document-samples"]


# --- layouts: pp 2 x dp 2 (4 processes), tp 2 x pp 2, and interleaved pp 2 x vpp 2 on --sft data --


def _sft_file(path, count=60):
    import json
    import random

    rng = random.Random(5)
    words = "pipeline stage token budget rank loss gradient sample".split()
    with open(path, "w") as handle:
        for _ in range(count):
            messages = [{"role": "system", "content": "Answer."}]
            for _ in range(rng.randint(1, 2)):
                question = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
                answer = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
                messages += [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            handle.write(json.dumps({"messages": messages}) + "\n")


def _sft_args(data):
    """_TINY on the JSONL conversations of ``data`` (byte tokens) instead of mock documents."""
    args = [a for a in _TINY if a != "--mock-data"]
    args[args.index("--vocab-size") + 1] = 257
    return args + ["--sft", "--data-path", data, "--split", "90,10,0"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    _sft_file(out / "conversations.jsonl")
    runs = {}
    # The interleaved case also trains on --sft conversations (loss on the answers only).
    cases = {
        "pp2": (
            2,
            _TINY + ["--pipeline-model-parallel-size", 2, "--train-iters", 2, "--eval-iters", 0],
        ),
        "dp2": (
            4,
            _TINY + ["--pipeline-model-parallel-size", 2, "--train-iters", 2, "--eval-iters", 0],
        ),
        "tp2": (
            4,
            _TINY + [
                "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                "--train-iters", 2, "--eval-iters", 0,
            ],
        ),
        "vpp2": (
            2,
            _sft_args(out / "conversations.jsonl") + [
                "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1,
                "--train-iters", 3, "--eval-interval", 3, "--eval-iters", 1,
            ],
        ),
    }  # fmt: skip
    # vpp2 prices the local attention's dense mask (S^2 a row), so the planner packs micro-batches
    # of two rows of up to 128 tokens instead of one of 256 (issue 18): still the same training.
    dynamic = {"vpp2": _DYNAMIC + ["--dynamic-batch-cost-attention-weight", "0.01"]}
    modes = {"pp2": ["fixed"], "dp2": ["dynamic"]}
    chains = {}
    for name, (nproc, args) in cases.items():
        for mode in modes.get(name, ["dynamic", "fixed"]):
            flags = dynamic.get(name, _DYNAMIC) if mode == "dynamic" else _FIXED
            log_path = out / f"{name}-{mode}.log"
            chains[name, mode] = [(nproc, LAUNCH, args + flags, {"log_path": log_path})]
    # A 4-process launch beside a 2-process one where possible.
    order = [("dp2", "dynamic"), ("pp2", "fixed"), ("tp2", "dynamic"), ("vpp2", "dynamic")]
    chains = {key: chains[key] for key in order + [k for k in chains if k not in order]}
    for key, [(rc, log, _)] in torchrun_chains(chains).items():
        runs[key] = parse_ok(rc, log)
        runs[(*key, "log")] = log
    return runs


#: The fixed micro-batches each layout's dynamic run is compared with. Data parallelism splits the
#: batch, not the weights: Megatron's fixed micro-batches train the same samples from the same
#: weights at pp 2 x dp 2 as at pp 2, so pp 2 x dp 2's dynamic run is compared with the 2-process
#: pp 2 run (they agreed to 2e-7) instead of a 4-process fixed launch of its own. tp 2 initialises
#: other weights (loss 5.47 against 4.79 at iteration 1): it keeps its own fixed run.
_FIXED_OF = {"dp2": "pp2", "tp2": "tp2", "vpp2": "vpp2"}


@pytest.mark.parametrize("layout", ["dp2", "tp2", "vpp2"])
def test_dynamic_batching_trains_like_fixed_micro_batches(layouts, layout):
    assert_same_training(layouts[layout, "dynamic"], layouts[_FIXED_OF[layout], "fixed"])


def test_layouts_are_the_ones_asked_for(layouts):
    dp2 = layouts["dp2", "dynamic", "log"]
    assert "data-parallel size: 2" in dp2 and "pipeline-model-parallel size: 2" in dp2
    tp2 = layouts["tp2", "dynamic", "log"]
    assert "tensor-model-parallel size: 2" in tp2 and "data-parallel size: 1" in tp2
    vpp = layouts["vpp2", "dynamic", "log"]
    assert re.search(r"Number of virtual stages per pipeline stage: 2", vpp), vpp[-3000:]
    # Packed micro-batches of two rows ran (B x S within the 256-token budget).
    rows = [
        (int(b), int(s)) for b, s in re.findall(r"micro-batches/rank: \d+ \[(\d+)x(\d+)\]", vpp)
    ]
    assert any(b > 1 for b, _ in rows) and all(b * s <= 256 for b, s in rows), rows
    # Interleaving at pp 2 needs an even micro-batch count per rank: the planner's, not Megatron's.
    shapes = re.findall(r"micro-batches/rank: (\d+) ", vpp)
    assert shapes and all(int(m) % 2 == 0 for m in shapes)


def test_validation_runs_through_the_planner(layouts):
    vpp = layouts["vpp2", "dynamic"]
    assert [i for i, _ in vpp["validation"]] == [3]


def test_sft_conversations_are_read_as_samples(layouts):
    # The interleaved layout above trained on --sft conversations (dynamic equals fixed there).
    # (--sft with --mock-data is refused in one line: a case of the start-up refusals run in one
    # process, test_megatron_lm_entry.py::test_bad_arguments_and_data_are_refused_at_start_up.)
    for mode in ("dynamic", "fixed"):
        log = layouts["vpp2", mode, "log"]
        assert "> SFT conversations" in log and "mock documents" not in log


# --- --variable-seq-lengths: each micro-batch its own row ------------------------------------------


def test_variable_seq_lengths_trains_like_fixed_micro_batches(layouts, tmp_path):
    """Per-micro-batch rows through pretrain() at pp 2 x vpp 2 on the interleaved case's
    conversations (very different lengths): megatron.core exchanges each shape before its send;
    the loss equals the fixed micro-batches of that case and the rows really vary."""
    _sft_file(tmp_path / "conversations.jsonl")  # the same conversations as the layouts fixture
    args = _sft_args(tmp_path / "conversations.jsonl") + [
        "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1,
        "--train-iters", 3, "--eval-interval", 3, "--eval-iters", 1,
    ]  # fmt: skip
    # Tokens-only cost: the tiny model's own FLOPs ratio (the default since issue 35) makes its
    # attention dominate, and the planner then gives every sample a row of 128 of its own.
    flags = ["--variable-seq-lengths", "--dynamic-batch-cost-attention-weight", 0]
    rc, log, _ = torchrun(2, LAUNCH, args + _DYNAMIC + flags, log_path=tmp_path / "dyn.log")
    assert_same_training(parse_ok(rc, log), layouts["vpp2", "fixed"])
    # The longest row is [1 x S]; with rows of their own length a step computes fewer tokens than
    # M rows of S (dp 1 here).
    lines = re.findall(
        r"micro-batches/rank: (\d+) \[1x(\d+)\] \| real tokens: \d+ \| computed tokens: (\d+)",
        log,
    )
    assert lines and any(int(c) < int(m) * int(s) for m, s, c in lines), lines


def test_variable_seq_lengths_without_the_flag_is_refused():
    """A pure argument check, made in this process by the function the launch calls on Megatron's
    arguments (patch 0001); that such a refusal reaches the user as one line under torchrun is
    test_a_budget_below_seq_length_follows_the_oversize_policy's refused launch."""
    from megatron_dynbatch.errors import DynBatchValueError
    from megatron_dynbatch.integrations.megatron_lm.arguments import validate_dynamic_batch_args

    args = megatron_lm_args(["--variable-seq-lengths"])
    stray = r"^--variable-seq-lengths given without --use-dynamic-batch-size"
    with pytest.raises(DynBatchValueError, match=stray):
        validate_dynamic_batch_args(args)
    for flag in ("--dynamic-batch-plan-ahead", "--no-dynamic-batch-plan-ahead"):
        stray = r"^--dynamic-batch-plan-ahead given without --use-dynamic-batch-size"
        with pytest.raises(DynBatchValueError, match=stray):
            validate_dynamic_batch_args(megatron_lm_args([flag]))


# --- the stock path: no flag ---------------------------------------------------------------------


def test_without_the_flag_it_trains_like_pretrain_gpt(tmp_path):
    args = _TINY + ["--pipeline-model-parallel-size", 2, "--train-iters", 4, "--eval-iters", 0]
    # Megatron's early exit under its signal handler: the ranks once hung at exit, joining data
    # loader workers that ignore SIGTERM (run_program held the exit's traceback, and with it the
    # loaders), until torchrun or a timeout killed them.
    args += ["--exit-signal-handler", "--exit-interval", 2]
    rc, log, _ = torchrun(2, LAUNCH, args, log_path=tmp_path / "stock.log")
    parsed = parse_ok(rc, log)
    assert "[exiting program at iteration 2]" in log
    assert sorted(parsed["iterations"]) == [1, 2]
    assert all("real" not in record for record in parsed["iterations"].values())
    # Stock GPTDataset windows: Megatron's mock dataset and its cache messages, not ours.
    assert "mock documents" not in log


# --- a budget below --seq-length: the oversize policy ---------------------------------------------


def test_a_budget_below_seq_length_follows_the_oversize_policy(tmp_path):
    # Mock documents reach --seq-length 128; the budget is 64 tokens.
    args = _TINY + ["--train-iters", 2, "--eval-iters", 0, "--max-tokens-per-gpu", 64]
    runs = torchrun_chains(
        {
            name: [(2, LAUNCH, args + flags, {"log_path": tmp_path / f"{name}.log"})]
            for name, flags in (
                ("error", ["--use-dynamic-batch-size"]),
                ("truncate", ["--use-dynamic-batch-size", "--oversize-samples", "truncate"]),
            )
        }
    )
    [(rc, log, _)] = runs["error"]
    assert rc != 0 and " iteration        1/" not in log
    # One line naming the flag (exit 2 there; the first failing rank prints it), no traceback of
    # ours.
    expected = r"^pretrain_gpt_dynbatch\.py: error: \[rank \d\] --max-tokens-per-gpu 64 is smaller"
    assert len(re.findall(expected, log, flags=re.M)) == 1, log[-3000:]
    assert "raise ValueError" not in log, log[-3000:]
    [(rc, log, _)] = runs["truncate"]
    parsed = parse_ok(rc, log)
    assert sorted(parsed["iterations"]) == [1, 2]
    rows = [int(s) for s in re.findall(r"micro-batches/rank: \d+ \[1x(\d+)\]", log)]
    assert rows and max(rows) <= 64  # every row within the budget
    assert re.search(r"truncated tokens: [1-9]\d* \|", log), log[-3000:]


# --- a user's own iterator: the batch-size check and resuming mid-batch --------------------------

_USER = [
    "--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4,
    "--seq-length", 128, "--max-position-embeddings", 128,
    "--micro-batch-size", 1, "--global-batch-size", 4, "--train-samples", 20,
    "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", 128,
    "--log-interval", 1, "--log-params-norm", "--hidden-dropout", 0, "--attention-dropout", 0,
    "--calculate-per-token-loss", "--eval-iters", 0, "--pipeline-model-parallel-size", 2,
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", 256,
]  # fmt: skip


def test_a_user_iterator_of_the_wrong_batch_size_stops_every_rank(tmp_path):
    rc, log, seconds = torchrun(
        2, USER_SCRIPT, _USER, env={"USER_ROLLOUTS_PER_BATCH": "16"}, log_path=tmp_path / "x.log"
    )
    assert rc != 0
    expected = "the data iterator yielded a batch of 16 samples, but --global-batch-size is 4"
    # The same error on every rank (step_agreement), said once (by the first rank to get there),
    # on one line, without a traceback through our code; torchrun's report repeats it.
    lines = [line for line in log.splitlines() if expected in line and "traceback :" not in line]
    assert len(lines) == 1 and lines[0].startswith("pretrain_user_iterator.py: error: [rank ")
    assert re.search(r"traceback : pretrain_user_iterator\.py: error: .*" + expected, log)
    assert "stopped on every rank" in lines[0] and "rank 1: " in lines[0], lines[0]
    assert f'File "{REPO / "megatron_dynbatch"}' not in log, log[-4000:]
    assert " iteration        1/" not in log  # nothing trained
    # Start-up and one failed step, not Megatron's process-group timeout (10 minutes).
    assert seconds < 300


_RESUME_ENV = {"USER_ROLLOUTS_PER_BATCH": "12", "USER_GROUP_SIZE": "2"}
_RESUME_ARGS = _USER + ["--rollouts-per-step", 4]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """The straight run (5 steps in batches of 3 steps, 12 rollouts of 2) and, per checkpoint
    format (Megatron's default, distributed, and ``torch``), 2 steps, save, exit, then resume
    (inside a 3-step batch): three chains of launches, side by side."""
    chains = {}
    for fmt in ("torch_dist", "torch"):
        out = tmp_path_factory.mktemp(f"resume-{fmt}")
        args = _RESUME_ARGS + ["--ckpt-format", fmt]
        checkpoint = out / "checkpoint"
        chains[fmt] = [
            (2, USER_SCRIPT, args + extra, {"env": _RESUME_ENV, "log_path": out / f"{name}.log"})
            for name, extra in (
                ("first", ["--save", checkpoint, "--save-interval", 2, "--exit-interval", 2]),
                ("resumed", ["--load", checkpoint]),
            )
        ]
    log_path = tmp_path_factory.mktemp("straight") / "straight.log"
    chains["straight"] = [
        (2, USER_SCRIPT, _RESUME_ARGS, {"env": _RESUME_ENV, "log_path": log_path})
    ]
    return torchrun_chains(chains)


@pytest.fixture(scope="module")
def straight(resume_runs):
    [(rc, log, _)] = resume_runs["straight"]
    return parse_ok(rc, log)


@pytest.fixture(scope="module", params=["torch_dist", "torch"])
def resumed(request, resume_runs, straight):
    """2 steps, save, exit, resume (inside a 3-step batch), beside the straight run."""
    logs = {"straight": straight}
    for name, (rc, log, _) in zip(("first", "resumed"), resume_runs[request.param], strict=True):
        logs[name] = parse_ok(rc, log)
        logs[name, "log"] = log
    return logs


def test_resuming_mid_batch_continues_the_straight_run_exactly(resumed):
    straight = resumed["straight"]["iterations"]
    first = resumed["first"]["iterations"]
    after = resumed["resumed"]["iterations"]
    assert sorted(first) == [1, 2] and sorted(after) == [3, 4, 5]
    for i in (1, 2):
        assert {k: v for k, v in first[i].items() if k != "ms"} == {
            k: v for k, v in straight[i].items() if k != "ms"
        }
    for i in (3, 4, 5):
        # Same weights at every later iteration: identical gradient and parameter norms, LR and
        # consumed rollouts (4 per step; the checkpoint was written inside a 3-step batch).
        for key in ("lr", "grad_norm", "params_norm", "consumed", "real", "computed"):
            assert after[i][key] == straight[i][key], (i, key, after[i], straight[i])
    for i in (3, 5):
        assert after[i]["loss"] == pytest.approx(straight[i]["loss"], rel=1e-6, abs=1e-6)
    # Megatron's first line of a run keeps accumulating the loss, so its second line (iteration 4
    # here, iteration 2 of a fresh run) is the mean of two iterations: of 3 and 4.
    mean = (straight[3]["loss"] + straight[4]["loss"]) / 2
    assert after[4]["loss"] == pytest.approx(mean, rel=1e-6, abs=1e-6)


def test_rollouts_count_as_the_global_batch(straight):
    """--train-samples 20 with 4 rollouts per step: 5 steps, the LR decays over 20 rollouts."""
    straight = straight["iterations"]
    assert sorted(straight) == [1, 2, 3, 4, 5] and straight[5]["lr"] == 0.0
    assert [straight[i]["consumed"] for i in sorted(straight)] == [4, 8, 12, 16, 20]
    assert all(record["batch"] == 4 for record in straight.values())


# --- the README's Megatron-LM commands, literally, and the demo (one test: the same training) ---

# The demo's launch/train_gpt_dynbatch.sh differs from the README's train block only in these
# values; with them, the demo's dynamic run is the README's run.
_README_SIZES = ["--global-batch-size", "16", "--train-iters", "6", "--eval-interval", "3"]
_README_SIZES += ["--eval-iters", "1"]
_SAME_RUN_KEYS = ("lr", "batch", "real", "computed", "consumed")


def test_readme_megatron_lm_commands(readme_workdir):
    """The README's data, train and compare blocks as typed, and ``bash scripts/demo.sh``.

    The data block built the corpus (the ``readme_workdir`` fixture: ``data/`` and ``out/`` in a
    scratch directory, never in the repository). The train block trains with dynamic batching;
    the demo then trains the same run twice (dynamic, fixed micro-batches) on that corpus and
    compares; the README's compare block compares the README's dynamic run with the demo's fixed
    one. The README's dynamic run and the demo's are the same training, value for value.
    """
    out = readme_workdir / "out"
    train = readme_block("train")
    last = train.rstrip().splitlines()[-1]
    assert last.strip().startswith("--use-dynamic-batch-size")
    assert last.rstrip().endswith("| tee out/dynamic.log")
    demo_out = readme_workdir / "demo"
    env = {"OUT": str(demo_out), "DATA_DIR": str(readme_workdir / "data")}
    # The train block and the demo (its own four trainings) side by side: they only read the
    # corpus the data block built, and write to their own directories.
    _, demo = side_by_side(
        [
            partial(
                run_shell, train, readme_workdir, out / "train.log", timeout_s=TORCHRUN_TIMEOUT_S
            ),
            partial(
                run_shell,
                shlex.join(["bash", "scripts/demo.sh", *_README_SIZES]),
                REPO,
                out / "demo.log",
                env=env,
                timeout_s=2 * TORCHRUN_TIMEOUT_S,
            ),
        ]
    )
    assert "=== dynamic micro-batches" in demo and "=== fixed micro-batches" in demo
    assert "=== a quarter of the memory" in demo
    assert re.search(r"iteration +6/ +6 .*micro-batches/rank: \d+ \[\d+x\d+\]", demo)
    # Equal memory in bytes: fixed's measured peak is the dynamic run's budget; stock packing's
    # peak beside them.
    assert re.search(
        r"peak memory measured over training \(MiB, largest rank\): fixed [\d.]+, "
        r"dynamic [\d.]+, stock [\d.]+$",
        demo,
        re.M,
    )
    assert "learning rates identical: yes" in demo and "(within 1e-05)" in demo
    # Stock packing trained as many tokens a step as the dynamic run: windows of 256 holding its
    # mean real tokens a step, rounded to a multiple of the micro-batch size (4 windows).
    windows = int(re.search(r"stock packing: (\d+) windows of 256 a step", demo).group(1))
    real = [
        int(n) for n in re.findall(r"real tokens: (\d+)", (demo_out / "dynamic.log").read_text())
    ]
    assert abs(windows * 256 - sum(real) / len(real)) <= 2 * 256, (windows, real)
    assert re.search(rf"global batch size: +{windows} \|", (demo_out / "stock.log").read_text())
    # The demo found the corpus the README's data block built (it builds one only when missing).
    assert sorted(p.name for p in (readme_workdir / "data").glob("pydoc_text_document.*")) == [
        "pydoc_text_document.bin",
        "pydoc_text_document.idx",
    ]

    (out / "fixed.log").write_text((demo_out / "fixed.log").read_text())
    compare = readme_block("compare").replace("python ", f"{shlex.quote(sys.executable)} ")
    report = run_shell(compare, readme_workdir, out / "compare.log")
    assert "learning rates identical: yes" in report
    dynamic = compare_runs.parse(str(out / "dynamic.log"))
    baseline = compare_runs.parse(str(out / "fixed.log"))
    assert_same_training(dynamic, baseline)
    assert sorted(dynamic["iterations"]) == list(range(1, 7))
    assert [i for i, _ in dynamic["validation"]] == [3, 6]
    # Dynamic batching computed far fewer tokens than 16 documents x 256 per step.
    computed = sum(r["computed"] for r in dynamic["iterations"].values())
    assert computed < 0.75 * 6 * 16 * 256

    # The README trains under a 256-token budget: the demo's run beside its equal-memory headline.
    demo_dynamic = compare_runs.parse(str(demo_out / "dynamic-256.log"))
    assert sorted(demo_dynamic["iterations"]) == sorted(dynamic["iterations"])
    for i, record in dynamic["iterations"].items():
        theirs = demo_dynamic["iterations"][i]
        for key in _SAME_RUN_KEYS:
            assert theirs.get(key) == record.get(key), (i, key, theirs, record)
        assert theirs["loss"] == pytest.approx(record["loss"], rel=1e-6), (i, theirs, record)
    assert [i for i, _ in demo_dynamic["validation"]] == [i for i, _ in dynamic["validation"]]
    for (_, theirs), (_, ours) in zip(
        demo_dynamic["validation"], dynamic["validation"], strict=True
    ):
        assert theirs == pytest.approx(ours, rel=1e-6)
