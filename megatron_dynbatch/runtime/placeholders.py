"""Placeholders and padding: every tensor that stands for "no data" is built here.

A placeholder (a whole micro-batch a DP rank runs to keep the count equal, rows that fill a
micro-batch to the planned size, a stand-in sample whose data a stage never reads) must look like
real data to the trainer's forward and loss code and carry nothing: zero loss weight, zero
advantages, padding tokens, a sample index no real sample has. Every path builds those values
here, so a new key or a new rule (say, "an attention mask attends to one token") is written once:

* :func:`placeholder_microbatch`: the materializer's full ``[B, S]`` micro-batch of padding, the
  start of every micro-batch it builds (real samples are then written into its rows);
* :func:`shape_only_sample`: a sample of the right length and dtypes with no data, for pipeline
  stages that never read tokens;
* :func:`placeholder_tensor`: a trainer's own key, shaped and typed like a real value (SkyRL,
  verl);
* :func:`padding_tensor`: one key of a trainer whose placeholder rules depend on the key's
  meaning (slime's per-sample lists, built by ``integrations/slime/placeholders.py``).

    placeholder_tensor(batch["loss_mask"], rows=2)            # [2, *trailing] zeros
    placeholder_tensor(batch["attention_mask"], rows=2, attend_first=True)
    placeholder_tensor(nested_log_probs)                      # same jagged lengths, zeros

**What makes a placeholder one is its marker, never its content.** A placeholder carries the
sample index :data:`PLACEHOLDER_INDEX` (no real sample has a negative index), each host in its own
format, and every detector asks :func:`is_placeholder` about that index and nothing else: not the
tokens, not the loss mask, not how many tokens a row attends to. The content (padding ids, the
:data:`PLACEHOLDER_ATTENDED_TOKENS` a row attends to, a verl copy of the shortest sample) may
change without any detector noticing.

Where each host carries the marker (built by) -> the detectors that read it, all through
:func:`is_placeholder`:

* **Megatron-LM / mcore** (our planned micro-batches): ``sample_index`` ``[B, S]`` on every
  position of padding and of a placeholder (:func:`placeholder_microbatch`) ->
  ``mcore.moe.padding_mask_of`` (the router padding mask), ``runtime.loss`` (per-sequence
  denominators), ``runtime.reorder.split_outputs``.
* **slime**: a sample's rollout position (its ``partition`` entry) for a placeholder sample and
  the phantom (``integrations.slime.placeholders.placeholder_sample``); a placeholder micro-batch
  is an index list that names no sample (``[]``) -> ``integrations.slime.moe`` (the samples of
  the micro-batch last served), ``integrations.slime.empty_rank.has_phantom``,
  ``integrations.slime.backend``.
* **SkyRL**: :data:`MARKER_KEY` ``[B]`` in each of the worker's micro-batch dicts, every row's
  sample index (``integrations.skyrl.iterator.PlannedBatchIterator.mark_rows``, called by patch
  0002) -> ``integrations.skyrl.moe`` (patch 0004 hands it the dict).
* **verl**: the non-tensor entry :data:`MARKER_KEY` of a placeholder micro-batch (a real one
  has none; ``integrations.verl.engine.placeholder_micro_batch``) ->
  ``integrations.verl.moe.is_placeholder_batch``.
* **NeMo-RL**: the shard's attribute :data:`MARKER_KEY`, every row's sample index (an attribute
  survives Ray's pickling; ``integrations.nemo_rl.shard``) ->
  ``integrations.nemo_rl.shard.placeholder_rows`` (``num_real_rows``,
  ``drop_placeholder_rows``).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import torch

from megatron_dynbatch.runtime.schema import BatchSchema

__all__ = [
    "IGNORED_LABEL",
    "MARKER_KEY",
    "PLACEHOLDER_ATTENDED_TOKENS",
    "PLACEHOLDER_INDEX",
    "is_placeholder",
    "padding_tensor",
    "placeholder_microbatch",
    "placeholder_tensor",
    "shape_only_sample",
]

#: Label written where no next token exists (last token of a sample, padding). Any valid id works
#: because the loss mask is zero there; 0 keeps cross-entropy gathers in range.
IGNORED_LABEL = 0
#: The placeholder marker: the sample index of whatever holds no sample (a padding position, a
#: placeholder row, sample or micro-batch). Real samples have indices >= 0, so it never collides.
PLACEHOLDER_INDEX = -1
#: The name under which a host without a ``sample_index`` of ours carries the marker (a SkyRL
#: micro-batch key, a verl non-tensor entry, a NeMo-RL shard attribute; see the table above).
MARKER_KEY = "dynbatch_sample_index"
#: Tokens a placeholder row attends to (``attend_first``, a NeMo-RL placeholder's
#: ``input_lengths``): trainers that strip padding drop a row that attends to none. Content: no
#: detector reads it.
PLACEHOLDER_ATTENDED_TOKENS = 1


def is_placeholder(index: Union[int, torch.Tensor, Sequence[int]]) -> Union[bool, torch.Tensor]:
    """Whether ``index``, a sample index as a host carries it, marks a placeholder.

    An ``int``: whether it is no real sample's (negative: :data:`PLACEHOLDER_INDEX`). A tensor of
    indices: the same, element by element (a ``bool`` tensor of its shape). A list or tuple (the
    sample indices of one micro-batch, or of one sample's rows): whether none of them is real, so
    an empty one (a micro-batch that names no sample) is a placeholder.
    """
    if isinstance(index, torch.Tensor):
        return index < 0
    if isinstance(index, (list, tuple)):
        return all(is_placeholder(i) for i in index)
    return int(index) < 0


def padding_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: Optional[Union[str, torch.device]] = None,
    fill: Union[int, float] = 0,
) -> torch.Tensor:
    """``shape`` filled with ``fill`` (a padding id, 0 for masks and per-token values)."""
    return torch.full(tuple(shape), fill, dtype=dtype, device=device)


def placeholder_tensor(
    value: torch.Tensor, *, rows: Optional[int] = None, attend_first: bool = False
) -> torch.Tensor:
    """Zeros with ``value``'s dtype and device: ``rows`` rows of its trailing shape, or (``rows``
    ``None``) exactly its shape; a nested (jagged) tensor keeps its per-row lengths.

    ``attend_first``: the first :data:`PLACEHOLDER_ATTENDED_TOKENS` positions of every row are 1
    (an attention mask must attend to at least one token, or trainers that strip padding drop the
    row); a row shorter than that attends to all of its positions.
    """
    attended = PLACEHOLDER_ATTENDED_TOKENS if attend_first else 0
    if value.is_nested:
        assert rows is None, "a nested placeholder keeps the rows (and lengths) it copies"
        values = torch.zeros_like(value.values())
        offsets = value.offsets()
        for k in range(attended):
            starts = offsets[:-1] + k
            values[starts[starts < offsets[1:]]] = 1
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    shape = value.shape if rows is None else (rows, *value.shape[1:])
    out = padding_tensor(shape, value.dtype, value.device)
    if attended:
        out[:, :attended] = 1
    return out


def placeholder_microbatch(
    schema: BatchSchema, b: int, s: int, device: Optional[Union[str, torch.device]] = None
) -> Dict[str, torch.Tensor]:
    """A full ``[B, S]`` micro-batch of padding with every key of ``schema`` (no ``cu_seqlens``).

    Padding tokens, label :data:`IGNORED_LABEL`, loss mask 0, ``sample_index``
    :data:`PLACEHOLDER_INDEX` (the marker), every declared field at its ``pad_value``. A placeholder micro-batch is
    exactly this (plus ``cu_seqlens``); a real one starts as this and gets its samples written in.
    """
    batch = {
        "tokens": padding_tensor((b, s), torch.int64, device, schema.pad_token_id),
        "labels": padding_tensor((b, s), torch.int64, device, IGNORED_LABEL),
        "loss_mask": padding_tensor((b, s), torch.float32, device),
        "position_ids": padding_tensor((b, s), torch.int64, device),
        "segment_ids": padding_tensor((b, s), torch.int64, device),
        "sample_index": padding_tensor((b, s), torch.int64, device, PLACEHOLDER_INDEX),
    }
    for spec in schema.fields:
        batch[spec.name] = padding_tensor(
            (b, s, *spec.trailing_shape), spec.dtype, device, spec.pad_value
        )
    return batch


def shape_only_sample(length: int, schema: BatchSchema) -> Dict[str, torch.Tensor]:
    """A sample of ``length`` tokens with every field of ``schema``, all zeros: what a pipeline
    stage that never reads tokens (a middle stage) materializes instead of reading the data."""
    sample: Dict[str, torch.Tensor] = {"tokens": padding_tensor((length,), torch.int64)}
    for spec in schema.fields:
        shape = (length, *spec.trailing_shape) if spec.kind == "token" else spec.trailing_shape
        sample[spec.name] = padding_tensor(shape, spec.dtype)
    return sample
