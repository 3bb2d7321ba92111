"""Inputs of the planner: the parallel layout, the token budget and the cost model.

Every field is validated in ``__post_init__`` with a ``ValueError`` that names the value and the fix,
so a bad configuration fails before any rank starts planning.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "CostModel",
    "ParallelLayout",
    "PlannerConfig",
    "LAYOUTS",
    "MAX_TOKENS",
    "OVERSIZE_POLICIES",
    "as_int",
    "check_int",
    "sample_multiple",
    "round_up",
    "ceil_div",
]

#: Micro-batch layouts. ``packed``: micro_batch_size 1, samples concatenated in one row of the step's
#: uniform length. ``padded``: ``micro_batch_size`` rows of the step's uniform ``seq_length``.
LAYOUTS = ("packed", "padded")

#: What happens to a sample longer than the token cap: ``error`` refuses the batch, ``truncate``
#: cuts it to the cap, ``allow`` runs it alone in its micro-batch, over the cap.
OVERSIZE_POLICIES = ("error", "truncate", "allow")

#: Largest sample length and token cap accepted (2**40, about 1.1e12 tokens): far beyond any
#: context window, and small enough that a cost of ``L**2`` stays exact in a float's range.
MAX_TOKENS = 1 << 40


def as_int(value: Any) -> Optional[int]:
    """``value`` as a plain int if it is an integer (numpy / torch integers included), else None.

    Anything with ``__index__`` counts (``operator.index``), except ``bool``: ``True`` is an int to
    Python but never a token count.
    """
    if isinstance(value, bool):
        return None
    if type(value) is int:
        return value
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(name: str, value, minimum: int, fix: str, maximum: Optional[int] = None) -> int:
    """The one integer check of the package: ``value`` as a plain int, or a ``ValueError``.

    Accepts Python, numpy and torch integers (:func:`as_int`); rejects bools, floats and strings
    instead of truncating or parsing them (``int(6.9) == 6``). ``fix`` tells the user what to
    change and ends the message.
    """
    number = as_int(value)
    if number is None:
        raise DynBatchValueError(
            f"{name}={value!r} ({type(value).__name__}) must be an integer >= {minimum}; {fix}"
        )
    if number < minimum:
        raise DynBatchValueError(f"{name}={number} must be >= {minimum}; {fix}")
    if maximum is not None and number > maximum:
        raise DynBatchValueError(f"{name}={number} is above the supported maximum {maximum}; {fix}")
    return number


def _set_int(obj: Any, name: str, minimum: int, fix: str, maximum: Optional[int] = None) -> None:
    """Check an integer field of a frozen dataclass and store it as a plain int."""
    object.__setattr__(
        obj, name, check_int(name, getattr(obj, name), minimum, fix, maximum=maximum)
    )


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
            _set_int(self, name, 1, f"pass --{name.replace('_', '-')} 1 or more.")
        if self.vpp_size > 1 and self.pp_size < 2:
            raise ValueError(
                f"vpp_size={self.vpp_size} needs pp_size >= 2 (interleaving splits pipeline stages), "
                f"got pp_size={self.pp_size}; set --vpp-size 1 or raise --pp-size."
            )
        group = self.microbatch_group_size_per_vp_stage
        if group is not None:
            group = check_int(
                "microbatch_group_size_per_vp_stage",
                group,
                1,
                "omit it to use Megatron's default (pp_size).",
            )
            object.__setattr__(self, "microbatch_group_size_per_vp_stage", group)
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
    """Weights of the compute cost of a micro-batch (the formula: :mod:`.cost`).

    One forward of a micro-batch of shape ``[B, S]`` costs ``token_weight * B * S`` (linear work
    on every position, padding included) + ``attention_weight`` x the squared length of every
    attention segment + ``response_weight`` x its samples' response tokens + ``microbatch_overhead``.
    The default is plain tokens. Attention-heavy long-context steps set ``attention_weight`` to about
    ``1 / (6 * hidden_size)`` of the token weight (attention's ``2*h*L**2`` FLOPs against the
    linear layers' ``12*h**2*L``).
    """

    token_weight: float = 1.0
    """Weight of the linear (MLP, projections) work of one position of a row."""
    attention_weight: float = 0.0
    """Weight of the quadratic (self-attention) term of one attention segment."""
    response_weight: float = 0.0
    """Weight of one response token (log-prob gather, value head, loss)."""
    microbatch_overhead: float = 0.0
    """Fixed cost of running one micro-batch (launches, pipeline send/receive), in the units of
    the other terms, placeholders included. Above 0 it keeps the planner from trading a pipeline
    bubble for many short rows whose fixed costs the rest of the model does not show."""

    def __post_init__(self) -> None:
        for name in ("token_weight", "attention_weight", "response_weight", "microbatch_overhead"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(float(value))
            ):
                raise ValueError(f"cost model {name}={value!r} must be a finite number >= 0.")
            if value < 0:
                raise ValueError(f"cost model {name}={value} must be >= 0.")
            object.__setattr__(self, name, float(value))
        if self.token_weight == 0 and self.attention_weight == 0 and self.response_weight == 0:
            raise ValueError("cost model weights are all 0; set at least token_weight > 0.")

    def cost(self, length: int, response_length: int) -> float:
        """Work of one sample's own tokens: ``token_weight*L + attention_weight*L**2 +
        response_weight*R`` (a micro-batch's cost adds its row's padding: :mod:`.cost`)."""
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
    """Cost model the planner minimises the simulated step time of."""
    oversize_samples: str = "allow"
    """A sample longer than the cap: ``allow`` runs it alone over the cap (warned, and every
    micro-batch of its step gets its length), ``truncate`` cuts it to the cap, ``error`` refuses."""

    def __post_init__(self) -> None:
        _set_int(
            self,
            "max_tokens_per_gpu",
            1,
            "pass --max-tokens-per-gpu with the token budget of one micro-batch.",
            maximum=MAX_TOKENS,
        )
        if self.rollouts_per_step is not None:
            _set_int(
                self,
                "rollouts_per_step",
                1,
                "omit --rollouts-per-step to train every rollout in one step.",
            )
        if self.oversize_samples not in OVERSIZE_POLICIES:
            raise ValueError(
                f"oversize_samples={self.oversize_samples!r} is not one of {OVERSIZE_POLICIES}; "
                "pass --oversize-samples error, truncate or allow."
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
                f"--max-tokens-per-gpu to at least {ceil_div(multiple, self.parallel.cp_size)}."
            )

    @property
    def token_cap(self) -> int:
        """Cap on one micro-batch's padded footprint: the per-GPU budget times cp (CP splits it)."""
        return self.max_tokens_per_gpu * self.parallel.cp_size
