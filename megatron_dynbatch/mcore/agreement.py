"""Every rank agrees that a step is ready before any pipeline communication starts.

Planning and materializing are local: a bad sample, a corrupt plan or an out-of-memory error is
raised on the rank whose data it is, while its peers go on into the pipeline schedule and wait in a
send or receive that never completes, until the process group's timeout (10 minutes by default in
Megatron). So the local part of a step runs inside :func:`step_agreement`, and one fixed-size
all-gather at its end carries from every rank its plan fingerprint, whether it succeeded, and a
short reason. Then either every rank goes on with the same plan, or every rank raises the same
:class:`StepAgreementError` naming the failed ranks and their reasons, within the time of one
collective. Usage::

    with step_agreement(group, what="step 3") as agreement:
        plan = plan_schedule(...)
        agreement.fingerprint = plan.fingerprint()
        microbatches = materialize_microbatches(...)
    forward_backward_func(...)  # reached on every rank, or on none

A rank that dies outright (killed, segfault) is not covered: its peers' collective fails when the
connection drops (gloo) or when the launcher tears the job down (torchrun).
"""

from __future__ import annotations

import traceback
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_dynbatch.errors import DynBatchRuntimeError, DynBatchValueError

__all__ = [
    "StepAgreementError",
    "PlanMismatchError",
    "check_plan_agreement",
    "gather_lengths",
    "step_agreement",
]

#: Bytes of each rank's failure reason in the all-gather (longer reasons are cut, marked "...").
_REASON_BYTES = 1024
# The fingerprint is 64 hex bits; an int64 holds 63 of them without sign trouble.
_FINGERPRINT_MASK = (1 << 63) - 1
# Header: [ok flag, has fingerprint, fingerprint, reason length].
_HEADER = 4


class StepAgreementError(DynBatchValueError):
    """A step cannot run: some rank failed before the schedule, or ranks planned differently.

    Raised with the same message on every rank of the group. On a rank that failed itself, the
    original exception is its ``__cause__``.
    """


