"""The runtime's public calls (materialize_microbatches, split_outputs, restore_order) as another
trainer makes them: numpy integers are integers, and a wrong argument is a DynBatchValueError that
says what to pass, not an AttributeError, KeyError or TypeError from inside (or a silent rank 1
for dp_rank=True)."""

import numpy as np
import pytest
import torch

from megatron_dynbatch import BatchSchema, PlannerConfig, materialize_microbatches
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import plan_schedule
from megatron_dynbatch.runtime.reorder import restore_order, split_outputs

pytestmark = pytest.mark.unit

LENGTHS = [5, 7, 9]
PLAN = plan_schedule(LENGTHS, config=PlannerConfig(max_tokens_per_gpu=64))
STEP = PLAN.steps[0]


def _samples(**extra):
    return {i: {"tokens": torch.arange(n), **extra} for i, n in enumerate(LENGTHS)}


def _build(step=STEP, rank=0, samples=None, schema=None, multiple=1):
    return materialize_microbatches(
        step,
        rank,
        _samples() if samples is None else samples,
        BatchSchema() if schema is None else schema,
        layout="packed",
        sample_multiple=multiple,
    )


def test_numpy_integers_are_integers_everywhere():
    given = _build(
        rank=np.int64(0),
        samples=_samples(prompt_length=np.int64(2)),
        schema=BatchSchema(pad_token_id=np.int64(3)),
        multiple=np.int64(1),
    )
    plain = _build(samples=_samples(prompt_length=2), schema=BatchSchema(pad_token_id=3))
    assert len(given) == len(plain)
    for a, b in zip(given, plain, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(step=PLAN), "pass one step, plan.steps"),
        (dict(rank=0.0), "dp_rank=0.0 must be an integer"),
        (dict(rank=True), "dp_rank=True must be an integer"),
        (dict(rank=1), "dp_rank=1 is outside"),
        (dict(schema="none"), "must be a BatchSchema"),
        (dict(samples={i: {"tokens": -torch.arange(1, n + 1)} for i, n in enumerate(LENGTHS)}),
         "token id -5 is negative"),  # fmt: skip
    ],
)
def test_wrong_arguments_are_refused_saying_what_to_pass(changes, named):
    with pytest.raises(DynBatchValueError, match=named):
        _build(**changes)


def test_restore_order_takes_tensor_and_numpy_indices_and_refuses_the_rest():
    x, y = torch.zeros(1), torch.ones(1)
    assert restore_order({torch.tensor(1): y, np.int64(0): x}, 2) == [x, y]
    assert restore_order([{0: x}, {1: y}], np.array([1, 0])) == [y, x]
    assert restore_order([{0: x}, {1: y}], np.int64(2)) == [x, y]
    for per_sample, expected in (({0: x}, 4.0), ({0: x}, True), ({0: x}, None), (None, 2),
                                 ({0: x}, ["a"])):  # fmt: skip
        with pytest.raises(DynBatchValueError, match="must be|holds 'a'"):
            restore_order(per_sample, expected)
    with pytest.raises(DynBatchValueError, match="sample_index"):
        split_outputs({"tokens": torch.zeros(1, 4)}, torch.zeros(1, 4))
