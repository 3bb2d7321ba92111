"""Megatron-LM's model flags for ``megatron-dynbatch plan`` (:func:`add_model_args`).

The reading of Megatron's arguments into the memory model lives in
:mod:`megatron_dynbatch.integrations.model_args` (slime parses the same arguments); its names are
imported here for the Megatron-LM entry and ``plan``.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_dynbatch.integrations.model_args import (
    DEFAULT_VOCAB_SIZE,
    memory_model_from_flags,
    model_dims_from_args,
)

__all__ = ["add_model_args", "memory_model_from_flags", "model_dims_from_args"]


def add_model_args(parser: argparse.ArgumentParser, title: str = "") -> Any:
    """Megatron's model flags ``plan`` needs to predict memory (same spellings and defaults);
    returns their argument group (``plan`` adds ``--max-memory-gib`` to it). ``title``: what the
    command does with them (default ``plan``'s)."""
    group = parser.add_argument_group(
        "model (Megatron-LM's flags; "
        + (title or "with --num-layers, plan --json predicts each stage's peak")
        + ")"
    )
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--hidden-size", type=int, default=None)
    group.add_argument("--num-attention-heads", type=int, default=None)
    group.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    group.add_argument(
        "--num-query-groups", type=int, default=None, help="grouped-query attention's KV heads"
    )
    group.add_argument(
        "--kv-channels", type=int, default=None, help="channels a head (default hidden / heads)"
    )
    group.add_argument("--vocab-size", type=int, default=None, help=f"default {DEFAULT_VOCAB_SIZE}")
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--recompute-granularity", choices=("selective", "full"), default=None)
    group.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope", "none"),
        default="rope",
        help="default rope here (no position table); Megatron's own default is learned_absolute",
    )
    group.add_argument("--max-position-embeddings", type=int, default=None)
    return group
