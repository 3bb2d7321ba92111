"""Run a function on N gloo ranks, in worker processes reused across calls (tests and `verify`).

Starting a process that imports torch and megatron costs seconds, so workers are started once per
world size and kept for the whole session (a persistent pool keyed by world size). A test body is a
plain module-level function; every rank calls it with the same arguments and returns a picklable
result:

    def _body(scale):
        return torch.distributed.get_rank() * scale

    def test_ranks():
        assert run_on_ranks(2, _body, 10) == [0, 10]

With ``layout=Layout(pp=2, vpp=2)`` the workers first apply the CPU shim and (re)initialise
Megatron's ``parallel_state`` for that layout; consecutive cases with the same layout keep it.

A failing or hung rank fails the test (with every rank's traceback) instead of hanging the suite,
and the pool of that world size is torn down, since its ranks may be stuck in a collective.
"""

import atexit
import dataclasses
import importlib
import logging
import os
import pickle
import queue
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["Layout", "DistributedTestError", "run_on_ranks", "shutdown_pools"]

DEFAULT_TIMEOUT_S = 180.0
# After one rank reports an error, how long the others get to report theirs before the pool is
# torn down (they may be blocked in a collective the failed rank never joins).
_GRACE_AFTER_ERROR_S = 5.0
_POLL_S = 0.2
# Seed passed to Megatron's model_parallel_cuda_manual_seed before every case with a layout.
_RNG_SEED = 1234


@dataclasses.dataclass(frozen=True)
class Layout:
    """Megatron model-parallel layout to initialise in the workers (dp is what remains)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank, or None for no interleaving."""


