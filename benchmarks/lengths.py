"""Deterministic sample-length generators for the benchmarks: one seed, one list, on any machine.

Every generator takes a ``seed`` and uses its own ``random.Random`` (never the global one, never numpy),
so a benchmark figure can be reproduced from its seed alone. Families:

* :func:`lognormal_lengths`: long-tailed (most samples short, a few near the maximum), the shape of
  RL response lengths;
* :func:`bimodal_lengths`: a mix of short and long samples (e.g. math answers and long chains of
  thought);
* :func:`uniform_lengths`: flat, the easy case;
* :func:`grpo_lengths`: GRPO groups, ``n`` samples per prompt sharing a rollout id and a prompt,
  their response lengths correlated through a per-prompt difficulty;
* :func:`multi_turn_lengths`: agentic rollouts that emit a variable number of samples each.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import List, Optional

from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "LengthSet",
    "bimodal_lengths",
    "grpo_lengths",
    "lognormal_lengths",
    "multi_turn_lengths",
    "uniform_lengths",
]


@dataclass(frozen=True)
class LengthSet:
    """Samples with the rollout structure the planner and the baselines take."""

    lengths: List[int]
    """Total tokens of each sample (prompt + response)."""
    rollout_ids: Optional[List[int]]
    """Rollout (prompt group) of each sample; ``None`` = every sample its own rollout."""
    prompt_lengths: Optional[List[int]]
    """Prompt tokens of each sample; ``None`` when the family has no prompt structure."""


def _check(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DynBatchValueError(f"{name}={value!r} must be an integer >= {minimum}.")


def _check_range(min_len: int, max_len: int) -> None:
    _check("min_len", min_len, 1)
    _check("max_len", max_len, 1)
    if min_len > max_len:
        raise DynBatchValueError(f"min_len={min_len} is larger than max_len={max_len}; swap them.")


def _clip(value: float, min_len: int, max_len: int) -> int:
    return max(min_len, min(max_len, int(round(value))))


def lognormal_lengths(
    num_samples: int,
    *,
    median: int = 1024,
    sigma: float = 1.0,
    min_len: int = 16,
    max_len: int = 16384,
    seed: int = 0,
) -> List[int]:
    """Long-tailed lengths: log-normal around ``median``, clipped to ``[min_len, max_len]``.

    ``sigma=1`` puts about 16% of samples above ``e * median``: the tail that makes fixed
    micro-batch sizes waste most of their padding.
    """
    _check("num_samples", num_samples, 0)
    _check_range(min_len, max_len)
    rng = random.Random(seed)
    mu = math.log(median)
    return [_clip(rng.lognormvariate(mu, sigma), min_len, max_len) for _ in range(num_samples)]


def bimodal_lengths(
    num_samples: int,
    *,
    short_mean: int = 512,
    long_mean: int = 8192,
    long_fraction: float = 0.2,
    spread: float = 0.25,
    min_len: int = 16,
    max_len: int = 16384,
    seed: int = 0,
) -> List[int]:
    """A mix of short and long samples, each mode normal with std ``spread * mean``."""
    _check("num_samples", num_samples, 0)
    _check_range(min_len, max_len)
    if not 0.0 <= long_fraction <= 1.0:
        raise DynBatchValueError(f"long_fraction={long_fraction} must lie in [0, 1].")
    rng = random.Random(seed)
    lengths = []
    for _ in range(num_samples):
        mean = long_mean if rng.random() < long_fraction else short_mean
        lengths.append(_clip(rng.gauss(mean, spread * mean), min_len, max_len))
    return lengths


def uniform_lengths(
    num_samples: int, *, low: int = 128, high: int = 8192, seed: int = 0
) -> List[int]:
    """Lengths uniform on ``[low, high]`` (inclusive)."""
    _check("num_samples", num_samples, 0)
    _check_range(low, high)
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num_samples)]


def grpo_lengths(
    num_prompts: int,
    group_size: int = 8,
    *,
    prompt_median: int = 256,
    response_median: int = 1024,
    prompt_sigma: float = 0.5,
    difficulty_sigma: float = 0.8,
    sample_sigma: float = 0.5,
    max_len: int = 16384,
    seed: int = 0,
) -> LengthSet:
    """GRPO rollouts: ``group_size`` samples per prompt, one rollout id per prompt.

    The samples of a group share their prompt length, and their response lengths share a per-prompt
    log-normal "difficulty" factor (``difficulty_sigma``) times a per-sample factor
    (``sample_sigma``): the within-group correlation is ``d^2 / (d^2 + s^2)`` in log space (0.72
    with the defaults), so hard prompts produce groups of uniformly long samples. Samples of a group
    are contiguous, as rollout engines return them.
    """
    _check("num_prompts", num_prompts, 0)
    _check("group_size", group_size, 1)
    _check("max_len", max_len, 2)
    rng = random.Random(seed)
    lengths: List[int] = []
    rollout_ids: List[int] = []
    prompt_lengths: List[int] = []
    for prompt in range(num_prompts):
        prompt_len = _clip(
            rng.lognormvariate(math.log(prompt_median), prompt_sigma), 1, max_len - 1
        )
        difficulty = rng.lognormvariate(0.0, difficulty_sigma)
        for _ in range(group_size):
            response = rng.lognormvariate(math.log(response_median * difficulty), sample_sigma)
            response_len = _clip(response, 1, max_len - prompt_len)
            lengths.append(prompt_len + response_len)
            rollout_ids.append(prompt)
            prompt_lengths.append(prompt_len)
    return LengthSet(lengths, rollout_ids, prompt_lengths)


def multi_turn_lengths(
    num_rollouts: int,
    *,
    mean_turns: float = 3.0,
    max_turns: int = 12,
    first_prompt_median: int = 512,
    turn_median: int = 768,
    turn_sigma: float = 0.7,
    max_len: int = 32768,
    seed: int = 0,
) -> LengthSet:
    """Agentic multi-turn rollouts, each emitting one training sample per turn.

    The number of turns is geometric with mean ``mean_turns`` (capped at ``max_turns``). Turn ``t``'s
    sample holds the whole context so far (its prompt is everything before the turn's response), so
    later samples of a rollout are longer: the shape that per-rollout step grouping has to absorb.
    """
    _check("num_rollouts", num_rollouts, 0)
    _check("max_turns", max_turns, 1)
    _check("max_len", max_len, 2)
    if mean_turns < 1.0:
        raise DynBatchValueError(
            f"mean_turns={mean_turns} must be >= 1 (every rollout has a turn)."
        )
    rng = random.Random(seed)
    stop = 1.0 / mean_turns  # geometric: each turn ends the rollout with this probability
    lengths: List[int] = []
    rollout_ids: List[int] = []
    prompt_lengths: List[int] = []
    for rollout in range(num_rollouts):
        context = _clip(rng.lognormvariate(math.log(first_prompt_median), 0.5), 1, max_len - 1)
        for _ in range(max_turns):
            response = _clip(
                rng.lognormvariate(math.log(turn_median), turn_sigma), 1, max_len - context
            )
            lengths.append(context + response)
            rollout_ids.append(rollout)
            prompt_lengths.append(context)
            context += response
            if rng.random() < stop or context >= max_len - 1:
                break
    return LengthSet(lengths, rollout_ids, prompt_lengths)
