"""Weighted blends of document samples (``--data-path 0.3 A 0.7 B``), with Megatron's meaning.

Megatron-LM's ``BlendedDataset`` splits every dataset of the blend by ``--split`` on its own, then
draws blend position ``p`` from the dataset whose share lags its weight most so far (the greedy
``build_blending_indices`` of ``megatron/core/datasets/helpers.cpp``): after ``n`` draws each
dataset has supplied ``weight * n`` samples up to one, with no randomness in the choice. Megatron's
samples are ``--seq-length`` windows of the token stream, all of one length, so its weights are
shares of the **tokens** too. Here a sample is a document (of a length of its own), so sample
shares and token shares differ wherever the datasets' documents differ in mean length (0.3 of the
samples from a corpus of long documents was ~44% of the tokens in issue 29). So by default
(``--blend-weights tokens``) the weights are token shares, as in Megatron: the greedy draws samples
in the shares ``weight / mean sample length`` (normalised), which gives every dataset its weight's
share of the tokens in expectation (the drawn token shares are printed). ``--blend-weights
samples`` draws samples in the weights' shares instead.

Within a dataset the samples come in that dataset's own seeded order (``--seed``), reshuffled each
time the dataset is exhausted, so a heavily weighted small corpus is repeated and a lightly weighted
large one is sampled, as in Megatron.

:class:`BlendedSamples` does the same over :class:`~.documents.SplitSamples` (one per dataset and
split) and serves the interface the document consumers read (``lengths_at``, ``sample_at``,
``len``): position ``p`` is still a pure function of ``(seed, split, p)``, equal on every rank.
The blending index is computed by Megatron's own C++ helper, extended by doubling as positions are
asked for (the greedy prefix does not depend on the total size); 10 million positions take well
under a second, so it is not cached on disk (``--data-cache-path`` is not needed for it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy
import torch

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["BLEND_WEIGHTS", "Blend", "BlendedSamples", "blends_from_args", "blending_indices"]

#: What a blend weight is a share of: tokens (Megatron's meaning, the default) or samples.
BLEND_WEIGHTS = ("tokens", "samples")

#: ``(prefixes, weights or None)``, as Megatron's ``get_blend_from_list`` returns it.
Blend = Tuple[List[str], Optional[List[float]]]

# First size of the blending index; it doubles whenever a later position is asked for.
_INITIAL_POSITIONS = 1 << 12


class SplitSource(Protocol):
    """What a blend reads of each dataset's split (:class:`~.documents.SplitSamples` serves it;
    named here so this module needs nothing from ``documents``, which imports it)."""

    @property
    def mean_length(self) -> float: ...

    def __len__(self) -> int: ...

    def lengths_at(self, positions: Sequence[int]) -> List[int]: ...

    def sample_at(self, position: int) -> Dict[str, torch.Tensor]: ...

    def tokens_in_first(self, count: int) -> int: ...


def blends_from_args(args: Any) -> Tuple[Optional[Blend], Optional[List[Optional[Blend]]]]:
    """``(blend, blend_per_split)`` of Megatron's data arguments, as ``pretrain()`` reads them.

    ``--data-path`` / ``--data-args-path`` give one blend that ``--split`` divides;
    ``--{train,valid,test}-data-path`` / ``--per-split-data-args-path`` one per split. Megatron's
    ``get_blend_from_list`` parses each list (``A B`` or ``0.3 A 0.7 B``). Written against
    megatron.core alone, so the data modules need no ``megatron.training`` import.
    """
    from megatron.core.datasets.utils import get_blend_from_list

    if getattr(args, "data_args_path", None) is not None:
        with open(args.data_args_path) as handle:
            return get_blend_from_list(handle.read().split()), None
    if getattr(args, "data_path", None) is not None:
        return get_blend_from_list(args.data_path), None
    if getattr(args, "per_split_data_args_path", None) is not None:
        with open(args.per_split_data_args_path) as handle:
            per_split = json.load(handle)
        lists = [per_split.get(name) for name in ("train", "valid", "test")]
        lists = [value.split() if isinstance(value, str) else value for value in lists]
        return None, [get_blend_from_list(value) for value in lists]
    lists = [getattr(args, f"{name}_data_path", None) for name in ("train", "valid", "test")]
    if any(value is not None for value in lists):
        return None, [get_blend_from_list(value) for value in lists]
    return None, None


def blending_indices(weights: Sequence[float], size: int) -> numpy.ndarray:
    """Dataset of each of the first ``size`` blend positions (Megatron's greedy, normalised)."""
    from megatron.core.datasets import helpers

    normalized = numpy.asarray(weights, dtype=numpy.float64)
    normalized = normalized / normalized.sum()
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
    helpers.build_blending_indices(
        dataset_index, dataset_sample_index, normalized, len(normalized), size, False
    )
    return dataset_index


@dataclasses.dataclass(frozen=True)
class _Name:
    """Stands in for a collection where consumers print ``split.documents.name``."""

    name: str


class BlendedSamples:
    """The samples of one split of a weighted blend (see the module docstring).

    Args:
        parts: One split of every dataset of the blend, in ``--data-path`` order.
        weights: Their weights (any positive scale; normalised as Megatron does).
        split_index: 0 train, 1 valid, 2 test.
        name: What the blend is (for messages).
        weights_are: ``"tokens"`` (Megatron's meaning): each dataset supplies its weight's share
            of the tokens; ``"samples"``: its weight's share of the samples.
    """

    def __init__(
        self,
        parts: Sequence[SplitSource],
        weights: Sequence[float],
        *,
        split_index: int,
        name: str,
        weights_are: str = "tokens",
    ) -> None:
        if weights_are not in BLEND_WEIGHTS:
            raise DynBatchValueError(
                f"weights_are={weights_are!r} must be one of {BLEND_WEIGHTS} (--blend-weights)."
            )
        if len(parts) != len(weights) or not parts:
            raise DynBatchValueError(
                f"a blend needs one weight per dataset; got {len(parts)} datasets and weights "
                f"{list(weights)}."
            )
        if any(not float(w) > 0 for w in weights):
            raise DynBatchValueError(
                f"blend weights {list(weights)} must all be positive (Megatron's BlendedDataset "
                "refuses others); drop the dataset or give it a weight > 0."
            )
        self.parts = list(parts)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.weights_are = weights_are
        draw = self.weights
        if weights_are == "tokens":
            # n_i samples of mean length m_i hold n_i * m_i tokens: draw n_i in proportion to
            # weight_i / m_i, and the tokens come in proportion to weight_i.
            draw = [w / part.mean_length for w, part in zip(self.weights, self.parts, strict=True)]
        self.draw_weights = [w / sum(draw) for w in draw]
        """The shares of the samples the greedy draws from each dataset."""
        self.split_index = split_index
        self.documents = _Name(name)
        self._dataset = numpy.zeros(0, dtype=numpy.int16)
        self._within = numpy.zeros(0, dtype=numpy.int64)

    def __len__(self) -> int:
        # One pass over every dataset's split: the minimum a split is sized to (Megatron asks
        # for at least what training consumes).
        return sum(len(part) for part in self.parts)

    def _ensure(self, size: int) -> None:
        if size <= self._dataset.shape[0]:
            return
        size = max(size, 2 * self._dataset.shape[0], _INITIAL_POSITIONS)
        dataset = blending_indices(self.draw_weights, size)
        # Position p's place within its dataset's stream: how many earlier positions drew it.
        within = numpy.zeros(size, dtype=numpy.int64)
        for index in range(len(self.parts)):
            chosen = numpy.flatnonzero(dataset == index)
            within[chosen] = numpy.arange(chosen.shape[0], dtype=numpy.int64)
        self._dataset, self._within = dataset, within

    def _where(self, position: int):
        position = int(position)
        if position < 0:
            raise IndexError(f"blend position {position} < 0")
        self._ensure(position + 1)
        return self.parts[int(self._dataset[position])], int(self._within[position])

    def lengths_at(self, positions: Sequence[int]) -> List[int]:
        """Sample lengths at ``positions`` (no token is read)."""
        lengths = []
        for position in positions:
            part, within = self._where(position)
            lengths.append(part.lengths_at([within])[0])
        return lengths

    def sample_at(self, position: int) -> Dict[str, torch.Tensor]:
        """The sample at ``position`` (as :meth:`SplitSamples.sample_at`)."""
        part, within = self._where(position)
        return part.sample_at(within)

    def _counts(self, num_positions: int) -> numpy.ndarray:
        self._ensure(num_positions)
        return numpy.bincount(self._dataset[:num_positions], minlength=len(self.parts))

    def shares(self, num_positions: int) -> List[float]:
        """Fraction of the first ``num_positions`` positions drawn from each dataset."""
        return [float(c) / max(num_positions, 1) for c in self._counts(num_positions)]

    def tokens_in_first(self, count: int) -> int:
        """Tokens of the samples at positions ``[0, count)`` (no token is read)."""
        return sum(
            part.tokens_in_first(int(drawn))
            for part, drawn in zip(self.parts, self._counts(int(count)), strict=True)
        )

    def token_shares(self, num_positions: int) -> List[float]:
        """Fraction of the tokens of the first ``num_positions`` positions from each dataset."""
        tokens = [
            part.tokens_in_first(int(count))
            for part, count in zip(self.parts, self._counts(num_positions), strict=True)
        ]
        return [t / max(sum(tokens), 1) for t in tokens]