class DistributedTestError(AssertionError):
    """A test body failed, hung or crashed on at least one rank."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _resolve(module_name: str, qualname: str) -> Callable:
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _megatron_process_groups(parallel_state) -> list:
    """Every process group ``parallel_state`` holds (this rank's), except the default group."""
    default = dist.distributed_c10d._get_default_group()
    found: list = []
    for value in vars(parallel_state).values():
        candidates = value if isinstance(value, (list, tuple)) else (value,)
        for group in candidates:
            if isinstance(group, dist.ProcessGroup) and group is not default:
                if all(group is not seen for seen in found):
                    found.append(group)
    return found


def os_thread_count() -> int:
    """OS threads of this process (Linux), to catch leaked communication threads in tests."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads: line in /proc/self/status")


def _set_layout(layout: Layout, current: Optional[Layout]) -> Layout:
    # Lazy: plain gloo tests never pay for importing megatron.
    from megatron_dynbatch.megatron.cpu_shim import apply_cpu_shim

    apply_cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if layout != current:
        if parallel_state.model_parallel_is_initialized():
            stale = _megatron_process_groups(parallel_state)
            parallel_state.destroy_model_parallel()
            # destroy_model_parallel only forgets its groups; each gloo group keeps its threads
            # and sockets, so a pool switching layouts hundreds of times ends with thousands of
            # threads per process (seen: load average > 1000 on two cores). Free them.
            for group in stale:
                dist.destroy_process_group(group)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            # The default backend is gloo already; duplicate gloo groups would only cost time.
            create_gloo_process_groups=False,
        )
    model_parallel_cuda_manual_seed(_RNG_SEED)
    torch.manual_seed(_RNG_SEED)
    return layout


def _worker_main(rank: int, world_size: int, port: int, task_queue, result_queue) -> None:
    # Two cores serve up to four ranks: more intra-op threads per rank only oversubscribe.
    torch.set_num_threads(1)
    # Megatron's notices (no apex, deprecated GPTModel, ...) repeat once per rank and per model
    # build; in a pool reused for many cases they drown the output that matters.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=DEFAULT_TIMEOUT_S),
    )
    layout = None
    while True:
        task = task_queue.get()
        if task is None:
            break
        task_id, sys_path, module_name, qualname, arguments, task_layout = task
        try:
            # Test modules imported by pytest after this worker started may live in directories
            # pytest put on sys.path later.
            for entry in sys_path:
                if entry not in sys.path:
                    sys.path.append(entry)
            args, kwargs = pickle.loads(arguments)
            if task_layout is not None:
                layout = _set_layout(task_layout, layout)
            result = _resolve(module_name, qualname)(*args, **kwargs)
            # Plain pickle (not the queue's torch reductions): tensors travel by value, not as
            # shared-memory handles whose lifetime is tied to this process.
            payload = (task_id, rank, True, pickle.dumps(result))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            payload = (task_id, rank, False, traceback.format_exc())
        result_queue.put(payload)
    if dist.is_initialized():
        dist.destroy_process_group()


class _Pool:
    """``world_size`` worker processes sharing one gloo world."""

    def __init__(self, world_size: int):
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.result_queue = context.Queue()
        self.task_queues = [context.Queue() for _ in range(world_size)]
        port = _free_port()
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(rank, world_size, port, self.task_queues[rank], self.result_queue),
                daemon=True,
                name=f"dist-test-rank{rank}-of-{world_size}",
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()
        self.next_task_id = 0

    def run(self, fn, args, kwargs, layout, timeout_s: float) -> list:
        module_name, qualname = fn.__module__, fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(
                f"{qualname} is not a module-level function; test bodies run in other processes "
                "and must be importable by name. Move it to the top level of its module."
            )
        task_id = self.next_task_id
        self.next_task_id += 1
        # Arguments travel as plain pickles too (by value), unpickled after the sys.path update.
        arguments = pickle.dumps((args, kwargs))
        task = (task_id, list(sys.path), module_name, qualname, arguments, layout)
        for task_queue in self.task_queues:
            task_queue.put(task)

        results: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world_size:
            try:
                got_id, rank, ok, payload = self.result_queue.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [p for p in self.processes if not p.is_alive()]
                if dead:
                    codes = {p.name: p.exitcode for p in dead}
                    raise DistributedTestError(
                        self._report(qualname, results, f"worker process(es) died: {codes}")
                    ) from None
                if time.monotonic() > deadline:
                    if any(not ok for ok, _ in results.values()):
                        what = (
                            f"failed; other ranks gave no result {_GRACE_AFTER_ERROR_S:.0f} s later"
                        )
                    else:
                        what = f"timed out after {timeout_s:.0f} s"
                    raise DistributedTestError(self._report(qualname, results, what)) from None
                continue
            assert got_id == task_id, (got_id, task_id)
            results[rank] = (ok, payload)
            if not ok:
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
        if not all(ok for ok, _ in results.values()):
            raise DistributedTestError(self._report(qualname, results, "failed"))
        return [pickle.loads(results[rank][1]) for rank in range(self.world_size)]

    def _report(self, qualname: str, results: dict, what: str) -> str:
        lines = [f"{qualname} on {self.world_size} rank(s) {what}."]
        for rank in range(self.world_size):
            if rank not in results:
                lines.append(f"--- rank {rank}: no result (hung or died)")
            elif not results[rank][0]:
                lines.append(f"--- rank {rank}:\n{results[rank][1]}")
        return "\n".join(lines)

    def shutdown(self, graceful: bool = True) -> None:
        if graceful:
            for task_queue in self.task_queues:
                task_queue.put(None)
            for process in self.processes:
                process.join(timeout=10)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


_POOLS: dict[int, _Pool] = {}


def run_on_ranks(
    world_size: int,
    fn: Callable,
    *args,
    layout: Optional[Layout] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs,
) -> list:
    """Call ``fn(*args, **kwargs)`` on every rank of a ``world_size`` gloo world.

    Args:
        world_size: Number of ranks; the pool for this size is started on first use and reused.
        fn: Module-level function (pickled by name) returning a picklable value.
        *args: Positional arguments, pickled to every rank.
        layout: Megatron layout to initialise first (applies the CPU shim), or None for plain
            ``torch.distributed`` tests.
        timeout_s: Seconds before a hung case fails the test.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        The results in rank order.

    Raises:
        DistributedTestError: On any rank's exception, a dead worker or a timeout (with the
            tracebacks of all failed ranks). The pool is then torn down and restarted on next use.
    """
    if layout is not None:
        model_parallel = layout.tp * layout.pp
        if world_size % model_parallel:
            raise ValueError(
                f"world_size={world_size} is not a multiple of tp*pp={model_parallel} for "
                f"{layout}; pick a world size that leaves a whole data-parallel size."
            )
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, layout, timeout_s)
    except DistributedTestError:
        # Some ranks may be stuck in a collective: this pool cannot be trusted any more.
        del _POOLS[world_size]
        pool.shutdown(graceful=False)
        raise


def shutdown_pools() -> None:
    """Stop every worker pool (registered with atexit; callable from a session fixture)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()


atexit.register(shutdown_pools)
