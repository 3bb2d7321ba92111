"""Hand-made StepPlans for runtime tests (the planner's statistics fields get neutral values)."""

import dataclasses
import typing

from megatron_dynbatch.planning.plan import StepPlan

#: A neutral value per field type (fields with a default keep it).
_NEUTRAL = {int: 0, float: 0.0, tuple: ()}


def make_step_plan(ranks, *, seq_length, micro_batch_size):
    """A StepPlan with the given schedule; statistics fields get neutral values."""
    values = dict(
        num_microbatches=len(ranks[0]),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        ranks=tuple(tuple(tuple(mb) for mb in rank) for rank in ranks),
    )
    types = typing.get_type_hints(StepPlan)
    for f in dataclasses.fields(StepPlan):
        if f.name in values or f.default is not dataclasses.MISSING:
            continue
        kind = typing.get_origin(types[f.name]) or types[f.name]
        values[f.name] = _NEUTRAL[kind]
    return StepPlan(**values)
