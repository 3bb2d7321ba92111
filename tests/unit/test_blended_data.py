"""Weighted blends of document samples: Megatron's shares, per split, deterministic from --seed.

Weights are token shares by default (Megatron's meaning: its samples are fixed-length windows);
``weights_are="samples"`` (``--blend-weights samples``) draws samples in the weights' shares.
"""

import argparse

import numpy
import pytest

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()  # importing megatron.core needs the triton stand-in on this machine

from megatron_dynbatch.errors import DynBatchValueError  # noqa: E402
from megatron_dynbatch.integrations.megatron_lm.data.blends import (  # noqa: E402
    BlendedSamples,
    blending_indices,
)
from megatron_dynbatch.integrations.megatron_lm.data.documents import (  # noqa: E402
    MOCK_NUM_DOCUMENTS,
    DocumentCollection,
    SplitSamples,
    document_splits,
    split_bookends,
)

pytestmark = pytest.mark.unit


def _collection(lengths, tag):
    lengths = numpy.asarray(lengths, dtype=numpy.int64)

    def read(document, offset, count):
        # Token = tag * 10^6 + document * 1000 + offset: every read names its dataset.
        return numpy.arange(offset, offset + count, dtype=numpy.int64) + 1000 * document + tag

    return DocumentCollection(lengths=lengths, read=read, name=f"corpus {tag}")


def _parts(seed=3, split_index=0):
    a = SplitSamples(
        _collection([4] * 40, 1_000_000), 0, 40, max_length=8, seed=seed,
        split_index=split_index, stream=1,
    )  # fmt: skip
    b = SplitSamples(
        _collection([6] * 500, 2_000_000), 0, 500, max_length=8, seed=seed,
        split_index=split_index, stream=2,
    )  # fmt: skip
    return a, b


def test_blending_follows_megatrons_greedy_to_one_sample():
    index = blending_indices([3.0, 7.0], 10_000)
    counts = numpy.cumsum(numpy.eye(2, dtype=numpy.int64)[index], axis=0)
    n = numpy.arange(1, 10_001)
    assert numpy.all(numpy.abs(counts[:, 0] - 0.3 * n) <= 1.0)
    assert numpy.all(numpy.abs(counts[:, 1] - 0.7 * n) <= 1.0)


