"""The one placeholder contract (``runtime/placeholders.py``): every host's detector finds its
placeholders by the marker (:func:`is_placeholder`), so a change of what a placeholder contains
leaves every detector right. verl's detector, which needs verl's ``tensordict_utils``, is checked
the same way in ``tests/megatron/test_verl_patched.py``."""

import ast
import pathlib

import pytest
import torch

import megatron_dynbatch
from megatron_dynbatch.runtime import placeholders
from megatron_dynbatch.runtime.placeholders import (
    MARKER_KEY,
    PLACEHOLDER_INDEX,
    is_placeholder,
    placeholder_microbatch,
)

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(megatron_dynbatch.__file__).parent
#: Placeholder content other than the default: placeholder rows attend to three tokens (the
#: stock rule is one, which a real one-token row also has).
ATTENDED = (1, 3)


def test_is_placeholder_reads_the_marker_in_every_format():
    assert is_placeholder(PLACEHOLDER_INDEX) and not is_placeholder(0) and not is_placeholder(7)
    index = torch.tensor([[3, 3, PLACEHOLDER_INDEX], [PLACEHOLDER_INDEX] * 3])
    assert is_placeholder(index).tolist() == [[False, False, True], [True, True, True]]
    # A micro-batch's sample indices: a placeholder when it names no real sample.
    assert is_placeholder([]) and is_placeholder([PLACEHOLDER_INDEX])
    assert not is_placeholder([0]) and not is_placeholder((PLACEHOLDER_INDEX, 2))


@pytest.mark.parametrize("attended", ATTENDED)
def test_mcore_padding_mask_follows_sample_index_not_tokens(monkeypatch, attended):
    from megatron_dynbatch.mcore.moe import padding_mask_of
    from megatron_dynbatch.runtime import BatchSchema
    from megatron_dynbatch.runtime.reorder import split_outputs

    monkeypatch.setattr(placeholders, "PLACEHOLDER_ATTENDED_TOKENS", attended)
    # A placeholder's tokens may be anything (here: a pad id that is a real token id).
    batch = placeholder_microbatch(BatchSchema(pad_token_id=attended), 2, 6)
    assert padding_mask_of(batch).all()
    batch["tokens"][0, :4] = attended  # a real sample of the pad id's tokens
    batch["sample_index"][0, :4] = 5
    mask = padding_mask_of(batch)
    assert mask.tolist() == [[False] * 4 + [True] * 2, [True] * 6]
    assert list(split_outputs(batch, torch.zeros(2, 6))) == [5]


def _skyrl_batch(lengths, width=8):
    class Batch(dict):
        metadata = None

    attention = torch.zeros((len(lengths), width), dtype=torch.int64)
    for i, length in enumerate(lengths):
        attention[i, width - length :] = 1
    batch = Batch(
        sequences=torch.randint(1, 50, (len(lengths), width)),
        attention_mask=attention,
        loss_mask=attention.clone(),
    )
    batch.metadata = {"response_length": width}
    return batch


@pytest.mark.parametrize("attended", ATTENDED)
def test_skyrl_placeholder_rows_are_known_by_their_marker(monkeypatch, attended):
    from megatron_dynbatch.integrations.skyrl.iterator import PlannedBatchIterator
    from megatron_dynbatch.integrations.skyrl.moe import padding_mask
    from megatron_dynbatch.integrations.skyrl.plan import plan_skyrl_minibatch

    monkeypatch.setattr(placeholders, "PLACEHOLDER_ATTENDED_TOKENS", attended)
    # A real sample of one attended token (what a placeholder row attended to before), and a
    # second rank with more micro-batches, so this one runs placeholder rows and micro-batches.
    lengths = [1, 5, 7]
    data = _skyrl_batch(lengths)
    plan = plan_skyrl_minibatch([lengths, [8, 8, 8, 8]], 8)
    iterator = PlannedBatchIterator(data, plan, 0)
    micro_batches = [{"attention_mask": b["attention_mask"]} for b in iterator]
    iterator.mark_rows(micro_batches)
    expected = iterator.row_indices()
    assert any(PLACEHOLDER_INDEX in rows for rows in expected)
    for batch, rows in zip(micro_batches, expected, strict=True):
        attention = batch["attention_mask"].to(torch.bool)
        for r, index in enumerate(rows):
            if index == PLACEHOLDER_INDEX:  # the content changed with the rule
                assert int(attention[r].sum()) == attended
        # remove_left_padding's layout: each row's attended tokens first.
        new_attention = attention.sort(dim=1, descending=True).values
        mask = padding_mask(batch[MARKER_KEY], new_attention)
        for r, index in enumerate(rows):
            if index == PLACEHOLDER_INDEX:
                assert mask[r].all()
            else:
                assert int((~mask[r]).sum()) == lengths[index]