class PlanMismatchError(StepAgreementError):
    """Ranks derived different plans: their data iterators yielded different rollout batches."""


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective over ``group`` must live (NCCL: the current GPU; gloo: CPU)."""
    # NCCL only moves CUDA tensors; gloo only CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(ok: bool, fingerprint: Optional[str], reason: str) -> torch.Tensor:
    data = reason.encode("utf-8", errors="replace")
    if len(data) > _REASON_BYTES:
        data = data[: _REASON_BYTES - 3] + b"..."
    payload = torch.zeros(_HEADER + _REASON_BYTES, dtype=torch.int64)
    payload[0] = int(ok)
    if fingerprint is not None:
        payload[1] = 1
        payload[2] = int(fingerprint, 16) & _FINGERPRINT_MASK
    payload[3] = len(data)
    payload[_HEADER : _HEADER + len(data)] = torch.tensor(list(data), dtype=torch.int64)
    return payload


def _decode(payload: torch.Tensor) -> Tuple[bool, Optional[int], str]:
    values = payload.cpu().tolist()
    length = values[3]
    reason = bytes(values[_HEADER : _HEADER + length]).decode("utf-8", errors="replace")
    return bool(values[0]), values[2] if values[1] else None, reason


def _gather(payload: torch.Tensor, group) -> List[Tuple[bool, Optional[int], str]]:
    device = collective_device(group)
    mine = payload.to(device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [_decode(t) for t in gathered]


def _require_initialized() -> None:
    if not dist.is_initialized():
        raise DynBatchRuntimeError(
            "torch.distributed is not initialized; dynamic batching checks that all ranks are "
            "ready for the same step before the pipeline starts, so initialise the process group "
            "first (Megatron does)."
        )


class _Agreement:
    """What the body of :func:`step_agreement` reports: the fingerprint of the plan it made."""

    def __init__(self, group, what: str, inside_schedule: Optional[str] = None):
        self.group = group
        self.what = what
        self.inside_schedule = inside_schedule
        self.fingerprint: Optional[str] = None
        #: Where in the step this rank's failure happened (leads its reason).
        self.where = ""
        #: The failure as told, where the exception raised only stands in for it (an interrupt
        #: inside the schedule, which the agreement itself lets through: .contained).
        self.reason = ""

    def __enter__(self) -> "_Agreement":
        _require_initialized()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False  # KeyboardInterrupt / SystemExit: leave at once, do not collect
        reason = ""
        if exc is not None:
            reason = self.reason or "".join(traceback.format_exception_only(exc_type, exc)).strip()
            if self.where:
                reason = f"{self.where}: {reason}"
        results = _gather(_encode(exc is None, self.fingerprint, reason), self.group)
        failed = [(rank, reason) for rank, (ok, _, reason) in enumerate(results) if not ok]
        where = f" ({self.what})" if self.what else ""
        if failed:
            listed = "; ".join(f"rank {rank}: {reason}" for rank, reason in failed)
            when = "before any pipeline communication"
            after = ""
            if self.inside_schedule is not None:
                when = "inside Megatron's schedule, which ran to its end on zero stand-ins,"
                after = f"; {self.inside_schedule}"
            raise StepAgreementError(
                f"dynamic batching stopped on every rank{where} {when} because {len(failed)} of "
                f"{len(results)} rank(s) failed: {listed}{after}"
            ) from exc
        fingerprints = [fingerprint for _, fingerprint, _ in results]
        if len(set(fingerprints)) > 1:
            differing = [r for r, v in enumerate(fingerprints) if v != fingerprints[0]]
            shown = [format(v, "x") if v is not None else None for v in fingerprints]
            raise PlanMismatchError(
                f"ranks {differing} derived a different plan than rank 0{where} (fingerprints "
                f"{shown}). Every rank must plan the same global sample lengths, rollout ids and "
                "settings: every rank's data iterator must yield the same global rollout batch "
                "(same samples and order), and every rank needs the same planner settings: "
                "token budget, layout, rollouts per step and cost weights (in Megatron-LM "
                "--max-tokens-per-gpu, --dynamic-batch-layout, --rollouts-per-step and the cost "
                "flags; a host's own keys elsewhere)."
            )
        return False


def step_agreement(
    group=None, *, what: str = "", inside_schedule: Optional[str] = None
) -> _Agreement:
    """Context manager: run a step's local work, then agree on it over ``group`` (default: world).

    Every rank of ``group`` must enter it. Inside, set ``agreement.fingerprint`` to the plan's
    :meth:`~megatron_dynbatch.planning.Plan.fingerprint` so ranks also check they planned alike.
    ``inside_schedule``: the failures agreed on happened in a schedule that ran to its end
    (:mod:`.contained`); the error says so, then this (what of the step is not valid).

    Raises:
        StepAgreementError: on every rank, when any rank's body raised (naming ranks and reasons).
        PlanMismatchError: on every rank, when the fingerprints differ.
    """
    return _Agreement(group, what, inside_schedule)


def check_plan_agreement(plan, group=None, *, what: str = "") -> None:
    """Agree on ``plan`` alone (the local work already succeeded on this rank).

    Raises:
        PlanMismatchError: naming the ranks whose plan differs from rank 0's.
        StepAgreementError: when another rank reports a failure in the same collective.
    """
    with step_agreement(group, what=what) as agreement:
        agreement.fingerprint = plan.fingerprint()


def gather_lengths(lengths: List[int], group) -> List[List[int]]:
    """Every rank's sample lengths, in rank order (lengths only, never data: one all-gather).

    What a host whose samples are already sharded over DP (SkyRL, verl) hands to
    :func:`~megatron_dynbatch.planning.sharded.plan_sharded_step`, so every rank derives the same
    plan. Call it between two :func:`step_agreement` blocks: after the local checks agreed, so no
    rank waits here for a rank that failed.
    """
    gathered: List[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [int(n) for n in lengths], group=group)
    return [list(x) for x in gathered]
