"""Write the demo corpus: Python's own documentation, one paragraph per JSON line.

    python launch/make_pydoc_corpus.py data/pydoc.jsonl

The text is ``pydoc_data.topics`` (the help topics shipped with every CPython, about 460 KB): its
paragraphs (separated by blank lines), in topic order, as ``{"text": ...}`` lines, the input
format of Megatron-LM's ``tools/preprocess_data.py`` and of ``python -m
megatron_dynbatch.integrations.megatron_lm.data.preprocess``. Paragraph lengths are long-tailed (median about 110
bytes, a few over 5,000), which is what dynamic batching is for.
"""

import argparse
import json
import pathlib
import re
from pydoc_data.topics import topics


def topic_paragraphs(name):
    """The non-empty paragraphs of one help topic, in order."""
    for paragraph in re.split(r"\n\s*\n", topics[name]):
        paragraph = paragraph.strip()
        if paragraph:
            yield paragraph


def paragraphs():
    for name in sorted(topics):
        yield from topic_paragraphs(name)


def write_corpus(documents, description: str) -> None:
    """Parse ``output`` from the command line and write ``documents`` there as JSONL."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("output", type=pathlib.Path, help="JSONL file to write")
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(args.output, "w", encoding="utf-8") as handle:
        for text in documents:
            handle.write(json.dumps({"text": text}) + "\n")
            count += 1
    print(f"wrote {count} documents to {args.output}")


if __name__ == "__main__":
    write_corpus(paragraphs(), __doc__.splitlines()[0])
