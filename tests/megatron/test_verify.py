"""Dynamic batching through real Megatron-Core schedules equals the fixed-batch reference.

Each schedule (no pipelining, 1F1B, interleaved) and each loss aggregation runs at least once on the
bundled long-tailed set, spread over four runs rather than their product (the loss is a per-token
weighting that the schedules do not touch; test_runtime_loss checks every aggregation against the
reference in both layouts). Per schedule: ragged inputs that force placeholders and a rank holding
only placeholders; the padded layout with several rows per micro-batch on both pipelines; oversize
policies. The verify report compares gradients of every rank, forward-only log-probs restored to
sample order, and the loss, against one process running each sample alone with plain autograd.
"""

import copy
import json
import subprocess
import sys

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import CostModel, ParallelLayout, PlannerConfig
from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks
from megatron_dynbatch.tools.verify import (
    DEFAULT_MAX_TOKENS_PER_GPU,
    GRAD_REL_TOL,
    build_spec,
    compare,
    run_verify,
)
from megatron_dynbatch.tools.verify.spec import MoESettings
from tests._support import torchrun

pytestmark = pytest.mark.gloo

SCHEDULES = {"no_pipelining": (1, 1), "1f1b": (2, 1), "interleaved": (2, 2)}
LOSSES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum"]

# Ragged: lengths from 3 to 120 under a 128-token cap, two GRPO groups and loners.
RAGGED = [
    {"length": 3, "rollout": "a", "prompt_length": 1},
    {"length": 120, "rollout": "a", "prompt_length": 20},
    {"length": 17, "rollout": "b", "prompt_length": 5},
    {"length": 64, "rollout": "b", "prompt_length": 5},
    5,
    {"length": 41, "prompt_length": 40},
    {"length": 1},
]
# Three samples that cannot share a 128-token micro-batch, on 2 DP ranks: 4 slots, 1 placeholder.
RAGGED_PLACEHOLDER = [
    {"length": 120, "rollout": "a", "prompt_length": 20},
    {"length": 97, "rollout": "a", "prompt_length": 3},
    {"length": 66, "prompt_length": 64},
]


