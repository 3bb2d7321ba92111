"""`megatron-dynbatch plan`: the public JSON interface, the table, errors, and planner purity."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import (
    ParallelLayout,
    PlannerConfig,
    check_plan,
    parse_samples_json,
    plan_samples,
)
from megatron_dynbatch.tools.cli import build_parser, main

pytestmark = pytest.mark.unit

SAMPLES = [
    120,
    {"length": 300, "rollout": "g1", "prompt_length": 100},
    {"length": 280, "rollout": "g1", "prompt_length": 100},
    {"length": 900, "rollout": 7},
    {"length": 40},
    2000,
    64,
]


def _write(tmp_path, data):
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_plan_json_round_trip(tmp_path, capsys):
    path = _write(tmp_path, SAMPLES)
    args = ["plan", path, "--dp-size", "2", "--pp-size", "2", "--vpp-size", "2"]
    args += ["--max-tokens-per-gpu", "1024", "--rollouts-per-step", "3", "--json"]
    assert main(args) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)  # exactly one JSON object on stdout
    assert "warning" in out.err and "5 (2000 tokens)" in out.err  # over the cap
    config = PlannerConfig(
        max_tokens_per_gpu=1024,
        parallel=ParallelLayout(dp_size=2, pp_size=2, vpp_size=2),
        rollouts_per_step=3,
    )
    samples = parse_samples_json(SAMPLES)
    expected = plan_samples(samples, config)
    check_plan(expected, samples, config)
    assert data == json.loads(json.dumps(expected.to_dict()))
    assert set(data) >= {"steps", "stats"}
    for step in data["steps"]:
        assert set(step) >= {"num_microbatches", "seq_length", "ranks"}
        assert len(step["ranks"]) == 2
        assert all(len(rank) == step["num_microbatches"] for rank in step["ranks"])
        # Issue 29: per-rank counts beside a per-rank bound; the all-ranks bound says so.
        real = sum(1 for rank in step["ranks"] for mb in rank if mb)
        assert real >= step["lower_bound_microbatches_all_ranks"]
        assert (
            step["num_microbatches"]
            >= step["lower_bound_microbatches_per_rank"]
            == -(-step["lower_bound_microbatches_all_ranks"] // 2)
        )
        # The earlier key stays, meaning what it always meant (all ranks).
        assert step["lower_bound_microbatches"] == step["lower_bound_microbatches_all_ranks"]
        assert step["idle_ranks"] == 0
    indices = sorted(i for s in data["steps"] for r in s["ranks"] for mb in r for i in mb)
    assert indices == list(range(len(SAMPLES)))
    stats = data["stats"]
    for key in ("num_samples", "num_placeholders", "num_microbatches", "lower_bound_microbatches"):
        assert isinstance(stats[key], int)
    assert stats["oversize_samples"] == [5]
    assert 0 < stats["fill"] <= 1 and stats["dp_imbalance"] >= 1


def test_plan_table_is_readable(tmp_path, capsys):
    assert main(["plan", _write(tmp_path, SAMPLES), "--max-tokens-per-gpu", "4096"]) == 0
    out = capsys.readouterr().out
    assert "M/rank" in out and "fill" in out and "7 samples" in out


@pytest.mark.parametrize(
    "data, extra, message",
    [
        ([], [], "no samples"),
        ([10, -1], [], "sample 1: -1"),
        ([{"length": 10, "rollout": [1]}], [], "rollout id [1]"),
        ([{"length": 10, "prompt_length": 11}], [], "prompt_length=11"),
        ([{"len": 10}], [], "unknown key"),
        ({"lengths": [1]}, [], "JSON array"),
        ([10], ["--dp-size", "0"], "--dp-size=0"),
    ],
)
def test_plan_errors_exit_nonzero_with_one_line_and_no_traceback(tmp_path, data, extra, message):
    path = _write(tmp_path, data)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_dynbatch.tools.cli",
            "plan",
            path,
            "--max-tokens-per-gpu",
            "64",
        ]
        + extra,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_plan_json_stops_quietly_when_its_reader_closes_the_pipe(tmp_path):
    # `plan --json | head -c 10`: the reader goes away after a few bytes; the command stops
    # without a BrokenPipeError traceback (one object of 16k samples is far over a pipe's buffer).
    path = _write(tmp_path, [100 + i % 900 for i in range(16384)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_dynbatch", "plan", path]
        + ["--dp-size", "512", "--max-tokens-per-gpu", "4096", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.read(10) == b'{"layout":'
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert proc.returncode in (0, 1)


def test_plan_json_of_the_fixed_planner_reports_the_budget_and_the_padding(tmp_path, capsys):
    # The fixed planner reported micro_batch_size x seq_length as the cap (104 of a budget of
    # 100 x cp 2) and a sample multiple of 1 where every sample is padded to tp x 2cp = 8.
    path = _write(tmp_path, [11, 21, 33, 41, 55, 99, 1, 3])
    args = ["plan", path, "--dp-size", "3", "--tp-size", "2", "--cp-size", "2"]
    args += ["--max-tokens-per-gpu", "100", "--dynamic-batch-planner", "fixed"]
    assert main(args + ["--dynamic-batch-layout", "padded", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["token_cap"], data["sample_multiple"]) == (200, 8)
    [step] = data["steps"]
    assert step["seq_length"] == 104 and step["micro_batch_size"] * 104 <= 200


def test_plan_reads_a_byte_order_mark_and_names_bad_files_for_a_user(tmp_path, capsys):
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf[100, 200]")
    assert main(["plan", str(bom), "--max-tokens-per-gpu", "256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["num_samples"] == 2
    huge = tmp_path / "huge.json"
    huge.write_text("[" + "9" * 5000 + "]")
    assert main(["plan", str(huge), "--max-tokens-per-gpu", "256"]) == 2
    err = capsys.readouterr().err
    assert "at most 2**40" in err and "set_int_max_str_digits" not in err
    assert main(["plan", _write(tmp_path, [1e3]), "--max-tokens-per-gpu", "256"]) == 2
    assert "1000, not 1e3" in capsys.readouterr().err
    # A folder as --plot is refused before the samples are read or planned.
    assert main(["plan", str(tmp_path / "missing.json"), "--plot", str(tmp_path)]
                + ["--max-tokens-per-gpu", "256"]) == 2  # fmt: skip
    assert "is a folder" in capsys.readouterr().err


def test_plan_missing_file_and_bad_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    for path in (str(tmp_path / "missing.json"), str(bad)):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_dynbatch.tools.cli",
                "plan",
                path,
                "--max-tokens-per-gpu",
                "8",
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_planner_and_plan_command_do_not_import_torch(tmp_path):
    """The planning core is pure: importing it (and running `plan`) must not pull in torch."""
    path = _write(tmp_path, SAMPLES)
    code = (
        "import sys\n"
        "import megatron_dynbatch.planning\n"
        "from megatron_dynbatch.tools.cli import main\n"
        f"main(['plan', {path!r}, '--max-tokens-per-gpu', '4096', '--json'])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_samples_json_accepts_a_response_length_for_either_other_length():
    samples = parse_samples_json(
        [
            {"length": 10, "response_length": 4},  # prompt 6
            {"prompt_length": 3, "response_length": 5},  # length 8
            {"length": 7, "prompt_length": 2, "response_length": 5},  # consistent
            {"length": 9, "prompt_length": 4},
        ]
    )
    assert list(samples.lengths) == [10, 8, 7, 9]
    assert list(samples.prompt_lengths) == [6, 3, 2, 4]


@pytest.mark.parametrize(
    "item, message",
    [
        ({"length": 7, "prompt_length": 3, "response_length": 5}, "!= length=7"),
        ({"length": 4, "response_length": 5}, "response_length=5 is greater than"),
        ({"response_length": 5}, "has no 'length'"),
        ({"length": 9, "response_length": -1}, "response_length=-1 must be an integer"),
        ({"length": 9, "response_length": 2.5}, "response_length=2.5 must be an integer"),
        ({"length": 9, "response": 2}, "unknown key(s) ['response']"),
    ],
)
def test_samples_json_response_length_errors_name_the_values(item, message):
    with pytest.raises(DynBatchValueError) as error:
        parse_samples_json([item])
    assert message in str(error.value)


def test_a_missing_required_flag_is_one_usage_line(tmp_path):
    """Issue 37: `plan` without --max-tokens-per-gpu printed 17 lines of usage."""
    path = _write(tmp_path, SAMPLES)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dynbatch.tools.cli", "plan", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    # Either budget will do (a docs probe: --max-memory-gib alone was refused, as training
    # takes it).
    assert "pass --max-tokens-per-gpu" in lines[0] and "or --max-memory-gib" in lines[0]


def test_plan_takes_a_memory_budget_alone_as_training_does(tmp_path, capsys):
    path = _write(tmp_path, SAMPLES)
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    assert main(["plan", path, "--max-memory-gib", "0.1", *model]) == 0
    out = capsys.readouterr().out
    assert "(the longest row --max-memory-gib 0.100 allows; no token budget is set)" in out, out


def test_plan_with_the_model_flags_plans_with_trainings_default_cost_model(tmp_path, capsys):
    """Issue 42: with Megatron's model flags `plan` prices micro-batches as a run's first steps do
    (the physical default of planning/model_cost.py on --device, its estimated overhead's gain
    threshold), not the old FLOPs ratio with an unknown overhead: the plan equals the one made
    with those weights given explicitly, on either device's rates."""
    from megatron_dynbatch.integrations.megatron_lm.model_args import model_dims_from_args
    from megatron_dynbatch.planning.model_cost import (
        CPU_RATES,
        ESTIMATED_MIN_GAIN,
        GPU_RATES,
        physical_cost,
    )
    from megatron_dynbatch.planning.spec import ParallelLayout

    samples = tmp_path / "s.json"
    samples.write_text(json.dumps([256, 40, 60, 256, 30, 200, 256, 80] * 4))
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
    base = [str(samples), "--max-tokens-per-gpu", "1024", "--pp-size", "2", "--json"]
    base += ["--dynamic-batch-layout", "padded", "--dynamic-batch-cost-attention", "dense"]

    def plan(*extra):
        assert main(["plan", *base, *extra]) == 0
        return json.loads(capsys.readouterr().out)["steps"]

    args = build_parser().parse_args(["plan", *base, *model])
    args.group_query_attention = False
    dims = model_dims_from_args(args, ParallelLayout(pp_size=2))
    for device, rates in (("cpu", CPU_RATES), ("cuda", GPU_RATES["fp32"])):
        weights = physical_cost(dims, "dense", rates).cost_model()
        explicit = plan(
            "--dynamic-batch-cost-attention-weight",
            repr(weights.attention_weight),
            "--dynamic-batch-cost-microbatch-overhead",
            repr(weights.microbatch_overhead),
            "--dynamic-batch-min-gain",
            repr(ESTIMATED_MIN_GAIN),
        )
        assert plan(*model, "--device", device) == explicit, device


