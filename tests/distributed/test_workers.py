"""The reusable worker pool: layout switches must not leak process-group threads."""

import pytest

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
