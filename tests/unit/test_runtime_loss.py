"""Loss normalisation: micro-batched, DP-split gradients equal the direct reference exactly."""

import pytest
import torch
import torch.nn.functional as F

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, plan_schedule
from megatron_dynbatch.runtime import (
    AGGREGATIONS,
    BatchSchema,
    finalize_loss,
    materialize_microbatches,
    microbatch_loss,
    reference_loss,
)
from tests._support import make_step_plan

pytestmark = pytest.mark.unit

VOCAB = 13
HIDDEN = 8
MAX_POSITIONS = 16


class TinyCausalLM(torch.nn.Module):
    """Embedding + one causal attention head restricted to the token's THD segment + LM head.

    Attention only within a segment and positions from ``position_ids`` make a packed or padded
    row compute, at each real token, exactly what the sample computes alone.
    """

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(
            torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
        )
        self.pos = torch.nn.Parameter(
            torch.randn(MAX_POSITIONS, HIDDEN, generator=gen, dtype=torch.float64)
        )
        self.qkv = torch.nn.Parameter(
            torch.randn(HIDDEN, 3 * HIDDEN, generator=gen, dtype=torch.float64)
        )
        self.head = torch.nn.Parameter(
            torch.randn(HIDDEN, VOCAB, generator=gen, dtype=torch.float64)
        )

    def forward(self, tokens, position_ids, segment_ids):
        x = self.embed[tokens] + self.pos[position_ids]
        q, k, v = (x @ self.qkv).split(HIDDEN, dim=-1)
        s = tokens.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
        scores = (q @ k.transpose(1, 2)) / HIDDEN**0.5
        scores = scores.masked_fill(~(causal & same_segment), float("-inf"))
        x = x + torch.softmax(scores, dim=-1) @ v
        return x @ self.head

    def per_token_loss(self, batch):
        logits = self(batch["tokens"], batch["position_ids"], batch["segment_ids"])
        losses = F.cross_entropy(
            logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), reduction="none"
        )
        return losses.reshape(batch["labels"].shape)


def make_samples():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 1, 9, 3, 7, 2, 4, 6]
    samples = {
        i: {"tokens": torch.randint(0, VOCAB, (n,), generator=gen)} for i, n in enumerate(lengths)
    }
    samples[3]["prompt_length"] = 3  # no loss token at all
    samples[4]["prompt_length"] = 2
    samples[6]["loss_mask"] = torch.tensor([1, 0, 1, 1])
    samples[7]["loss_mask"] = torch.tensor([0, 0, 1, 0, 1, 1])
    return samples


# Two DP ranks with unequal micro-batches (different sample and token counts) and placeholders.
PLANS = {
    "packed": make_step_plan(
        [[(0, 3, 1), (), (2,)], [(4, 5), (6, 7), ()]], seq_length=12, micro_batch_size=1
    ),
    "padded": make_step_plan(
        [[(0, 1), (2,), ()], [(3, 4), (5,), (6, 7)]], seq_length=10, micro_batch_size=2
    ),
}


def micro_batched_gradients(model, aggregation, layout):
    """What Megatron computes with calculate_per_token_loss=True over 2 DP ranks.

    Backward of every micro-batch's numerator (gradients accumulate, as DP all-reduce sums them),
    denominators summed over micro-batches and ranks, gradients divided once at the end.
    """
    plan = PLANS[layout]
    samples = make_samples()
    model.zero_grad()
    numerator_total = torch.zeros((), dtype=torch.float64)
    denominator_total = torch.zeros((), dtype=torch.int32)
    log_total = torch.zeros(2)
    for rank in range(len(plan.ranks)):
        own = {i: samples[i] for mb in plan.rank_microbatches(rank) for i in mb}
        batches = materialize_microbatches(
            plan, rank, own, BatchSchema(), layout=layout, sample_multiple=2
        )
        for batch in batches:
            numerator, denominator, log = microbatch_loss(
                aggregation, model.per_token_loss(batch), batch
            )
            assert numerator.requires_grad and denominator.dtype == torch.int32
            numerator.backward()
            numerator_total += numerator.detach()
            denominator_total += denominator
            log_total += log["loss"]
    if aggregation != "sum" and int(denominator_total) > 0:  # finalize_model_grads
        for p in model.parameters():
            p.grad /= int(denominator_total)
    grads = [p.grad.clone() for p in model.parameters()]
    return finalize_loss(aggregation, numerator_total, denominator_total), grads, log_total


