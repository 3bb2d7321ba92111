"""Build a Megatron indexed dataset (``.bin`` / ``.idx``) from JSONL text: bytes or Megatron's tokenizers.

    python -m megatron_dynbatch.integrations.megatron_lm.data.preprocess --input corpus.jsonl \\
        --output-prefix data/corpus --append-eod [--tokenizer-type TYPE --tokenizer-model FILE ...]

writes ``data/corpus_text_document.bin`` and ``.idx`` (Megatron-LM's naming:
``{prefix}_{json key}_document``), one document per JSON line, with
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``: the format Megatron-LM's
``tools/preprocess_data.py`` writes (that tool is not part of the megatron-core wheel; to run it
here, see ``launch/megatron_preprocess.py``).

Without ``--tokenizer-type`` the tokens are bytes: token ``b`` is the UTF-8 byte ``b`` (0-255) and
``--append-eod`` ends every document with 256, the end-of-document id of Megatron's
``NullTokenizer`` with ``--vocab-size 257``; train with ``--tokenizer-type NullTokenizer
--vocab-size 257``. No vocabulary file is needed.

With ``--tokenizer-type`` the tokenizer options are Megatron-LM's own (its ``_add_tokenizer_args``
group, the one ``pretrain_gpt.py`` and ``tools/preprocess_data.py`` take), the tokenizer is built by
megatron.core's ``build_tokenizer`` as both build it, and documents are written as the tool writes
them (token dtype from the vocabulary size; ``--append-eod`` adds the tokenizer's ``eod`` to every
document with tokens; a document without tokens is recorded empty): the same bytes as
``tools/preprocess_data.py`` given the same options. Train with the same tokenizer options.
A tokenizer whose Python package is missing (Hugging Face ones need ``transformers``) and
``--split-sentences`` are refused in one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import warnings
from typing import Iterator, List, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["BYTE_EOD", "BYTE_VOCAB_SIZE", "byte_tokens", "main", "write_indexed_dataset"]

#: Blank input lines named in the note that counts them.
_SHOWN_LINES = 5
#: Byte-level vocabulary: 256 byte values plus the end-of-document token.
BYTE_VOCAB_SIZE = 257
#: End-of-document id (NullTokenizer's ``vocab_size - 1`` with ``--vocab-size 257``).
BYTE_EOD = 256

# The Python package each Megatron tokenizer type imports when it is built (megatron.core's
# tokenizers/text/libraries; NullTokenizer needs none). Checked before building so a missing
# package is one line naming it, not a traceback from inside megatron.core.
_TOKENIZER_PACKAGES = {
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
    "HuggingFaceTokenizer": "transformers",
    "SFTTokenizer": "transformers",
    "MultimodalTokenizer": "transformers",
    "GPT2BPETokenizer": "transformers",
    "BertWordPieceCase": "transformers",
    "BertWordPieceLowerCase": "transformers",
}

# Tokenizer types that load a local model file given by --tokenizer-model (megatron.core asserts
# on a missing path; a one-line refusal says which option to add).
_MODEL_FILE_TYPES = {
    "SentencePieceTokenizer": "SentencePiece .model",
    "GPTSentencePieceTokenizer": "SentencePiece .model",
    "Llama2Tokenizer": "SentencePiece .model",
    "TikTokenizer": "tiktoken vocabulary .json",
}


def byte_tokens(text: str, *, append_eod: bool) -> List[int]:
    """UTF-8 bytes of ``text`` as token ids, optionally followed by :data:`BYTE_EOD`."""
    tokens = list(text.encode("utf-8"))
    if append_eod:
        tokens.append(BYTE_EOD)
    return tokens


def _documents(path: pathlib.Path, key: str, blank: List[int]) -> Iterator[Tuple[int, str]]:
    """``(line number, text)`` of every non-blank JSON line; blank lines' numbers go to ``blank``."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                blank.append(number)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DynBatchValueError(
                    f"{path}:{number}: not a JSON line ({error.msg})."
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise DynBatchValueError(
                    f"{path}:{number}: expected an object with a string {key!r} field "
                    "(--json-keys)."
                )
            yield number, record[key]


