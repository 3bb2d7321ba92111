"""NeMo-RL's shards built from the plan, with a stand-in of its batch type (no checkout needed):
placeholder rows, NeMo-RL's attributes, outputs back in sample order, one iterator per chunk."""

import pytest
import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.nemo_rl.plan import nemo_rl_planner_config, plan_nemo_rl_shards
from megatron_dynbatch.integrations.nemo_rl.shard import (
    chunk_iterators,
    drop_placeholder_rows,
    num_real_rows,
    placeholder_rows,
    restore_rows,
    shard_for_logprob,
    shard_for_train,
)

pytestmark = pytest.mark.unit


class Batch(dict):
    """What the shard builder uses of NeMo-RL's ``BatchedDataDict``: ``size``, ``select_indices``."""

    @property
    def size(self):
        value = next(iter(self.values()))
        return value.shape[0] if torch.is_tensor(value) else len(value)

    def select_indices(self, indices):
        out = type(self)()
        for key, value in self.items():
            out[key] = value[indices] if torch.is_tensor(value) else [value[i] for i in indices]
        return out


CFG = {
    "make_sequence_length_divisible_by": 2,
    "sequence_packing": {"enabled": True, "train_mb_tokens": 40, "logprob_mb_tokens": 80},
    "megatron_cfg": {"enabled": True, "pipeline_model_parallel_size": 2},
}


def _batch(lengths):
    n, width = len(lengths), max(lengths)
    ids = torch.arange(1, n * width + 1).reshape(n, width)
    return Batch(
        input_ids=ids,
        input_lengths=torch.tensor(lengths, dtype=torch.int32),
        token_mask=torch.ones(n, width),
        sample_mask=torch.ones(n),
        tag=[f"s{i}" for i in range(n)],
    )


def test_shards_carry_every_sample_once_and_loss_masked_placeholder_rows():
    lengths = [30, 5, 7, 3, 9, 11]
    data = _batch(lengths)
    shards = shard_for_train(CFG, data, dp_size=4, batch_size=3)
    seen = []
    for shard in shards:
        placeholders = set(placeholder_rows(shard))
        assert num_real_rows(shard) == shard.size - len(placeholders)
        assert sum(shard.elem_counts_per_gb) == shard.size
        for row in range(shard.size):
            if row in placeholders:
                # A shape, not data: every key, zero weight, one token.
                assert shard["sample_mask"][row] == 0 and shard["token_mask"][row].sum() == 0
                assert shard["input_ids"][row].sum() == 0 and shard["input_lengths"][row] == 1
                assert shard["input_ids"].dtype == data["input_ids"].dtype
                assert shard["tag"][row] is None
            else:
                seen.append(shard["tag"][row])
    assert sorted(seen) == sorted(data["tag"])
    # 2 global batches of 3 samples over 4 ranks: some rank holds only placeholders.
    assert any(num_real_rows(s) == 0 for s in shards)
    counts = {tuple(len(gb) for gb in s.micro_batch_indices) for s in shards}
    assert len(counts) == 1, "every rank runs the same micro-batch count per global batch"


def test_log_probs_come_back_in_sample_order():
    lengths = [12, 30, 3, 17, 8]
    data = _batch(lengths)
    shards, order = shard_for_logprob(CFG, data, dp_size=2)
    # A worker's output per row: the row's first token id (placeholders: 0), then its drop.
    outputs = [shard["input_ids"][:, 0].clone() for shard in shards]
    kept = [drop_placeholder_rows(s, out) for s, out in zip(shards, outputs, strict=True)]
    gathered = torch.cat(kept)
    restored = torch.empty_like(gathered)
    restored[torch.tensor(order)] = gathered  # NeMo-RL's reorder_data
    assert restored.tolist() == data["input_ids"][:, 0].tolist()
    plan = plan_nemo_rl_shards(
        lengths,
        nemo_rl_planner_config(CFG, dp_size=2, forward_only=True),
        pad_multiple=2,
        forward_only=True,
    )
    assert restore_rows(outputs, plan).tolist() == data["input_ids"][:, 0].tolist()


def test_output_rows_must_match_the_shard():
    shards, _ = shard_for_logprob(CFG, _batch([30, 30, 3]), dp_size=4)
    shard = next(s for s in shards if placeholder_rows(s))
    with pytest.raises(DynBatchValueError, match="output rows for a shard of"):
        drop_placeholder_rows(shard, torch.zeros(shard.size + 1))


def test_chunk_iterators_serve_each_microbatch_to_every_chunk_once_taken():
    taken = []

    def source():
        for k in range(3):
            taken.append(k)
            yield k

    first, second = chunk_iterators(source(), 2)
    assert [next(first), next(first), next(second), next(first), next(second)] == [0, 1, 0, 2, 1]
    assert list(second) == [2] and list(first) == []
    assert taken == [0, 1, 2]
