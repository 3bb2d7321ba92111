"""The next training batch's plan, made in a background thread while the current step trains.

Planning needs only the batch's lengths and the planner's config, and the config a step plans
with is known when the step before it has been prepared (calibration and the memory model change
only between steps). So the Megatron-LM entry reads the next batch right after preparing a step
and plans it here while that step's forward and backward run; the GPU no longer waits for it.

The plan is kept only when the step that needs it plans with an equal config: otherwise that step
plans again, as it would have without this. Either way a step runs the plan the synchronous path
would make (the planner is a pure function of lengths and config), so every rank keeps running the
same plan. A thread, not a process: the planner is pure Python and holds the GIL while it runs,
but the training step mostly waits in torch's kernels and collectives, which release it; a step
that does not is no slower than planning before it. Not thread-safe itself: one owner.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Tuple

from megatron_dynbatch.planning import Plan, PlannerConfig, SampleSet
from megatron_dynbatch.planning.registry import run_planner

__all__ = ["PlanAhead"]


class PlanAhead:
    """One batch read ahead of its step, and its plan being made (or the error reading it)."""

    def __init__(
        self,
        batch: Any = None,
        config: Optional[PlannerConfig] = None,
        error: Optional[BaseException] = None,
    ) -> None:
        self.batch = batch
        self.config = config
        self._error = error
        self._plan: Optional[Plan] = None
        self._planning_error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if error is None:
            # A daemon: a run that ends (or is stopped) never waits for a plan it will not use.
            self._thread = threading.Thread(
                target=self._run, name="dynbatch-plan-ahead", daemon=True
            )
            self._thread.start()

    @classmethod
    def failed(cls, error: BaseException) -> "PlanAhead":
        """Reading the next batch failed: the step that needs it raises ``error`` (an exhausted
        iterator after the last step is never needed)."""
        return cls(error=error)

    def _run(self) -> None:
        try:
            samples = SampleSet.build(
                self.batch.lengths(), self.batch.rollout_ids, self.batch.prompt_lengths()
            )
            self._plan = run_planner(samples, self.config)
        except BaseException as error:  # raised where the step plans, on the caller's thread
            self._planning_error = error

    def wait(self) -> None:
        """Until the plan is made (before anything else plans: one planner at a time)."""
        if self._thread is not None:
            self._thread.join()

    def take(
        self, config: PlannerConfig, plan_now: Callable[[Any], Tuple[Plan, float]]
    ) -> Tuple[Any, Plan, float, bool]:
        """The batch, its plan, the seconds the step waited for it and whether the plan is the one
        made ahead: it is when ``config`` equals the one it was made with, else the plan is
        ``plan_now(batch)``'s.

        Raises:
            The error reading the batch or planning it met (a planning error only where the
            config is the same: another config plans again).
        """
        if self._error is not None:
            raise self._error
        started = time.perf_counter()
        self.wait()
        if config != self.config:
            plan, _ = plan_now(self.batch)
            return self.batch, plan, time.perf_counter() - started, False
        if self._planning_error is not None:
            raise self._planning_error
        return self.batch, self._plan, time.perf_counter() - started, True
