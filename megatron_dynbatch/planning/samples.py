"""Validated per-sample inputs of the planner: lengths, rollout ids and prompt lengths.

Also parses the public ``SAMPLES.json`` format shared by ``plan`` and ``verify``: a JSON array whose
elements are either an integer (a sample's total length, its own rollout) or an object
``{"length": int, "rollout": str|int, "prompt_length": int}`` (rollout and prompt_length optional).
"""

from __future__ import annotations

import itertools
import operator
import reprlib
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Hashable, List, Mapping, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError

from .spec import MAX_TOKENS, as_int

__all__ = ["SampleSet", "as_sequence", "parse_samples_json", "rollout_key"]

# Values in error messages: a deeply nested or huge input must not explode the message.
_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxstring, _short.maxother = 2, 4, 40, 40


def rollout_key(value: Any, index: int) -> Hashable:
    """A hashable key for a rollout id; ``None`` gives the sample a rollout of its own.

    Keys carry the id's type so that the string ``"1"`` and the integer ``1`` stay different
    rollouts, as they are different JSON values; implicit rollouts can never collide with user ids.
    Integers of any integer type (numpy, torch) are the same id as the plain int.
    """
    if value is None:
        return ("implicit", index)
    if isinstance(value, str):
        return ("str", value)
    number = as_int(value)
    if number is not None:
        return ("int", number)
    raise DynBatchValueError(
        f"sample {index}: rollout id {_short.repr(value)} has type {type(value).__name__}; "
        "rollout ids must be str or int (or omitted, giving the sample a rollout of its own)."
    )


def as_sequence(name: str, values: Any, what: str) -> List[Any]:
    """``values`` as a list, refusing what only looks like a sequence of samples: a str, a dict,
    a set (no sample order), a generator (no length), a 0-d tensor or array (no elements)."""
    refused = isinstance(values, (str, bytes, Mapping, AbstractSet))
    if not refused and hasattr(values, "__len__"):
        try:
            return list(values)
        except TypeError:  # len() of a 0-d tensor / array raises
            pass
    raise DynBatchValueError(
        f"{name} must be a sequence of {what} (a list or tuple), got "
        f"{type(values).__name__} {_short.repr(values)}."
    )