def test_calibrate_fits_scales_of_the_default_model_as_training_does(tmp_path, capsys):
    """Issue 42: offline `calibrate` with the model flags (or a run's file recording its model)
    fits scales of the default model, as training does (its ratio of attention to token work
    kept, never a free weight of 0); without either it fits free weights as before."""
    steps = []
    for m, b in ((8, 4), (11, 3), (16, 2), (32, 1), (8, 4), (11, 3), (16, 2), (32, 1)):
        # Token work only: a free fit has nothing to put into attention.
        seconds = 0.02 + 2e-5 * 256 * b * m + 3e-3 * m
        steps.append(
            {
                "seconds": seconds,
                "seq_length": 256,
                "micro_batch_size": b,
                "layout": "padded",
                "attention": "dense",
                "pp_size": 2,
                "ranks": [[[256] * b] * m],
            }
        )
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(steps))
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]

    def calibrate(source, *extra):
        assert main(["calibrate", str(source), "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["calibration"]

    assert calibrate(path)["form"] == "free"
    scaled = calibrate(path, *model, "--device", "cpu")
    assert scaled["form"] in ("scales", "physical") and scaled["attention_weight"] > 0
    recorded = tmp_path / "run.json"
    from megatron_dynbatch.planning.spec import CostModel

    # What a run records: its model in planner units (here one of the tiny GPT's size on CPU).
    prior = dataclasses.asdict(
        CostModel(attention_weight=3e-3, microbatch_overhead=100.0, attention="dense")
    )
    recorded.write_text(json.dumps({"steps": steps, "prior": prior}))
    again = calibrate(recorded)
    assert again["form"] in ("scales", "physical")
    # Scales of the recorded model: its ratio of attention to token work, kept.
    ratio = again["attention_weight"] / again["token_weight"]
    assert ratio == pytest.approx(prior["attention_weight"] / prior["token_weight"], rel=1e-6)


def test_calibrate_names_its_own_file_and_plan_takes_the_kv_channels_it_names(tmp_path, capsys):
    # A probe: calibrate's unreadable file was "SAMPLES.json", and plan's refusal of a hidden
    # size the heads do not divide named --kv-channels, a flag plan did not take.
    assert main(["calibrate", str(tmp_path / "missing.json")]) == 2
    assert "cannot read OBSERVATIONS.json" in capsys.readouterr().err
    path = tmp_path / "samples.json"
    path.write_text("[100, 200, 300]")
    model = ["--num-layers", "2", "--hidden-size", "65", "--num-attention-heads", "4"]
    plan = ["plan", str(path), "--max-tokens-per-gpu", "512", "--json", *model]
    assert main(plan) == 2
    assert "(or its --kv-channels)" in capsys.readouterr().err
    assert main([*plan, "--kv-channels", "16"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"]


def test_plans_oversize_warning_names_the_flags_as_its_refusal_does(tmp_path, capsys):
    # A probe: the warning said (max_tokens_per_gpu=4 x cp_size=1), the refusal of the same
    # input under error (--max-tokens-per-gpu=4 x --cp-size=1).
    path = tmp_path / "samples.json"
    path.write_text("[5, 2, 4, 1]")
    assert main(["plan", str(path), "--max-tokens-per-gpu", "4", "--json"]) == 0
    err = capsys.readouterr().err
    assert "(--max-tokens-per-gpu=4)" in err and "max_tokens_per_gpu" not in err
    # The planner names the budget by its flag itself (the Megatron-LM launch prints the
    # warning as raised: it read max_tokens_per_gpu=128 x cp_size=1), cp only where it
    # multiplies the budget.
    assert main(["plan", str(path), "--max-tokens-per-gpu", "2", "--cp-size", "2", "--json"]) == 0
    assert "(--max-tokens-per-gpu=2 x --cp-size=2)" in capsys.readouterr().err


def test_a_budget_under_one_padded_sample_under_error_names_what_the_longest_needs(
    tmp_path, capsys
):
    """A probe: "raise --max-tokens-per-gpu to at least 16" (one padded sample), then, at 16,
    refused again for the longest sample ("at least 1504"). Both values it names now plan."""
    path = tmp_path / "samples.json"
    path.write_text("[100, 500, 3000]")
    layout = ["--tp-size", "8", "--cp-size", "2"]
    refused = ["plan", str(path), "--max-tokens-per-gpu", "3", *layout]
    assert main([*refused, "--oversize-samples", "error"]) == 2
    err = capsys.readouterr().err
    assert "the longest sample (3000 tokens, 3008 padded) must fit it" in err, err
    least, other = (int(n) for n in re.findall(r"at least (\d+)", err))
    assert (least, other) == (1504, 16), err
    plan = ["plan", str(path), *layout, "--json"]
    assert main([*plan, "--max-tokens-per-gpu", str(least), "--oversize-samples", "error"]) == 0
    assert json.loads(capsys.readouterr().out)["token_cap"] == 3008
    for policy in ("truncate", "allow"):
        assert main([*plan, "--max-tokens-per-gpu", str(other), "--oversize-samples", policy]) == 0
        assert json.loads(capsys.readouterr().out)["token_cap"] == 32


@pytest.mark.parametrize("policy", ["allow", "error"])
def test_planner_fixed_under_one_padded_sample_names_what_the_longest_needs_at_once(
    tmp_path, capsys, policy
):
    """A probe: planner 'fixed' at --max-tokens-per-gpu 4 named "at least 16" (one padded
    sample), then at 16 "at least 48" (it pads every sample to the longest, whatever the oversize
    policy), then its padded layout. Every value and flag it names now plans, in one round."""
    path = tmp_path / "samples.json"
    path.write_text("[19, 80, 80, 15, 58]")
    base = ["plan", str(path), "--tp-size", "8", "--cp-size", "2", "--oversize-samples", policy]
    assert main([*base, "--dynamic-batch-planner", "fixed", "--max-tokens-per-gpu", "4"]) == 2
    err = capsys.readouterr().err
    assert "pass --dynamic-batch-layout padded and" in err, err
    least, other = (int(n) for n in re.findall(r"at least (\d+)", err))
    assert (least, other) == (48, 16), err
    fixed = [*base, "--dynamic-batch-planner", "fixed", "--dynamic-batch-layout", "padded"]
    assert main([*fixed, "--max-tokens-per-gpu", str(least), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_cap"] == 96
    # The other way named: planner 'dynbatch' (under error, with the policy it names).
    dynbatch = [*base, "--dynamic-batch-planner", "dynbatch", "--max-tokens-per-gpu", str(other)]
    if policy == "error":
        assert "--oversize-samples allow or truncate" in err, err
        dynbatch[dynbatch.index("error")] = "allow"
    assert main([*dynbatch, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_cap"] == 32


def test_verify_refuses_a_layout_it_cannot_run_before_naming_a_budget(tmp_path, capsys):
    """A re-probe: the budget named for --tp-size 8 under error was then refused by verify's own
    layout check ("4 attention heads do not split over --tp-size=8")."""
    path = tmp_path / "samples.json"
    path.write_text("[100, 500, 3000]")
    verify = ["verify", "--samples", str(path), "--max-tokens-per-gpu", "1"]
    verify += ["--oversize-samples", "error"]
    for layout, said in ((["--tp-size", "8"], "do not split over"), (["--cp-size", "2"], "cp")):
        assert main([*verify, *layout]) == 2
        err = capsys.readouterr().err
        assert said in err and "longest sample" not in err, err


def test_plan_on_cpu_shows_the_plan_a_cpu_run_makes(tmp_path, capsys):
    """A docs probe: ``plan --device cpu`` priced packed rows per segment and gave every
    micro-batch its own row, as on GPUs; a CPU run (gloo, Megatron's local attention) keeps one
    row a step and pays attention over the whole row. Now it plans as that run does."""
    import random

    rng = random.Random(5)
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([rng.randint(30, 256) for _ in range(16)]))
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
    base = ["plan", str(samples), "--max-tokens-per-gpu", "1024", "--pp-size", "2", *model]
    steps = {}
    for device in ("cpu", "cuda"):
        assert main([*base, "--vocab-size", "257", "--device", device, "--json"]) == 0
        steps[device] = json.loads(capsys.readouterr().out)["steps"][0]
    assert steps["cpu"]["row_lengths"] == [] and steps["cpu"]["micro_batch_size"] > 1
    assert steps["cuda"]["row_lengths"] and steps["cuda"]["micro_batch_size"] == 1
    # Told otherwise, it plans so on CPU too.
    explicit = [*base, "--device", "cpu", "--variable-seq-lengths", "--json"]
    explicit += ["--dynamic-batch-cost-attention", "segment"]
    assert main(explicit) == 0
    assert json.loads(capsys.readouterr().out)["steps"][0]["row_lengths"]


@pytest.mark.parametrize("gib", ["2e299", "1e-10"])
def test_plan_refuses_a_memory_budget_out_of_range_by_its_flag(tmp_path, capsys, gib):
    """Probes: 2e299 GiB overflowed the byte count into a traceback; 1e-10 became 0 bytes,
    refused as "budget_bytes=0 must be > 0" (no flag, no value, no fix)."""
    path = tmp_path / "samples.json"
    path.write_text("[5, 6]")
    model = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"]
    plan = ["plan", str(path), "--json", "--max-tokens-per-gpu", "100", *model]
    assert main([*plan, "--max-memory-gib", gib]) == 2
    err = capsys.readouterr().err
    assert f"--max-memory-gib {float(gib)} must be a number of GiB > 0 (from 1e-09" in err, err
    assert main([*plan, "--max-memory-gib", "80"]) == 0


@pytest.mark.parametrize(
    "flag", ["--dynamic-batch-cost-attention-weight", "--cost-attention-weight"]
)
def test_a_cost_overflow_on_the_longest_sample_names_the_flag(tmp_path, capsys, flag):
    """A probe: the overflow caught on an oversize sample's row (100,000 tokens, not the cap's)
    named the weight by the cost model's field (``attention_weight=1e+290``)."""
    path = tmp_path / "samples.json"
    path.write_text("[100000, 5]")
    assert main(["plan", str(path), "--json", "--max-tokens-per-gpu", "4096", flag, "1e290"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}=1e+290" in err and "attention_weight" not in err, err
