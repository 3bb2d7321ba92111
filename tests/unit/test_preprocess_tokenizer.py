"""Indexed data with a real tokenizer: our preprocess command and Megatron-LM's own tool agree.

The tokenizer is a SentencePiece model trained here, at test time, on text that ships with every
CPython (``pydoc_data.topics``, as the demo corpus), by ``launch/make_sentencepiece_model.py``:
nothing is downloaded. Megatron's ``SentencePieceTokenizer`` (megatron.core, real) tokenizes.
The comparison with Megatron-LM's ``tools/preprocess_data.py`` needs a Megatron-LM checkout in
``MEGATRON_LM_DIR`` (the tool is not in the megatron-core wheel) and is skipped without one.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy
import pytest
import sentencepiece

from megatron_dynbatch.integrations.megatron_lm.data import megatron_tool, preprocess
from tests._support import REPO, command_env

pytestmark = pytest.mark.unit

MEGATRON_LM_DIR = os.environ.get(megatron_tool.MEGATRON_LM_DIR_ENV)
HAS_TOOL = bool(MEGATRON_LM_DIR) and (
    pathlib.Path(MEGATRON_LM_DIR, "tools", "preprocess_data.py").is_file()
)
VOCAB_SIZE = 500
# Lines of the test corpus beyond the help-topic paragraphs: an empty text (Megatron records a
# document without a sequence and adds no EOD), non-ASCII text, and runs of spaces.
EXTRA_TEXTS = ["", "naïve café ∑ — done", "spaces   between    words\n\nand lines"]


def _texts():
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics)[:40]:
        paragraphs.extend(p.strip() for p in topics[name].split("\n\n") if p.strip())
    return paragraphs[:300] + EXTRA_TEXTS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``(jsonl path, texts, SentencePiece model path)``."""
    directory = tmp_path_factory.mktemp("sp")
    texts = _texts()
    jsonl = directory / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    subprocess.run(
        [sys.executable, str(REPO / "launch" / "make_sentencepiece_model.py"), str(jsonl)]
        + [str(directory / "sp"), "--vocab-size", str(VOCAB_SIZE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return jsonl, texts, directory / "sp.model"


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


def test_sentencepiece_documents_hold_the_tokenizers_ids_and_its_eod(corpus, tmp_path):
    jsonl, texts, model = corpus
    preprocess.main(
        ["--input", str(jsonl), "--output-prefix", str(tmp_path / "c"), "--append-eod"]
        + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model)]
    )
    dataset = _read(tmp_path / "c_text_document")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    eod = processor.eos_id()
    assert processor.get_piece_size() == VOCAB_SIZE and eod == 2
    non_empty = [t for t in texts if t]
    assert len(dataset) == len(non_empty)  # sequences: the empty text has none
    assert len(dataset.document_indices) == len(texts) + 1  # documents: it is still recorded
    assert dataset.index.dtype == numpy.uint16  # Megatron's dtype for a vocabulary under 65,500
    for index, text in enumerate(non_empty):
        assert dataset[index].tolist() == processor.encode(text) + [eod], text[:40]
    assert max(int(dataset[i].max()) for i in range(len(dataset))) < VOCAB_SIZE


def test_tokenizer_options_reach_megatrons_tokenizer(tmp_path):
    # NullTokenizer reads space-separated ids; its EOD is vocab_size - 1 unless given.
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text('{"text": "5 6 7"}\n{"text": "9"}\n')
    common = ["--input", str(jsonl), "--append-eod", "--tokenizer-type", "NullTokenizer"]
    preprocess.main(common + ["--output-prefix", str(tmp_path / "a"), "--vocab-size", "100"])
    preprocess.main(
        common + ["--output-prefix", str(tmp_path / "b"), "--vocab-size", "100000"]
        + ["--null-tokenizer-eod-id", "3"]  # fmt: skip
    )
    a, b = _read(tmp_path / "a_text_document"), _read(tmp_path / "b_text_document")
    assert [a[0].tolist(), a[1].tolist()] == [[5, 6, 7, 99], [9, 99]]
    assert [b[0].tolist(), b[1].tolist()] == [[5, 6, 7, 3], [9, 3]]
    assert (a.index.dtype, b.index.dtype) == (numpy.uint16, numpy.int32)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--split-sentences"], "--split-sentences is not supported"),
        (
            ["--tokenizer-model", "m.model", "--vocab-size", "9"],
            "--vocab-size, --tokenizer-model given without --tokenizer-type",
        ),
        (
            ["--tokenizer-type", "SentencePieceTokenizer"],
            "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model FILE",
        ),
        (
            ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "absent.model"],
            "--tokenizer-type SentencePieceTokenizer: tokenizer_path: absent.model is invalid",
        ),
        (
            ["--tokenizer-type", "NullTokenizer", "--vocab-size", "257"],
            "ids.jsonl:1: the tokenizer cannot read this text (invalid literal for int() with "
            "base 10: 'hello'); leave out --tokenizer-type for byte tokens.",
        ),
    ],
    ids=["split-sentences", "options-without-type", "no-model", "missing-model", "null-on-text"],
)
def test_unsupported_options_are_refused_in_one_line(tmp_path, capsys, options, message):
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text('{"text": "hello"}\n')
    with pytest.raises(SystemExit) as exit_info:
        preprocess.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "c")] + options)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert error.startswith("error: ") and error.count("\n") == 1, error
    assert message in error
    assert not list(tmp_path.glob("c_*"))  # nothing written


