"""Start-up checks of Megatron indexed datasets (``PREFIX.idx`` / ``PREFIX.bin``).

Megatron reads a ``.bin`` lazily: a truncated file fails at the first step that touches its end
(without naming the file), a ``.bin`` a few bytes short trains until validation reaches the missing
tokens, and an ``.idx`` paired with another dataset's ``.bin`` trains on the wrong tokens without a
word. :func:`validate_data_paths` reads every ``.idx`` of the data arguments once, before the model
is built, and checks what the ``.idx`` implies about its ``.bin``:

* header ``MMIDIDX\\0\\0``, version 1, a known dtype code;
* the ``.idx`` size equals the one its sequence and document counts imply;
* sequence pointers follow from the lengths and the dtype (a consistent index);
* document indices start at 0, never decrease and end at the sequence count;
* the ``.bin`` size equals the bytes the last sequence ends at;
* where the data was built with an end-of-document token (the ``.bin``'s last token is the
  tokenizer's ``eod``), a sample of documents (:data:`DOCUMENT_END_SAMPLES`, spread over the
  dataset) each end with it where the ``.idx`` says they end: an ``.idx`` of the same documents in
  another order beside the original ``.bin`` has the right size but cuts documents elsewhere.

Each failure is a :class:`~megatron_dynbatch.errors.DynBatchValueError` naming the file, the
expected and the actual values, and the fix (rebuild with ``tools/preprocess_data.py`` or our
``preprocess``). The ``.idx`` is read; of the ``.bin`` only its size and the last token of the
sampled documents.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any, List, Optional

import numpy

from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "DOCUMENT_END_SAMPLES",
    "IndexSummary",
    "check_indexed_prefix",
    "data_prefixes",
    "validate_data_paths",
]

#: Documents whose last token is checked against the end-of-document token at start-up: spread
#: evenly over the dataset, the first and the last included. Reading one token each costs a page
#: of the .bin; a shuffled .idx cuts nearly every document elsewhere, so a few dozen suffice.
DOCUMENT_END_SAMPLES = 64

# The .idx layout Megatron's _IndexWriter writes (megatron/core/datasets/indexed_dataset.py).
_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
# 9-byte magic, <Q version, <B dtype code, <Q sequence count, <Q document count.
_HEADER_BYTES = len(_MAGIC) + 8 + 1 + 8 + 8
# Megatron's DType codes and their item sizes.
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
_DTYPE_NAMES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}
_FIX = (
    "rebuild it with Megatron-LM's tools/preprocess_data.py or `python -m "
    "megatron_dynbatch.integrations.megatron_lm.data.preprocess`, or pass the right prefix"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexSummary:
    """What one checked ``.idx`` says about its dataset."""

    prefix: str
    """The ``--data-path`` prefix (without ``.idx`` / ``.bin``)."""
    dtype: str
    """Token dtype of the ``.bin`` (e.g. ``uint16``)."""
    num_sequences: int
    """Sequences in the dataset (GPT documents)."""
    num_documents: int
    """Document boundaries in the ``.idx`` (sequence count + 1 for text datasets)."""
    num_tokens: int
    """Total tokens the ``.bin`` holds."""


def _fail(path: str, what: str) -> DynBatchValueError:
    return DynBatchValueError(f"{path}: {what}; {_FIX}.")


def check_indexed_prefix(prefix: str, eod: Optional[int] = None) -> IndexSummary:
    """Check ``prefix.idx``, the size of ``prefix.bin`` and, given ``eod``, documents' ends.

    Args:
        prefix: The dataset's path prefix.
        eod: The tokenizer's end-of-document token; when the ``.bin`` ends with it, sampled
            documents must end with it too. ``None``: not checked.

    Raises:
        DynBatchValueError: A file is missing, or the ``.idx`` is malformed, or the ``.bin`` size
            differs from the one the ``.idx`` implies; the message names the file and the values.
    """
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DynBatchValueError(
                f"--data-path {prefix!r}: {path} not found; pass the prefix that "
                "tools/preprocess_data.py or `python -m "
                "megatron_dynbatch.integrations.megatron_lm.data.preprocess` wrote (e.g. "
                "data/corpus_text_document, without the extension)."
            )
    idx_size = os.path.getsize(idx_path)
    if idx_size < _HEADER_BYTES:
        raise _fail(idx_path, f"{idx_size} bytes, shorter than the {_HEADER_BYTES}-byte header")
    with open(idx_path, "rb") as handle:
        header = handle.read(_HEADER_BYTES)
    magic = header[: len(_MAGIC)]
    if magic != _MAGIC:
        raise _fail(idx_path, f"header {magic!r} is not Megatron's {_MAGIC!r} (not an .idx file)")
    version, code, num_sequences, num_documents = struct.unpack("<QBQQ", header[len(_MAGIC) :])
    if version != _VERSION:
        raise _fail(idx_path, f"version {version}, expected {_VERSION}")
    if code not in _DTYPE_SIZES:
        raise _fail(idx_path, f"dtype code {code} is none of Megatron's {sorted(_DTYPE_SIZES)}")
    itemsize = _DTYPE_SIZES[code]
    # lengths int32 [n], pointers int64 [n], document indices int64 [d], optional modes int8 [n].
    expected = _HEADER_BYTES + 12 * num_sequences + 8 * num_documents
    if idx_size not in (expected, expected + num_sequences):
        raise _fail(
            idx_path,
            f"{idx_size} bytes, but its {num_sequences} sequences and {num_documents} documents "
            f"need {expected} (or {expected + num_sequences} with sequence modes): truncated or "
            "corrupt",
        )
    index = numpy.memmap(idx_path, mode="r", dtype=numpy.uint8)
    offset = _HEADER_BYTES
    lengths = numpy.frombuffer(index, dtype=numpy.int32, count=num_sequences, offset=offset)
    offset += 4 * num_sequences
    pointers = numpy.frombuffer(index, dtype=numpy.int64, count=num_sequences, offset=offset)
    offset += 8 * num_sequences
    documents = numpy.frombuffer(index, dtype=numpy.int64, count=num_documents, offset=offset)
    if num_sequences and int(lengths.min()) < 0:
        raise _fail(idx_path, f"negative sequence length {int(lengths.min())}")
    if num_sequences:
        # Pointers are the running byte offsets of the lengths (what _IndexWriter writes).
        starts = numpy.concatenate(([0], numpy.cumsum(lengths[:-1], dtype=numpy.int64)))
        bad = numpy.flatnonzero(pointers != starts * itemsize)
        if bad.size:
            first = int(bad[0])
            raise _fail(
                idx_path,
                f"sequence {first} starts at byte {int(pointers[first])}, but the lengths before "
                f"it put it at {int(starts[first]) * itemsize}: an inconsistent index",
            )
    if num_documents == 0 or int(documents[0]) != 0 or int(documents[-1]) != num_sequences:
        ends = (int(documents[0]), int(documents[-1])) if num_documents else None
        raise _fail(
            idx_path,
            f"document indices (first, last) = {ends}, expected (0, {num_sequences}) for "
            f"{num_sequences} sequences",
        )
    if num_documents > 1 and bool((numpy.diff(documents) < 0).any()):
        raise _fail(idx_path, "document indices decrease")
    num_tokens = int(lengths.sum(dtype=numpy.int64))
    bin_size = os.path.getsize(bin_path)
    if bin_size != num_tokens * itemsize:
        how = "truncated" if bin_size < num_tokens * itemsize else "longer than its index"
        raise DynBatchValueError(
            f"{bin_path}: {bin_size} bytes, but {idx_path} describes {num_sequences} sequences of "
            f"{num_tokens} {_DTYPE_NAMES[code]} tokens = {num_tokens * itemsize} bytes ({how}: a "
            f"partial copy, or an .idx paired with another dataset's .bin); {_FIX}."
        )
    if eod is not None and num_tokens:
        _check_document_ends(bin_path, idx_path, code, lengths, pointers, documents, eod)
    return IndexSummary(
        prefix=prefix,
        dtype=_DTYPE_NAMES[code],
        num_sequences=num_sequences,
        num_documents=num_documents,
        num_tokens=num_tokens,
    )


def _check_document_ends(bin_path, idx_path, code, lengths, pointers, documents, eod) -> None:
    """Where the ``.bin`` ends with ``eod`` (built with it), sampled documents must end with it."""
    tokens = numpy.memmap(bin_path, mode="r", dtype=_DTYPE_NAMES[code])
    if int(tokens[-1]) != eod:
        return  # built without end-of-document tokens: nothing marks where documents end
    itemsize = _DTYPE_SIZES[code]
    num_documents = len(documents) - 1
    count = min(DOCUMENT_END_SAMPLES, num_documents)
    picks = sorted({round(k * (num_documents - 1) / max(count - 1, 1)) for k in range(count)})
    for document in picks:
        last = int(documents[document + 1]) - 1  # the document's last sequence
        if last < int(documents[document]) or int(lengths[last]) == 0:
            continue  # an empty document has no end to check
        end = int(pointers[last]) // itemsize + int(lengths[last]) - 1
        token = int(tokens[end])
        if token != eod:
            raise DynBatchValueError(
                f"{idx_path}: document {document} ends at token {end} of {bin_path} with token "
                f"{token}, not the end-of-document token {eod} that ends the data: this .idx "
                "does not describe this .bin (documents in another order, or another dataset's "
                f"index); {_FIX}."
            )


def data_prefixes(args: Any) -> List[str]:
    """The indexed-dataset prefixes named by Megatron's data arguments (none for mock / SFT)."""
    if getattr(args, "mock_data", False) or getattr(args, "sft", False):
        return []
    if getattr(args, "sft_conversations", False):
        return []
    from megatron_dynbatch.integrations.megatron_lm.data.blends import blends_from_args

    blend, per_split = blends_from_args(args)
    prefixes: List[str] = []
    for entry in [blend, *(per_split or [])]:
        if entry is not None:
            prefixes += list(entry[0])
    return list(dict.fromkeys(prefixes))


def validate_data_paths(args: Any, eod: Optional[int] = None) -> List[IndexSummary]:
    """Check every indexed dataset of Megatron's data arguments; call before building the model.

    ``eod``: the tokenizer's end-of-document token, to check documents' ends (see
    :func:`check_indexed_prefix`); ``None`` skips that check.

    Returns:
        One summary per prefix (empty for ``--mock-data`` and ``--sft``).

    Raises:
        DynBatchValueError: The first bad file, named, with the values and the fix.
    """
    return [check_indexed_prefix(prefix, eod) for prefix in data_prefixes(args)]
