"""The ``megatron-dynbatch verify`` command: run the check, print the report, set the exit code.

Exit statuses (``EXIT_*``): 0 PASS; 1 numerical FAIL; 2 bad input (a one-line error, from
``megatron_dynbatch.tools.cli``); 3 no verdict because a rank failed, crashed or hung, or verify itself
crashed (one line naming the ranks and what they raised, or the per-rank report and tracebacks); killed by signal N on
SIGTERM/SIGINT after the worker processes are killed (a shell shows 128 + N).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any, Dict, Iterator, NoReturn, Optional, Sequence

from megatron_dynbatch.planning import PlannerConfig
from megatron_dynbatch.tools.verify.compare import GRAD_REL_TOL, LOGPROB_ABS_TOL
from megatron_dynbatch.tools.verify.launch import (
    check_torchrun_world_size,
    run_under_torchrun,
    run_verify,
    under_torchrun,
)
from megatron_dynbatch.tools.verify.machine import check_fits_machine
from megatron_dynbatch.tools.verify.spec import build_spec, plan_warnings
from megatron_dynbatch.tools.wording import flags_in_place

__all__ = [
    "EXIT_PASS",
    "EXIT_FAIL",
    "EXIT_BAD_INPUT",
    "EXIT_RANK_FAILED",
    "run_verify_cli",
    "format_report",
]

EXIT_PASS = 0
EXIT_FAIL = 1
#: Returned by ``megatron_dynbatch.tools.cli.main`` for a ``ValueError`` raised before any rank started.
EXIT_BAD_INPUT = 2
EXIT_RANK_FAILED = 3
# Signals after which the worker pools are killed before this process dies of the same signal.
_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def format_report(report: Dict[str, Any]) -> str:
    """The human-readable verdict (``--json`` prints the report itself)."""
    verdict = "PASS" if report["passed"] else "FAIL"
    return (
        f"{verdict}: dp={report['dp_size']} pp={report['pp_size']} vpp={report['vpp_size']} "
        f"tp={report['tp_size']} layout={report['layout']} loss={report['loss_mode']} "
        f"({report['world_size']} {report['backend']} ranks)"
        + (
            ""
            if not report.get("moe")
            else f" moe: {report['moe']['num_experts']} experts top-{report['moe']['topk']} "
            f"ep={report['moe']['ep_size']} z-loss {report['moe']['z_loss_coeff']:g}"
        )
        + "\n"
        f"  samples={report['num_samples']} micro-batches/rank={report['num_microbatches']} "
        f"[{report['micro_batch_size']}x{report['seq_length']}] placeholders="
        f"{report['num_placeholders']}"
        + (
            ""
            if report["num_steps"] == 1
            else f" optimizer steps={report['num_steps']} (micro-batches and shape: the first's)"
        )
        + "\n"
        f"  max grad rel diff   {report['max_grad_rel_diff']:.3e} (tol {GRAD_REL_TOL:g})\n"
        f"  max grad abs diff   {report['max_grad_abs_diff']:.3e}\n"
        f"  max logprob diff    {report['max_logprob_abs_diff']:.3e} (tol {LOGPROB_ABS_TOL:g})\n"
        f"  loss {report['loss']:.8f} vs reference {report['reference_loss']:.8f}"
        + ("" if report["num_steps"] == 1 else " (mean over steps; each step checked)")
        + "\n"
        f"  wall {report['elapsed_s']:.1f} s"
    )


@contextlib.contextmanager
def _pools_killed_on_signals() -> Iterator[None]:
    """While inside: on SIGTERM/SIGINT kill the gloo worker pools, then die of the same signal.

    Without it, Python's default SIGTERM ends only this process. The workers would exit on their
    own (parent-death signal, watchdog), but killing them here first is immediate and leaves no
    worker mid-collective whose parent is still tearing down.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    from megatron_dynbatch.tools.testing.workers import shutdown_pools

    def handler(signum, frame):
        stopped = shutdown_pools(graceful=False)
        # os.write, not print: the signal may have interrupted a print to the same stream.
        name = signal.Signals(signum).name
        os.write(
            2, f"megatron-dynbatch verify: {name}: killed {stopped} worker process(es)\n".encode()
        )
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = {signum: signal.signal(signum, handler) for signum in _CLEANUP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _rank_failure_message(error: Exception) -> str:
    """One line when every failed rank raised the same agreement error, else the full report."""
    from megatron_dynbatch.mcore.agreement import StepAgreementError
    from megatron_dynbatch.tools.testing.workers import DistributedTestError

    if isinstance(error, StepAgreementError):
        return str(error)
    assert isinstance(error, DistributedTestError), type(error)
    agreement_names = {"StepAgreementError", "PlanMismatchError"}
    messages = {message for name, message in error.errors.values() if name in agreement_names}
    if (
        not error.exit_codes
        and len(messages) == 1
        and all(name in agreement_names for name, _ in error.errors.values())
    ):
        return messages.pop()
    return f"no verdict: {error}"


def run_verify_cli(
    config: PlannerConfig,
    *,
    loss: str,
    samples: Optional[Sequence[Any]] = None,
    as_json: bool = False,
    moe: Optional[Any] = None,
) -> int:
    """Entry point of ``megatron-dynbatch verify``; returns an ``EXIT_*`` status.

    ``samples`` is the decoded SAMPLES.json array (``None``: the bundled set); ``moe`` a
    :class:`~megatron_dynbatch.tools.verify.spec.MoESettings` for a mixture-of-experts model.

    Raises:
        ValueError: On bad input, before any rank starts (the caller prints it and exits 2).
    """
    spec = build_spec(config, loss=loss, samples=samples, moe=moe)
    if under_torchrun():
        check_torchrun_world_size(spec)
    # Before any rank starts: what this machine cannot finish is bad input, not a hang (issue 44).
    check_fits_machine(spec, start_ranks=not under_torchrun())
    if not under_torchrun() or os.environ.get("RANK", "0") == "0":
        # The planner's warnings (oversize samples over the cap, the default `allow`), once.
        for message in plan_warnings(spec):
            message = flags_in_place(message)
            print(f"megatron-dynbatch verify: warning: {message}", file=sys.stderr, flush=True)
    if under_torchrun():
        _leave_rank(_verdict(spec, as_json))
    return _verdict(spec, as_json)


def _leave_rank(code: int) -> NoReturn:
    """End this torchrun rank with ``code`` now, its output flushed, skipping the interpreter's
    teardown. That teardown can hang: twice in full test runs on a 2-core machine, both ranks
    had printed the report and closed their groups, then sat in the garbage collector at exit
    (no Python frame: a destructor of torch's distributed objects) until the test's 400 s ran
    out. Nothing is left to release: after a verdict or a failure every rank agreed on, the
    groups are closed behind the last barrier; after a crash of this rank alone, torchrun stops
    the others when this one exits."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _verdict(spec, as_json: bool) -> int:
    """Run the check (in this torchrun world, or on a pool of worker processes) and print the
    report; the exit status."""
    from megatron_dynbatch.mcore.agreement import StepAgreementError
    from megatron_dynbatch.tools.testing.workers import DistributedTestError

    try:
        if under_torchrun():
            # torchrun owns these processes and their signals.
            report = run_under_torchrun(spec)
            if report is None:
                return EXIT_PASS
        else:
            with _pools_killed_on_signals():
                report = run_verify(spec)
    except (StepAgreementError, DistributedTestError) as error:
        print(f"megatron-dynbatch verify: error: {_rank_failure_message(error)}", file=sys.stderr)
        return EXIT_RANK_FAILED
    except Exception:  # noqa: BLE001 - any other crash is no verdict either, never a FAIL (1)
        print(
            f"megatron-dynbatch verify: error: no verdict:\n{traceback.format_exc()}",
            file=sys.stderr,
        )
        return EXIT_RANK_FAILED
    print(json.dumps(report) if as_json else format_report(report))
    sys.stdout.flush()
    return EXIT_PASS if report["passed"] else EXIT_FAIL