def test_drawn_shares_follow_the_weights_within_one_percent():
    blend = BlendedSamples(_parts(), [0.3, 0.7], split_index=0, name="a+b", weights_are="samples")
    tags = [blend.sample_at(p)["tokens"][0].item() // 1_000_000 for p in range(2000)]
    assert abs(tags.count(1) / 2000 - 0.3) < 0.01 and abs(tags.count(2) / 2000 - 0.7) < 0.01
    assert blend.shares(2000) == pytest.approx([0.3, 0.7], abs=0.01)
    # Lengths come without reading tokens and agree with the samples.
    assert blend.lengths_at(range(50)) == [len(blend.sample_at(p)["tokens"]) for p in range(50)]


def test_a_small_upweighted_dataset_repeats_every_sample_once_per_pass():
    blend = BlendedSamples(_parts(), [0.5, 0.5], split_index=0, name="a+b", weights_are="samples")
    firsts = [blend.sample_at(p)["tokens"][0].item() for p in range(160)]
    small = [t for t in firsts if t // 1_000_000 == 1]
    assert len(small) == 80  # two passes over the 40 documents of corpus 1
    assert sorted(small[:40]) == sorted(small[40:]) == sorted(set(small))
    assert small[:40] != small[40:]  # reshuffled for its second pass


def test_positions_are_a_function_of_seed_and_split():
    one = BlendedSamples(_parts(seed=3), [0.3, 0.7], split_index=0, name="x")
    again = BlendedSamples(_parts(seed=3), [0.3, 0.7], split_index=0, name="x")
    other = BlendedSamples(_parts(seed=4), [0.3, 0.7], split_index=0, name="x")
    first = [one.sample_at(p)["tokens"][0].item() for p in range(100)]
    # Asked out of order (a later rank resuming): the same answers.
    assert [again.sample_at(p)["tokens"][0].item() for p in reversed(range(100))] == first[::-1]
    assert first != [other.sample_at(p)["tokens"][0].item() for p in range(100)]


def test_tokens_of_the_first_positions_are_the_drawn_samples_lengths():
    """What ``--log-progress`` counts (progress.py): the consumed samples' own tokens."""
    blend = BlendedSamples(_parts(seed=3), [0.3, 0.7], split_index=0, name="x")
    for count in (0, 1, 17, 500):
        assert blend.tokens_in_first(count) == sum(blend.lengths_at(range(count))), count


def test_weights_are_token_shares_by_default_as_in_megatron():
    # Corpus 1's samples hold 4 tokens, corpus 2's 6: 0.3 / 0.7 of the samples would be
    # 1.2 / 4.2 tokens, i.e. 22% / 78% of the tokens; Megatron's weights mean 30% / 70% of them.
    blend = BlendedSamples(_parts(), [0.3, 0.7], split_index=0, name="a+b")
    assert blend.weights_are == "tokens"
    tokens = [0, 0]
    for p in range(3000):
        sample = blend.sample_at(p)["tokens"]
        tokens[sample[0].item() // 1_000_000 - 1] += len(sample)
    assert [t / sum(tokens) for t in tokens] == pytest.approx([0.3, 0.7], abs=0.005)
    assert blend.token_shares(3000) == pytest.approx([t / sum(tokens) for t in tokens])
    by_samples = BlendedSamples(
        _parts(), [0.3, 0.7], split_index=0, name="x", weights_are="samples"
    )
    assert by_samples.token_shares(3000) == pytest.approx([0.222, 0.778], abs=0.005)
    with pytest.raises(DynBatchValueError, match="--blend-weights"):
        BlendedSamples(_parts(), [0.3, 0.7], split_index=0, name="x", weights_are="documents")


def test_bad_weights_are_refused_with_the_values():
    with pytest.raises(DynBatchValueError, match=r"weights \[0.3, 0.0\] must all be positive"):
        BlendedSamples(_parts(), [0.3, 0.0], split_index=0, name="x")
    with pytest.raises(DynBatchValueError, match="one weight per dataset"):
        BlendedSamples(_parts(), [1.0], split_index=0, name="x")


def _args(**values):
    defaults = dict(
        seq_length=128, seed=11, mock_data=False, split="90,10,0", mmap_bin_files=True,
        data_path=None, train_data_path=None, valid_data_path=None, test_data_path=None,
        per_split_data_args_path=None, data_args_path=None, train_iters=50,
        global_batch_size=8, blend_weights="samples",
    )  # fmt: skip
    return argparse.Namespace(**{**defaults, **values})


def test_data_path_weights_blend_every_split_of_real_indexed_datasets(tmp_path, capsys):
    import json

    from megatron_dynbatch.integrations.megatron_lm.data import preprocess

    prefixes = []
    for name, count in (("small", 40), ("large", 400)):
        source = tmp_path / f"{name}.jsonl"
        source.write_text(
            "".join(json.dumps({"text": f"{name} {i} " * (i % 7 + 1)}) + "\n" for i in range(count))
        )
        prefixes.append(str(preprocess.write_indexed_dataset(source, str(tmp_path / name))))
    args = _args(data_path=["0.3", prefixes[0], "0.7", prefixes[1]])
    train, valid, test = document_splits(args, 257, None)
    assert test is None
    for split, index in ((train, 0), (valid, 1)):
        assert isinstance(split, BlendedSamples) and split.split_index == index
        shares = split.shares(1000)
        assert shares == pytest.approx([0.3, 0.7], abs=0.01)
        # Each part is that dataset's own split (90/10 of its documents).
        assert [len(p) for p in split.parts] == ([36, 360] if index == 0 else [4, 40])
    text = bytes(train.sample_at(0)["tokens"].tolist()).decode()
    assert text.startswith(("small", "large"))
    assert (
        "> blend split 0: weights [0.3000, 0.7000] are shares of the samples (--blend-weights "
        "samples; --blend-weights tokens for shares of the tokens): drawn token shares ["
    ) in capsys.readouterr().out
    # Per-split blends: --train-data-path with weights, --valid-data-path one prefix.
    args = _args(
        train_data_path=["1", prefixes[0], "3", prefixes[1]], valid_data_path=[prefixes[0]]
    )
    train, valid, test = document_splits(args, 257, None)
    assert train.shares(400) == pytest.approx([0.25, 0.75], abs=0.01)
    assert isinstance(valid, SplitSamples) and len(valid) == 40 and test is None


def test_mock_data_is_split_as_megatron_splits_it_whatever_split_says():
    """Megatron's GPTDataset splits mock data 1,1,1 and ignores --split: a probe found
    `--mock-data --split 100,0,0 --eval-iters 1` refused with the switch on (no validation
    data) where the same command ran with it off."""
    splits = document_splits(_args(mock_data=True, split="100,0,0"), 257, None)
    ranges = [(int(split.document[0]), int(split.document[-1]) + 1) for split in splits]
    assert ranges == split_bookends("1,1,1", MOCK_NUM_DOCUMENTS), ranges
    assert all(end - begin > MOCK_NUM_DOCUMENTS // 4 for begin, end in ranges)


def test_a_blend_split_empty_for_a_small_dataset_names_a_split_that_works(tmp_path):
    """A probe: `--data-path 0.5 tiny 0.5 half --split 98,1,1` was refused for the empty test
    share of the small dataset with "change --split" and no split named; the one named now runs."""
    import json

    from megatron_dynbatch.integrations.megatron_lm.data import preprocess

    prefixes = []
    for name, count in (("small", 3), ("large", 30)):
        source = tmp_path / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(count)))
        prefixes.append(str(preprocess.write_indexed_dataset(source, str(tmp_path / name))))
    args = _args(data_path=["0.5", prefixes[0], "0.5", prefixes[1]], split="98,1,1")
    with pytest.raises(DynBatchValueError, match=r"split 1 \(validation\)") as caught:
        document_splits(args, 257, None)
    message = str(caught.value)
    assert "--test-data-path" in message, message
    working = message.split("pass --split ")[1].split(",")[:3]
    working = ",".join(part.split(" ")[0] for part in working)
    assert working == "1,1,1", message
    splits = document_splits(_args(data_path=args.data_path, split=working), 257, None)
    assert all(isinstance(split, BlendedSamples) for split in splits)
    assert all(len(part) >= 1 for split in splits for part in split.parts)
