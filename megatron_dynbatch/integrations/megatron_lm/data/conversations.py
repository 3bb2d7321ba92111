"""SFT conversations from JSONL (``--sft``): one sample per line, loss on responses only.

The input is Megatron-LM's SFT format (``megatron/training/datasets/sft_dataset.py``): one JSON
object per line with a ``messages`` list of ``{"role": "system" | "user" | "assistant",
"content": str}``; a line may hold several conversations, each starting at a ``system`` message.
The samples follow Megatron's ``SFTDataset``:

* a sample is a line (``SFTDataset`` counts lines: ``--global-batch-size`` lines per step); its
  conversations are tokenized one by one and concatenated;
* a line longer than ``--seq-length`` is truncated at the right (never cut into several samples),
  so a long answer loses its end, and conversations after the cut are dropped;
* a line without an assistant turn still is a sample, with zero loss tokens; blank lines are
  skipped. Both are counted in one start-up warning, with the lines truncation leaves without loss.

One difference remains: ``SFTDataset`` hands the conversations of a line to transformer-engine as
separate THD segments (attention and positions restart at each conversation); here a line is one
segment, so a line's later conversations attend to its earlier ones. Lines of one conversation
(the usual layout) are identical. The loss mask trains the assistant tokens only.

Tokenization, picked from the Megatron tokenizer:

* a tokenizer with a working ``tokenize_conversation`` (Megatron's ``SFTTokenizer``, i.e. a Hugging
  Face tokenizer and ``--sft-tokenizer-prompt-format``): its tokens, and loss where its targets are
  not ``IGNORE_INDEX`` (the positions Megatron's ``SFTDataset`` trains);
* ``--tokenizer-type NullTokenizer --vocab-size 257`` (the byte tokens of
  :mod:`megatron_dynbatch.integrations.megatron_lm.data.preprocess`): the byte template below, which needs no
  vocabulary file. Each message is ``<|role|>\\n`` + content + ``\\n``; the loss covers the
  assistant's content and its newline, and the end-of-document token that closes a conversation
  whose last message is the assistant's.

Scale: the file is read once to measure every line (the planner needs only lengths);
afterwards only the byte offsets of the lines are kept, and a sample's tokens are rebuilt from its
line when a rank loads it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.data.preprocess import (
    BYTE_EOD,
    BYTE_VOCAB_SIZE,
    byte_tokens,
)

__all__ = [
    "ConversationStats",
    "IGNORE_INDEX",
    "ROLES",
    "byte_conversation_tokenizer",
    "conversation_tokenizer",
    "read_conversations",
    "sft_warning",
    "split_conversations",
]

#: Megatron's target id for positions without loss (``sft_dataset.IGNORE_INDEX``).
IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")

#: ``conversation -> (tokens int64 [L], loss_mask float32 [L])``; ``loss_mask[k]`` is the loss on
#: predicting ``tokens[k]`` (Megatron's targets, shifted with the labels).
ConversationTokenizer = Callable[[List[Dict[str, str]]], Tuple[numpy.ndarray, numpy.ndarray]]


def split_conversations(messages: List[Dict[str, str]]) -> List[List[Dict[str, str]]]:
    """A line's messages as conversations: a new one starts at every ``system`` message."""
    conversations: List[List[Dict[str, str]]] = []
    current: List[Dict[str, str]] = []
    for message in messages:
        if message["role"] == "system" and current:
            conversations.append(current)
            current = []
        current.append(message)
    if current:
        conversations.append(current)
    return conversations


