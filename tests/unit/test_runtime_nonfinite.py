"""NaN/Inf in declared fields: inert on masked positions, an error on loss-bearing ones (issue 10.3).

Before the fix a NaN advantage on a fully masked sample gave a finite loss and NaN gradients:
``where(mask, ce * adv, 0)`` selects the value, but backward computes ``0 * NaN`` for d/d(ce).
"""

import pytest
import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime import (
    AGGREGATIONS,
    BatchSchema,
    FieldSpec,
    detach_masked_positions,
    materialize_microbatches,
    microbatch_loss,
)
from tests._support import make_step_plan

pytestmark = pytest.mark.unit

NAN, INF = float("nan"), float("inf")

SCHEMA = BatchSchema(
    fields=(
        FieldSpec(name="advantages", kind="sample", dtype=torch.float32, pad_value=0.5),
        FieldSpec(name="adv", kind="token", dtype=torch.float32),
        FieldSpec(name="old_logp", kind="token", dtype=torch.float32, shift_to_labels=True),
        FieldSpec(name="group", kind="sample", dtype=torch.int64, pad_value=-1),
    )
)


def _sample(length, prompt, *, advantages=1.0, adv=None, old_logp=None):
    return {
        "tokens": torch.arange(1, length + 1, dtype=torch.int64),
        "prompt_length": prompt,
        "advantages": torch.tensor(advantages),
        "adv": torch.ones(length) if adv is None else torch.tensor(adv),
        "old_logp": torch.zeros(length) if old_logp is None else torch.tensor(old_logp),
        "group": torch.tensor(3),
    }


def _materialize(samples, seq_length=16):
    plan = make_step_plan([[tuple(samples)]], seq_length=seq_length, micro_batch_size=1)
    (batch,) = materialize_microbatches(
        plan, 0, samples, SCHEMA, layout="packed", sample_multiple=1
    )
    return batch


def test_non_finite_values_on_loss_free_tokens_become_the_pad_value():
    # L = 6, prompt 3: targets are tokens 3, 4, 5. Row position j predicts token j + 1, so an
    # unshifted field bears loss at its values 2, 3, 4 and a shifted one at 3, 4, 5.
    samples = {
        0: _sample(
            6,
            3,
            adv=[NAN, INF, 2.0, 3.0, 4.0, NAN],
            old_logp=[NAN, -INF, NAN, -1.0, -2.0, -3.0],
        ),
        # Fully masked (prompt = L): its NaN advantage bears no loss anywhere.
        1: _sample(4, 4, advantages=NAN),
    }
    batch = _materialize(samples)
    for name in ("advantages", "adv", "old_logp"):
        assert bool(torch.isfinite(batch[name]).all()), (name, batch[name])
    # Loss-bearing values are untouched; the replaced ones hold the pad value.
    assert batch["adv"][0, :6].tolist() == [0.0, 0.0, 2.0, 3.0, 4.0, 0.0]
    assert batch["old_logp"][0, :5].tolist() == [0.0, 0.0, -1.0, -2.0, -3.0]
    assert batch["advantages"][0, 6:10].tolist() == [0.5] * 4
    assert batch["advantages"][0, :6].tolist() == [1.0] * 6


@pytest.mark.parametrize(
    "sample, message",
    [
        (_sample(6, 3, adv=[0.0, 0.0, NAN, 0.0, 0.0, 0.0]), r"'adv' is NaN or Inf on 1 .*token 2"),
        (_sample(6, 3, old_logp=[0.0] * 5 + [-INF]), r"'old_logp' is NaN or Inf on 1 .*token 5"),
        (_sample(6, 3, advantages=NAN), r"'advantages' = nan is NaN or Inf .* 3 loss-bearing"),
        (_sample(6, 0, advantages=INF), r"'advantages' = inf .* 5 loss-bearing"),
    ],
)
def test_non_finite_value_on_a_loss_bearing_token_names_sample_and_field(sample, message):
    with pytest.raises(DynBatchValueError, match=r"sample 7: field " + message):
        _materialize({7: sample})


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masked_nan_advantage_leaves_gradients_finite_and_unchanged(aggregation):
    def grad_of(advantage):
        batch = _materialize(
            {0: _sample(6, 2, advantages=0.3), 1: _sample(5, 5, advantages=advantage)}
        )
        ce = torch.linspace(0.5, 2.0, 16).reshape(1, 16).requires_grad_()
        numerator, _, _ = microbatch_loss(aggregation, ce * batch["advantages"], batch)
        numerator.backward()
        return ce.grad

    poisoned, clean = grad_of(NAN), grad_of(-2.0)
    assert bool(torch.isfinite(poisoned).all()), poisoned
    assert torch.equal(poisoned, clean)


def test_detach_masked_positions_blocks_nan_that_the_token_loss_creates():
    """A batch that did not come from the materializer (or a loss dividing by 0 on padding)."""
    batch = {
        "loss_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
        "sample_index": torch.tensor([[0, 0, 0, -1]]),
        "advantages": torch.tensor([[NAN, 2.0, 2.0, INF]]),
    }
    ce = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    # Without it: the value is finite but the gradient is NaN (the original failure).
    numerator, _, _ = microbatch_loss("token-mean", ce * batch["advantages"], batch)
    numerator.backward()
    assert torch.isfinite(numerator) and not bool(torch.isfinite(ce.grad).all())
    ce.grad = None
    guarded = detach_masked_positions(ce, batch)
    assert torch.equal(guarded, ce)
    numerator, _, _ = microbatch_loss("token-mean", guarded * batch["advantages"], batch)
    numerator.backward()
    assert ce.grad.tolist() == [[0.0, 2.0, 2.0, 0.0]]
    with pytest.raises(DynBatchValueError, match="per_token has shape"):
        detach_masked_positions(torch.zeros(4), batch)