def _lengths(values: Sequence[Any]) -> List[int]:
    """Checked lengths as plain ints (numpy / torch integers accepted)."""
    if set(map(type, values)) == {int}:
        if min(values) >= 1 and max(values) <= MAX_TOKENS:
            return list(values)
        numbers: List[Optional[int]] = list(values)
    else:
        numbers = [as_int(v) for v in values]
    bad = [
        (i, v) for i, (v, n) in enumerate(zip(values, numbers, strict=True)) if n is None or n < 1
    ]
    if bad:
        shown = ", ".join(f"sample {i}: {_short.repr(v)}" for i, v in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise DynBatchValueError(
            f"sample lengths must be integers >= 1; got {shown}{more}. Drop empty samples before "
            f"planning, and pass token counts as integers (1000, not 1e3, 1000.0 or a fraction)."
        )
    huge = [(i, n) for i, n in enumerate(numbers) if n > MAX_TOKENS]
    if huge:
        i, n = huge[0]
        raise DynBatchValueError(
            f"sample {i}: length {n} is above the supported maximum of {MAX_TOKENS} tokens (2**40); "
            "pass token counts (a corrupt length?)."
        )
    return numbers  # type: ignore[return-value]


def _check_prompts(prompts: List[Any], lengths: Sequence[int]) -> None:
    """Check prompt lengths in place: ``None`` -> 0, integers of any type -> int, <= length."""
    for i, (p, total) in enumerate(zip(prompts, lengths, strict=True)):
        if p is None:
            prompts[i] = 0
            continue
        number = as_int(p)
        if number is None or number < 0:
            raise DynBatchValueError(
                f"sample {i}: prompt_length={_short.repr(p)} must be an integer >= 0."
            )
        if number > total:
            raise DynBatchValueError(
                f"sample {i}: prompt_length={number} is greater than its total length={total}; "
                "the length must count prompt and response tokens together."
            )
        prompts[i] = number


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
        values = as_sequence("lengths", lengths, "positive integers")
        if not values:
            raise DynBatchValueError(
                "no samples: lengths is empty; pass at least one sample length."
            )
        checked = _lengths(values)
        n = len(checked)
        if rollout_ids is None:
            ids: List[Any] = [None] * n
            # No user ids to collide with: each sample's index is its own rollout's key.
            keys: Tuple[Hashable, ...] = tuple(range(n))
        else:
            ids = as_sequence("rollout_ids", rollout_ids, "str or int ids, one per sample")
            if len(ids) != n:
                raise DynBatchValueError(
                    f"got {len(ids)} rollout ids for {n} sample lengths; pass exactly one rollout "
                    f"id per sample (or none at all)."
                )
            if set(map(type, ids)) in ({int}, {str}):
                # One type of id: the ids themselves are distinct keys (1M samples in ~10 ms).
                keys = tuple(ids)
            else:
                keys = tuple(rollout_key(r, i) for i, r in enumerate(ids))
        if prompt_lengths is None:
            prompts = [0] * n
        else:
            prompts = as_sequence("prompt_lengths", prompt_lengths, "integers >= 0")
            if len(prompts) != n:
                raise DynBatchValueError(
                    f"got {len(prompts)} prompt lengths for {n} sample lengths; pass one per sample."
                )
            if (
                set(map(type, prompts)) == {int}
                and min(prompts) >= 0
                and not any(map(operator.gt, prompts, checked))
            ):
                prompts = list(prompts)  # plain ints within their samples: nothing to convert
            else:
                _check_prompts(prompts, checked)
        return cls(
            lengths=tuple(checked),
            rollout_keys=keys,
            rollout_ids=tuple(ids),
            prompt_lengths=tuple(prompts),
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def rollouts(self) -> List[Tuple[Any, List[int]]]:
        """``[(rollout id, [sample indices])]`` in order of each rollout's first appearance."""
        keys = self.rollout_keys
        n = len(keys)
        # Rollout engines return a rollout's samples together: where every id is one run of
        # neighbours, the runs are the rollouts (C loops, no per-sample Python work).
        starts = [0] + list(itertools.compress(range(1, n), map(operator.ne, keys[1:], keys)))
        if n and len(starts) == len(set(keys)):
            ids = self.rollout_ids
            return [
                (ids[start], list(range(start, end)))
                for start, end in zip(starts, starts[1:] + [n], strict=True)
            ]
        groups: dict = {}
        for index, key in enumerate(keys):
            members = groups.get(key)
            if members is None:
                groups[key] = [index]
            else:
                members.append(index)
        return [(self.rollout_ids[members[0]], members) for members in groups.values()]

    def steps(self, rollouts_per_step: Optional[int]) -> List[Tuple[int, List[int]]]:
        """``[(rollouts in the step, sorted sample indices)]``: whole rollouts, in order.

        Every step takes the next ``rollouts_per_step`` rollouts (all of them when ``None``); a
        short last step is kept, never dropped.
        """
        if rollouts_per_step is None:
            # One step of everything: only the rollout count is needed, not the grouping.
            return [(len(set(self.rollout_keys)), list(range(len(self.lengths))))]
        count = len(set(self.rollout_keys))
        if 0 < count <= rollouts_per_step:
            # One step holds every rollout (slime plans one step a call): the same, no grouping.
            return [(count, list(range(len(self.lengths))))]
        rollouts = self.rollouts()
        per_step = rollouts_per_step
        result = []
        for start in range(0, len(rollouts), per_step):
            chunk = rollouts[start : start + per_step]
            merged = itertools.chain.from_iterable(members for _, members in chunk)
            result.append((len(chunk), sorted(merged)))
        return result


def _length_and_prompt(index: int, item: dict) -> Tuple[Any, Any]:
    """``length`` and ``prompt_length`` of one sample object; ``response_length`` may stand in
    for either (``length = prompt_length + response_length``), and must agree when all three are
    given."""
    length, prompt = item.get("length"), item.get("prompt_length")
    response = item.get("response_length")
    if response is None:
        if length is None:
            raise DynBatchValueError(f"sample {index}: object {_short.repr(item)} has no 'length'.")
        return length, prompt  # SampleSet.build checks both
    # Arithmetic on the three needs integers first.
    for name, value in (
        ("response_length", response),
        ("length", length),
        ("prompt_length", prompt),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise DynBatchValueError(
                f"sample {index}: {name}={_short.repr(value)} must be an integer >= 0 (a token "
                "count)."
            )
    if length is None:
        if prompt is None:
            raise DynBatchValueError(
                f"sample {index}: object {_short.repr(item)} has no 'length'; give length, or "
                "prompt_length and response_length."
            )
        return prompt + response, prompt
    if prompt is None:
        if response > length:
            raise DynBatchValueError(
                f"sample {index}: response_length={response} is greater than its total "
                f"length={length}; the length must count prompt and response tokens together."
            )
        return length, length - response
    if prompt + response != length:
        raise DynBatchValueError(
            f"sample {index}: prompt_length={prompt} + response_length={response} != "
            f"length={length}; give them consistently, or only two of the three."
        )
    return length, prompt


def parse_samples_json(data: Any) -> SampleSet:
    """Validate the decoded ``SAMPLES.json`` array and build a :class:`SampleSet`."""
    if not isinstance(data, list):
        raise DynBatchValueError(
            f"SAMPLES.json must hold a JSON array of lengths or objects, got {type(data).__name__}."
        )
    lengths: List[Any] = []
    rollouts: List[Any] = []
    prompts: List[Optional[int]] = []
    for index, item in enumerate(data):
        if isinstance(item, dict):
            unknown = set(item) - {"length", "rollout", "prompt_length", "response_length"}
            if unknown:
                raise DynBatchValueError(
                    f"sample {index}: unknown key(s) {sorted(unknown)}; allowed: length, rollout, "
                    f"prompt_length, response_length."
                )
            length, prompt = _length_and_prompt(index, item)
            lengths.append(length)
            rollouts.append(item.get("rollout"))
            prompts.append(prompt)
        else:
            lengths.append(item)
            rollouts.append(None)
            prompts.append(None)
    return SampleSet.build(lengths, rollouts, prompts)
