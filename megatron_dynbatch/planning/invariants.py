"""One checker for every guarantee a plan makes; tests run it over every input family.

It re-derives everything from the inputs, trusting nothing the planner reports, so it also guards a
plan read back from JSON or produced by another scheduler.
"""

from __future__ import annotations

from typing import List

from .plan import Plan
from .samples import SampleSet
from .spec import PlannerConfig, round_up

__all__ = ["PlanInvariantError", "check_plan"]


class PlanInvariantError(AssertionError):
    """A plan breaks one of its guarantees (a planner bug, never a user error)."""


def check_plan(plan: Plan, samples: SampleSet, config: PlannerConfig) -> None:
    """Raise :class:`PlanInvariantError` listing every broken guarantee of ``plan``."""
    problems: List[str] = []
    parallel = config.parallel
    dp = parallel.dp_size
    cap = config.token_cap
    multiple = parallel.sample_multiple
    sizes = [round_up(length, multiple) for length in samples.lengths]
    n = len(samples)

    # Nothing lost, nothing duplicated.
    seen = [0] * n
    for s, step in enumerate(plan.steps):
        for rank in step.ranks:
            for mb in rank:
                for i in mb:
                    if not 0 <= i < n:
                        problems.append(f"step {s}: sample index {i} out of range [0, {n})")
                    else:
                        seen[i] += 1
    missing = [i for i, c in enumerate(seen) if c == 0]
    duplicated = [i for i, c in enumerate(seen) if c > 1]
    if missing:
        problems.append(f"samples never scheduled: {missing[:20]}")
    if duplicated:
        problems.append(f"samples scheduled more than once: {duplicated[:20]}")

    # Whole rollouts, in order of first appearance, rollouts_per_step per step.
    rollouts = samples.rollouts()
    per_step = config.rollouts_per_step or len(rollouts)
    expected_steps = -(-len(rollouts) // per_step)
    if len(plan.steps) != expected_steps:
        problems.append(f"{len(plan.steps)} steps, expected {expected_steps}")
    step_of = {}
    for s, step in enumerate(plan.steps):
        for rank in step.ranks:
            for mb in rank:
                for i in mb:
                    step_of[i] = s
    for r, (_, members) in enumerate(rollouts):
        want = r // per_step
        got = {step_of.get(i) for i in members}
        if got != {want}:
            problems.append(
                f"rollout #{r} (samples {members[:8]}) is in steps {sorted(map(str, got))}, expected {want}"
            )

    for s, step in enumerate(plan.steps):
        where = f"step {s}"
        m = step.num_microbatches
        if len(step.ranks) != dp:
            problems.append(f"{where}: {len(step.ranks)} ranks, expected dp_size={dp}")
        if m < 1:
            problems.append(f"{where}: num_microbatches={m} < 1")
        if m % parallel.microbatch_multiple:
            problems.append(
                f"{where}: num_microbatches={m} is not a multiple of {parallel.microbatch_multiple}"
            )
        for r, rank in enumerate(step.ranks):
            if len(rank) != m:
                problems.append(f"{where}: rank {r} has {len(rank)} micro-batches, expected {m}")
        S, B = step.seq_length, step.micro_batch_size
        step_items = [i for rank in step.ranks for mb in rank for i in mb if 0 <= i < n]
        step_oversize = sorted(i for i in step_items if sizes[i] > cap)
        if sorted(step.oversize_samples) != step_oversize:
            problems.append(
                f"{where}: reported oversize {list(step.oversize_samples)}, actual {step_oversize}"
            )
        if plan.layout == "packed":
            if B != 1:
                problems.append(f"{where}: packed layout with micro_batch_size={B}")
            if S > cap and not step_oversize:
                problems.append(
                    f"{where}: seq_length={S} exceeds the cap {cap} with no oversize sample"
                )
        else:
            if B * S > cap and not (step_oversize and B == 1):
                problems.append(f"{where}: padded footprint {B}x{S}={B * S} exceeds the cap {cap}")
        if S % multiple:
            problems.append(f"{where}: seq_length={S} is not a multiple of {multiple}")
        for r, rank in enumerate(step.ranks):
            for k, mb in enumerate(rank):
                mb_sizes = [sizes[i] for i in mb if 0 <= i < n]
                footprint = sum(mb_sizes)
                label = f"{where} rank {r} micro-batch {k}"
                if plan.layout == "packed":
                    if footprint > S:
                        problems.append(f"{label}: {footprint} padded tokens exceed seq_length={S}")
                    if footprint > cap and len(mb) != 1:
                        problems.append(f"{label}: {footprint} padded tokens exceed the cap {cap}")
                else:
                    if len(mb) > B:
                        problems.append(f"{label}: {len(mb)} samples exceed micro_batch_size={B}")
                    if mb_sizes and max(mb_sizes) > S:
                        problems.append(f"{label}: a sample longer than seq_length={S}")
        placeholders = sum(1 for rank in step.ranks for mb in rank if not mb)
        if placeholders != step.num_placeholders:
            problems.append(
                f"{where}: num_placeholders={step.num_placeholders}, counted {placeholders}"
            )
        real_mbs = dp * m - placeholders
        if real_mbs < step.lower_bound_microbatches:
            problems.append(
                f"{where}: {real_mbs} real micro-batches, below the lower bound "
                f"{step.lower_bound_microbatches}"
            )

    stats = plan.stats
    if stats.num_samples != n:
        problems.append(f"stats.num_samples={stats.num_samples}, expected {n}")
    if stats.num_placeholders != sum(s.num_placeholders for s in plan.steps):
        problems.append("stats.num_placeholders does not add up")
    if stats.num_microbatches != sum(dp * s.num_microbatches for s in plan.steps):
        problems.append("stats.num_microbatches does not add up")
    if sorted(stats.oversize_samples) != sorted(i for i in range(n) if sizes[i] > cap):
        problems.append("stats.oversize_samples is not exactly the samples over the cap")
    if not 0 < stats.fill <= 1:
        problems.append(f"stats.fill={stats.fill} outside (0, 1]")
    if problems:
        raise PlanInvariantError("plan breaks its guarantees:\n  " + "\n  ".join(problems))