# Short samples under a 128-token cap: the padded layout can hold four rows per micro-batch. With a
# per-micro-batch overhead the planner takes that (without one, pipelines prefer more, smaller
# micro-batches for a shorter bubble).
SHORT = [{"length": n, "rollout": n % 5, "prompt_length": n // 4} for n in range(9, 33, 2)]


def _spec(
    dp=1,
    pp=1,
    vpp=1,
    layout="packed",
    cap=DEFAULT_MAX_TOKENS_PER_GPU,
    overhead=0.0,
    oversize="allow",
    attention=None,
    attention_weight=0.0,
    group=None,
    rollouts_per_step=None,
    **kwargs,
):
    parallel = ParallelLayout(
        dp_size=dp, pp_size=pp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group
    )
    cost = CostModel(
        microbatch_overhead=overhead, attention=attention, attention_weight=attention_weight
    )
    config = PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=parallel,
        layout=layout,
        cost=cost,
        oversize_samples=oversize,
        rollouts_per_step=rollouts_per_step,
    )
    return build_spec(config, **kwargs)


def _check(report):
    assert report["passed"], report
    assert report["max_grad_rel_diff"] <= GRAD_REL_TOL
    return report


# One case per schedule and per loss: (schedule, dp, loss). dp 1 with pipelining is here; dp 2
# without pipelining and the "sum" loss is also test_verify_cli_json, and dp 1 without pipelining is
# test_compare_catches_wrong_order_and_wrong_gradients.
BUNDLED_CASES = [
    ("no_pipelining", 2, "token-mean"),
    ("1f1b", 2, "seq-mean-token-mean"),
    ("interleaved", 2, "seq-mean-token-sum"),
    ("1f1b", 1, "sum"),
]
assert {c[0] for c in BUNDLED_CASES} == set(SCHEDULES) and {c[2] for c in BUNDLED_CASES} == set(
    LOSSES
)


@pytest.mark.parametrize("schedule, dp, loss", BUNDLED_CASES)
def test_bundled_set_matches_reference(schedule, dp, loss):
    pp, vpp = SCHEDULES[schedule]
    report = _check(run_verify(_spec(dp, pp, vpp, loss=loss)))
    assert (report["dp_size"], report["pp_size"], report["vpp_size"]) == (dp, pp, vpp)
    assert report["loss_mode"] == loss


# Padded rows through both pipelines (the shapes each stage sends change with the row count);
# without pipelining the padded layout is test_every_setting_is_echoed_in_the_json_report's run.
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_padded_layout_matches_reference(schedule):
    pp, vpp = SCHEDULES[schedule]
    # Rows of at most 31 tokens under a 128-token cap: several rows share a micro-batch.
    short = _check(run_verify(_spec(2, pp, vpp, layout="padded", overhead=4096.0, samples=SHORT)))
    assert short["layout"] == "padded" and short["micro_batch_size"] > 1, short


# Packed micro-batches of several rows each (issue 18): under the local implementation's dense
# mask a row pays S^2 whatever it holds, so the planner packs [B x S] rows with B > 1 (rows of at
# most 128 // B tokens, several short samples to a row); through both pipelines.
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_packed_rows_several_per_microbatch_match_reference(schedule):
    pp, vpp = SCHEDULES[schedule]
    spec = _spec(
        2, pp, vpp, overhead=4096.0, attention="dense", attention_weight=1.0 / 384, samples=SHORT
    )
    report = _check(run_verify(spec))
    assert report["layout"] == "packed" and report["micro_batch_size"] > 1, report
    assert report["seq_length"] * report["micro_batch_size"] <= DEFAULT_MAX_TOKENS_PER_GPU
    # Several samples share a row: fewer rows than samples.
    rows = 2 * report["num_microbatches"] * report["micro_batch_size"]
    assert rows < len(SHORT), report


# The two ragged sets on every schedule; the two losses that weigh samples differently alternate.
RAGGED_LOSSES = {
    "no_pipelining": "seq-mean-token-mean",
    "1f1b": "token-mean",
    "interleaved": "seq-mean-token-mean",
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_ragged_samples_with_placeholders(schedule):
    pp, vpp = SCHEDULES[schedule]
    loss = RAGGED_LOSSES[schedule]
    ragged = _check(run_verify(_spec(2, pp, vpp, loss=loss, samples=RAGGED)))
    assert ragged["num_samples"] == len(RAGGED)
    forced = _check(run_verify(_spec(2, pp, vpp, loss=loss, samples=RAGGED_PLACEHOLDER)))
    assert forced["num_placeholders"] > 0, forced


# Two samples over the 128-token cap (a GRPO pair and a loner).
OVERSIZE = RAGGED + [
    {"length": 200, "rollout": "b", "prompt_length": 30},
    {"length": 150, "prompt_length": 100},
]


@pytest.mark.parametrize("policy", ["allow", "truncate"])
def test_oversize_samples_match_the_reference_of_their_policy(policy):
    # allow: the two run alone at their full length, every row of the step that long; truncate:
    # both are cut to the cap, and the reference trains the same first 128 tokens.
    report = _check(run_verify(_spec(2, 2, 1, oversize=policy, samples=OVERSIZE, loss="sum")))
    assert report["oversize_samples"] == policy
    if policy == "allow":
        assert report["seq_length"] == 200 and report["truncated_tokens"] == 0
    else:
        assert report["seq_length"] <= 128 and report["truncated_tokens"] == (200 - 128) + (
            150 - 128
        )


@pytest.mark.torchrun  # starts ``megatron-dynbatch verify`` as a user does
def test_oversize_error_is_bad_input_before_any_process(tmp_path):
    with pytest.raises(DynBatchValueError, match=r"2 sample\(s\) exceed the token cap 128"):
        _spec(2, 2, 1, oversize="error", samples=OVERSIZE)
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(OVERSIZE))
    argv = ["verify", "--samples", str(path), "--oversize-samples", "error", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dynbatch.tools.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "sample 7: 200 tokens" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.torchrun  # ``torchrun ... megatron-dynbatch verify``: the ranks are torchrun's own
def test_verify_under_torchrun_passes_and_every_rank_exits_cleanly(tmp_path):
    # As `torchrun -m megatron_dynbatch.tools.cli verify ...` runs it, with a hook at interpreter
    # teardown: each rank must leave without it (that teardown hung twice in full runs, both ranks
    # in the garbage collector after the report; a rank aborting there fails torchrun too).
    script = tmp_path / "verify_rank.py"
    script.write_text(
        "import atexit, runpy\n"
        "atexit.register(print, 'interpreter teardown ran', flush=True)\n"
        "runpy.run_module('megatron_dynbatch.tools.cli', run_name='__main__', alter_sys=True)\n"
    )
    argv = ["verify", "--pp-size", "2", "--json"]
    rc, log, _ = torchrun(2, script, argv, log_path=tmp_path / "verify.log")
    assert rc == 0 and "terminate called" not in log, log[-4000:]
    assert "interpreter teardown ran" not in log, log[-4000:]
    report = json.loads(next(line for line in log.splitlines() if line.startswith("{")))
    assert report["passed"] and report["pp_size"] == 2 and report["world_size"] == 2, report


# One rank of a torchrun world (here a world of one) whose step fails on every rank together.
_FAILING_RANK = """
import os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
import torch.distributed as dist
from megatron_dynbatch.cpu.core_shim import apply_cpu_shim
apply_cpu_shim()  # megatron imports on CPU only with it (run_under_torchrun applies it too)
from megatron.core import parallel_state
from megatron_dynbatch.mcore.agreement import StepAgreementError, step_agreement
from megatron_dynbatch.planning import ParallelLayout, PlannerConfig
from megatron_dynbatch.tools.verify import build_spec, launch

def failing_body(spec):
    with step_agreement(what="verify step"):
        raise RuntimeError("sample 3 is unreadable")

launch.dynamic_body = failing_body
spec = build_spec(PlannerConfig(max_tokens_per_gpu=128, parallel=ParallelLayout()))
try:
    launch.run_under_torchrun(spec)
except StepAgreementError as error:
    print("raised:", error)
print("still open:", dist.is_initialized(), parallel_state.model_parallel_is_initialized())
"""


def test_verify_under_torchrun_closes_its_groups_when_every_rank_fails():
    # A failure every rank agreed on leaves every rank alive: the groups close as after a pass,
    # or gloo's threads can abort the rank at exit instead of verify's own exit code.
    proc = subprocess.run(
        [sys.executable, "-c", _FAILING_RANK], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "raised:" in proc.stdout and "sample 3 is unreadable" in proc.stdout, proc.stdout
    assert "still open: False False" in proc.stdout, proc.stdout


def test_the_interleaving_group_asked_for_is_the_one_megatron_runs():
    # A count aligned to a group of 3 is refused by Megatron's default group (pp = 2: remainder
    # 1); verify built its model with the default and failed on every rank, reporting group 3.
    spec = _spec(1, 2, 2, cap=8, oversize="truncate", group=3, loss="sum", samples=[7, 3, 11, 1, 5])
    report = _check(run_verify(spec))
    assert report["microbatch_group_size_per_vp_stage"] == 3
    assert report["num_microbatches"] % 3 == 0 and report["num_microbatches"] % 2 == 1, report


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_rank_with_only_placeholders_still_trains(schedule):
    pp, vpp = SCHEDULES[schedule]
    samples = [{"length": 40, "prompt_length": 8}]
    report = _check(run_verify(_spec(2, pp, vpp, samples=samples)))
    # One sample on two DP ranks: rank 1 runs only placeholders.
    assert report["num_placeholders"] >= report["num_microbatches"]


def test_compare_catches_wrong_order_and_wrong_gradients():
    """The verify verdict can fail: swapped outputs or a scaled gradient are caught."""
    spec = _spec(loss="token-mean")
    from megatron_dynbatch.tools.verify import dynamic_body, reference_body

    dynamic = run_on_ranks(1, dynamic_body, spec, layout=Layout())
    [reference] = run_on_ranks(1, reference_body, spec, layout=Layout())
    assert compare(spec, dynamic, reference)["passed"]

    swapped = copy.deepcopy(dynamic)
    logprobs = swapped[0]["logprobs"]
    i, j = next(
        (i, j)
        for i in range(len(logprobs))
        for j in range(i + 1, len(logprobs))
        if logprobs[i].shape == logprobs[j].shape
    )
    logprobs[i], logprobs[j] = logprobs[j], logprobs[i]
    assert not compare(spec, swapped, reference)["passed"]

    scaled = copy.deepcopy(dynamic)
    [step] = scaled[0]["steps"]
    name = next(iter(step["grads"]))
    step["grads"][name] = step["grads"][name] * 1.01
    report = compare(spec, scaled, reference)
    assert not report["passed"] and report["max_grad_rel_diff"] > GRAD_REL_TOL


def test_every_optimizer_step_of_rollouts_per_step_matches_its_own_reference():
    """``--rollouts-per-step``: each optimizer step's gradients and loss against a reference of
    that step's samples alone, through 1F1B; a step holding another step's gradients fails."""
    # The bundled set's 11 rollouts, 4 a step: three optimizer steps.
    spec = _spec(2, 2, 1, loss="seq-mean-token-mean", rollouts_per_step=4)
    from megatron_dynbatch.tools.verify import dynamic_body, reference_body

    dynamic = run_on_ranks(spec.world_size, dynamic_body, spec, layout=Layout(pp=2))
    [reference, *_] = run_on_ranks(spec.world_size, reference_body, spec, layout=Layout())
    report = _check(compare(spec, dynamic, reference))
    assert report["num_steps"] == 3 and report["rollouts_per_step"] == 4
    assert len(report["step_losses"]) == len(report["step_shapes"]) == 3
    # Each step's own loss, not one over every sample: they differ from step to step.
    assert len({round(loss, 6) for loss in report["reference_step_losses"]}) == 3
    # Step 2's gradients where step 1's belong (as if its buffers were not zeroed): caught.
    wrong = copy.deepcopy(dynamic)
    for result in wrong:
        result["steps"][1]["grads"] = result["steps"][2]["grads"]
    assert not compare(spec, wrong, reference)["passed"]
    # A step's logged loss off (its sums halved on every rank): caught on that step.
    halved = copy.deepcopy(dynamic)
    for result in halved:
        sums = result["steps"][0]["log_sums"]
        if sums is not None:
            sums[0] /= 2
    assert not compare(spec, halved, reference)["passed"]


def _mismatched_plan_body():
    """Rank 1 plans one extra sample: every rank must fail, none may hang."""
    import torch.distributed as dist

    from megatron_dynbatch.mcore.agreement import PlanMismatchError, check_plan_agreement
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, plan_schedule

    lengths = [10, 20, 30] + ([40] if dist.get_rank() == 1 else [])
    plan = plan_schedule(
        lengths, config=PlannerConfig(max_tokens_per_gpu=64, parallel=ParallelLayout(dp_size=2))
    )
    try:
        check_plan_agreement(plan)
    except PlanMismatchError as exc:
        return str(exc)
    return None


def test_ranks_with_different_plans_fail_loudly():
    messages = run_on_ranks(2, _mismatched_plan_body, layout=Layout())
    assert all(m is not None and "ranks [1]" in m for m in messages), messages


def test_verify_cli_json(capsys):
    from megatron_dynbatch.tools.cli import main

    # --rollouts-per-step through the command line (verify checked one step and had no such
    # flag): the bundled set's 11 rollouts, 6 a step, are two optimizer steps.
    code = main(["verify", "--dp-size", "2", "--loss", "sum", "--rollouts-per-step", "6", "--json"])
    import json

    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] is True
    for key in ("max_grad_rel_diff", "max_logprob_abs_diff", "num_placeholders", "passed"):
        assert key in report
    assert report["rollouts_per_step"] == 6 and report["num_steps"] == 2, report


@pytest.mark.parametrize("planner, layout", [("dynbatch-thorough", "packed"), ("fixed", "padded")])
def test_verify_checks_the_planner_it_is_given(planner, layout, capsys):
    # verify had no --dynamic-batch-planner: the thorough planner and Megatron's stock batching
    # could not be verified.
    from megatron_dynbatch.tools.cli import main

    argv = ["verify", "--dp-size", "2", "--pp-size", "2", "--json"]
    code = main(argv + ["--dynamic-batch-planner", planner, "--dynamic-batch-layout", layout])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] is True, report
    assert report["planner"] == planner and report["layout"] == layout


def test_verify_refuses_a_model_it_cannot_split():
    with pytest.raises(DynBatchValueError, match="do not split"):
        _spec(pp=3)
    with pytest.raises(DynBatchValueError, match="aggregation='mean'"):
        _spec(loss="mean")


def test_moe_with_z_loss_matches_reference_with_placeholders_at_pp2_vpp2_ep2():
    """``verify --moe``: a tiny MoE (4 experts, top-2, z-loss 0.01) at pp 2 x vpp 2, dp 2 with
    expert parallel size 2, on samples that force a placeholder micro-batch. The routers get the
    padding mask, so the per-token z-loss covers the real tokens only, as in the reference."""
    moe = MoESettings(ep_size=2, z_loss_coeff=1e-2)
    report = _check(run_verify(_spec(2, 2, 2, samples=RAGGED_PLACEHOLDER, moe=moe)))
    assert report["num_placeholders"] > 0, report
    assert report["moe"] == {"num_experts": 4, "topk": 2, "ep_size": 2, "z_loss_coeff": 1e-2}


def test_moe_settings_refuse_what_megatron_cannot_split():
    with pytest.raises(DynBatchValueError, match="--moe-ep-size 3 must be >= 1 and divide the 4"):
        MoESettings(ep_size=3)
    with pytest.raises(DynBatchValueError, match="--moe-ep-size 2 must divide --dp-size 1"):
        _spec(1, samples=RAGGED, moe=MoESettings(ep_size=2))


@pytest.mark.parametrize("extra", [[], ["--moe", "--dp-size", "2", "--moe-ep-size", "2"]])
def test_verify_prints_its_verdict_without_gpu_library_warnings(tmp_path, extra):
    """Issue 37: `verify` printed 8 Transformer Engine / Apex warnings before its verdict on CPU;
    with --moe at ep 2, a FutureWarning of torch's from Megatron's router on every rank."""
    from tests._support import command_env

    path = tmp_path / "samples.json"
    path.write_text(json.dumps([16, 24, 40]))
    command = [sys.executable, "-m", "megatron_dynbatch.tools.cli", "verify", "--samples"]
    proc = subprocess.run(
        command + [str(path), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=command_env(),
    )
    assert proc.returncode == 0 and proc.stdout.startswith("PASS"), proc.stdout + proc.stderr
    assert "not installed" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
