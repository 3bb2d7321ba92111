"""Build a Megatron indexed dataset (``.bin`` / ``.idx``) from JSONL text, byte-level tokens.

    python -m megatron_dynbatch.integrations.megatron_lm.data.preprocess --input corpus.jsonl \\
        --output-prefix data/corpus --append-eod

writes ``data/corpus_text_document.bin`` and ``.idx`` (Megatron-LM's naming:
``{prefix}_{json key}_document``), one document per JSON line, with
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``: the format Megatron-LM's
``tools/preprocess_data.py`` writes (that tool is not part of the megatron-core wheel). Train on it
with ``--data-path data/corpus_text_document --tokenizer-type NullTokenizer --vocab-size 257``.

The tokenizer is byte-level: token ``b`` is the UTF-8 byte ``b`` (0-255) and ``--append-eod`` ends
every document with 256, the end-of-document id of Megatron's ``NullTokenizer`` with
``--vocab-size 257``. No vocabulary file is needed. For BPE or Hugging Face tokenizers use
Megatron-LM's ``tools/preprocess_data.py``; both write the same format.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Iterator, List, Optional, Sequence

import numpy

__all__ = ["BYTE_EOD", "BYTE_VOCAB_SIZE", "byte_tokens", "main", "write_indexed_dataset"]

#: Byte-level vocabulary: 256 byte values plus the end-of-document token.
BYTE_VOCAB_SIZE = 257
#: End-of-document id (NullTokenizer's ``vocab_size - 1`` with ``--vocab-size 257``).
BYTE_EOD = 256


def byte_tokens(text: str, *, append_eod: bool) -> List[int]:
    """UTF-8 bytes of ``text`` as token ids, optionally followed by :data:`BYTE_EOD`."""
    tokens = list(text.encode("utf-8"))
    if append_eod:
        tokens.append(BYTE_EOD)
    return tokens


def _documents(path: pathlib.Path, key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON line ({error.msg}).") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ValueError(
                    f"{path}:{number}: expected an object with a string {key!r} field "
                    "(--json-keys)."
                )
            yield record[key]


def write_indexed_dataset(
    input_path: pathlib.Path, output_prefix: str, *, key: str = "text", append_eod: bool = False
) -> pathlib.Path:
    """Write ``{output_prefix}_{key}_document.bin/.idx``; return that prefix (as for --data-path).

    Empty documents (no text and no EOD) are skipped, as Megatron-LM's tool does.
    """
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()  # importing megatron.core needs triton or its stand-in; no-op with CUDA
    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    prefix = f"{output_prefix}_{key}_document"
    pathlib.Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    count = 0
    for text in _documents(input_path, key):
        tokens = byte_tokens(text, append_eod=append_eod)
        if not tokens:
            continue
        builder.add_document(numpy.asarray(tokens, dtype=numpy.uint16), [len(tokens)])
        count += 1
    if count == 0:
        raise ValueError(f"{input_path} holds no document with text under {key!r}.")
    builder.finalize(get_idx_path(prefix))
    print(f"wrote {count} documents to {prefix}.bin / .idx (byte tokens, vocab {BYTE_VOCAB_SIZE})")
    return pathlib.Path(prefix)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dynbatch.integrations.megatron_lm.data.preprocess",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--input", type=pathlib.Path, required=True, help="JSONL file")
    parser.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    parser.add_argument("--json-keys", default="text", help="field holding the text (one key)")
    parser.add_argument(
        "--append-eod", action="store_true", help=f"end every document with {BYTE_EOD}"
    )
    args = parser.parse_args(argv)
    try:
        write_indexed_dataset(
            args.input, args.output_prefix, key=args.json_keys, append_eod=args.append_eod
        )
    except (OSError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
