"""SFT conversations from JSONL (``--sft``): one sample per conversation, loss on responses only.

The input is Megatron-LM's SFT format (``megatron/training/datasets/sft_dataset.py``): one JSON
object per line with a ``messages`` list of ``{"role": "system" | "user" | "assistant",
"content": str}``; a line may hold several conversations, each starting at a ``system`` message.
Megatron's ``SFTDataset`` packs conversations into ``--seq-length`` rows itself; dynamic batching
needs them one by one, so this module reads them as documents for
:mod:`megatron_dynbatch.integrations.megatron_lm.data.documents`, with a loss mask that trains the assistant tokens only.

Tokenization, picked from the Megatron tokenizer:

* a tokenizer with a working ``tokenize_conversation`` (Megatron's ``SFTTokenizer``, i.e. a Hugging
  Face tokenizer and ``--sft-tokenizer-prompt-format``): its tokens, and loss where its targets are
  not ``IGNORE_INDEX`` (the positions Megatron's ``SFTDataset`` trains);
* ``--tokenizer-type NullTokenizer --vocab-size 257`` (the byte tokens of
  :mod:`megatron_dynbatch.integrations.megatron_lm.data.preprocess`): the byte template below, which needs no
  vocabulary file. Each message is ``<|role|>\\n`` + content + ``\\n``; the loss covers the
  assistant's content and its newline, and the end-of-document token that closes a conversation
  whose last message is the assistant's.

Scale: the file is read once to measure every conversation (the planner needs only lengths);
afterwards only the byte offsets of the lines are kept, and a sample's tokens are rebuilt from its
line when a rank loads it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy

from megatron_dynbatch.integrations.megatron_lm.data.preprocess import (
    BYTE_EOD,
    BYTE_VOCAB_SIZE,
    byte_tokens,
)

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "byte_conversation_tokenizer",
    "conversation_tokenizer",
    "read_conversations",
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
            raise ValueError(
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
        raise ValueError(
            f"--sft: --tokenizer-type {tokenizer_type} cannot tokenize conversations; use "
            "--tokenizer-type SFTTokenizer (a Hugging Face --tokenizer-model and "
            "--sft-tokenizer-prompt-format) or NullTokenizer --vocab-size 257 (byte template)."
        )
    try:
        tokenize([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}])
    except NotImplementedError as error:
        raise ValueError(
            f"--sft: --tokenizer-type {tokenizer_type} cannot tokenize conversations ({error}); "
            "use --tokenizer-type SFTTokenizer or NullTokenizer --vocab-size 257."
        ) from None
    return tokenize


def _messages(line: bytes, where: str) -> List[Dict[str, str]]:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ValueError(f"{where}: not a JSON object ({error}); one object per line.") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(
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
            raise ValueError(
                f"{where}: message {index} is {str(message)[:80]}; each message needs a role in "
                f"{list(ROLES)} and a string content."
            )
    return messages


def read_conversations(
    paths: Sequence[str], tokenize: ConversationTokenizer
) -> Tuple[numpy.ndarray, Callable[[int], Tuple[numpy.ndarray, numpy.ndarray]], str]:
    """Measure every conversation of the JSONL files.

    Returns:
        ``(lengths, load, name)``: token counts (int64), ``load(conversation) -> (tokens,
        loss_mask)``, and a description for messages.

    Raises:
        ValueError: On a missing file, a malformed line (naming file and line), or no conversation.
    """
    where_of: List[Tuple[int, int, int]] = []  # (file, byte offset of the line, conversation)
    lengths: List[int] = []
    for file_index, path in enumerate(paths):
        file = pathlib.Path(path)
        if not file.is_file():
            raise ValueError(
                f"--sft --data-path {path!r}: no such file; pass the JSONL file of conversations "
                '(one {"messages": [...]} object per line).'
            )
        offset = 0
        with file.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    messages = _messages(line, f"{path}:{number}")
                    for index, conversation in enumerate(split_conversations(messages)):
                        tokens, _ = tokenize(conversation)
                        where_of.append((file_index, offset, index))
                        lengths.append(int(tokens.shape[0]))
                offset += len(line)
    if not lengths:
        raise ValueError(f"--sft --data-path {list(paths)}: no conversations found.")
    cache: Dict[int, Tuple[numpy.ndarray, numpy.ndarray]] = {}

    def load(conversation: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        if conversation not in cache:
            file_index, offset, index = where_of[conversation]
            with open(paths[file_index], "rb") as handle:
                handle.seek(offset)
                line = handle.readline()
            messages = _messages(line, f"{paths[file_index]} at byte {offset}")
            cache.clear()  # samples are loaded one at a time: keep the last conversation only
            cache[conversation] = tokenize(split_conversations(messages)[index])
        return cache[conversation]

    return numpy.asarray(lengths, dtype=numpy.int64), load, f"SFT conversations {list(paths)}"
