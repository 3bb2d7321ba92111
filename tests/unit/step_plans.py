"""Hand-made StepPlans for runtime tests (the planner's statistics fields get neutral values)."""

import dataclasses

from megatron_dynbatch.planning.plan import StepPlan


def make_step_plan(ranks, *, seq_length, micro_batch_size):
    """A StepPlan with the given schedule; statistics fields get neutral values."""
    values = dict(
        num_microbatches=len(ranks[0]),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        ranks=tuple(tuple(tuple(mb) for mb in rank) for rank in ranks),
    )
    for f in dataclasses.fields(StepPlan):
        if f.name not in values:
            kind = str(f.type)
            values[f.name] = 0.0 if "float" in kind else (() if "uple" in kind else 0)
    return StepPlan(**values)