def reference_gradients(model, aggregation):
    """Each sample alone, one loss over the whole step."""
    samples = make_samples()
    schema = BatchSchema()
    model.zero_grad()
    losses, masks = [], []
    for i in sorted(samples):
        checked = schema.check_sample(i, samples[i])
        tokens = checked.tokens[None]
        n = checked.length
        labels = torch.cat([checked.tokens[1:], torch.zeros(1, dtype=torch.int64)])
        logits = model(tokens, torch.arange(n)[None], torch.zeros(1, n, dtype=torch.int64))[0]
        losses.append(F.cross_entropy(logits, labels, reduction="none"))
        masks.append(torch.cat([checked.loss_mask[1:], torch.zeros(1)]))
    value = reference_loss(aggregation, losses, masks)
    value.backward()
    return value.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_microbatched_gradients_equal_reference(aggregation, layout):
    model = TinyCausalLM()
    value, grads, log_total = micro_batched_gradients(model, aggregation, layout)
    ref_value, ref_grads = reference_gradients(model, aggregation)
    assert ref_value != 0
    torch.testing.assert_close(value, ref_value, rtol=1e-6, atol=0)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert ref.norm() > 0
        assert (grad - ref).norm() <= 1e-6 * ref.norm()
    # Megatron's report, sum(log[0]) / sum(log[1]), is the same global value; for sum, the
    # step's sum per sample (one plan-independent figure).
    per = len(make_samples()) if aggregation == "sum" else 1
    torch.testing.assert_close(
        (log_total[0] / log_total[1]).double(), ref_value / per, rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_the_sum_report_counts_no_placeholder(dp):
    """A probe: ``sum``'s report divided by every micro-batch, placeholders included, so the same
    two samples logged 6.0 at dp 1, 3.0 at dp 2 and 1.5 at dp 4; now their sum per sample."""
    samples = {0: {"tokens": torch.arange(5)}, 1: {"tokens": torch.arange(3)}}
    config = PlannerConfig(max_tokens_per_gpu=8, parallel=ParallelLayout(dp_size=dp))
    step = plan_schedule([5, 3], config=config).steps[0]
    assert (step.num_placeholders > 0) == (dp == 4)
    logs = [
        microbatch_loss("sum", torch.ones(b["loss_mask"].shape), b)[2]["loss"]
        for rank in range(dp)
        for b in materialize_microbatches(
            step, rank, samples, BatchSchema(), layout="packed", sample_multiple=1
        )
    ]
    total = torch.stack(logs).sum(0)
    assert float(total[0] / total[1]) == 3.0  # 6 loss tokens of loss 1 over 2 samples


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sequence_means_count_exactly_in_half_precision(dtype):
    """A probe: in bfloat16 the per-sequence counts stopped at 256 (fp16: 2048), so a 1,000-token
    sample's mean read twice its value. Counts are integers and sums float32 now."""
    samples = {
        0: {"tokens": torch.zeros(3000, dtype=torch.int64)},
        1: {"tokens": torch.zeros(3, dtype=torch.int64)},
    }
    step = plan_schedule([3000, 3], config=PlannerConfig(max_tokens_per_gpu=4096)).steps[0]
    [batch] = materialize_microbatches(
        step, 0, samples, BatchSchema(), layout="packed", sample_multiple=1
    )
    loss = torch.zeros(batch["loss_mask"].shape)
    loss[0, :1500] = 1.0  # 1,500 of sample 0's 2,999 loss tokens
    for aggregation, exact in (
        ("seq-mean-token-mean", (1500 / 2999) / 2),
        ("seq-mean-token-sum", 1500 / 2),
    ):
        numerator, denominator, _ = microbatch_loss(aggregation, loss.to(dtype), batch)
        assert numerator.dtype == dtype
        value = float(finalize_loss(aggregation, numerator, denominator))
        assert value == pytest.approx(exact, rel=1e-2), (aggregation, value)


def test_sample_share_weighting_is_wrong_for_token_mean():
    """The module docstring's example: A has 2 loss tokens of loss 1, B 8 of loss 0."""
    samples = {
        0: {"tokens": torch.zeros(3, dtype=torch.int64)},
        1: {"tokens": torch.zeros(9, dtype=torch.int64)},
    }
    plan = make_step_plan([[(0,), (1,)]], seq_length=10, micro_batch_size=1)
    batches = materialize_microbatches(
        plan, 0, samples, BatchSchema(), layout="packed", sample_multiple=1
    )
    losses = [batches[0]["sample_index"].eq(0).double(), torch.zeros(1, 10, dtype=torch.float64)]

    def both(aggregation):
        parts = [
            microbatch_loss(aggregation, loss, b) for loss, b in zip(losses, batches, strict=True)
        ]
        exact = finalize_loss(aggregation, sum(p[0] for p in parts), sum(p[1] for p in parts))
        # Sample-share: each micro-batch's own mean, weighted by its share of the samples.
        num_samples = len(samples)
        share = sum(
            finalize_loss(aggregation, num, den)
            * (b["sample_index"].unique().gt(-1).sum() / num_samples)
            for (num, den, _), b in zip(parts, batches, strict=True)
        )
        return float(exact), float(share)

    exact, share = both("token-mean")
    assert exact == pytest.approx(0.2) and share == pytest.approx(0.5)
    exact, share = both("seq-mean-token-mean")
    assert exact == pytest.approx(0.5) == share


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_placeholder_contributes_nothing_but_still_backpropagates(aggregation):
    model = TinyCausalLM()
    plan = make_step_plan([[()]], seq_length=8, micro_batch_size=1)
    (batch,) = materialize_microbatches(
        plan, 0, {}, BatchSchema(), layout="packed", sample_multiple=1
    )
    numerator, denominator, log = microbatch_loss(aggregation, model.per_token_loss(batch), batch)
    assert numerator.detach().item() == 0 and int(denominator) == 0
    assert numerator.requires_grad
    numerator.backward()
    assert all(p.grad is not None and p.grad.eq(0).all() for p in model.parameters())
    assert log["loss"].shape == (2,)


def test_sequence_without_loss_tokens_counts_as_a_sequence():
    samples = {
        0: {"tokens": torch.ones(4, dtype=torch.int64)},
        1: {"tokens": torch.ones(1, dtype=torch.int64)},
    }
    plan = make_step_plan([[(0, 1)]], seq_length=5, micro_batch_size=1)
    (batch,) = materialize_microbatches(
        plan, 0, samples, BatchSchema(), layout="packed", sample_multiple=1
    )
    loss = torch.full((1, 5), 2.0)
    for aggregation, expected in [("seq-mean-token-mean", 1.0), ("seq-mean-token-sum", 3.0)]:
        numerator, denominator, _ = microbatch_loss(aggregation, loss, batch)
        assert int(denominator) == 2
        assert float(finalize_loss(aggregation, numerator, denominator)) == expected
        ref = reference_loss(
            aggregation,
            [torch.full((4,), 2.0), torch.full((1,), 2.0)],
            [torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.zeros(1)],
        )
        assert float(ref) == expected


def test_non_finite_loss_on_padding_is_ignored():
    samples = {0: {"tokens": torch.ones(3, dtype=torch.int64)}}
    plan = make_step_plan([[(0,)]], seq_length=6, micro_batch_size=1)
    (batch,) = materialize_microbatches(
        plan, 0, samples, BatchSchema(), layout="packed", sample_multiple=1
    )
    loss = torch.tensor([[1.0, 3.0, float("nan"), float("inf"), float("nan"), 5.0]])
    for aggregation in AGGREGATIONS:
        numerator, _, _ = microbatch_loss(aggregation, loss, batch)
        assert torch.isfinite(numerator)


def test_empty_step_and_errors():
    assert float(reference_loss("token-mean", [], [])) == 0.0
    batch = {"loss_mask": torch.ones(1, 4), "sample_index": torch.full((1, 4), -1)}
    with pytest.raises(DynBatchValueError, match="aggregation='mean' is not one of"):
        microbatch_loss("mean", torch.zeros(1, 4), batch)
    with pytest.raises(DynBatchValueError, match=r"per_token_loss has shape \(4,\)"):
        microbatch_loss("token-mean", torch.zeros(4), batch)
    with pytest.raises(DynBatchValueError, match="sample_index -1"):
        microbatch_loss("seq-mean-token-mean", torch.zeros(1, 4), batch)
    with pytest.raises(DynBatchValueError, match="2 loss tensors and 1 masks"):
        reference_loss("sum", [torch.zeros(2), torch.zeros(2)], [torch.zeros(2)])
    with pytest.raises(DynBatchValueError, match="sample 0: loss shape"):
        reference_loss("sum", [torch.zeros(2)], [torch.zeros(3)])


def test_a_batch_without_the_materializers_keys_or_a_list_loss_is_refused_by_name():
    # A probe: a bare KeyError ('loss_mask') and AttributeError (a list as the loss).
    loss = torch.ones(1, 3)
    with pytest.raises(DynBatchValueError, match="the micro-batch has no 'loss_mask'"):
        microbatch_loss("token-mean", loss, {"tokens": torch.ones(1, 3)})
    mask = {"loss_mask": torch.ones(1, 3)}
    with pytest.raises(DynBatchValueError, match="per_token_loss must be a"):
        microbatch_loss("token-mean", [[1.0, 1.0, 1.0]], mask)
    with pytest.raises(DynBatchValueError, match="the micro-batch has no 'sample_index'"):
        microbatch_loss("seq-mean-token-mean", loss, mask)
    numerator, denominator, _ = microbatch_loss("token-mean", loss, mask)
    assert (float(numerator), int(denominator)) == (3.0, 3)
