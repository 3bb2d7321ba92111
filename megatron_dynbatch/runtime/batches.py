"""The input types of dynamic batching: what a data iterator yields for one or more steps.

A batch holds the **global** samples of one or more optimizer steps and is the same on every
rank: every rank plans from its lengths alone and loads only its own DP rank's samples.
:class:`RolloutBatch` holds the samples in memory; :class:`LazyRolloutBatch` holds their lengths
and a loader of one sample by index. :func:`coerce_batch` accepts either, or a RolloutBatch dict.

Torch only (sample tensors); no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime.schema import BatchSchema

__all__ = ["LazyRolloutBatch", "RolloutBatch", "coerce_batch"]


def _prompt_length(sample: Mapping[str, Any]) -> Optional[int]:
    prompt = sample.get("prompt_length")
    if isinstance(prompt, torch.Tensor):
        prompt = int(prompt.item())
    return prompt


@dataclass(frozen=True)
class RolloutBatch:
    """The global samples of one or more optimizer steps, in memory, identical on every rank."""

    samples: Sequence[Mapping[str, Any]]
    """Sample ``i``: ``tokens`` (int64 ``[L]``), optionally ``loss_mask`` or ``prompt_length``, and
    every field the schema declares (see :mod:`megatron_dynbatch.runtime.schema`)."""
    rollout_ids: Optional[Sequence[Hashable]] = None
    """One str/int id per sample; a rollout's samples always share a step. ``None``: one rollout
    per sample."""
    schema: BatchSchema = field(default_factory=BatchSchema)
    """Declared extra fields (advantages, old log-probs, ...) and the padding token."""

    def __post_init__(self) -> None:
        if not isinstance(self.samples, Sequence) or isinstance(self.samples, (str, bytes)):
            raise DynBatchValueError(
                f"RolloutBatch.samples must be a sequence of sample dicts, got "
                f"{type(self.samples).__name__}."
            )
        if not self.samples:
            raise DynBatchValueError(
                "RolloutBatch.samples is empty; yield at least one sample per batch."
            )
        _check_ids_and_schema(self, len(self.samples))

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> List[int]:
        return [int(sample["tokens"].shape[0]) for sample in self.samples]

    def prompt_lengths(self) -> List[Optional[int]]:
        """Per-sample prompt lengths for the cost model's response term (``None`` if unknown)."""
        return [_prompt_length(sample) for sample in self.samples]

    def load(self, indices: Sequence[int]) -> Dict[int, Mapping[str, Any]]:
        """The samples ``indices`` (this rank's share of a step)."""
        return {i: self.samples[i] for i in indices}


@dataclass(frozen=True)
class LazyRolloutBatch:
    """The global samples of one or more optimizer steps, as lengths and a per-sample loader.

    Every rank plans from ``lengths`` and calls ``load_sample`` only for the samples its DP rank
    trains (on the first and last pipeline stages). Use it when a batch is too large to read on
    every rank.
    """

    sample_lengths: Sequence[int]
    """Token count of every sample (what the plan needs)."""
    load_sample: Callable[[int], Mapping[str, Any]]
    """``load_sample(i)`` returns sample ``i`` as a :class:`RolloutBatch` sample dict; its
    ``tokens`` must have ``sample_lengths[i]`` entries."""
    rollout_ids: Optional[Sequence[Hashable]] = None
    """As in :class:`RolloutBatch`."""
    sample_prompt_lengths: Optional[Sequence[Optional[int]]] = None
    """Per-sample prompt lengths (cost model only), or ``None``."""
    schema: BatchSchema = field(default_factory=BatchSchema)
    """As in :class:`RolloutBatch`."""

    def __post_init__(self) -> None:
        if not self.sample_lengths:
            raise DynBatchValueError(
                "LazyRolloutBatch.sample_lengths is empty; yield at least one sample."
            )
        _check_ids_and_schema(self, len(self.sample_lengths))
        if self.sample_prompt_lengths is not None and len(self.sample_prompt_lengths) != len(
            self.sample_lengths
        ):
            raise DynBatchValueError(
                f"LazyRolloutBatch has {len(self.sample_lengths)} lengths but "
                f"{len(self.sample_prompt_lengths)} prompt lengths; give one per sample or none."
            )
        if not callable(self.load_sample):
            raise DynBatchValueError(
                "LazyRolloutBatch.load_sample must be callable: index -> sample."
            )

    def __len__(self) -> int:
        return len(self.sample_lengths)

    def lengths(self) -> List[int]:
        return [int(length) for length in self.sample_lengths]

    def prompt_lengths(self) -> List[Optional[int]]:
        if self.sample_prompt_lengths is None:
            return [None] * len(self.sample_lengths)
        return list(self.sample_prompt_lengths)

    def load(self, indices: Sequence[int]) -> Dict[int, Mapping[str, Any]]:
        samples = {}
        for i in indices:
            sample = self.load_sample(i)
            got = int(sample["tokens"].shape[0])
            if got != int(self.sample_lengths[i]):
                raise DynBatchValueError(
                    f"LazyRolloutBatch sample {i}: load_sample returned {got} tokens but sample_lengths "
                    f"says {int(self.sample_lengths[i])}; the plan was made from sample_lengths."
                )
            samples[i] = sample
        return samples


def _check_ids_and_schema(batch: Any, count: int) -> None:
    """The fields both batch kinds share: one rollout id per sample (or none), a schema."""
    if batch.rollout_ids is not None and len(batch.rollout_ids) != count:
        raise DynBatchValueError(
            f"the batch has {count} samples but {len(batch.rollout_ids)} rollout ids; give one id "
            "per sample or none."
        )
    if not isinstance(batch.schema, BatchSchema):
        raise DynBatchValueError(
            f"{type(batch).__name__}.schema must be a BatchSchema, got {batch.schema!r}."
        )


def coerce_batch(value: Any) -> Any:
    """Accept a :class:`RolloutBatch`, a :class:`LazyRolloutBatch`, or a RolloutBatch dict."""
    if isinstance(value, (RolloutBatch, LazyRolloutBatch)):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"samples", "rollout_ids", "schema"})
        if unknown or "samples" not in value:
            raise DynBatchValueError(
                "a rollout-batch dict needs 'samples' and may have 'rollout_ids' and 'schema'; got "
                f"keys {sorted(value)}. With --use-dynamic-batch-size the data iterator yields "
                "whole batches (megatron_dynbatch RolloutBatch / LazyRolloutBatch), not Megatron's "
                "fixed micro-batches: use launch/pretrain_gpt_dynbatch.py's data path or yield "
                "rollout batches (see megatron_dynbatch/runtime/batches.py)."
            )
        return RolloutBatch(**value)
    raise DynBatchValueError(
        f"the data iterator yielded a {type(value).__name__}; with --use-dynamic-batch-size it "
        "must yield a megatron_dynbatch RolloutBatch or LazyRolloutBatch holding the global batch "
        "(every rank the same)."
    )
