"""The reusable worker pool: layout switches must not leak process-group threads; a pool's
rendezvous port cannot be taken by another process while its workers start."""

import errno
import os
import socket

import pytest

from megatron_dynbatch.tools.testing import workers
from megatron_dynbatch.tools.testing.workers import Layout, os_thread_count, run_on_ranks

pytestmark = pytest.mark.gloo


def _threads() -> int:
    return os_thread_count()


def test_layout_switches_do_not_leak_threads():
    layouts = [Layout(pp=2), Layout(), Layout(pp=2, vpp=2), Layout()]
    run_on_ranks(2, _threads, layout=layouts[0])
    baseline = max(run_on_ranks(2, _threads, layout=layouts[1]))
    for _ in range(2):
        for layout in layouts:
            counts = run_on_ranks(2, _threads, layout=layout)
    # Before the fix every switch added about a dozen threads per process: over 10 after the two
    # rounds here (each layout switch re-creates Megatron's groups: a few are enough).
    assert max(counts) <= baseline + 10, (baseline, counts)


def _master_port() -> int:
    return int(os.environ["MASTER_PORT"])


def test_the_rendezvous_port_is_held_before_the_workers_start():
    """The port used to be picked free, released, and bound seconds later by rank 0 (after its
    imports): a torchrun launch or another pool beside the suite could take it in between, and
    rank 0 died with EADDRINUSE. Now the parent listens on it from the pool's first moment."""
    pool = workers._Pool(2)
    try:
        port = pool.store.port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            with pytest.raises(OSError) as taken:
                sock.bind(("127.0.0.1", port))
            assert taken.value.errno == errno.EADDRINUSE
        assert pool.run(_master_port, (), {}, None, 60.0) == [port, port]
    finally:
        pool.shutdown()
