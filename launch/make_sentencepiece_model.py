"""Train a small SentencePiece tokenizer on a JSONL corpus: a real tokenizer with no download.

    python launch/make_sentencepiece_model.py data/pydoc.jsonl data/pydoc_sp --vocab-size 1000

writes ``data/pydoc_sp.model`` (and ``.vocab``) from the ``"text"`` field of every line, for
Megatron's ``--tokenizer-type SentencePieceTokenizer --tokenizer-model data/pydoc_sp.model``
(its end-of-document token is SentencePiece's ``</s>``, id 2). Any SentencePiece ``.model`` works
the same way (a Llama 2 ``tokenizer.model``, for one); this one is for trying the path here.
"""

import argparse
import json
import pathlib

import sentencepiece


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", type=pathlib.Path, help="JSONL file with a text field per line")
    parser.add_argument("model_prefix", help="writes MODEL_PREFIX.model and MODEL_PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=1000, help="pieces, specials included")
    parser.add_argument("--json-key", default="text", help="field holding the text")
    args = parser.parse_args()
    with open(args.input, encoding="utf-8") as handle:
        texts = [json.loads(line)[args.json_key] for line in handle if line.strip()]
    pathlib.Path(args.model_prefix).parent.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=args.model_prefix,
        vocab_size=args.vocab_size,
        model_type="bpe",
        minloglevel=2,  # warnings and errors only
    )
    print(f"wrote {args.model_prefix}.model ({args.vocab_size} pieces, from {len(texts)} texts)")


if __name__ == "__main__":
    main()