def test_a_tokenizer_whose_package_is_missing_is_named(tmp_path, capsys, monkeypatch):
    # transformers is not installed here; should it be, a None in sys.modules hides it (find_spec
    # then answers None, and an import raises) so the refusal is still what is tested.
    monkeypatch.setitem(sys.modules, "transformers", None)
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "hello"}\n')
    with pytest.raises(SystemExit) as exit_info:
        preprocess.main(
            ["--input", str(jsonl), "--output-prefix", str(tmp_path / "c")]
            + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"]
        )
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.count("\n") == 1
    assert "--tokenizer-type HuggingFaceTokenizer needs the Python package 'transformers'" in error


def test_byte_tokens_stay_the_default(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "hé"}\n')
    preprocess.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "c"), "--append-eod"])
    dataset = _read(tmp_path / "c_text_document")  # kept: its items are views of its mmap
    assert dataset[0].tolist() == [104, 195, 169, preprocess.BYTE_EOD]


def test_blank_lines_are_skipped_and_said(tmp_path, capsys):
    """Issue 29: an empty line of input was skipped silently (it may be a lost document)."""
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "a"}\n\n{"text": "b"}\n   \n')
    preprocess.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "c"), "--append-eod"])
    dataset = _read(tmp_path / "c_text_document")
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[97, 256], [98, 256]]
    err = capsys.readouterr().err
    assert f"skipped 2 blank line(s) of {jsonl} (line 2, 4): no document is written" in err


def test_the_megatron_tool_wrapper_names_a_missing_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(megatron_tool.MEGATRON_LM_DIR_ENV, raising=False)
    for argv, message in [
        (["--input", "x.jsonl"], "pass --megatron-lm-dir DIR or set MEGATRON_LM_DIR"),
        (["--megatron-lm-dir", str(tmp_path), "--input", "x.jsonl"], "tools/preprocess_data.py"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            megatron_tool.main(argv)
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and error.count("\n") == 1 and message in error, error


@pytest.mark.skipif(
    not HAS_TOOL,
    reason="MEGATRON_LM_DIR does not name a Megatron-LM checkout with tools/preprocess_data.py "
    "(git clone -b core_r0.19.0 https://github.com/NVIDIA/Megatron-LM)",
)
def test_megatron_lms_own_tool_writes_the_same_bytes(corpus, tmp_path):
    jsonl, _, model = corpus
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model)]
    ours = tmp_path / "ours"
    preprocess.main(
        ["--input", str(jsonl), "--output-prefix", str(ours), "--append-eod"] + tokenizer
    )
    theirs = tmp_path / "theirs"
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "megatron_preprocess.py"), "--input", str(jsonl)]
        + ["--output-prefix", str(theirs), "--append-eod", "--workers", "2"]
        + tokenizer,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for suffix in ("bin", "idx"):
        ours_bytes = pathlib.Path(f"{ours}_text_document.{suffix}").read_bytes()
        theirs_bytes = pathlib.Path(f"{theirs}_text_document.{suffix}").read_bytes()
        assert len(ours_bytes) > 1000 and ours_bytes == theirs_bytes, suffix
