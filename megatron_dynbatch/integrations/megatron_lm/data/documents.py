"""Variable-length samples from Megatron's data formats: one sample per document.

Megatron-LM's ``GPTDataset`` concatenates documents and cuts the token stream into fixed
``--seq-length`` windows; dynamic batching needs the documents themselves. This module reads them
from the same sources:

* ``--data-path`` / ``--{train,valid,test}-data-path``: Megatron indexed datasets (``.bin`` /
  ``.idx`` written by ``tools/preprocess_data.py`` or ``python -m
  megatron_dynbatch.integrations.megatron_lm.data.preprocess``). A document is one sequence of the ``.idx`` (as for
  ``GPTDataset``); its length comes from the ``.idx`` without reading the ``.bin``.
* ``--sft`` with ``--data-path FILE.jsonl``: Megatron's SFT conversations, one document per
  line as in ``SFTDataset``, truncated at ``--seq-length``, loss on the responses only
  (:mod:`megatron_dynbatch.integrations.megatron_lm.data.conversations`).
* ``--mock-data``: seeded mock documents with a long-tailed (log-normal) length distribution whose
  tokens follow a learnable rule, so demos and tests need no files.

A document longer than ``--seq-length`` tokens becomes consecutive samples of at most
``--seq-length`` tokens (no token is dropped); ``--seq-length`` is therefore the longest sample.
SFT lines are the exception, as in Megatron's ``SFTDataset``: one sample per line, cut at the right.
A weighted blend (``--data-path 0.3 A 0.7 B``) splits every dataset on its own and draws from them
in Megatron's ``BlendedDataset`` proportions (:mod:`.blends`); prefixes without weights are
concatenated.
Documents are split into train / valid / test by ``--split`` exactly as Megatron splits the
sequences of an indexed dataset (``round(fraction * count)`` bookends), or taken whole from per-split
paths. Each split's samples are visited in a seeded order (``--seed``), reshuffled every epoch;
position ``p`` of a split is a pure function of ``(seed, split, p)``, equal on every rank.

Two consumers:

* :class:`DocumentSampleDataset` (fixed micro-batches, ``--document-samples`` without
  ``--use-dynamic-batch-size``): a map-style dataset, sample ``p`` padded to ``--seq-length``, read
  through Megatron's own data loader and sampler. The baseline for the same samples.
* :class:`DocumentBatchStream` (``--use-dynamic-batch-size``): an iterator of
  :class:`~megatron_dynbatch.runtime.batches.LazyRolloutBatch`, one per optimizer step
  (``--global-batch-size`` consecutive positions), starting at the consumed-samples counter. It
  hands the planner the lengths and loads a sample's tokens only when the hook asks for one of
  this rank's samples.

Both read positions ``[k * B, (k + 1) * B)`` for step ``k``, so the two train on the same samples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.console import print_rank_0
from megatron_dynbatch.planning.fixed import plan_fixed_microbatches
from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches
from megatron_dynbatch.runtime.batches import LazyRolloutBatch

__all__ = [
    "DocumentBatchStream",
    "DocumentCollection",
    "DocumentSampleDataset",
    "SplitSamples",
    "conversation_documents",
    "indexed_documents",
    "mock_documents",
    "split_bookends",
    "stream_starts",
]

# Megatron's default --split (arguments.py uses it for --data-path without --split).
DEFAULT_SPLIT = "969, 30, 1"

# Mock documents: how many, and the log-normal length law relative to --seq-length (median a
# fifth of it, a long tail past it so some documents are cut into several samples).
MOCK_NUM_DOCUMENTS = 100_000
#: The split of mock data, ``--split`` ignored, as Megatron-Core splits its own mock dataset.
MOCK_SPLIT = "1,1,1"
#: ``--split``'s three parts, in its order, as messages name them.
SPLIT_NAMES = ("training", "validation", "test")
_MOCK_MEDIAN_FRACTION = 0.2
_MOCK_SIGMA = 0.9
_MOCK_MIN_LENGTH = 2
_MOCK_MAX_FACTOR = 3
# The mock tokens' rule: token k = (a * token k-1 + b) mod (vocab - 2) + 1, with ``a`` one of a few
# multipliers chosen per document (so it must be inferred from the context) and ``b`` fixed.
_MOCK_MULTIPLIERS = (3, 5, 7, 11)
_MOCK_OFFSET = 17


@dataclasses.dataclass(frozen=True)
class DocumentCollection:
    """Documents as lengths plus a reader of token ranges."""

    lengths: numpy.ndarray
    """Token count of every document (int64)."""
    read: Callable[[int, int, int], numpy.ndarray]
    """``read(document, offset, count)`` returns ``count`` tokens starting at ``offset``."""
    name: str
    """What the documents are (for messages)."""
    read_loss_mask: Optional[Callable[[int, int, int], numpy.ndarray]] = None
    """Like ``read`` for the loss mask of those tokens (SFT: responses only), or None (all 1)."""
    truncate: bool = False
    """A document longer than ``--seq-length`` is cut at the right to one sample (Megatron's
    ``SFTDataset``), instead of becoming consecutive samples (pretraining documents)."""

    def __len__(self) -> int:
        return int(self.lengths.shape[0])


def indexed_documents(prefixes: Sequence[str], *, mmap: bool = True) -> DocumentCollection:
    """The sequences of one or more Megatron indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``).

    Several prefixes are concatenated in order. Only the ``.idx`` files are read here; tokens are
    read on demand.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    datasets = []
    for prefix in prefixes:
        if not IndexedDataset.exists(prefix):
            raise DynBatchValueError(
                f"--data-path {prefix!r}: {prefix}.bin / {prefix}.idx not found; pass the prefix "
                "that tools/preprocess_data.py or `python -m megatron_dynbatch.integrations.megatron_lm.data.preprocess` "
                "wrote (e.g. data/corpus_text_document, without the extension)."
            )
        datasets.append(IndexedDataset(prefix, mmap=mmap))
    lengths = numpy.concatenate(
        [numpy.asarray(d.sequence_lengths, dtype=numpy.int64) for d in datasets]
    )
    starts = numpy.cumsum([0] + [len(d) for d in datasets])

    def read(document: int, offset: int, count: int) -> numpy.ndarray:
        which = int(numpy.searchsorted(starts, document, side="right")) - 1
        local = document - int(starts[which])
        return numpy.asarray(datasets[which].get(local, offset=offset, length=count))

    return DocumentCollection(lengths=lengths, read=read, name=f"indexed dataset {list(prefixes)}")