def test_skyrl_mark_rows_refuses_dicts_that_are_not_its_micro_batches():
    from megatron_dynbatch.errors import DynBatchValueError
    from megatron_dynbatch.integrations.skyrl.iterator import PlannedBatchIterator
    from megatron_dynbatch.integrations.skyrl.plan import plan_skyrl_minibatch

    data = _skyrl_batch([3, 4])
    iterator = PlannedBatchIterator(data, plan_skyrl_minibatch([[3, 4]], 8), 0)
    with pytest.raises(DynBatchValueError, match="micro-batch dicts"):
        iterator.mark_rows([])


@pytest.mark.parametrize("attended", ATTENDED)
def test_nemo_rl_placeholder_rows_are_known_by_their_marker(monkeypatch, attended):
    from megatron_dynbatch.integrations.nemo_rl.shard import (
        INPUT_LENGTHS_KEY,
        num_real_rows,
        placeholder_rows,
        shard_for_train,
    )

    class Batch(dict):
        @property
        def size(self):
            return next(iter(self.values())).shape[0]

        def select_indices(self, indices):
            return type(self)({key: value[indices] for key, value in self.items()})

    monkeypatch.setattr(placeholders, "PLACEHOLDER_ATTENDED_TOKENS", attended)
    # Real samples of one token, like the stock placeholder row; 2 global batches of 3 samples
    # over 4 ranks, so some rank holds placeholder rows.
    lengths = [1, 1, 9, 1, 12, 1]
    data = Batch(
        input_ids=torch.arange(6 * 12).reshape(6, 12),
        input_lengths=torch.tensor(lengths),
        sample_mask=torch.ones(6),
    )
    cfg = {
        "sequence_packing": {"enabled": True, "train_mb_tokens": 16},
        "megatron_cfg": {"enabled": True, "pipeline_model_parallel_size": 2},
    }
    shards = shard_for_train(cfg, data, 4, 3)
    marked = [placeholder_rows(s) for s in shards]
    assert any(marked)
    for shard, rows in zip(shards, marked, strict=True):
        lengths_here = shard[INPUT_LENGTHS_KEY].tolist()
        assert all(lengths_here[p] == attended for p in rows)
        assert not any(shard["sample_mask"][p] for p in rows)
        assert num_real_rows(shard) == int(shard["sample_mask"].sum())
    assert sum(num_real_rows(s) for s in shards) == len(lengths)


def test_slime_placeholders_and_the_phantom_are_known_by_their_marker():
    from megatron_dynbatch.integrations.slime.empty_rank import add_phantom_sample, has_phantom
    from megatron_dynbatch.integrations.slime.moe import _last_is_padding

    class Iterator:
        def __init__(self, rollout_data):
            self.rollout_data = rollout_data
            self.micro_batch_indices = rollout_data["micro_batch_indices"]
            self.offset = 0

        def padding(self):
            self.offset += 1
            return _last_is_padding(self)

    # A rank with samples: a real micro-batch, then a placeholder (names no sample).
    real = {"partition": [4, 9], "micro_batch_indices": [[0, 1], []], "tokens": [None, None]}
    it = Iterator(real)
    assert [it.padding(), it.padding()] == [False, True]
    assert not has_phantom(real)
    # A rank without samples: the phantom (rollout position = the marker) in the first
    # micro-batch, placeholders after it; the phantom's content is real-looking data.
    empty = {
        "partition": [],
        "micro_batch_indices": [[], []],
        "tokens": [],
        "total_lengths": [],
        "response_lengths": [],
        "loss_masks": [],
    }
    add_phantom_sample(empty, None)
    assert empty["micro_batch_indices"] == [[0], []] and has_phantom(empty)
    it = Iterator(empty)
    assert [it.padding(), it.padding()] == [True, True]


def test_no_detector_outside_the_contract_compares_with_the_marker_value():
    """Detectors call ``is_placeholder``; none compares a sample index with 0 or -1 itself."""
    hits = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "placeholders.py" and path.parent.name == "runtime":
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name):
                if node.left.id == "sample_index" and any(
                    isinstance(c, ast.Constant) and c.value in (0, -1) for c in node.comparators
                ):
                    hits.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert hits == [], f"call runtime.placeholders.is_placeholder instead: {hits}"
