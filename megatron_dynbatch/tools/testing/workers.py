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

A failing, hung or dead rank fails the test (with every rank's traceback, and "rank 1 died (exit
code -9, SIGKILL)" for a rank that is gone) instead of hanging the suite, and the pool of that world
size is torn down, since its ranks may be stuck in a collective.

Workers never outlive the process that started them: they ask Linux to SIGKILL them when it dies
(``PR_SET_PDEATHSIG``) and a watchdog thread exits when their parent changes (any POSIX), so a
SIGTERM or SIGKILL of ``verify`` or of pytest leaves no orphan holding hundreds of MB. Each worker's
``/proc/<pid>/comm`` is ``dynbatch-rankN`` so it can be found.
"""

import atexit
import contextlib
import ctypes
import ctypes.util
import dataclasses
import importlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dynbatch.errors import DynBatchError, DynBatchRuntimeError, DynBatchValueError

__all__ = [
    "WORKER_NAME_PREFIX",
    "Layout",
    "DistributedTestError",
    "run_on_ranks",
    "shutdown_pools",
]

DEFAULT_TIMEOUT_S = 180.0
# After one rank reports an error, how long the others get to report theirs before the pool is
# torn down (they may be blocked in a collective the failed rank never joins).
_GRACE_AFTER_ERROR_S = 5.0
_POLL_S = 0.2
# Seed passed to Megatron's model_parallel_cuda_manual_seed before every case with a layout.
_RNG_SEED = 1234
# How often a worker's watchdog checks that its parent is alive (the fallback where the kernel's
# parent-death signal is unavailable, or does not apply: see _die_with_parent).
_PARENT_POLL_S = 0.5
# Exit status of a worker that found its parent gone (EX_SOFTWARE would be 70; any non-zero works,
# this one is recognisable in logs).
_ORPHAN_EXIT_CODE = 75
# Linux prctl(2) options (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: Prefix of every worker's process name (``/proc/<pid>/comm``, at most 15 bytes): ``dynbatch-rank3``.
WORKER_NAME_PREFIX = "dynbatch-rank"
# After a worker died, how long the survivors get to report (a gloo collective with a dead peer
# fails within milliseconds; a rank busy computing is not waited for).
_DEAD_GRACE_S = 1.0
# How long a graceful shutdown waits for all workers together before killing the rest.
_SHUTDOWN_JOIN_S = 5.0


@dataclasses.dataclass(frozen=True)
class Layout:
    """Megatron model-parallel layout to initialise in the workers (dp is what remains)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank, or None for no interleaving."""
    ep: int = 1
    """Expert-parallel size (MoE models; its groups span data-parallel ranks)."""
    cp: int = 1
    """Context-parallel size (each sequence split over ``cp`` ranks; dp is what remains)."""


class DistributedTestError(DynBatchError, AssertionError):
    """A test body failed, hung or crashed on at least one rank.

    Besides the full report (its message), it keeps what each failed rank said, so a command can
    print one clear line instead of tracebacks.
    """

    def __init__(
        self,
        message: str,
        *,
        errors: Optional[Dict[int, Tuple[str, str]]] = None,
        exit_codes: Optional[Dict[int, int]] = None,
    ):
        super().__init__(message)
        self.errors: Dict[int, Tuple[str, str]] = dict(errors or {})
        """Rank -> (exception type name, message) of every rank whose body raised."""
        self.exit_codes: Dict[int, int] = dict(exit_codes or {})
        """Rank -> exit code of every worker process that died (negative: killed by a signal)."""


def describe_exit_code(code: Optional[int]) -> str:
    """``-9`` -> ``exit code -9, SIGKILL``; ``1`` -> ``exit code 1``."""
    if code is not None and code < 0:
        try:
            return f"exit code {code}, {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _rendezvous_store() -> "dist.TCPStore":
    """The pool's rendezvous server, held by the parent on a port the kernel picks as it binds.

    A port picked free here and bound later by rank 0 could be taken in between (by a torchrun
    launch or another pool beside this one: ``EADDRINUSE``, rank 0 dead before its first case);
    a server that already listens cannot lose it. The workers connect to it as clients.
    """
    return dist.TCPStore(
        "127.0.0.1",
        0,
        None,
        True,
        timeout=timedelta(seconds=DEFAULT_TIMEOUT_S),
        wait_for_workers=False,
    )


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
    raise DynBatchRuntimeError("no Threads: line in /proc/self/status")


def _set_layout(layout: Layout, current: Optional[Layout]) -> Layout:
    # Lazy: plain gloo tests never pay for importing megatron.
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

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
            expert_model_parallel_size=layout.ep,
            context_parallel_size=layout.cp,
            # The default backend is gloo already; duplicate gloo groups would only cost time.
            create_gloo_process_groups=False,
        )
    model_parallel_cuda_manual_seed(_RNG_SEED)
    torch.manual_seed(_RNG_SEED)
    return layout


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(_ORPHAN_EXIT_CODE)


def _die_with_parent(rank: int, parent_pid: int, use_pdeathsig: bool) -> None:
    """Make this worker exit as soon as the process that started it dies, however it dies.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started the worker exits, so the parent
    asks for it only when that is its main thread; the watchdog covers every other case (and
    non-Linux systems) within ``_PARENT_POLL_S``. Neither needs the parent's cooperation, so they
    also work when the parent is SIGKILLed. Workers ignore SIGINT: a Ctrl-C in a terminal reaches
    the whole process group, and it is the parent that decides (it kills its pools).
    """
    libc = _libc()
    if libc is not None:
        name = f"{WORKER_NAME_PREFIX}{rank}".encode()[:15]
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        if use_pdeathsig:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The parent may have died before the prctl call: then this process was re-parented already.
    if os.getppid() != parent_pid:
        os._exit(_ORPHAN_EXIT_CODE)
    threading.Thread(
        target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True
    ).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    task_conn,
    result_conn,
    parent_pid: int,
    use_pdeathsig: bool,
) -> None:
    _die_with_parent(rank, parent_pid, use_pdeathsig)
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
    timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)
    # Every rank is a client of the parent's store (_rendezvous_store): no rank binds a port.
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    layout = None
    while True:
        try:
            task = task_conn.recv()
        except EOFError:  # the parent is gone (its watchdog and death signal end us too)
            break
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
            # Plain pickle (not the pipe's torch reductions): tensors travel by value, not as
            # shared-memory handles whose lifetime is tied to this process.
            payload = (task_id, rank, True, pickle.dumps(result))
        except BaseException as exc:  # noqa: BLE001 - report everything, including assertions
            payload = (task_id, rank, False, (type(exc).__name__, str(exc), traceback.format_exc()))
        result_conn.send(payload)
    if dist.is_initialized():
        dist.destroy_process_group()


class _Pool:
    """``world_size`` worker processes sharing one gloo world."""

    def __init__(self, world_size: int):
        context = mp.get_context("spawn")
        self.world_size = world_size
        # Pipes, not queues, both ways. A result queue shared by the ranks would keep its write
        # lock forever when a rank is killed while writing, and silence every other rank's
        # report. And a queue holds named semaphores: a verify killed by a signal then left the
        # resource tracker warning of "leaked semaphore objects" (a task pipe has one writer,
        # this process, and one reader, an idle worker, so nothing needs a lock).
        tasks = [context.Pipe(duplex=False) for _ in range(world_size)]
        self.task_writers = [writer for _, writer in tasks]
        pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
        self.result_readers = [reader for reader, _ in pipes]
        self.store = _rendezvous_store()  # kept for the pool's life: the workers' rendezvous
        port = self.store.port
        use_pdeathsig = threading.current_thread() is threading.main_thread()
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(
                    rank,
                    world_size,
                    port,
                    tasks[rank][0],
                    pipes[rank][1],
                    os.getpid(),
                    use_pdeathsig,
                ),
                daemon=True,
                name=f"dist-test-rank{rank}-of-{world_size}",
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()
        # The workers hold theirs: a dead worker's result pipe then reads as closed, and a
        # worker's task pipe as closed once this process is gone.
        for (task_reader, _), (_, writer) in zip(tasks, pipes, strict=True):
            task_reader.close()
            writer.close()
        self.closed_readers: set = set()
        self.next_task_id = 0

    def run(self, fn, args, kwargs, layout, timeout_s: float) -> list:
        module_name, qualname = fn.__module__, fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise DynBatchValueError(
                f"{qualname} is not a module-level function; test bodies run in other processes "
                "and must be importable by name. Move it to the top level of its module."
            )
        task_id = self.next_task_id
        self.next_task_id += 1
        # Arguments travel as plain pickles too (by value), unpickled after the sys.path update.
        arguments = pickle.dumps((args, kwargs))
        task = (task_id, list(sys.path), module_name, qualname, arguments, layout)
        for writer in self.task_writers:
            # A dead worker's pipe refuses the task: the loop below names the dead rank.
            with contextlib.suppress(OSError):
                writer.send(task)

        results: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world_size:
            received = self._receive(_POLL_S)
            if not received:
                dead = self._dead_ranks()
                if dead:
                    # The survivors' collectives with the dead rank fail at once (gloo sees the
                    # closed connection): collect what they say before tearing the pool down.
                    self._drain(task_id, results, time.monotonic() + _DEAD_GRACE_S)
                    lost = ", ".join(
                        f"rank {r} died ({describe_exit_code(c)})" for r, c in dead.items()
                    )
                    raise self._error(qualname, results, f"failed: {lost}", dead) from None
                if time.monotonic() > deadline:
                    if any(not ok for ok, _ in results.values()):
                        what = (
                            f"failed; other ranks gave no result {_GRACE_AFTER_ERROR_S:.0f} s later"
                        )
                    else:
                        what = f"timed out after {timeout_s:.0f} s"
                    raise self._error(qualname, results, what) from None
            for got_id, rank, ok, payload in received:
                assert got_id == task_id, (got_id, task_id)
                results[rank] = (ok, payload)
                if not ok:
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
        if not all(ok for ok, _ in results.values()):
            raise self._error(qualname, results, "failed")
        if layout is not None:
            # Once megatron.core is imported, its safe_globals module pickles every tensor storage
            # by reference to itself; unpickling here imports it, which on CPU needs the shim.
            from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

            apply_cpu_shim()
        return [pickle.loads(results[rank][1]) for rank in range(self.world_size)]

    def _dead_ranks(self) -> Dict[int, Optional[int]]:
        return {
            rank: process.exitcode
            for rank, process in enumerate(self.processes)
            if not process.is_alive()
        }

    def _receive(self, timeout: float) -> list:
        """The results that arrive within ``timeout`` (at most one per rank)."""
        readers = [r for r in self.result_readers if r not in self.closed_readers]
        received = []
        for reader in mp_connection.wait(readers, timeout):
            try:
                received.append(reader.recv())
            except (EOFError, OSError):
                self.closed_readers.add(reader)  # its worker is gone
        return received

    def _drain(self, task_id: int, results: dict, until: float) -> None:
        """Collect results that arrive before ``until`` (or until every live rank reported)."""
        while len(results) + len(self._dead_ranks()) < self.world_size:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            for got_id, rank, ok, payload in self._receive(min(remaining, _POLL_S)):
                if got_id == task_id:
                    results[rank] = (ok, payload)

    def _error(
        self,
        qualname: str,
        results: dict,
        what: str,
        exit_codes: Optional[Dict[int, Optional[int]]] = None,
    ) -> DistributedTestError:
        """One line per rank first (what it raised, or that it died or hung), then tracebacks."""
        exit_codes = dict(exit_codes or {})
        errors = {
            rank: (payload[0], payload[1]) for rank, (ok, payload) in results.items() if not ok
        }
        lines = [f"{qualname} on {self.world_size} rank(s) {what}."]
        for rank in range(self.world_size):
            if rank in errors:
                name, message = errors[rank]
                first = message.strip().splitlines()[0] if message.strip() else ""
                lines.append(f"  rank {rank}: {name}: {first}")
            elif rank in exit_codes:
                lines.append(f"  rank {rank}: died ({describe_exit_code(exit_codes[rank])})")
            elif rank not in results:
                lines.append(f"  rank {rank}: no result (hung)")
        for rank in sorted(errors):
            lines.append(f"--- rank {rank}:\n{results[rank][1][2]}")
        return DistributedTestError("\n".join(lines), errors=errors, exit_codes=exit_codes)

    def shutdown(self, graceful: bool = True) -> None:
        if graceful:
            for writer in self.task_writers:
                with contextlib.suppress(OSError):
                    writer.send(None)
            # One deadline for all: a worker still inside a test body never reads the None.
            deadline = time.monotonic() + _SHUTDOWN_JOIN_S
            for process in self.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=10)
        for writer in self.task_writers:
            writer.close()
        self.store = None  # the server stops with its last reference


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
        DistributedTestError: On any rank's exception, a dead worker or a timeout (one line per
            failed rank, then their tracebacks; ``errors`` and ``exit_codes`` hold the same
            per rank). The pool is then torn down and restarted on next use.
    """
    if layout is not None:
        model_parallel = layout.tp * layout.pp * layout.cp
        if world_size % model_parallel:
            raise DynBatchValueError(
                f"world_size={world_size} is not a multiple of tp*pp*cp={model_parallel} for "
                f"{layout}; pick a world size that leaves a whole data-parallel size."
            )
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, layout, timeout_s)
    except BaseException:
        # A failed case (some ranks may be stuck in a collective) or an interrupted wait (the
        # ranks are still running it; their late results would answer the next case): this pool
        # cannot be trusted any more.
        if _POOLS.get(world_size) is pool:
            del _POOLS[world_size]
        pool.shutdown(graceful=False)
        raise


def shutdown_pools(graceful: bool = True) -> int:
    """Stop every worker pool (registered with atexit; callable from a session fixture).

    Args:
        graceful: Ask idle workers to leave their gloo world first (workers still inside a case
            are killed after a few seconds); ``False`` kills them at once (signal handlers).

    Returns:
        How many worker processes were stopped.
    """
    stopped = 0
    while _POOLS:
        _, pool = _POOLS.popitem()
        stopped += len(pool.processes)
        pool.shutdown(graceful=graceful)
    return stopped


atexit.register(shutdown_pools)