def byte_conversation_tokenizer(eod: int = BYTE_EOD) -> ConversationTokenizer:
    """The byte template (``NullTokenizer`` with ``--vocab-size 257``): see the module docstring."""

    def tokenize(conversation: List[Dict[str, str]]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        tokens: List[int] = []
        mask: List[float] = []
        for message in conversation:
            header = byte_tokens(f"<|{message['role']}|>\n", append_eod=False)
            body = byte_tokens(message["content"] + "\n", append_eod=False)
            trained = 1.0 if message["role"] == "assistant" else 0.0
            tokens += header + body
            mask += [0.0] * len(header) + [trained] * len(body)
        tokens.append(eod)
        mask.append(1.0 if conversation[-1]["role"] == "assistant" else 0.0)
        return numpy.asarray(tokens, dtype=numpy.int64), numpy.asarray(mask, dtype=numpy.float32)

    return tokenize


def conversation_tokenizer(tokenizer: Any, tokenizer_type: str) -> ConversationTokenizer:
    """How to tokenize conversations with Megatron's tokenizer (see the module docstring).

    Raises:
        ValueError: If the tokenizer can neither tokenize conversations nor is the byte tokenizer.
    """
    if tokenizer_type == "NullTokenizer":
        if tokenizer.vocab_size < BYTE_VOCAB_SIZE or tokenizer.eod != BYTE_EOD:
            raise DynBatchValueError(
                f"--sft with --tokenizer-type NullTokenizer uses byte tokens, which need "
                f"--vocab-size {BYTE_VOCAB_SIZE} (end of document {BYTE_EOD}); got vocab size "
                f"{tokenizer.vocab_size}, end of document {tokenizer.eod}."
            )
        return byte_conversation_tokenizer(tokenizer.eod)

    def tokenize(conversation: List[Dict[str, str]]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        tokens, targets = tokenizer.tokenize_conversation(
            conversation, return_target=True, add_generation_prompt=False
        )
        tokens = numpy.asarray(tokens, dtype=numpy.int64)
        targets = numpy.asarray(targets, dtype=numpy.int64)
        return tokens, (targets != IGNORE_INDEX).astype(numpy.float32)

    if not callable(getattr(tokenizer, "tokenize_conversation", None)):
        raise DynBatchValueError(
            f"--sft: --tokenizer-type {tokenizer_type} cannot tokenize conversations; use "
            "--tokenizer-type SFTTokenizer (a Hugging Face --tokenizer-model and "
            "--sft-tokenizer-prompt-format) or NullTokenizer --vocab-size 257 (byte template)."
        )
    try:
        tokenize([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}])
    except NotImplementedError as error:
        raise DynBatchValueError(
            f"--sft: --tokenizer-type {tokenizer_type} cannot tokenize conversations ({error}); "
            "use --tokenizer-type SFTTokenizer or NullTokenizer --vocab-size 257."
        ) from None
    return tokenize


def _messages(line: bytes, where: str) -> List[Dict[str, str]]:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise DynBatchValueError(
            f"{where}: not a JSON object ({error}); one object per line."
        ) from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DynBatchValueError(
            f'{where}: needs a non-empty "messages" list of {{"role", "content"}} objects '
            f"(Megatron's SFT format); got {type(record).__name__} with keys "
            f"{sorted(record) if isinstance(record, dict) else None}."
        )
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise DynBatchValueError(
                f"{where}: message {index} is {str(message)[:80]}; each message needs a role in "
                f"{list(ROLES)} and a string content."
            )
    return messages


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversationStats:
    """What reading the JSONL files found, for the start-up warning."""

    num_lines: int
    """Lines that became samples."""
    num_blank_lines: int
    """Blank lines skipped (Megatron's JSON loader skips them too)."""
    num_without_loss: int
    """Samples with no trained token at all (no assistant turn): trained with zero loss tokens."""
    first_loss_token: numpy.ndarray
    """Per sample, the index of its first trained token, or -1 (to count what truncation leaves
    without loss)."""


def read_conversations(
    paths: Sequence[str], tokenize: ConversationTokenizer
) -> Tuple[
    numpy.ndarray, Callable[[int], Tuple[numpy.ndarray, numpy.ndarray]], str, ConversationStats
]:
    """Measure every line of the JSONL files: one sample per line, as Megatron's ``SFTDataset``.

    A line's conversations (a new one at every ``system`` message) are tokenized one by one and
    concatenated, as ``SFTDataset`` packs them into its row.

    Returns:
        ``(lengths, load, name, stats)``: token counts (int64), ``load(line) -> (tokens,
        loss_mask)``, a description for messages, and :class:`ConversationStats`.

    Raises:
        ValueError: On a missing file, a malformed line (naming file and line), or no conversation.
    """
    where_of: List[Tuple[int, int]] = []  # (file, byte offset of the line)
    lengths: List[int] = []
    first_loss: List[int] = []
    blank = 0
    for file_index, path in enumerate(paths):
        file = pathlib.Path(path)
        if not file.is_file():
            raise DynBatchValueError(
                f"--sft --data-path {path!r}: no such file; pass the JSONL file of conversations "
                '(one {"messages": [...]} object per line).'
            )
        offset = 0
        with file.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    tokens, mask = _tokenize_line(_messages(line, f"{path}:{number}"), tokenize)
                    where_of.append((file_index, offset))
                    lengths.append(int(tokens.shape[0]))
                    trained = numpy.flatnonzero(mask)
                    first_loss.append(int(trained[0]) if trained.size else -1)
                else:
                    blank += 1
                offset += len(line)
    if not lengths:
        raise DynBatchValueError(f"--sft --data-path {list(paths)}: no conversations found.")
    cache: Dict[int, Tuple[numpy.ndarray, numpy.ndarray]] = {}

    def load(sample: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        if sample not in cache:
            file_index, offset = where_of[sample]
            with open(paths[file_index], "rb") as handle:
                handle.seek(offset)
                line = handle.readline()
            messages = _messages(line, f"{paths[file_index]} at byte {offset}")
            cache.clear()  # samples are loaded one at a time: keep the last line only
            cache[sample] = _tokenize_line(messages, tokenize)
        return cache[sample]

    first = numpy.asarray(first_loss, dtype=numpy.int64)
    stats = ConversationStats(
        num_lines=len(lengths),
        num_blank_lines=blank,
        num_without_loss=int((first < 0).sum()),
        first_loss_token=first,
    )
    name = f"SFT conversations {list(paths)}"
    return numpy.asarray(lengths, dtype=numpy.int64), load, name, stats


def _tokenize_line(
    messages: List[Dict[str, str]], tokenize: ConversationTokenizer
) -> Tuple[numpy.ndarray, numpy.ndarray]:
    pieces = [tokenize(conversation) for conversation in split_conversations(messages)]
    tokens = numpy.concatenate([piece[0] for piece in pieces])
    mask = numpy.concatenate([piece[1] for piece in pieces])
    return tokens, mask


def sft_warning(
    stats: ConversationStats, seq_length: int, name: str, cut: Optional[Tuple[int, str]] = None
) -> Optional[str]:
    """The start-up warning about lines that train nothing or lose their answer, or None.

    ``cut``: ``(tokens, flag)`` where dynamic batching cuts samples shorter than ``seq_length``
    (``--oversize-samples truncate`` at the token budget): lines whose answer starts past it
    train nothing either (a probe saw them counted only as truncated tokens).
    """
    truncated_to_nothing = int((stats.first_loss_token >= seq_length).sum())
    cut_to_nothing = 0
    if cut is not None and cut[0] < seq_length:
        first = stats.first_loss_token
        cut_to_nothing = int(((first >= cut[0]) & (first < seq_length)).sum())
    # Each cause with its own fix: only truncation is cured by a longer --seq-length.
    parts = []
    if stats.num_blank_lines:
        parts.append(f"{stats.num_blank_lines} blank lines skipped (remove them to silence this)")
    if stats.num_without_loss:
        parts.append(
            f"{stats.num_without_loss} of {stats.num_lines} samples have no assistant turn and "
            "train with zero loss tokens (give them an assistant answer, or drop those lines)"
        )
    if truncated_to_nothing:
        parts.append(
            f"{truncated_to_nothing} samples start their first answer at or after --seq-length "
            f"{seq_length}, so truncation leaves them without loss tokens (raise --seq-length, "
            "or shorten their prompts)"
        )
    if cut_to_nothing:
        parts.append(
            f"{cut_to_nothing} samples start their first answer at or after {cut[1]} {cut[0]}, "
            "where --oversize-samples truncate cuts them, so they train with zero loss tokens "
            f"(raise {cut[1]}, or shorten their prompts)"
        )
    if not parts:
        return None
    return f"WARNING: {name}: " + "; ".join(parts) + " (as Megatron's SFTDataset does)."
