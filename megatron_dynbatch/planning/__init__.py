"""The pure planning core: standard library only (no torch, no megatron, no I/O).

Lengths in, index lists out: :func:`plan_schedule` turns per-sample token lengths (and rollout ids)
into one schedule that every rank derives identically; :mod:`.registry` names it and the other
planners (one signature, one :class:`Plan`) that the hosts, ``--dynamic-batch-planner`` and the
benchmarks pick from.
"""

from .invariants import PlanInvariantError, check_plan
from .plan import Plan, PlanStats, StepPlan
from .planner import OversizeSampleWarning, plan_samples
from .registry import get_planner, plan_schedule, planner_names, register_planner, run_planner
from .samples import SampleSet, parse_samples_json
from .spec import CostModel, ParallelLayout, PlannerConfig, round_up, sample_multiple

__all__ = [
    "CostModel",
    "OversizeSampleWarning",
    "ParallelLayout",
    "Plan",
    "PlanInvariantError",
    "PlanStats",
    "PlannerConfig",
    "SampleSet",
    "StepPlan",
    "check_plan",
    "get_planner",
    "parse_samples_json",
    "plan_samples",
    "plan_schedule",
    "planner_names",
    "register_planner",
    "round_up",
    "run_planner",
    "sample_multiple",
]
