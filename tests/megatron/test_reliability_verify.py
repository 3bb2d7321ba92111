"""``megatron-dynbatch verify`` reports only what ran, and its exit status says what happened.

Issue 10, items 2, 4 and 8. Before: ``--tp-size 4 --cp-size 2`` were accepted and ignored (PASS),
``--max-tokens-per-gpu 0`` became 128, a crashed worker exited 1 like a numerical FAIL, and a
SIGTERM left the gloo workers running forever. Exit statuses: 0 PASS, 1 FAIL, 2 bad input, 3 a rank
failed, crashed or hung, killed by signal N on SIGTERM/SIGINT.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from megatron_dynbatch.planning import ParallelLayout, PlannerConfig
from megatron_dynbatch.tools.cli import main
from megatron_dynbatch.tools.verify import build_spec, launch, reference_body, run_verify
from megatron_dynbatch.tools.verify.cli import (
    EXIT_BAD_INPUT,
    EXIT_FAIL,
    EXIT_PASS,
    EXIT_RANK_FAILED,
)
from tests._support import (
    FAIL_FAST_S,
    WORKER_EXIT_WITHIN_S,
    alive,
    seconds_until_gone,
    worker_pids,
)

pytestmark = pytest.mark.gloo

REPO = pathlib.Path(__file__).resolve().parents[2]
SHORT = [{"length": n, "rollout": n % 3, "prompt_length": n // 4} for n in range(9, 40, 3)]


def _samples_file(tmp_path):
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(SHORT))
    return str(path)


@pytest.mark.parametrize("dp, pp", [(2, 1), (1, 2)], ids=["dp2-tp2", "pp2-tp2"])
def test_tensor_parallel_really_runs_and_matches_the_reference(dp, pp):
    parallel = ParallelLayout(dp_size=dp, pp_size=pp, tp_size=2)
    spec = build_spec(PlannerConfig(max_tokens_per_gpu=128, parallel=parallel), samples=SHORT)
    report = run_verify(spec)
    assert report["passed"], report
    # The report echoes what the ranks ran (compare checks each rank's own parallel_state).
    assert (report["tp_size"], report["dp_size"], report["pp_size"]) == (2, dp, pp)
    assert report["world_size"] == 4 and report["backend"] == "gloo"
    assert report["cp_size"] == 1 and report["sequence_parallel"] is False
    # Every packed sample is padded to a multiple of tp, so the row length is too.
    assert report["sample_multiple"] == 2 and report["seq_length"] % 2 == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        # Named by the command's own flags, in place.
        (["--cp-size", "2"], "verify cannot run --cp-size=2"),
        (["--tp-size", "3"], "do not split over --tp-size=3"),
        (["--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu=0"),
        (["--dp-size", "0"], "--dp-size=0"),
    ],
)
def test_settings_verify_cannot_run_are_refused_not_ignored(flags, message, capsys):
    assert main(["verify", *flags]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_every_setting_is_echoed_in_the_json_report(tmp_path, capsys):
    argv = ["verify", "--samples", _samples_file(tmp_path), "--max-tokens-per-gpu", "64"]
    argv += ["--layout", "padded", "--loss", "seq-mean-token-sum", "--json"]
    assert main(argv) == EXIT_PASS
    report = json.loads(capsys.readouterr().out)
    expected = {
        "dp_size": 1,
        "pp_size": 1,
        "vpp_size": 1,
        "tp_size": 1,
        "cp_size": 1,
        "world_size": 1,
        "layout": "padded",
        "loss_mode": "seq-mean-token-sum",
        "max_tokens_per_gpu": 64,
        "num_samples": len(SHORT),
        "cost_attention_weight": 0.0,
        "cost_response_weight": 0.0,
    }
    assert {key: report[key] for key in expected} == expected, report


def test_a_torchrun_world_of_the_wrong_size_is_bad_input(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["verify", "--dp-size", "2"]) == EXIT_BAD_INPUT
    assert "torchrun started 3 processes but --dp-size 2" in capsys.readouterr().err


def _crashing_compare(spec, dynamic, reference):
    raise RuntimeError("a bug in the comparison")


def test_a_crash_of_verify_itself_is_no_verdict_not_a_fail(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "compare", _crashing_compare)
    assert main(["verify", "--samples", _samples_file(tmp_path)]) == EXIT_RANK_FAILED
    err = capsys.readouterr().err
    assert "no verdict" in err and "RuntimeError: a bug in the comparison" in err, err


def _wrong_reference(spec):
    """The real reference with one gradient scaled by 1.01: a numerical FAIL."""
    result = reference_body(spec)
    if result is not None:
        grads = result["steps"][0]["grads"]
        name = next(iter(grads))
        grads[name] = grads[name] * 1.01
    return result


def test_numerical_fail_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "reference_body", _wrong_reference)
    assert main(["verify", "--samples", _samples_file(tmp_path)]) == EXIT_FAIL
    assert capsys.readouterr().out.startswith("FAIL: ")


def _rank1_fails_before_the_schedule(spec):
    import torch.distributed as dist

    from megatron_dynbatch.mcore.agreement import step_agreement

    with step_agreement(what="verify step"):
        if dist.get_rank() == 1:
            raise ValueError("sample 3: an injected bad sample")


def test_a_rank_error_exits_3_with_the_agreed_one_line_message(capsys, monkeypatch):
    monkeypatch.setattr(launch, "dynamic_body", _rank1_fails_before_the_schedule)
    assert main(["verify", "--dp-size", "2"]) == EXIT_RANK_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "stopped on every rank (verify step)" in err
    assert "rank 1: ValueError: sample 3: an injected bad sample" in err


def _rank1_killed_inside_the_schedule(spec):
    import torch.distributed as dist

    from megatron_dynbatch.tools.verify import bodies

    real_loss = bodies._advantage_loss

    def dies_at_second_loss(batch, ce, calls=[]):  # noqa: B006 - a per-process call counter
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_loss(batch, ce)

    bodies._advantage_loss = dies_at_second_loss
    try:
        return bodies.dynamic_body(spec)
    finally:
        bodies._advantage_loss = real_loss


def test_a_rank_killed_inside_the_schedule_exits_3_fast(capsys, monkeypatch):
    """dp = 2: rank 1 dies in its second loss while rank 0 trains on, into the DDP all-reduce."""
    main(["verify", "--dp-size", "2"])  # warm the pool: time the failure, not the start
    capsys.readouterr()
    monkeypatch.setattr(launch, "dynamic_body", _rank1_killed_inside_the_schedule)
    started = time.monotonic()
    assert main(["verify", "--dp-size", "2"]) == EXIT_RANK_FAILED
    seconds = time.monotonic() - started
    err = capsys.readouterr().err
    print(f"dp=2, rank 1 killed in the schedule: verify exited 3 after {seconds:.2f} s")
    assert seconds < FAIL_FAST_S
    assert "no verdict" in err and "rank 1 died (exit code -9, SIGKILL)" in err, err
    assert "rank 0: RuntimeError:" in err and "Connection" in err, err


@pytest.mark.torchrun  # starts ``megatron-dynbatch verify`` as a user does
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_kills_the_workers_and_exits_by_the_signal(tmp_path):
    stderr_path = tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "megatron_dynbatch.tools.cli", "verify", "--dp-size", "2"]
    with open(stderr_path, "w") as stderr:
        verify = subprocess.Popen(
            [*command, "--samples", _samples_file(tmp_path)],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            workers = _wait_for_running_workers(verify, stderr_path)
            trackers = _resource_trackers(verify.pid)
            verify.send_signal(signal.SIGTERM)
            started = time.monotonic()
            code = verify.wait(timeout=30)
            gone_after = seconds_until_gone(workers)
            exited_after = time.monotonic() - started
            # multiprocessing's resource tracker outlives them briefly, and warns as it exits of
            # what the killed process left (before the fix: 12 "leaked semaphore objects").
            seconds_until_gone(trackers)
        finally:
            if verify.poll() is None:
                verify.kill()
    print(f"SIGTERM: verify exited and its workers were gone {exited_after:.2f} s later")
    assert code == -signal.SIGTERM, stderr_path.read_text()
    assert gone_after < WORKER_EXIT_WITHIN_S and not any(alive(pid) for pid in workers)
    assert "SIGTERM: killed 2 worker process(es)" in stderr_path.read_text()
    assert trackers and "leaked" not in stderr_path.read_text(), stderr_path.read_text()


def _resource_trackers(parent_pid: int) -> list:
    """The pids of ``parent_pid``'s multiprocessing resource tracker (started with its pool)."""
    import psutil

    return [
        child.pid
        for child in psutil.Process(parent_pid).children()
        if "resource_tracker" in " ".join(child.cmdline())
    ]


def _wait_for_running_workers(verify, stderr_path, timeout_s=120.0):
    """Both workers of ``verify`` exist and are at work (over a CPU second each: imports, body)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = worker_pids(verify.pid)
        if len(workers) == 2 and all(_cpu_seconds(pid) > 1.0 for pid in workers):
            return workers
        assert verify.poll() is None, stderr_path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"verify's workers did not start in {timeout_s} s")


def _cpu_seconds(pid):
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
