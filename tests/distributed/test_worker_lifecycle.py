"""Worker processes: a dead rank is reported at once, and no worker outlives its parent.

Before the fix a SIGTERM to ``verify`` left its gloo workers running forever (re-parented to PID 1,
about 400 MB each, blocked reading a pipe), and a dead rank was reported by process name only.
Run as a script (``python THIS_FILE``), this module is the parent that the tests kill.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron_dynbatch.tools.testing.workers import (
    DistributedTestError,
    run_on_ranks,
)
from tests._support import (
    FAIL_FAST_S,
    REPO,
    WORKER_EXIT_WITHIN_S,
    seconds_until_gone,
    wait_for_workers,
)

pytestmark = pytest.mark.gloo


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
    assert elapsed < FAIL_FAST_S, elapsed
    assert "rank 1 died (exit code -9, SIGKILL)" in str(error), error
    assert error.exit_codes == {1: -signal.SIGKILL}
    # The survivor's collective fails as soon as gloo sees the closed connection.
    assert error.errors[0][0] == "RuntimeError" and "Connection" in error.errors[0][1], error
    # The broken pool was replaced: the next case runs on fresh workers.
    assert run_on_ranks(2, _rank) == [0, 1]


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
    assert gone_after < WORKER_EXIT_WITHIN_S


def _block_forever():
    print("running", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    threading.Thread(target=run_on_ranks, args=(1, _block_forever), daemon=True).start()
    run_on_ranks(2, _block_forever)
