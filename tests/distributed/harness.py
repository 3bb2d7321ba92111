"""Test-side name for the package's reusable gloo worker pool (see megatron_dynbatch.megatron.workers)."""

from megatron_dynbatch.megatron.workers import (  # noqa: F401
    DistributedTestError,
    Layout,
    run_on_ranks,
    shutdown_pools,
)

__all__ = ["DistributedTestError", "Layout", "run_on_ranks", "shutdown_pools"]
