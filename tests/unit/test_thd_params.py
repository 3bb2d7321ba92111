"""THD PackedSeqParams built from materialized micro-batches (the transformer-engine path).

Attention with THD needs transformer-engine, which cannot run here; these tests check what we
hand to it: segment boundaries that tile the row, placeholders included.
"""

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()

from megatron_dynbatch.errors import DynBatchValueError  # noqa: E402
from megatron_dynbatch.mcore.forward import packed_seq_params_from_batch  # noqa: E402
from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, plan_schedule  # noqa: E402
from megatron_dynbatch.planning.spec import round_up  # noqa: E402
from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches  # noqa: E402

pytestmark = pytest.mark.unit


def _microbatches(layout, tp, cp):
    # Four rows of 12 fit the padded cap of 48 on each of two ranks: one micro-batch of B = 4 per
    # rank holds the eight samples with no placeholder row (B = 1 would need four micro-batches).
    lengths = [5, 9, 3, 12, 7, 11, 4, 6] if layout == "padded" else [5, 9, 3, 12, 7]
    plan = plan_schedule(
        lengths,
        config=PlannerConfig(
            max_tokens_per_gpu=48 if layout == "padded" else 24,
            layout=layout,
            parallel=ParallelLayout(dp_size=2, tp_size=tp, cp_size=cp),
        ),
    )
    step = plan.steps[0]
    batches = []
    for rank in range(2):
        samples = {
            i: {"tokens": torch.arange(1, lengths[i] + 1)} for mb in step.ranks[rank] for i in mb
        }
        batches += materialize_microbatches(
            step,
            rank,
            samples,
            BatchSchema(),
            layout=plan.layout,
            sample_multiple=plan.sample_multiple,
        )
    return plan, batches, lengths


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (2, 2)])
def test_thd_segments_tile_the_row_and_respect_the_multiple(tp, cp):
    plan, batches, lengths = _microbatches("packed", tp, cp)
    for batch in batches:
        params = packed_seq_params_from_batch(batch)
        cu = params.cu_seqlens_q
        assert params.qkv_format == "thd" and cu.dtype == torch.int32
        assert int(cu[0]) == 0 and int(cu[-1]) == plan.steps[0].seq_length
        widths = (cu[1:] - cu[:-1]).tolist()
        assert all(w > 0 for w in widths) and params.max_seqlen_q == max(widths)
        samples = [int(i) for i in batch["sample_index"][0].unique() if i >= 0]
        # Every sample's segment is its length rounded up to the TP/CP multiple, in row order;
        # what is left of the row is one padding segment (none when the row is full).
        in_order = sorted(samples, key=lambda i: int((batch["sample_index"][0] == i).nonzero()[0]))
        expected = [round_up(lengths[i], plan.sample_multiple) for i in in_order]
        tail = plan.steps[0].seq_length - sum(expected)
        assert widths == expected + ([tail] if tail else [])


def test_thd_refuses_padded_rows():
    _, batches, _ = _microbatches("padded", 1, 1)
    wide = [b for b in batches if b["tokens"].shape[0] > 1]
    assert wide, "the padded plan should have B > 1"
    with pytest.raises(DynBatchValueError, match="micro_batch_size 1"):
        packed_seq_params_from_batch(wide[0])
