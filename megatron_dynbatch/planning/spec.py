"""Inputs of the planner: the parallel layout, the token budget and the cost model.

Every field is validated in ``__post_init__`` with a ``ValueError`` that names the value and the fix,
so a bad configuration fails before any rank starts planning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "CostModel",
    "ParallelLayout",
    "PlannerConfig",
    "LAYOUTS",
    "sample_multiple",
    "round_up",
    "ceil_div",
]

#: Micro-batch layouts. ``packed``: micro_batch_size 1, samples concatenated in one row of the step's
#: uniform length. ``padded``: ``micro_batch_size`` rows of the step's uniform ``seq_length``.
LAYOUTS = ("packed", "padded")


def _check_int(name: str, value, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; {fix}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}; {fix}")


def ceil_div(numerator: int, denominator: int) -> int:
    """Integer ceiling of ``numerator / denominator`` for positive denominators."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return ceil_div(value, multiple) * multiple


def sample_multiple(tp_size: int, cp_size: int) -> int:
    """The multiple every sample's length is padded to inside a packed row.

    Context parallelism splits each sequence into ``2 * cp`` chunks (load-balanced causal CP), and
    sequence parallelism then splits every chunk over the ``tp`` ranks, so with CP a sample must be a
    multiple of ``tp * cp * 2``; without CP only the row must split over TP, which a per-sample multiple
    of ``tp`` guarantees. Example: tp=2, cp=4 -> 16; tp=4, cp=1 -> 4; tp=1, cp=1 -> 1.
    """
    return tp_size * cp_size * 2 if cp_size > 1 else tp_size


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The Megatron parallel layout the schedule must fit."""

    dp_size: int = 1
    """Data-parallel ranks; every one of them runs the same number of micro-batches per step."""
    pp_size: int = 1
    """Pipeline stages."""
    vpp_size: int = 1
    """Virtual pipeline chunks per stage; > 1 selects Megatron's interleaved schedule."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Megatron's interleaving group; ``None`` means Megatron's default, ``pp_size``."""
    tp_size: int = 1
    """Tensor-parallel size (sequence parallelism pads each packed sample to a multiple of it)."""
    cp_size: int = 1
    """Context-parallel size (the per-GPU budget covers 1/cp of a sequence)."""

    def __post_init__(self) -> None:
        for name in ("dp_size", "pp_size", "vpp_size", "tp_size", "cp_size"):
            _check_int(name, getattr(self, name), 1, f"pass --{name.replace('_', '-')} 1 or more.")
        if self.vpp_size > 1 and self.pp_size < 2:
            raise ValueError(
                f"vpp_size={self.vpp_size} needs pp_size >= 2 (interleaving splits pipeline stages), "
                f"got pp_size={self.pp_size}; set --vpp-size 1 or raise --pp-size."
            )
        group = self.microbatch_group_size_per_vp_stage
        if group is not None:
            _check_int(
                "microbatch_group_size_per_vp_stage",
                group,
                1,
                "omit it to use Megatron's default (pp_size).",
            )
            if group < self.pp_size:
                raise ValueError(
                    f"microbatch_group_size_per_vp_stage={group} is smaller than pp_size={self.pp_size}; "
                    f"Megatron's interleaved schedule rejects that. Use a value >= {self.pp_size} or omit "
                    f"--microbatch-group-size-per-vp-stage."
                )

    @property
    def group_size(self) -> int:
        """The interleaving group (Megatron's default is pp_size)."""
        return self.microbatch_group_size_per_vp_stage or self.pp_size

    @property
    def microbatch_multiple(self) -> int:
        """What every rank's micro-batch count must be a multiple of for Megatron's schedule.

        Without interleaving any count >= 1 works. The interleaved schedule walks micro-batches in
        groups of ``microbatch_group_size_per_vp_stage``, so the count must be a multiple of it.
        """
        return self.group_size if self.vpp_size > 1 else 1

    @property
    def sample_multiple(self) -> int:
        return sample_multiple(self.tp_size, self.cp_size)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-sample compute cost ``token_weight*L + attention_weight*L**2 + response_weight*R``.

    ``L`` is the sample's total length and ``R`` its response length (``L - prompt_length``; ``L``
    when no prompt length is known). The default is plain tokens. Attention-heavy long-context steps
    set ``attention_weight`` to about ``1 / (6 * hidden_size)``-ish relative to the token term; the
    response term models work done only on response tokens (log-prob gather, value head, loss).
    """

    token_weight: float = 1.0
    """Weight of the linear (MLP, projections) term."""
    attention_weight: float = 0.0
    """Weight of the quadratic (self-attention) term."""
    response_weight: float = 0.0
    """Weight of the response-token term."""

    def __post_init__(self) -> None:
        for name in ("token_weight", "attention_weight", "response_weight"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ValueError(f"cost model {name}={value!r} must be a finite number >= 0.")
            if value < 0:
                raise ValueError(f"cost model {name}={value} must be >= 0.")
        if self.token_weight == 0 and self.attention_weight == 0 and self.response_weight == 0:
            raise ValueError("cost model weights are all 0; set at least token_weight > 0.")

    def cost(self, length: int, response_length: int) -> float:
        return (
            self.token_weight * length
            + self.attention_weight * float(length) * float(length)
            + self.response_weight * response_length
        )


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Everything the pure planner needs besides the sample lengths."""

    max_tokens_per_gpu: int
    """Hard cap on the padded token footprint of one micro-batch on one GPU (times cp_size)."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    """The Megatron parallel layout."""
    rollouts_per_step: Optional[int] = None
    """Rollouts (prompt groups) per optimizer step; ``None`` puts every rollout in one step."""
    layout: str = "packed"
    """``packed`` (one row of concatenated samples) or ``padded`` ([B, S] rows)."""
    cost: CostModel = field(default_factory=CostModel)
    """Cost model used to balance DP ranks and order micro-batches."""

    def __post_init__(self) -> None:
        _check_int(
            "max_tokens_per_gpu",
            self.max_tokens_per_gpu,
            1,
            "pass --max-tokens-per-gpu with the token budget of one micro-batch.",
        )
        if self.rollouts_per_step is not None:
            _check_int(
                "rollouts_per_step",
                self.rollouts_per_step,
                1,
                "omit --rollouts-per-step to train every rollout in one step.",
            )
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"layout={self.layout!r} is not one of {LAYOUTS}; use --layout packed or padded."
            )
        if not isinstance(self.parallel, ParallelLayout):
            raise ValueError(f"parallel={self.parallel!r} must be a ParallelLayout.")
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"cost={self.cost!r} must be a CostModel.")
        multiple = self.parallel.sample_multiple
        if self.token_cap < multiple:
            raise ValueError(
                f"max_tokens_per_gpu={self.max_tokens_per_gpu} (x cp_size={self.parallel.cp_size}) is "
                f"smaller than one padded sample: every sample is padded to a multiple of {multiple} "
                f"(tp_size={self.parallel.tp_size}, cp_size={self.parallel.cp_size}); raise "
                f"--max-tokens-per-gpu to at least {-(-multiple // self.parallel.cp_size)}."
            )

    @property
    def token_cap(self) -> int:
        """Cap on one micro-batch's padded footprint: the per-GPU budget times cp (CP splits it)."""
        return self.max_tokens_per_gpu * self.parallel.cp_size
