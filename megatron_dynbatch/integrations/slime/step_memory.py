"""Each slime training step's peak memory: predicted by the rollout side, measured by the trainer.

With ``--max-memory-gib`` the rollout side ships every step's predicted peak per pipeline stage
(:meth:`DPSchedule.rank_fields <megatron_dynbatch.integrations.slime.dp_schedule.DPSchedule.
rank_fields>`). :func:`~megatron_dynbatch.integrations.slime.backend.agree_on_step` opens a step
here: on a GPU ``torch.cuda.reset_peak_memory_stats``. slime's ``train_one_step`` has no hook at
its end, so the step is read (``torch.cuda.max_memory_allocated``) when the next one opens, or when
a log-prob pass or the next rollout's data iterators begin. Rank 0 (pipeline stage 0, DP rank 0)
prints one line a step::

    dynamic batching: slime step 3: peak memory predicted/measured (MiB): 812/640 (pipeline
    stage 0; largest stage predicted 905) | memory budget (MiB): 1024

and any rank whose measured peak is over the budget says so. On CPU nothing is measured (no
counterpart of ``max_memory_allocated`` for one step of slime's trainer): the line gives the
prediction and says that the measurement was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_dynbatch.planning.memory import MIB

__all__ = ["STEP_PEAKS", "StepPeakLog"]


@dataclass
class _OpenStep:
    step_id: int
    predicted_mib: List[float]
    """Per pipeline stage, this DP rank's predicted peak."""
    budget_mib: float


class StepPeakLog:
    """The step being measured in this trainer process (one at a time: slime trains one step
    after another; the CUDA allocator's peak counter is the process's too)."""

    def __init__(self) -> None:
        self.open: Optional[_OpenStep] = None
        self.lines: List[str] = []
        """Every line printed (rank 0) or reported (over the budget), in order."""

    def begin(self, step_id: int, predicted_mib: List[float], budget_mib: float) -> None:
        """A training step starts: close the last one, reset the peak counter."""
        self.close()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.open = _OpenStep(step_id, [float(p) for p in predicted_mib], float(budget_mib))

    def close(self) -> Optional[str]:
        """Read and report the open step (if any); returns rank 0's line."""
        step, self.open = self.open, None
        if step is None:
            return None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        stage0, largest = step.predicted_mib[0], max(step.predicted_mib)
        if torch.cuda.is_available():
            measured = torch.cuda.max_memory_allocated() / MIB
            if measured > step.budget_mib:
                over = (
                    f"[rank {rank}] dynamic batching: slime step {step.step_id}: measured "
                    f"{measured:.0f} MiB at its peak, over --max-memory-gib "
                    f"{step.budget_mib / 1024:g} ({step.budget_mib:.0f} MiB), although the plan "
                    f"predicted at most {largest:.0f} MiB; lower --max-memory-gib by the "
                    "difference (the model is not calibrated in slime)."
                )
                self.lines.append(over)
                print(over, flush=True)
            shown = f"predicted/measured (MiB): {stage0:.0f}/{measured:.0f}"
        else:
            shown = (
                f"predicted (MiB): {stage0:.0f}, measured: skipped (no CUDA: "
                "torch.cuda.max_memory_allocated is GPU-only)"
            )
        if rank != 0:
            return None
        line = (
            f"dynamic batching: slime step {step.step_id}: peak memory {shown} (pipeline stage 0;"
            f" largest stage predicted {largest:.0f}) | memory budget (MiB): {step.budget_mib:.0f}"
        )
        self.lines.append(line)
        print(line, flush=True)
        return line


#: The trainer process's step measurement (slime's trainer calls our hooks as functions; the
#: open step lives here between two of its calls).
STEP_PEAKS = StepPeakLog()