def write_indexed_dataset(
    input_path: pathlib.Path,
    output_prefix: str,
    *,
    key: str = "text",
    append_eod: bool = False,
    tokenizer=None,
) -> pathlib.Path:
    """Write ``{output_prefix}_{key}_document.bin/.idx``; return that prefix (as for --data-path).

    Args:
        tokenizer: A Megatron tokenizer (``tokenize``, ``eod``, ``vocab_size``, as built by
            megatron.core's ``build_tokenizer``); ``None`` for byte tokens.

    A document without tokens is recorded with no sequence, as Megatron-LM's tool records it.
    """
    from megatron_dynbatch.integrations.megatron_lm.data.megatron_tool import (
        prepare_megatron_imports,
    )

    prepare_megatron_imports()
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    if tokenizer is None:
        vocab_size, described = BYTE_VOCAB_SIZE, "byte tokens"

        def encode(text: str) -> List[int]:
            return byte_tokens(text, append_eod=append_eod)

    else:
        vocab_size = tokenizer.vocab_size
        library = getattr(tokenizer, "library", type(tokenizer).__name__)
        described = f"{library} tokenizer, eod {tokenizer.eod}"

        def encode(text: str) -> List[int]:
            tokens = list(tokenizer.tokenize(text))
            if tokens and append_eod:  # the tool adds no EOD to a document without tokens
                tokens.append(tokenizer.eod)
            return tokens

    prefix = f"{output_prefix}_{key}_document"
    pathlib.Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    bin_path = get_bin_path(prefix)
    builder = IndexedDatasetBuilder(bin_path, dtype=DType.optimal_dtype(vocab_size))
    try:
        count = 0
        blank: List[int] = []
        for number, text in _documents(input_path, key, blank):
            try:
                tokens = encode(text)
            except ValueError as error:
                # NullTokenizer ("null-text") reads space-separated integer ids, not text.
                hint = "; leave out --tokenizer-type for byte tokens" if "null" in described else ""
                raise DynBatchValueError(
                    f"{input_path}:{number}: the tokenizer cannot read this text ({error}){hint}."
                ) from None
            builder.add_document(tokens, [len(tokens)] if tokens else [])
            count += bool(tokens)
        if count == 0:
            raise DynBatchValueError(f"{input_path} holds no document with text under {key!r}.")
    except BaseException:
        # A .bin without its .idx would only mislead the next run: remove the partial file.
        builder.data_file.close()
        pathlib.Path(bin_path).unlink()
        raise
    builder.finalize(get_idx_path(prefix))
    print(f"wrote {count} documents to {prefix}.bin / .idx ({described}, vocab {vocab_size})")
    if blank:
        # Said, not silent: a blank line may be a lost document (issue 29).
        shown = ", ".join(map(str, blank[:_SHOWN_LINES])) + (
            ", ..." if len(blank) > _SHOWN_LINES else ""
        )
        print(
            f"skipped {len(blank)} blank line(s) of {input_path} (line {shown}): no document "
            "is written for a blank line",
            file=sys.stderr,
        )
    return pathlib.Path(prefix)


def _add_tokenizer_options(parser: argparse.ArgumentParser) -> dict:
    """Add Megatron-LM's tokenizer option group to ``parser``; return ``{dest: (default, flag)}``."""
    from megatron_dynbatch.integrations.megatron_lm.data.megatron_tool import (
        prepare_megatron_imports,
    )

    prepare_megatron_imports()
    with warnings.catch_warnings():
        # Importing the arguments module imports Megatron's model and optimizer modules, which
        # warn that apex / Transformer Engine are missing: irrelevant to tokenizing.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        from megatron.training.arguments import _add_tokenizer_args

    _add_tokenizer_args(parser)
    probe = _add_tokenizer_args(argparse.ArgumentParser(add_help=False))
    defaults = vars(probe.parse_args([]))
    return {
        action.dest: (defaults[action.dest], action.option_strings[0])
        for action in probe._actions  # argparse has no public list of a parser's options
        if action.dest in defaults
    }


def _build_tokenizer(args: argparse.Namespace, defaults: dict) -> object:
    """The Megatron tokenizer the options describe, ``None`` for byte tokens.

    Raises:
        DynBatchValueError: For an option this command cannot honour here (one line, with the fix).
    """
    if args.split_sentences:
        raise DynBatchValueError(
            "--split-sentences is not supported: this command writes one sequence per document "
            "(Megatron-LM's sentence splitting needs nltk and its punkt data, not installed here)."
        )
    if args.tokenizer_type is None:
        # An option that would do nothing with byte tokens is an error, not silently ignored.
        given = [
            flag for dest, (default, flag) in defaults.items() if getattr(args, dest) != default
        ]
        if given:
            flags = ", ".join(given)
            raise DynBatchValueError(
                f"{flags} given without --tokenizer-type; pass --tokenizer-type (e.g. "
                "SentencePieceTokenizer), or leave the tokenizer options out for byte tokens."
            )
        return None
    if args.tokenizer_type in _MODEL_FILE_TYPES and not args.tokenizer_model:
        raise DynBatchValueError(
            f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model FILE (its "
            f"{_MODEL_FILE_TYPES[args.tokenizer_type]} file)."
        )
    package = _TOKENIZER_PACKAGES.get(args.tokenizer_type)
    if package is not None and importlib.util.find_spec(package) is None:
        raise DynBatchValueError(
            f"--tokenizer-type {args.tokenizer_type} needs the Python package {package!r}, which "
            f"is not installed (pip install {package}); SentencePiece tokenizers work here."
        )
    # The values Megatron-LM's tools/preprocess_data.py sets: only build_tokenizer's padded
    # vocabulary size reads them, the tokens do not depend on them.
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    try:
        return build_tokenizer(args)
    except (ValueError, OSError, ImportError) as error:
        raise DynBatchValueError(f"--tokenizer-type {args.tokenizer_type}: {error}") from None


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dynbatch.integrations.megatron_lm.data.preprocess",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
    )
    parser.add_argument("--input", type=pathlib.Path, required=True, help="JSONL file")
    parser.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    parser.add_argument("--json-keys", default="text", help="field holding the text (one key)")
    parser.add_argument(
        "--append-eod",
        action="store_true",
        help=f"end every document with the end-of-document token ({BYTE_EOD} for bytes)",
    )
    parser.add_argument(
        "--split-sentences",
        action="store_true",
        help="refused: this command writes one sequence per document",
    )
    defaults = _add_tokenizer_options(parser)
    args = parser.parse_args(argv)
    try:
        tokenizer = _build_tokenizer(args, defaults)
        write_indexed_dataset(
            args.input,
            args.output_prefix,
            key=args.json_keys,
            append_eod=args.append_eod,
            tokenizer=tokenizer,
        )
    except (OSError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
