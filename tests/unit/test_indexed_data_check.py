"""Start-up checks of .bin/.idx files: each broken pairing is refused naming the file."""

import argparse
import json
import shutil

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.data import preprocess
from megatron_dynbatch.integrations.megatron_lm.data.indexed_check import (
    check_indexed_prefix,
    data_prefixes,
    validate_data_paths,
)

pytestmark = pytest.mark.unit


def _build(tmp_path, name, texts):
    source = tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(preprocess.write_indexed_dataset(source, str(tmp_path / name), append_eod=True))


@pytest.fixture
def corpora(tmp_path):
    a = _build(tmp_path, "a", ["hello world", "a second document", "x" * 50])
    b = _build(tmp_path, "b", ["other corpus"] * 4)
    return tmp_path, a, b


def test_a_good_dataset_passes_and_is_summarised(corpora):
    _, a, _ = corpora
    summary = check_indexed_prefix(a)
    assert summary.dtype == "uint16" and summary.num_sequences == 3
    assert summary.num_documents == 4
    assert summary.num_tokens == len("hello world") + len("a second document") + 50 + 3


def test_a_truncated_bin_is_named_with_both_sizes(corpora):
    _, a, _ = corpora
    with open(f"{a}.bin", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(DynBatchValueError, match=r"a_text_document\.bin: 10 bytes.*truncated"):
        check_indexed_prefix(a)


def test_a_bin_two_bytes_short_is_refused(corpora):
    _, a, _ = corpora
    size = open(f"{a}.bin", "rb").seek(0, 2)
    with open(f"{a}.bin", "r+b") as handle:
        handle.truncate(size - 2)
    with pytest.raises(DynBatchValueError, match=f"{size - 2} bytes.*= {size} bytes"):
        check_indexed_prefix(a)


def test_an_idx_paired_with_another_datasets_bin_is_refused(corpora):
    _, a, b = corpora
    shutil.copy(f"{b}.bin", f"{a}.bin")
    with pytest.raises(DynBatchValueError, match="another dataset's .bin"):
        check_indexed_prefix(a)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda data: b"NOTANIDX\x00" + data[9:], "not an .idx file"),
        (lambda data: data[:9] + (2).to_bytes(8, "little") + data[17:], "version 2, expected 1"),
        (lambda data: data[:17] + bytes([42]) + data[18:], "dtype code 42"),
        (lambda data: data[:-5], "truncated or corrupt"),
        (lambda data: data[:4], "shorter than the 34-byte header"),
    ],
)
def test_a_malformed_idx_is_named(corpora, corrupt, message):
    _, a, _ = corpora
    with open(f"{a}.idx", "rb") as handle:
        data = handle.read()
    with open(f"{a}.idx", "wb") as handle:
        handle.write(corrupt(data))
    with pytest.raises(DynBatchValueError, match=rf"a_text_document\.idx: .*{message}"):
        check_indexed_prefix(a)


def test_a_missing_file_names_the_prefix(tmp_path):
    with pytest.raises(DynBatchValueError, match=r"--data-path .*nothing\.idx not found"):
        check_indexed_prefix(str(tmp_path / "nothing"))


def _args(**values):
    defaults = dict(
        mock_data=False, sft=False, data_path=None, train_data_path=None, valid_data_path=None,
        test_data_path=None, per_split_data_args_path=None, data_args_path=None,
    )  # fmt: skip
    return argparse.Namespace(**{**defaults, **values})


def test_every_prefix_of_weighted_and_per_split_blends_is_checked(corpora):
    _, a, b = corpora
    assert data_prefixes(_args(data_path=["0.3", a, "0.7", b])) == [a, b]
    assert data_prefixes(_args(data_path=[a, b])) == [a, b]
    assert data_prefixes(_args(train_data_path=["1", a], valid_data_path=[b])) == [a, b]
    assert data_prefixes(_args(mock_data=True, data_path=[a])) == []
    assert data_prefixes(_args(sft=True, data_path=["x.jsonl"])) == []
    assert [s.prefix for s in validate_data_paths(_args(data_path=["0.3", a, "0.7", b]))] == [a, b]
    with open(f"{b}.bin", "r+b") as handle:
        handle.truncate(3)
    with pytest.raises(DynBatchValueError, match=r"b_text_document\.bin: 3 bytes"):
        validate_data_paths(_args(data_path=["0.3", a, "0.7", b]))


def test_an_idx_of_the_same_documents_in_another_order_is_refused(tmp_path):
    """Issue 37: an .idx of the same documents shuffled, beside the original .bin, has the right
    size and a consistent index, and trained silently; the documents' ends give it away."""
    import random

    texts = [f"document {i} " + "w" * (3 + 7 * i % 41) for i in range(40)]
    original = _build(tmp_path, "original", texts)
    shuffled = list(texts)
    random.Random(1).shuffle(shuffled)
    (tmp_path / "other").mkdir()
    other = _build(tmp_path / "other", "shuffled", shuffled)
    eod = preprocess.BYTE_EOD
    check_indexed_prefix(original, eod)  # the right index passes
    shutil.copy(f"{other}.idx", f"{original}.idx")
    check_indexed_prefix(original)  # sizes alone cannot tell
    with pytest.raises(
        DynBatchValueError,
        match=r"original_text_document\.idx: document \d+ ends at token \d+ of .* with token "
        rf"\d+, not the end-of-document token {eod} that ends the data: this \.idx does not "
        r"describe this \.bin",
    ):
        check_indexed_prefix(original, eod)
    # Built without end-of-document tokens, nothing marks the ends: not refused for lack of one.
    source = tmp_path / "plain.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    plain = str(preprocess.write_indexed_dataset(source, str(tmp_path / "plain"), append_eod=False))
    check_indexed_prefix(plain, eod)
