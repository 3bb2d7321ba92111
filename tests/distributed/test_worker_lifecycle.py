"""Worker processes: a dead rank is reported at once, and no worker outlives its parent.

Before the fix a SIGTERM to ``verify`` left its gloo workers running forever (re-parented to PID 1,
about 400 MB each, blocked reading a pipe), and a dead rank was reported by process name only.
Run as a script (``python THIS_FILE``), this module is the parent that the tests kill.
"""

import os
import pathlib
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron_dynbatch.tools.testing.workers import (
    WORKER_NAME_PREFIX,
    DistributedTestError,
    run_on_ranks,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
# Workers must be gone this soon after their parent died (parent-death signal: at once; the
# watchdog thread: within its 0.5 s poll).
_EXIT_WITHIN_S = 5.0
_START_TIMEOUT_S = 120.0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _die_before_collective():
    """Rank 1 is SIGKILLed; rank 0 waits for it in an all-gather."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    gathered = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(gathered, torch.ones(2))


def test_a_killed_rank_is_reported_at_once_with_its_signal():
    run_on_ranks(2, _rank)  # start the pool first: time the failure, not the start
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_on_ranks(2, _die_before_collective)
    elapsed = time.monotonic() - started
    error = caught.value
    assert elapsed < 10, elapsed
    assert "rank 1 died (exit code -9, SIGKILL)" in str(error), error
    assert error.exit_codes == {1: -signal.SIGKILL}
    # The survivor's collective fails as soon as gloo sees the closed connection.
    assert error.errors[0][0] == "RuntimeError" and "Connection" in error.errors[0][1], error
    # The broken pool was replaced: the next case runs on fresh workers.
    assert run_on_ranks(2, _rank) == [0, 1]


def _worker_pids(parent_pid: int) -> dict:
    """pid -> /proc comm of the live (not zombie) worker processes whose parent is parent_pid."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if comm.startswith(WORKER_NAME_PREFIX) and int(fields["PPid"]) == parent_pid:
            found[int(entry.name)] = comm
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by PID 1, does not)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def wait_for_workers(parent: subprocess.Popen, count: int, stderr_path) -> dict:
    """Wait until ``parent`` has ``count`` live workers and every one printed ``running``.

    ``parent.stdout`` must be a binary pipe: it is read with a deadline, never blocking.
    """
    deadline = time.monotonic() + _START_TIMEOUT_S
    output = b""
    fd = parent.stdout.fileno()
    while output.count(b"running") < count:
        remaining = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(0.0, remaining))[0] if remaining > 0 else []
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            stderr = pathlib.Path(stderr_path).read_text()[-3000:]
            raise AssertionError(
                f"{output.count(b'running')} of {count} workers running after "
                f"{_START_TIMEOUT_S - remaining:.0f} s (parent exit code {parent.poll()}):\n{stderr}"
            )
        output += chunk
    workers = _worker_pids(parent.pid)
    assert len(workers) == count, workers
    return workers


def seconds_until_gone(pids, timeout_s: float = _EXIT_WITHIN_S) -> float:
    started = time.monotonic()
    while any(alive(pid) for pid in pids):
        if time.monotonic() - started > timeout_s:
            left = [pid for pid in pids if alive(pid)]
            for pid in left:  # do not leave them behind for the rest of the suite
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"workers {left} outlived their parent by {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_their_parent_is_sigkilled(tmp_path):
    """No handler runs on SIGKILL: the parent-death signal and the watchdog must do it alone."""
    # stderr to a file: the killed parent's resource tracker warns about its semaphores.
    stderr_path = tmp_path / "stderr.txt"
    stderr = open(stderr_path, "w")  # closed after the subprocess ended
    parent = subprocess.Popen(
        [sys.executable, __file__],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    try:
        # A pool of 2 started by the main thread (parent-death signal) and one of 1 started by
        # another thread (watchdog only: the signal would follow that thread, not the process).
        workers = wait_for_workers(parent, 3, stderr_path)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        gone_after = seconds_until_gone(workers)
    finally:
        if parent.poll() is None:
            parent.kill()
        stderr.close()
    print(f"workers gone {gone_after:.2f} s after SIGKILL of their parent")
    assert gone_after < _EXIT_WITHIN_S


def _block_forever():
    print("running", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    threading.Thread(target=run_on_ranks, args=(1, _block_forever), daemon=True).start()
    run_on_ranks(2, _block_forever)
