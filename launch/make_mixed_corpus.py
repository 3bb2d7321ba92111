"""Write the second demo corpus: short paragraphs mixed with very long documents, one per JSON line.

    python launch/make_mixed_corpus.py data/mixed.jsonl

From the same text as ``make_pydoc_corpus.py`` (``pydoc_data.topics``, shipped with CPython): the
help topics sixteen at a time as very long documents (tens of KB each), and after every fourth of
them the short paragraphs of its first topic (44 documents). The training loop cuts every
document at ``--seq-length`` (no token dropped), so most tokens sit in full-length pieces: fixed
micro-batches are already almost full here (fill 0.986 at ``--seq-length 256`` on byte tokens), the case
where dynamic batching must at least not be slower.
"""

from pydoc_data.topics import topics

from make_pydoc_corpus import topic_paragraphs, write_corpus

#: Help topics per long document, and every how many long documents one topic's paragraphs follow.
TOPICS_PER_DOCUMENT = 16
PARAGRAPHS_EVERY = 4


def documents():
    names = sorted(topics)
    for number, start in enumerate(range(0, len(names), TOPICS_PER_DOCUMENT)):
        group = names[start : start + TOPICS_PER_DOCUMENT]
        yield "\n\n".join(topics[name].strip() for name in group)
        if number % PARAGRAPHS_EVERY == 0:
            yield from topic_paragraphs(group[0])


if __name__ == "__main__":
    write_corpus(documents(), __doc__.splitlines()[0])