def _mock_tokens(seed: int, document: int, length: int, vocab_size: int) -> numpy.ndarray:
    rng = numpy.random.default_rng((seed, document))
    modulus = max(vocab_size - 2, 2)
    multiplier = _MOCK_MULTIPLIERS[int(rng.integers(len(_MOCK_MULTIPLIERS)))]
    tokens = numpy.empty(length, dtype=numpy.int64)
    tokens[0] = int(rng.integers(modulus)) + 1
    for k in range(1, length):
        tokens[k] = (multiplier * tokens[k - 1] + _MOCK_OFFSET) % modulus + 1
    return tokens


def mock_documents(
    *, seed: int, seq_length: int, vocab_size: int, num_documents: int = MOCK_NUM_DOCUMENTS
) -> DocumentCollection:
    """Seeded mock documents: log-normal lengths (median ``seq_length / 5``, tail to 3x).

    Token ids lie in ``[1, vocab_size - 2]`` (never 0 nor the NullTokenizer's EOD,
    ``vocab_size - 1``).
    """
    rng = numpy.random.default_rng(seed)
    median = max(_MOCK_MIN_LENGTH, _MOCK_MEDIAN_FRACTION * seq_length)
    raw = rng.lognormal(mean=numpy.log(median), sigma=_MOCK_SIGMA, size=num_documents)
    lengths = numpy.clip(numpy.rint(raw), _MOCK_MIN_LENGTH, _MOCK_MAX_FACTOR * seq_length).astype(
        numpy.int64
    )

    def read(document: int, offset: int, count: int) -> numpy.ndarray:
        tokens = _mock_tokens(seed, document, int(lengths[document]), vocab_size)
        return tokens[offset : offset + count]

    return DocumentCollection(lengths=lengths, read=read, name="mock documents")


