"""split_outputs / restore_order: exact round trips and strict failures (never zip-and-drop)."""

import pytest
import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime import (
    BatchSchema,
    materialize_microbatches,
    restore_order,
    split_outputs,
)
from tests._support import make_step_plan

pytestmark = pytest.mark.unit

LENGTHS = [5, 1, 9, 3, 7, 2, 4, 6]
PLANS = {
    "packed": make_step_plan(
        [[(0, 3, 1), (), (2,)], [(4, 5), (6, 7), ()]], seq_length=12, micro_batch_size=1
    ),
    "padded": make_step_plan(
        [[(0, 1), (2,), ()], [(3, 4), (5,), (6, 7)]], seq_length=10, micro_batch_size=2
    ),
}


def _samples():
    # Token i*100 + j, so every output value says which sample and position it came from.
    return {
        i: {"tokens": torch.arange(n, dtype=torch.int64) + 100 * i} for i, n in enumerate(LENGTHS)
    }


def _fake_forward(batch):
    """A per-token "model" output [B, S, 2]: the token id and its position."""
    return torch.stack([batch["tokens"].double(), batch["position_ids"].double()], dim=-1)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_round_trip_over_ranks_restores_sample_order(layout):
    plan, samples = PLANS[layout], _samples()
    per_rank = []
    for rank in range(2):
        own = {i: samples[i] for mb in plan.rank_microbatches(rank) for i in mb}
        merged = {}
        for batch, mb in zip(
            materialize_microbatches(
                plan, rank, own, BatchSchema(), layout=layout, sample_multiple=2
            ),
            plan.rank_microbatches(rank),
            strict=True,
        ):
            parts = split_outputs(batch, _fake_forward(batch))
            assert sorted(parts) == sorted(mb)  # placeholders give nothing
            merged.update(parts)
        per_rank.append(merged)
    outputs = restore_order(per_rank, len(LENGTHS))
    assert len(outputs) == len(LENGTHS)
    for i, out in enumerate(outputs):
        n = LENGTHS[i]
        assert out.shape == (n, 2)
        assert out[:, 0].tolist() == (torch.arange(n) + 100 * i).tolist()
        assert out[:, 1].tolist() == list(range(n))


def test_restore_order_with_explicit_indices_and_single_mapping():
    a, b = torch.zeros(1), torch.ones(1)
    assert restore_order({7: a, 3: b}, [3, 7]) == [b, a]
    assert restore_order({}, 0) == []


@pytest.mark.parametrize(
    "per_sample, expected, message",
    [
        ([{0: 0}, {2: 2}], 3, r"missing \[1\]"),
        ([{0: 0, 1: 1}, {1: 1, 2: 2}], 3, r"samples \[1\] .* returned more than once"),
        ([{0: 0, 1: 1, 5: 5}], 2, r"unexpected \[5\]"),
        ({0: 0}, [0, 0], "expected indices repeat"),
        ({0: 0}, -1, "num_samples=-1"),
        ([{0: 0}, [1]], 2, "sequence of mappings"),
    ],
)
def test_restore_order_is_strict(per_sample, expected, message):
    with pytest.raises(DynBatchValueError, match=message):
        restore_order(per_sample, expected)


def test_split_outputs_rejects_wrong_output_shape_and_split_samples():
    plan = make_step_plan([[(0,)]], seq_length=8, micro_batch_size=1)
    (batch,) = materialize_microbatches(
        plan,
        0,
        {0: {"tokens": torch.ones(3, dtype=torch.int64)}},
        BatchSchema(),
        layout="packed",
        sample_multiple=1,
    )
    with pytest.raises(
        DynBatchValueError, match=r"must start with the micro-batch's \[B, S\] = \[1, 8\]"
    ):
        split_outputs(batch, torch.zeros(8, 1, 4))  # Megatron's [S, B, H], not transposed
    broken = dict(batch, sample_index=torch.tensor([[0, 0, -1, 0, -1, -1, -1, -1]]))
    with pytest.raises(DynBatchValueError, match="two separate runs"):
        split_outputs(broken, torch.zeros(1, 8))
    padded = {"sample_index": torch.tensor([[-1, 4], [4, -1]])}
    with pytest.raises(DynBatchValueError, match="spans rows 0 and 1"):
        split_outputs(padded, torch.zeros(2, 2))
