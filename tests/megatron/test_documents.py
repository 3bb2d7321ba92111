"""Document samples from Megatron's formats, and the byte-level .bin/.idx builder (in-process)."""

import json

import numpy
import pytest
import torch

from megatron_dynbatch.megatron.cpu_shim import apply_cpu_shim

apply_cpu_shim()  # importing megatron.core needs the triton stand-in on this machine

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from megatron_dynbatch.megatron import preprocess  # noqa: E402
from megatron_dynbatch.megatron.documents import (  # noqa: E402
    DocumentBatchStream,
    DocumentCollection,
    DocumentSampleDataset,
    SplitSamples,
    indexed_documents,
    mock_documents,
    split_bookends,
)
from megatron_dynbatch.planning.fixed import plan_fixed_microbatches  # noqa: E402
from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches  # noqa: E402


def _collection(lengths):
    lengths = numpy.asarray(lengths, dtype=numpy.int64)

    def read(document, offset, count):
        # Token t of document d is d * 1000 + t: every read is checkable.
        return numpy.arange(offset, offset + count, dtype=numpy.int64) + 1000 * document

    return DocumentCollection(lengths=lengths, read=read, name="test documents")


def test_split_bookends_follow_megatrons_rounding():
    assert split_bookends("98,2,0", 1000) == [(0, 980), (980, 1000), None]
    assert split_bookends("969, 30, 1", 2608) == [(0, 2527), (2527, 2605), (2605, 2608)]
    assert split_bookends("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]


def test_long_documents_become_consecutive_samples_and_no_token_is_lost():
    documents = _collection([5, 10, 23, 1, 11])
    samples = SplitSamples(documents, 1, 5, max_length=10, seed=3, split_index=0)
    assert len(samples) == 1 + 3 + 1 + 2  # documents 1..4 cut at 10 tokens
    tokens = [samples.sample_at(p)["tokens"].tolist() for p in range(len(samples))]
    assert all(1 <= len(t) <= 10 for t in tokens)
    assert sorted(sum(tokens, [])) == sorted(
        [1000 * d + t for d in range(1, 5) for t in range(int(documents.lengths[d]))]
    )
    assert samples.lengths_at(range(len(samples))) == [len(t) for t in tokens]


def test_order_is_seeded_per_split_and_reshuffled_every_epoch():
    documents = _collection([3] * 50)
    first = SplitSamples(documents, 0, 50, max_length=8, seed=1, split_index=0)
    again = SplitSamples(documents, 0, 50, max_length=8, seed=1, split_index=0)
    other_split = SplitSamples(documents, 0, 50, max_length=8, seed=1, split_index=1)
    epoch0 = [first.sample_at(p)["tokens"][0].item() for p in range(50)]
    assert epoch0 == [again.sample_at(p)["tokens"][0].item() for p in range(50)]
    assert epoch0 != [other_split.sample_at(p)["tokens"][0].item() for p in range(50)]
    epoch1 = [first.sample_at(p)["tokens"][0].item() for p in range(50, 100)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def test_eod_mask_loss_drops_the_prediction_after_an_end_of_document_token():
    documents = _collection([6])  # tokens 0..5; call token 3 the end of a document
    samples = SplitSamples(documents, 0, 1, max_length=8, seed=0, split_index=0, eod_id=3)
    sample = samples.sample_at(0)
    # loss_mask marks targets: token 4 (predicted from the EOD input) is not one.
    assert sample["loss_mask"].tolist() == [1, 1, 1, 1, 0, 1]


def test_mock_documents_are_seeded_long_tailed_and_in_vocabulary():
    documents = mock_documents(seed=5, seq_length=128, vocab_size=128, num_documents=2000)
    again = mock_documents(seed=5, seq_length=128, vocab_size=128, num_documents=2000)
    assert numpy.array_equal(documents.lengths, again.lengths)
    assert numpy.array_equal(documents.read(7, 0, 20), again.read(7, 0, 20))
    assert documents.lengths.min() >= 2 and (documents.lengths > 128).sum() > 0
    assert numpy.median(documents.lengths) < 40  # long-tailed: median ~ seq_length / 5
    tokens = numpy.concatenate([documents.read(d, 0, int(documents.lengths[d])) for d in range(50)])
    assert tokens.min() >= 1 and tokens.max() <= 126  # never 0 nor the EOD id (127)


def test_fixed_rows_are_the_dynamic_paths_padded_rows():
    documents = _collection([7, 12])
    samples = SplitSamples(documents, 0, 2, max_length=16, seed=0, split_index=0)
    dataset = DocumentSampleDataset(samples, num_samples=4, seq_length=16)
    assert len(dataset) == 4
    row = dataset[1]
    sample = samples.sample_at(1)
    step = plan_fixed_microbatches(
        [len(sample["tokens"])], dp_size=1, micro_batch_size=1, seq_length=16
    ).steps[0]
    (expected,) = materialize_microbatches(
        step, 0, {0: sample}, BatchSchema(), layout="padded", sample_multiple=1
    )
    assert set(row) == set(expected) - {"cu_seqlens"}
    for key, value in row.items():
        assert torch.equal(value, expected[key][0]), key
    assert row["loss_mask"].sum() == len(sample["tokens"]) - 1


def test_batch_stream_serves_consecutive_positions_from_the_consumed_counter():
    documents = _collection([4, 9, 2, 14, 6, 5, 8, 3, 11, 7])
    samples = SplitSamples(documents, 0, 10, max_length=8, seed=2, split_index=0)
    stream = DocumentBatchStream(samples, batch_size=3, start=6, num_samples=13)
    batch = next(stream)
    assert batch.lengths() == samples.lengths_at(range(6, 9))
    loaded = batch.load([0, 2])
    assert torch.equal(loaded[2]["tokens"], samples.sample_at(8)["tokens"])
    assert next(stream).lengths() == samples.lengths_at(range(9, 12))
    with pytest.raises(StopIteration):
        next(stream)  # positions 12..14 exceed num_samples=13


def test_preprocess_writes_megatrons_format_with_byte_tokens(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    texts = ["hello", "", "é ∑ end"]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess.main(
        ["--input", str(corpus), "--output-prefix", str(tmp_path / "c"), "--append-eod"]
    )
    prefix = str(tmp_path / "c_text_document")
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 3  # the empty text still has its EOD
    for index, text in enumerate(texts):
        expected = list(text.encode("utf-8")) + [preprocess.BYTE_EOD]
        assert dataset[index].tolist() == expected
    documents = indexed_documents([prefix, prefix])
    assert documents.lengths.tolist() == [6, 1, 11, 6, 1, 11]
    assert documents.read(5, 2, 3).tolist() == list("é ∑ end".encode("utf-8"))[2:5]


def test_preprocess_reports_bad_input_in_one_line(tmp_path, capsys):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    with pytest.raises(SystemExit) as exit_info:
        preprocess.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "c")])
    assert exit_info.value.code == 2
    assert "bad.jsonl:2: expected an object with a string 'text' field" in capsys.readouterr().err


def test_indexed_documents_name_a_missing_prefix(tmp_path):
    with pytest.raises(ValueError, match="not found; pass the prefix"):
        indexed_documents([str(tmp_path / "nothing")])
