"""The ``megatron-dynbatch verify`` command: run the check, print the report, set the exit code."""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, Optional, Sequence

from megatron_dynbatch.megatron.verify.compare import GRAD_REL_TOL, LOGPROB_ABS_TOL
from megatron_dynbatch.megatron.verify.launch import run_under_torchrun, run_verify, under_torchrun
from megatron_dynbatch.megatron.verify.spec import build_spec
from megatron_dynbatch.planning import PlannerConfig

__all__ = ["run_verify_cli", "format_report"]


def format_report(report: Dict[str, Any]) -> str:
    """The human-readable verdict (``--json`` prints the report itself)."""
    verdict = "PASS" if report["passed"] else "FAIL"
    return (
        f"{verdict}: dp={report['dp_size']} pp={report['pp_size']} vpp={report['vpp_size']} "
        f"layout={report['layout']} loss={report['loss_mode']}\n"
        f"  samples={report['num_samples']} micro-batches/rank={report['num_microbatches']} "
        f"[{report['micro_batch_size']}x{report['seq_length']}] placeholders="
        f"{report['num_placeholders']}\n"
        f"  max grad rel diff   {report['max_grad_rel_diff']:.3e} (tol {GRAD_REL_TOL:g})\n"
        f"  max grad abs diff   {report['max_grad_abs_diff']:.3e}\n"
        f"  max logprob diff    {report['max_logprob_abs_diff']:.3e} (tol {LOGPROB_ABS_TOL:g})\n"
        f"  loss {report['loss']:.8f} vs reference {report['reference_loss']:.8f}\n"
        f"  wall {report['elapsed_s']:.1f} s"
    )


def run_verify_cli(
    config: PlannerConfig,
    *,
    loss: str,
    samples: Optional[Sequence[Any]] = None,
    as_json: bool = False,
) -> int:
    """Entry point of ``megatron-dynbatch verify``: exit 0 on PASS, 1 on FAIL.

    ``samples`` is the decoded SAMPLES.json array (``None``: the bundled set).
    """
    spec = build_spec(config, loss=loss, samples=samples)
    if under_torchrun():
        report = run_under_torchrun(spec)
        if report is None:
            return 0
    else:
        report = run_verify(spec)
    print(json.dumps(report) if as_json else format_report(report))
    sys.stdout.flush()
    return 0 if report["passed"] else 1
