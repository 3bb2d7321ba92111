"""Validated per-sample inputs of the planner: lengths, rollout ids and prompt lengths.

Also parses the public ``SAMPLES.json`` format shared by ``plan`` and ``verify``: a JSON array whose
elements are either an integer (a sample's total length, its own rollout) or an object
``{"length": int, "rollout": str|int, "prompt_length": int}`` (rollout and prompt_length optional).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, List, Optional, Sequence, Tuple

__all__ = ["SampleSet", "parse_samples_json", "rollout_key"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def rollout_key(value: Any, index: int) -> Hashable:
    """A hashable key for a rollout id; ``None`` gives the sample a rollout of its own.

    Keys carry the id's type so that the string ``"1"`` and the integer ``1`` stay different
    rollouts, as they are different JSON values; implicit rollouts can never collide with user ids.
    """
    if value is None:
        return ("implicit", index)
    if _is_int(value):
        return ("int", value)
    if isinstance(value, str):
        return ("str", value)
    raise ValueError(
        f"sample {index}: rollout id {value!r} has type {type(value).__name__}; rollout ids must be "
        f"str or int (or omitted, giving the sample a rollout of its own)."
    )


@dataclass(frozen=True)
class SampleSet:
    """Per-sample inputs after validation.

    Rollout ids may be given as any str/int values; samples of one rollout (one GRPO prompt group or
    one multi-turn trajectory) need not be contiguous: they are grouped by id, and rollouts are
    ordered by the first appearance of their id.
    """

    lengths: Tuple[int, ...]
    rollout_keys: Tuple[Hashable, ...]
    rollout_ids: Tuple[Any, ...]
    """The ids as given (``None`` where the sample has a rollout of its own)."""
    prompt_lengths: Tuple[int, ...]
    """0 where unknown."""

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        rollout_ids: Optional[Sequence[Any]] = None,
        prompt_lengths: Optional[Sequence[Optional[int]]] = None,
    ) -> "SampleSet":
        if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
            raise ValueError(
                f"lengths must be a sequence of positive integers, got {type(lengths).__name__}."
            )
        lengths = list(lengths)
        if not lengths:
            raise ValueError("no samples: lengths is empty; pass at least one sample length.")
        bad = [(i, v) for i, v in enumerate(lengths) if not _is_int(v) or v <= 0]
        if bad:
            shown = ", ".join(f"sample {i}: {v!r}" for i, v in bad[:5])
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise ValueError(
                f"sample lengths must be integers >= 1; got {shown}{more}. Drop empty samples before "
                f"planning, and pass token counts, not fractions."
            )
        n = len(lengths)
        if rollout_ids is None:
            rollout_ids = [None] * n
        else:
            rollout_ids = list(rollout_ids)
            if len(rollout_ids) != n:
                raise ValueError(
                    f"got {len(rollout_ids)} rollout ids for {n} sample lengths; pass exactly one rollout "
                    f"id per sample (or none at all)."
                )
        keys = tuple(rollout_key(r, i) for i, r in enumerate(rollout_ids))
        if prompt_lengths is None:
            prompts = [0] * n
        else:
            prompts = list(prompt_lengths)
            if len(prompts) != n:
                raise ValueError(
                    f"got {len(prompts)} prompt lengths for {n} sample lengths; pass one per sample."
                )
            for i, (p, total) in enumerate(zip(prompts, lengths, strict=True)):
                if p is None:
                    prompts[i] = 0
                    continue
                if not _is_int(p) or p < 0:
                    raise ValueError(f"sample {i}: prompt_length={p!r} must be an integer >= 0.")
                if p > total:
                    raise ValueError(
                        f"sample {i}: prompt_length={p} is greater than its total length={total}; the "
                        f"length must count prompt and response tokens together."
                    )
        return cls(
            lengths=tuple(lengths),
            rollout_keys=keys,
            rollout_ids=tuple(rollout_ids),
            prompt_lengths=tuple(prompts),
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def rollouts(self) -> List[Tuple[Any, List[int]]]:
        """``[(rollout id, [sample indices])]`` in order of each rollout's first appearance."""
        groups: dict = {}
        order: List[Hashable] = []
        for index, key in enumerate(self.rollout_keys):
            members = groups.get(key)
            if members is None:
                groups[key] = members = []
                order.append(key)
            members.append(index)
        return [(self.rollout_ids[groups[key][0]], groups[key]) for key in order]


def parse_samples_json(data: Any) -> SampleSet:
    """Validate the decoded ``SAMPLES.json`` array and build a :class:`SampleSet`."""
    if not isinstance(data, list):
        raise ValueError(
            f"SAMPLES.json must hold a JSON array of lengths or objects, got {type(data).__name__}."
        )
    lengths: List[Any] = []
    rollouts: List[Any] = []
    prompts: List[Optional[int]] = []
    for index, item in enumerate(data):
        if isinstance(item, dict):
            unknown = set(item) - {"length", "rollout", "prompt_length"}
            if unknown:
                raise ValueError(
                    f"sample {index}: unknown key(s) {sorted(unknown)}; allowed: length, rollout, "
                    f"prompt_length."
                )
            if "length" not in item:
                raise ValueError(f"sample {index}: object {item!r} has no 'length'.")
            lengths.append(item["length"])
            rollouts.append(item.get("rollout"))
            prompts.append(item.get("prompt_length"))
        else:
            lengths.append(item)
            rollouts.append(None)
            prompts.append(None)
    return SampleSet.build(lengths, rollouts, prompts)