def split_bookends(split: str, num_documents: int) -> List[Optional[Tuple[int, int]]]:
    """``[begin, end)`` document ranges of train / valid / test, as Megatron splits ``--split``."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    ranges: List[Optional[Tuple[int, int]]] = []
    for bookend in matrix:
        if bookend is None:
            ranges.append(None)
            continue
        begin = int(round(bookend[0] * float(num_documents)))
        end = int(round(bookend[1] * float(num_documents)))
        ranges.append((begin, end) if end > begin else None)
    return ranges


class SplitSamples:
    """The samples of one split: its documents cut at ``max_length``, in a seeded order per epoch.

    Args:
        documents: The collection.
        begin, end: The split's documents ``[begin, end)``.
        max_length: Longest sample (``--seq-length``); longer documents become several samples.
        seed: ``--seed``.
        split_index: 0 train, 1 valid, 2 test (each split has its own order).
        eod_id: With ``--eod-mask-loss``, the end-of-document token (no loss on predicting the token
            after it), or ``None``.
        stream: Salt of the seeded order, so the datasets of a blend are shuffled independently
            (0: the order of a lone dataset).
        vocab_size: The model's (padded) vocabulary: a sample with a token id outside
            ``[0, vocab_size)`` is refused when it is read (``None``: not checked).
    """

    def __init__(
        self,
        documents: DocumentCollection,
        begin: int,
        end: int,
        *,
        max_length: int,
        seed: int,
        split_index: int,
        eod_id: Optional[int] = None,
        stream: int = 0,
        vocab_size: Optional[int] = None,
    ) -> None:
        if max_length < 2:
            raise DynBatchValueError(
                f"--seq-length {max_length} must be >= 2 (a sample needs a target)."
            )
        self.documents = documents
        self.max_length = max_length
        self.seed = seed
        self.split_index = split_index
        self.eod_id = eod_id
        self.stream = stream
        self.vocab_size = vocab_size
        lengths = documents.lengths[begin:end]
        if documents.truncate:
            pieces = numpy.minimum(lengths, 1)  # one sample per document, cut at max_length
        else:
            pieces = -(-lengths // max_length)  # ceil
        self.document = numpy.repeat(numpy.arange(begin, end, dtype=numpy.int64), pieces)
        first = numpy.repeat(numpy.cumsum(pieces) - pieces, pieces)
        piece = numpy.arange(self.document.shape[0], dtype=numpy.int64) - first
        self.offset = piece * max_length
        self.length = numpy.minimum(numpy.repeat(lengths, pieces) - self.offset, max_length).astype(
            numpy.int64
        )
        if self.document.shape[0] == 0:
            raise DynBatchValueError(
                f"split {split_index} of {documents.name} has no documents (documents "
                f"[{begin}, {end})); change --split or give more data."
            )
        self._orders: Dict[int, numpy.ndarray] = {}

    def __len__(self) -> int:
        return int(self.document.shape[0])

    def _order(self, epoch: int) -> numpy.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            key = (self.seed, self.split_index, epoch) + ((self.stream,) if self.stream else ())
            rng = numpy.random.default_rng(key)
            order = rng.permutation(len(self))
            self._orders = {epoch: order}  # keep one epoch: positions are read in order
        return order

    def _piece(self, position: int) -> int:
        epoch, within = divmod(int(position), len(self))
        return int(self._order(epoch)[within])

    def lengths_at(self, positions: Sequence[int]) -> List[int]:
        """Sample lengths at ``positions`` (no token is read)."""
        return [int(self.length[self._piece(p)]) for p in positions]

    @property
    def mean_length(self) -> float:
        """Mean sample length of the split (tokens)."""
        return float(self.length.mean())

    def tokens_in_first(self, count: int) -> int:
        """Tokens of the samples at positions ``[0, count)`` (no token is read)."""
        epochs, within = divmod(int(count), len(self))
        total = epochs * int(self.length.sum())
        if within:
            total += int(self.length[self._order(epochs)[:within]].sum())
        return total

    def sample_at(self, position: int) -> Dict[str, torch.Tensor]:
        """The sample at ``position``: ``tokens`` int64 ``[L]`` (and ``loss_mask`` with EOD)."""
        piece = self._piece(position)
        where = int(self.document[piece]), int(self.offset[piece]), int(self.length[piece])
        tokens = numpy.array(self.documents.read(*where), dtype=numpy.int64)
        if self.vocab_size is not None and tokens.size:
            _check_token_ids(tokens, self.vocab_size, self.documents.name, where)
        sample = {"tokens": torch.as_tensor(tokens)}
        read_mask = self.documents.read_loss_mask
        if read_mask is not None:
            mask = numpy.array(read_mask(*where), dtype=numpy.float32)
            sample["loss_mask"] = torch.as_tensor(mask)
        if self.eod_id is not None:
            # As --eod-mask-loss in Megatron's GPTDataset: no loss where the *input* token is the
            # end of a document, i.e. target k is masked when token k - 1 is EOD.
            after_eod = torch.zeros_like(sample["tokens"], dtype=torch.bool)
            after_eod[1:] = sample["tokens"][:-1] == self.eod_id
            keep = (~after_eod).to(torch.float32)
            sample["loss_mask"] = sample["loss_mask"] * keep if "loss_mask" in sample else keep
        return sample


def _check_token_ids(
    tokens: numpy.ndarray, vocab_size: int, name: str, where: Tuple[int, int, int]
) -> None:
    """Refuse token ids the model's embedding has no row for.

    Data tokenized with another tokenizer than the run's is a classic Megatron failure: on a GPU
    the embedding's device-side assert kills one rank and the others wait in their collectives
    until the timeout; here the sample is refused when it is read (inside the step's agreement
    with dynamic batching, so every rank raises this at once). A min and a max per sample.
    """
    low, high = int(tokens.min()), int(tokens.max())
    if low >= 0 and high < vocab_size:
        return
    bad = high if high >= vocab_size else low
    # (NullTokenizer's vocabulary is --vocab-size ids, its end of document the last of them.)
    document, offset, _ = where
    at = offset + int(numpy.flatnonzero(tokens == bad)[0])
    raise DynBatchValueError(
        f"{name}: document {document} holds token id {bad} (at token {at}), outside the model's "
        f"vocabulary ({vocab_size} ids once padded to --make-vocab-size-divisible-by); the data "
        "was made with another tokenizer or vocabulary: run with the one it was preprocessed "
        f"with (with --tokenizer-type NullTokenizer: --vocab-size {bad + 1} or more), or "
        "preprocess it again with this one."
    )


#: Samples of every split read at start-up for :func:`check_first_samples` (a few milliseconds).
FIRST_SAMPLES = 64


def check_first_samples(splits: Sequence[Optional[Any]], count: int = FIRST_SAMPLES) -> None:
    """Read the first ``count`` samples of every split, before the model is built: data made
    with another tokenizer shows in any of them, and is refused at start-up, naming the document
    (``SplitSamples.sample_at`` checks the token ids), instead of at the first step that reads
    one (a probe: after the model was built). Later samples are still checked as they are read.
    """
    for split in splits:
        if split is not None:
            for position in range(min(count, len(split))):
                split.sample_at(position)


class DocumentSampleDataset(torch.utils.data.Dataset):
    """Fixed micro-batches over document samples: sample ``p`` padded to ``seq_length``.

    Items are the micro-batch dict of one row (``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, ``segment_ids``, ``sample_index``; ``[seq_length]`` each), laid out exactly as
    the dynamic path's padded rows, so Megatron's data loader stacks them into ``[mbs, S]``.
    """

    def __init__(self, samples: SplitSamples, num_samples: int, seq_length: int) -> None:
        self.samples = samples
        self.num_samples = int(num_samples)
        self.seq_length = seq_length

    @property
    def split(self) -> Any:
        """Megatron's ``Split`` of these samples: its ``build_pretraining_data_loader`` reads it
        to load validation and test with ``--eval-micro-batch-size`` (a probe: without it they
        ran at ``--micro-batch-size``; a pipeline stage then sent a shape its peer did not
        expect, and at dp 2 each validation iteration read twice the samples)."""
        from megatron.core.datasets.utils import Split

        return (Split.train, Split.valid, Split.test)[self.samples.split_index]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, position: int) -> Dict[str, torch.Tensor]:
        sample = self.samples.sample_at(position)
        length = int(sample["tokens"].shape[0])
        step = plan_fixed_microbatches(
            [length], dp_size=1, micro_batch_size=1, seq_length=self.seq_length
        ).steps[0]
        (row,) = materialize_microbatches(
            step, 0, {0: sample}, BatchSchema(), layout="padded", sample_multiple=1
        )
        return {key: value[0] for key, value in row.items() if key != "cu_seqlens"}


def stream_starts(
    consumed_train_samples: int, consumed_valid_samples: int, skip_train: bool
) -> Tuple[int, int, int]:
    """Where the train / valid / test batch streams start, as Megatron's own loaders start
    (``build_train_valid_test_data_loaders`` in ``megatron/training/training.py``): training at
    the consumed counter; validation there too, but at its first sample under ``--skip-train``
    (a checkpoint scored alone is scored on the split's first batches, as ``--document-samples``
    scores it); the test split always at its first sample."""
    return (
        int(consumed_train_samples),
        0 if skip_train else int(consumed_valid_samples),
        0,
    )


class DocumentBatchStream(Iterator[LazyRolloutBatch]):
    """One :class:`LazyRolloutBatch` per step: positions ``[start + k*B, start + (k+1)*B)``.

    Args:
        samples: The split's samples.
        batch_size: ``--global-batch-size`` (or ``--eval-global-batch-size``).
        start: First position (the consumed-samples counter after ``--load``).
        num_samples: Positions available (Megatron's requested size); the stream stops there.
    """

    def __init__(
        self, samples: SplitSamples, batch_size: int, start: int, num_samples: int
    ) -> None:
        self.samples = samples
        self.batch_size = int(batch_size)
        self.position = int(start)
        self.num_samples = int(num_samples)

    def __iter__(self) -> "DocumentBatchStream":
        return self

    def __next__(self) -> LazyRolloutBatch:
        if self.position + self.batch_size > self.num_samples:
            raise StopIteration
        positions = range(self.position, self.position + self.batch_size)
        self.position += self.batch_size
        samples = self.samples
        first = positions[0]
        return LazyRolloutBatch(
            sample_lengths=samples.lengths_at(positions),
            load_sample=lambda i: samples.sample_at(first + i),
        )


def conversation_documents(
    paths: Sequence[str],
    tokenize: Callable,
    *,
    seq_length: Optional[int] = None,
    cut: Optional[Tuple[int, str]] = None,
) -> DocumentCollection:
    """SFT lines of JSONL files as documents (see ``conversations``), truncated like SFTDataset.

    With ``seq_length``, prints (rank 0) one warning with the counts of blank lines skipped,
    samples without an assistant turn, and samples that truncation leaves without loss (``cut``:
    ``(tokens, flag)`` where the dynamic planner cuts them shorter, see ``sft_warning``).
    """
    from megatron_dynbatch.integrations.megatron_lm.data.conversations import (
        read_conversations,
        sft_warning,
    )

    lengths, load, name, stats = read_conversations(paths, tokenize)
    if seq_length is not None:
        warning = sft_warning(stats, seq_length, name, cut)
        if warning is not None:
            print_rank_0(warning)

    def read(document: int, offset: int, count: int) -> numpy.ndarray:
        return load(document)[0][offset : offset + count]

    def read_loss_mask(document: int, offset: int, count: int) -> numpy.ndarray:
        return load(document)[1][offset : offset + count]

    return DocumentCollection(
        lengths=lengths, read=read, name=name, read_loss_mask=read_loss_mask, truncate=True
    )


def document_splits(
    args: Any,
    tokenizer_vocab_size: int,
    eod_id: Optional[int],
    conversation_tokenizer: Optional[Callable] = None,
    cut: Optional[Tuple[int, str]] = None,
) -> List[Optional[Any]]:
    """Train / valid / test samples from Megatron's data arguments.

    Each entry is a :class:`SplitSamples`, or a :class:`~.blends.BlendedSamples` for a weighted
    blend (``--data-path 0.3 A 0.7 B``, or weights in ``--{train,valid,test}-data-path``), or
    ``None`` for a split without data. Prefixes without weights are concatenated, then split.
    ``conversation_tokenizer`` (with ``--sft``): the data paths are JSONL conversations; ``cut``:
    ``(tokens, flag)`` that ``--oversize-samples truncate`` cuts them to (its start-up warning,
    see ``conversation_documents``; ``arguments.truncation_from_args``).
    """
    from megatron_dynbatch.integrations.megatron_lm.data.blends import blends_from_args

    # Megatron's padded vocabulary (set with the tokenizer); token ids at or past it are refused.
    vocab = getattr(args, "padded_vocab_size", None)
    common = dict(max_length=args.seq_length, seed=args.seed, eod_id=eod_id, vocab_size=vocab)

    def collection(paths: Sequence[str]) -> DocumentCollection:
        if conversation_tokenizer is not None:
            return conversation_documents(
                paths, conversation_tokenizer, seq_length=args.seq_length, cut=cut
            )
        return indexed_documents(paths, mmap=args.mmap_bin_files)

    split = args.split or DEFAULT_SPLIT
    if args.mock_data:
        documents = mock_documents(
            seed=args.seed, seq_length=args.seq_length, vocab_size=tokenizer_vocab_size
        )
        # As Megatron's GPTDataset splits mock data (BlendedMegatronDatasetConfig), whatever
        # --split says: a command that runs with the switch off runs with it on.
        return _split(documents, MOCK_SPLIT, common)
    blend, blend_per_split = blends_from_args(args)
    if blend is not None:
        paths, weights = blend
        if weights is None:
            return _split(collection(paths), split, common)
        collections = [collection([path]) for path in paths]
        parts = [
            _split(documents, split, common, stream=i + 1)
            for i, documents in enumerate(collections)
        ]
        counts = [len(documents) for documents in collections]
        return [
            _blend([part[index] for part in parts], paths, weights, index, args, counts)
            for index in range(len(parts[0]))
        ]
    if blend_per_split is None or all(entry is None for entry in blend_per_split):
        raise DynBatchValueError(
            "no data: pass --mock-data, --data-path PREFIX or --train-data-path / "
            "--valid-data-path / --test-data-path."
        )
    splits: List[Optional[Any]] = []
    for index, entry in enumerate(blend_per_split):
        if entry is None:
            splits.append(None)
            continue
        paths, weights = entry
        if weights is None:
            documents = collection(paths)
            splits.append(SplitSamples(documents, 0, len(documents), split_index=index, **common))
            continue
        parts = []
        for i, path in enumerate(paths):
            documents = collection([path])
            parts.append(
                SplitSamples(
                    documents, 0, len(documents), split_index=index, stream=i + 1, **common
                )
            )
        splits.append(_blend(parts, paths, weights, index, args))
    return splits


def _blend(
    parts: Sequence[Optional[SplitSamples]],
    paths: Sequence[str],
    weights: Sequence[float],
    split_index: int,
    args: Any,
    counts: Optional[Sequence[int]] = None,
) -> Optional[Any]:
    """One split of a weighted blend, its drawn shares printed once (rank 0). ``counts``: each
    dataset's documents (``--data-path``'s blend, cut by ``--split``), to name a split that
    gives every dataset a document in every split that has a share."""
    from megatron_dynbatch.integrations.megatron_lm.data.blends import BlendedSamples

    if all(part is None for part in parts):
        return None
    empty = [path for path, part in zip(paths, parts, strict=True) if part is None]
    if empty:
        split = args.split or DEFAULT_SPLIT
        working = _split_for_every(split, counts) if counts else None
        change = f"pass --split {working}" if working else "change --split"
        raise DynBatchValueError(
            f"split {split_index} ({SPLIT_NAMES[split_index]}) of the blend {list(paths)} "
            f"(--split {split!r}) is empty for {empty}: too few documents for that split; "
            f"{change}, give those datasets more documents, or blend them only where they have "
            "data (--train-data-path / --valid-data-path / --test-data-path)."
        )
    weights_are = getattr(args, "blend_weights", None) or "tokens"
    blended = BlendedSamples(
        parts,
        weights,
        split_index=split_index,
        name=f"blend {list(paths)} weights {list(weights)}",
        weights_are=weights_are,
    )
    # The shares over one pass of the split (every part's samples once), or over what training
    # draws (--train-iters x --global-batch-size) when that is more.
    drawn = len(blended)
    if split_index == 0 and getattr(args, "train_iters", None):
        drawn = max(drawn, args.train_iters * args.global_batch_size)

    def text(values: Sequence[float]) -> str:
        return ", ".join(f"{value:.4f}" for value in values)

    other = "samples" if weights_are == "tokens" else "tokens"
    print_rank_0(
        f"> blend split {split_index}: weights [{text(blended.weights)}] are shares of the "
        f"{weights_are} (--blend-weights {weights_are}"
        + (", Megatron's meaning" if weights_are == "tokens" else "")
        + f"; --blend-weights {other} for shares of the {other}): drawn token shares "
        f"[{text(blended.token_shares(drawn))}], sample shares [{text(blended.shares(drawn))}] "
        f"of the first {drawn} samples"
    )
    return blended


def _split_for_every(split: str, counts: Sequence[int]) -> Optional[str]:
    """A ``--split`` that gives every dataset of ``counts`` documents at least one document in
    every split ``split`` gives a share (one each to the others, the rest to training), or
    ``None`` where the smallest dataset has too few documents for that."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    wanted = [i for i, share in enumerate(parse_and_normalize_split(split)) if share > 0]
    fewest = min(counts)
    others = [i for i in wanted if i != 0]
    if fewest <= len(others):
        return None
    shares = [fewest - len(others) if i == 0 else int(i in others) for i in range(3)]
    candidate = ",".join(str(share) for share in shares)
    for count in counts:
        ranges = split_bookends(candidate, count)
        if any(ranges[i] is None for i in wanted):
            return None
    return candidate


def _split(
    documents: DocumentCollection, split: str, common: Dict[str, Any], stream: int = 0
) -> List[Optional[SplitSamples]]:
    splits: List[Optional[SplitSamples]] = []
    for index, bookend in enumerate(split_bookends(split, len(documents))):
        if bookend is None:
            splits.append(None)
        else:
            splits.append(
                SplitSamples(documents, *bookend, split_index=index, stream=stream, **common)
            )
    return splits
