"""Inputs of the planner: the parallel layout, the token budget and the cost model.

Every field is validated in ``__post_init__`` with a ``ValueError`` that names the value and the fix,
so a bad configuration fails before any rank starts planning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Literal, Mapping, Optional, Tuple

from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "CostModel",
    "ParallelLayout",
    "PlannerConfig",
    "ATTENTION_CROSSOVER_7B",
    "ATTENTION_KINDS",
    "ASSUMED_OVERHEAD_CHECKS",
    "DEFAULT_MIN_GAIN",
    "PEER_TOLERANCE",
    "DEFAULT_PLANNER",
    "THOROUGH_PLANNER",
    "OWN_PLANNERS",
    "DEFAULT_OVERHEAD_FRACTION",
    "LAYOUT_FLAGS",
    "LAYOUTS",
    "MAX_TOKENS",
    "OVERSIZE_POLICIES",
    "as_int",
    "check_int",
    "sample_multiple",
    "round_up",
    "ceil_div",
    "layout_flags",
    "setting_flags",
    "without_field_hints",
]

#: Micro-batch layouts. ``packed``: samples concatenated in rows of the step's uniform length, one
#: row a micro-batch, or B where attention pays ``S**2`` a row (``StepPlan.packed_rows``).
#: ``padded``: ``micro_batch_size`` rows of the step's uniform ``seq_length``, one sample a row.
LAYOUTS = ("packed", "padded")

#: What the attention kernel computes for a row of length ``S`` (see :mod:`.cost`):
#: ``segment``: every segment (sample, and the row's padding tail in short segments) on its own,
#: ``sum(len**2)``:
#: transformer-engine THD / flash-attention varlen; ``causal``: the whole row as one causal
#: sequence, ``S**2`` whatever it holds (a causal kernel without segment boundaries);
#: ``dense``: the full ``S x S`` score matrix of a masked softmax (Megatron's ``local`` unfused
#: attention with an explicit mask), ``2 * S**2``: twice a causal kernel's triangle.
ATTENTION_KINDS = ("segment", "causal", "dense")

#: ``L**2`` work per ``L`` work of a dense transformer of hidden size 4,096 (a 7B model), the cost
#: model used where none is calibrated (slime without model dimensions, the benchmarks) and verl's
#: workload weight: causal attention's ``2*h*L**2`` FLOPs meet the linear layers' ``12*h**2*L`` at
#: ``L = 6*h = 24576`` tokens.
ATTENTION_CROSSOVER_7B = 24576

#: The registered planner (:mod:`.registry`) a :class:`PlannerConfig` plans with unless told
#: otherwise: this package's planner, :func:`.planner.plan_samples`.
DEFAULT_PLANNER = "dynbatch"
#: The same planner spending several times the planning CPU for a step simulated about 1% faster
#: under a pipeline (clustered ranks on steps of more than 256 samples, refined tents, a larger
#: refinement budget: issue 45);
#: for steps long enough, or planned off the critical path, for that to pay.
THOROUGH_PLANNER = "dynbatch-thorough"
#: This package's planners (forward-only passes plan the same way under either).
OWN_PLANNERS = (DEFAULT_PLANNER, THOROUGH_PLANNER)

#: The per-micro-batch overhead assumed when none is given, as a fraction of the cost of one full
#: row at the token cap. Kernel launches, pipeline p2p latency and Python cost 1-5% of a full row
#: on the runs we measured; 2% keeps the planner from splitting a step for a gain the real
#: overhead would eat, without hiding the bubble savings of a deep pipeline.
DEFAULT_OVERHEAD_FRACTION = 0.02

#: When the overhead is assumed (not calibrated), a candidate with more micro-batches per rank must
#: be predicted faster by at least this fraction to be chosen over one with fewer.
DEFAULT_MIN_GAIN = 0.03

#: Where the overhead is assumed, the real one may lie anywhere from none to 5% of a full row (the
#: range above). On a step of up to 1,024 samples the plan is checked at these fractions against
#: the trainers' own schedules (:func:`.candidates.peer_schedules`: first fit as slime runs it,
#: differencing as verl does) and is never more than :data:`PEER_TOLERANCE` slower than the best
#: of them at any of them: on a tiny pipelined step the best micro-batch count moves with the
#: overhead (3 samples on one rank at pp 2: two micro-batches 26% faster than one with no
#: overhead, 4% slower at 5%), and a guess must not lose to the trainer's own plan. A told or
#: calibrated overhead is trusted and not checked.
ASSUMED_OVERHEAD_CHECKS = (0.0, 0.01, 0.02, 0.035, 0.05)
#: ... within this fraction of the best peer's step at every one of them.
PEER_TOLERANCE = 0.005

#: What happens to a sample longer than the token cap: ``error`` refuses the batch, ``truncate``
#: cuts it to the cap, ``allow`` runs it alone in its micro-batch, over the cap.
OVERSIZE_POLICIES = ("error", "truncate", "allow")

#: Largest sample length and token cap accepted (2**40, about 1.1e12 tokens): far beyond any
#: context window, and small enough that a cost of ``L**2`` stays exact in a float's range.
MAX_TOKENS = 1 << 40


def memory_only_budget(cp_size: int) -> int:
    """``max_tokens_per_gpu`` of a run given only a memory budget: no token cap of its own, the
    planner's cap is the longest row the memory budget allows (:attr:`PlannerConfig.token_cap`).
    The one value training and ``plan`` set, and :attr:`PlannerConfig.cap_source` recognises."""
    return MAX_TOKENS // cp_size


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
        number = operator.index(value)
    except TypeError:
        return None
    # torch's __index__ also takes a bool tensor and a one-element vector (numpy's refuses both):
    # a tensor counts only as one value of an integer dtype.
    dim = getattr(value, "dim", None)
    if callable(dim) and (dim() != 0 or str(value.dtype) == "torch.bool"):
        return None
    return number


def check_int(name: str, value, minimum: int, fix: str, maximum: Optional[int] = None) -> int:
    """The one integer check of the package: ``value`` as a plain int, or a ``ValueError``.

    Accepts Python, numpy and torch integers (:func:`as_int`); rejects bools, floats and strings
    instead of truncating or parsing them (``int(6.9) == 6``). ``fix`` tells the user what to
    change and ends the message.
    """
    if isinstance(value, bool):
        raise DynBatchValueError(f"{name}={value!r} is a bool, not an integer; {fix}")
    number = as_int(value)
    if number is None:
        raise DynBatchValueError(
            f"{name}={value!r} ({type(value).__name__}) is not an integer; {fix}"
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


def require_config(config: Any, where: str) -> None:
    """Refuse ``config`` that is not a :class:`PlannerConfig` where ``where`` takes one (a probe:
    ``None`` was an AttributeError far inside)."""
    if not isinstance(config, PlannerConfig):
        raise DynBatchValueError(
            f"{where}: config must be a PlannerConfig, got {type(config).__name__}; build one, "
            "e.g. PlannerConfig(max_tokens_per_gpu=8192)."
        )


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    if not isinstance(multiple, numbers.Integral) or isinstance(multiple, bool) or multiple < 1:
        # A probe of the public API: 0 was a ZeroDivisionError and -2 a value below ``value``.
        raise DynBatchValueError(f"round_up: multiple={multiple!r} must be a whole number >= 1.")
    return ceil_div(value, multiple) * multiple


def tokens_padded(length: int, multiple: int) -> str:
    """``"N tokens"``, with the padded length where padding changes it, for messages that say a
    sample is over a cap: a 7-token sample is over a cap of 7 when it pads to 8 (tp_size=2), and
    ``"7 tokens"`` alone reads as a false alarm."""
    note = padded_note(length, multiple)
    return f"{length} tokens ({note})" if note else f"{length} tokens"


def padded_note(length: int, multiple: int) -> str:
    """``"8 padded to a multiple of 2"`` where padding changes ``length``, else ``""``."""
    padded = round_up(length, multiple)
    return "" if padded == length else f"{padded} padded to a multiple of {multiple}"


def sample_multiple(tp_size: int, cp_size: int) -> int:
    """The multiple every sample's length is padded to inside a packed row.

    Context parallelism splits each sequence into ``2 * cp`` chunks (load-balanced causal CP), and
    sequence parallelism then splits every chunk over the ``tp`` ranks, so with CP a sample must be a
    multiple of ``tp * cp * 2``; without CP only the row must split over TP, which a per-sample multiple
    of ``tp`` guarantees. Example: tp=2, cp=4 -> 16; tp=4, cp=1 -> 4; tp=1, cp=1 -> 1.
    """
    for name, value in (("tp_size", tp_size), ("cp_size", cp_size)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise DynBatchValueError(
                f"sample_multiple: {name}={value!r} must be a whole number >= 1 (1: no "
                "parallelism of that kind)."
            )
    return tp_size * cp_size * 2 if cp_size > 1 else tp_size


#: The layout's fields as each tool spells them. :class:`ParallelLayout` and the planner name the
#: fields (``vpp_size=2 needs pp_size >= 2``); each entry point runs them under
#: :func:`layout_flags` with its tool, so the message also names the flag the user typed.
#: Megatron-LM and slime share Megatron-LM's parser (slime adds no layout flag of its own).
LAYOUT_FLAGS: Dict[str, Dict[str, str]] = {
    "megatron-dynbatch": {
        "dp_size": "--dp-size",
        "pp_size": "--pp-size",
        "vpp_size": "--vpp-size",
        "microbatch_group_size_per_vp_stage": "--microbatch-group-size-per-vp-stage",
        "tp_size": "--tp-size",
        "cp_size": "--cp-size",
    },
    "Megatron-LM": {
        "dp_size": "world size / (--tensor-model-parallel-size x --pipeline-model-parallel-size "
        "x --context-parallel-size)",
        "pp_size": "--pipeline-model-parallel-size",
        "vpp_size": "--num-virtual-stages-per-pipeline-rank (or "
        "--num-layers-per-virtual-pipeline-stage)",
        "microbatch_group_size_per_vp_stage": "--microbatch-group-size-per-virtual-pipeline-stage",
        "tp_size": "--tensor-model-parallel-size",
        "cp_size": "--context-parallel-size",
    },
    "SkyRL": {
        "dp_size": "the number of GPUs / (tensor x pipeline x context parallel size)",
        "pp_size": "trainer.policy.megatron_config.pipeline_model_parallel_size",
        "vpp_size": "trainer.policy.megatron_config.transformer_config_kwargs."
        "virtual_pipeline_model_parallel_size",
        "microbatch_group_size_per_vp_stage": "trainer.policy.megatron_config."
        "transformer_config_kwargs.microbatch_group_size_per_vp_stage",
        "tp_size": "trainer.policy.megatron_config.tensor_model_parallel_size",
        "cp_size": "trainer.policy.megatron_config.context_parallel_size",
    },
    "NeMo-RL": {
        "dp_size": "cluster GPUs / (tensor x pipeline x context parallel size)",
        "pp_size": "policy.megatron_cfg.pipeline_model_parallel_size",
        "vpp_size": "policy.megatron_cfg.virtual_pipeline_model_parallel_size",
        "microbatch_group_size_per_vp_stage": "policy.megatron_cfg."
        "microbatch_group_size_per_vp_stage",
        "tp_size": "policy.megatron_cfg.tensor_model_parallel_size",
        "cp_size": "policy.megatron_cfg.context_parallel_size",
    },
}
LAYOUT_FLAGS["slime"] = LAYOUT_FLAGS["Megatron-LM"]
LAYOUT_FLAGS["verl"] = {
    "dp_size": "the number of GPUs / (tensor x pipeline x context parallel size)",
    "pp_size": "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
    "vpp_size": "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
    "microbatch_group_size_per_vp_stage": "actor_rollout_ref.actor.megatron.override_transformer_"
    "config.microbatch_group_size_per_vp_stage",
    "tp_size": "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "cp_size": "actor_rollout_ref.actor.megatron.context_parallel_size",
}


#: A field's Python spelling beside the flag in a refusal ("pass --max-tokens-per-gpu
#: (max_tokens_per_gpu=) ..."), for trainers on the Python API; a tool or host that names the
#: setting in its own words drops it (:func:`without_field_hints`).
_FIELD_HINT = re.compile(r" \([a-z_]+=(?:|None|False|'[^']*'(?:, '[^']*')*(?: or '[^']*')?)\)")


def without_field_hints(message: str) -> str:
    """``message`` without the Python field hints :data:`_FIELD_HINT` matches."""
    return _FIELD_HINT.sub("", message)


@contextlib.contextmanager
def layout_flags(tool: str) -> Iterator[None]:
    """A ``ValueError`` raised inside that names layout fields also names ``tool``'s flags.

    The error keeps its type; its message gets one sentence, e.g. ``(flags: slime: vpp_size is
    --num-virtual-stages-per-pipeline-rank (or --num-layers-per-virtual-pipeline-stage); pp_size is
    --pipeline-model-parallel-size.)``. Nested uses add it once.
    """
    with setting_flags(LAYOUT_FLAGS[tool], tool=tool):
        yield


@contextlib.contextmanager
def setting_flags(flags: Mapping[str, str], *, tool: Optional[str] = None) -> Iterator[None]:
    """A ``ValueError`` raised inside that names planner settings also names their flags.

    ``flags`` maps a setting as the planner's messages name it (``layout``, ``token_weight``,
    ``vpp_size``) to the option a user sets it with. The planner checks every setting once, in
    one wording; each host adds its own spelling through this, e.g. ``layout='thd' is not one of
    ('packed', 'padded'); use packed or padded. (flags: layout is --dynamic-batch-layout.)``.
    The error keeps its type; nested uses add the sentence once.
    """
    try:
        yield
    except ValueError as error:
        text = str(error)
        if len(error.args) == 1 and "(flags: " not in text:
            text = without_field_hints(text)  # the tool's flags name the settings
            # A host's config key stands in the setting's place (a probe: verl's and NeMo-RL's
            # refusals led with "vpp_size=2 needs pp_size >= 2" and a glossary after it);
            # command-line flags and descriptions keep the glossary.
            in_place = {k: v for k, v in flags.items() if _CONFIG_KEY.fullmatch(v)}
            for setting, key in in_place.items():
                text = re.sub(rf"\b{setting}\b", key, text)
            error.args = (text,)
        named = [
            f"{k} is {v}"
            for k, v in flags.items()
            if not _CONFIG_KEY.fullmatch(v) and re.search(rf"\b{k}\b", text)
        ]
        if named and len(error.args) == 1 and "(flags: " not in text:
            where = f"{tool}: " if tool else ""
            error.args = (f"{text} (flags: {where}{'; '.join(named)}.)",)
        raise


#: A host's dotted config key (``policy.megatron_cfg.pipeline_model_parallel_size``), which
#: :func:`setting_flags` puts in its setting's place.
_CONFIG_KEY = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")


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
            _set_int(self, name, 1, f"set {name} to 1 or more.")
        if self.vpp_size > 1 and self.pp_size < 2:
            raise DynBatchValueError(
                f"vpp_size={self.vpp_size} needs pp_size >= 2 (interleaving splits pipeline stages), "
                f"got pp_size={self.pp_size}; set vpp_size to 1 or raise pp_size."
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
            # Only the interleaved schedule reads the group (and refuses one below pp); without
            # interleaving Megatron accepts any value and so do we.
            if group < self.pp_size and self.vpp_size > 1:
                raise DynBatchValueError(
                    f"microbatch_group_size_per_vp_stage={group} is smaller than pp_size={self.pp_size}; "
                    f"Megatron's interleaved schedule rejects that. Use a value >= {self.pp_size} or omit "
                    "microbatch_group_size_per_vp_stage."
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
    on every position, padding included) + ``attention_weight`` x the attention term of each row
    (by :attr:`attention`: the squared length of every segment, ``S**2`` or ``2 * S**2``) +
    ``response_weight`` x its samples' response tokens + ``microbatch_overhead``. Attention-heavy
    long-context steps set ``attention_weight`` to about ``1 / (6 * hidden_size)`` of the token
    weight (a causal kernel's ``2*h*L**2`` FLOPs against the linear layers' ``12*h**2*L``).
    """

    token_weight: float = 1.0
    """Weight of the linear (MLP, projections) work of one position of a row."""
    attention_weight: float = 0.0
    """Weight of one unit of the attention term: a causal square ``L**2`` (see :attr:`attention`)."""
    response_weight: float = 0.0
    """Weight of one response token (log-prob gather, value head, loss)."""
    microbatch_overhead: Optional[float] = None
    """Fixed cost of running one micro-batch (launches, pipeline send/receive, Python), in the units
    of the other terms, placeholders included. ``None``: not known (not calibrated); the planner
    assumes ``DEFAULT_OVERHEAD_FRACTION`` of a full row at the token cap
    (:meth:`resolved`) and asks more micro-batches for a gain of ``DEFAULT_MIN_GAIN``."""
    attention: Optional[Literal["segment", "causal", "dense"]] = None
    """What the attention implementation executes (``ATTENTION_KINDS``). ``None``: by layout,
    ``segment`` for ``packed`` (THD ``cu_seqlens``), ``causal`` for ``padded`` (``S**2`` a row).
    The ``padded`` layout never runs segments (one sample a row, padding attended like the
    sample), so ``segment`` there counts as ``causal``."""
    shape_exchange_overhead: float = 0.0
    """Extra fixed cost of a micro-batch when the step's row lengths vary (Megatron's
    ``variable_seq_lengths`` exchanges every tensor shape before its pipeline send), in the units
    of the other terms; only counted for plans with variable row lengths."""

    def __post_init__(self) -> None:
        names = ["token_weight", "attention_weight", "response_weight", "shape_exchange_overhead"]
        if self.microbatch_overhead is not None:
            names.append("microbatch_overhead")
        for name in names:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(float(value))
            ):
                raise DynBatchValueError(
                    f"cost model {name}={value!r} must be a finite number >= 0."
                )
            if value < 0:
                raise DynBatchValueError(f"cost model {name}={value} must be >= 0.")
            object.__setattr__(self, name, float(value))
        if self.token_weight == 0 and self.attention_weight == 0 and self.response_weight == 0:
            raise DynBatchValueError("cost model weights are all 0; set at least token_weight > 0.")
        if self.attention is not None and self.attention not in ATTENTION_KINDS:
            raise DynBatchValueError(
                f"cost model attention={self.attention!r} is not one of {ATTENTION_KINDS}; use "
                "segment (THD / flash varlen), causal (one causal row) or dense (local, masked), "
                "or None to follow the layout."
            )

    @property
    def overhead(self) -> float:
        """The per-micro-batch overhead the formulas use (``None`` counts as 0 until resolved)."""
        return self.microbatch_overhead or 0.0

    @property
    def overhead_known(self) -> bool:
        """Whether the overhead was given (calibrated or set), not assumed."""
        return self.microbatch_overhead is not None

    def attention_kind(self, layout: str) -> str:
        """The attention kind of :attr:`attention` for a layout (``None`` and padded resolved)."""
        kind = self.attention or ("segment" if layout == "packed" else "causal")
        if layout != "packed" and kind == "segment":
            return "causal"
        return kind

    def full_row_cost(self, seq_length: int, layout: str = "packed") -> float:
        """Forward cost of one row of ``seq_length`` filled by one sample, without overhead or
        response work: what ``DEFAULT_OVERHEAD_FRACTION`` is a fraction of."""
        s = float(seq_length)
        factor = 2.0 if self.attention_kind(layout) == "dense" else 1.0
        return self.token_weight * s + factor * self.attention_weight * s * s

    def resolved(self, token_cap: int, layout: str = "packed") -> "CostModel":
        """This model with :attr:`attention` and :attr:`microbatch_overhead` filled in.

        An unknown overhead becomes ``DEFAULT_OVERHEAD_FRACTION`` of :meth:`full_row_cost` at the
        token cap. Resolving a resolved model changes nothing.
        """
        overhead = self.microbatch_overhead
        if overhead is None:
            overhead = DEFAULT_OVERHEAD_FRACTION * self.full_row_cost(token_cap, layout)
            if not math.isfinite(overhead):
                raise DynBatchValueError(
                    f"the cost model overflows a float for rows of {token_cap} tokens "
                    f"(token_weight={self.token_weight!r}, attention_weight="
                    f"{self.attention_weight!r}); the weights are relative: keep the token weight "
                    "near 1 and the attention weight near 1/(6*hidden_size), e.g. 4e-5."
                )
        return dataclasses.replace(
            self, attention=self.attention_kind(layout), microbatch_overhead=overhead
        )

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
    variable_row_lengths: bool = False
    """Each micro-batch runs its own row length (its padded tokens rounded up to
    ``row_multiple``) instead of the step's longest: for trainers that exchange shapes per
    micro-batch (slime always; Megatron-LM with ``--variable-seq-lengths``). ``packed`` only; a
    row is rounded only while it stays within the cap, and a placeholder runs the shortest row,
    one ``row_multiple`` (:func:`.step_search.variable_rows`)."""
    row_multiple: int = 1
    """Variable rows are padded to a multiple of this and of the sample multiple (slime: 128 x
    tp)."""
    min_microbatches: int = 1
    """At least this many micro-batches per rank (rounded up to what the schedule accepts): a
    sharded step plans a rank again for the count another rank sets (:mod:`.sharded`), since it
    runs that many anyway; 1: the planner's own choice."""
    min_gain: Optional[float] = None
    """A candidate with more micro-batches per rank is chosen over one with fewer only when its
    simulated step is faster by at least this fraction. ``None``: ``DEFAULT_MIN_GAIN`` when the
    cost model's overhead is assumed, 0 when it is given (a calibrated model is trusted)."""
    overhead_assumed: Optional[bool] = None
    """Whether the cost model's per-micro-batch overhead is assumed (resolved here from the model
    as given: ``None`` reads ``microbatch_overhead is None``; kept through ``replace``). Assumed,
    steps are checked against the trainers' own schedules over :data:`ASSUMED_OVERHEAD_CHECKS`."""
    planner: str = DEFAULT_PLANNER
    """The registered planner the hosts plan with (:mod:`.registry`; looked up when planning,
    so a planner registered later is accepted here)."""
    memory: Optional[Any] = None
    """A :class:`.memory.MemoryLimit` (``--max-memory-gib``): no micro-batch shape is planned
    whose predicted peak on any pipeline stage exceeds it (the token cap is then also at most
    its longest one-row micro-batch); ``None``: the token cap alone."""
    budget_flag: str = "--max-tokens-per-gpu"
    """The option that sets :attr:`max_tokens_per_gpu`, as messages name it (a forward-only
    pass's config is built from ``--log-probs-max-tokens-per-gpu``: its refusals told users to
    raise the training budget, which changed nothing)."""
    oversize_flag: Optional[str] = "--oversize-samples"
    """The option that sets :attr:`oversize_samples`, as messages name it (a flag, or a config
    key); ``None``: the host decides the policy itself, so a refusal names no way through it (a
    probe: a registered host's refusals told its users to pass our flag, which it does not have)."""

    def __post_init__(self) -> None:
        _set_int(
            self,
            "max_tokens_per_gpu",
            1,
            "pass --max-tokens-per-gpu (max_tokens_per_gpu=) with the token budget of one "
            "micro-batch.",
            maximum=MAX_TOKENS,
        )
        if self.rollouts_per_step is not None:
            _set_int(
                self,
                "rollouts_per_step",
                1,
                "omit --rollouts-per-step (rollouts_per_step=None) to train every rollout in one "
                "step.",
            )
        if self.oversize_samples not in OVERSIZE_POLICIES:
            raise DynBatchValueError(
                f"oversize_samples={self.oversize_samples!r} is not one of {OVERSIZE_POLICIES}; "
                "pass --oversize-samples error, truncate or allow (oversize_samples='error', "
                "'truncate' or 'allow')."
            )
        if self.layout not in LAYOUTS:
            raise DynBatchValueError(
                f"layout={self.layout!r} is not one of {LAYOUTS}; use packed or padded."
            )
        if not isinstance(self.parallel, ParallelLayout):
            raise DynBatchValueError(f"parallel={self.parallel!r} must be a ParallelLayout.")
        if not isinstance(self.cost, CostModel):
            raise DynBatchValueError(f"cost={self.cost!r} must be a CostModel.")
        if self.memory is not None and not callable(getattr(self.memory, "row_cap", None)):
            raise DynBatchValueError(
                f"memory={self.memory!r} must be a MemoryLimit (planning.memory) or None; a "
                "budget in GiB is --max-memory-gib's, which a host turns into one with its model."
            )
        if not isinstance(self.variable_row_lengths, bool):
            raise DynBatchValueError(
                f"variable_row_lengths={self.variable_row_lengths!r} must be True or False."
            )
        if self.variable_row_lengths and self.layout != "packed":
            raise DynBatchValueError(
                "variable_row_lengths needs layout='packed' (padded rows have the longest "
                "sample's length); use --dynamic-batch-layout packed (layout='packed') or turn "
                "variable row lengths off (variable_row_lengths=False)."
            )
        _set_int(self, "row_multiple", 1, "pass a row multiple of 1 or more (slime: 128 x tp).")
        _set_int(self, "min_microbatches", 1, "pass at least 1 micro-batch per rank.")
        if not isinstance(self.planner, str) or not self.planner:
            raise DynBatchValueError(
                f"planner={self.planner!r} must name a registered planner, e.g. "
                f"{DEFAULT_PLANNER!r} (megatron_dynbatch.planning.registry)."
            )
        if self.min_gain is None:
            gain = 0.0 if self.cost.overhead_known else DEFAULT_MIN_GAIN
        else:
            gain = self.min_gain
            if isinstance(gain, bool) or not isinstance(gain, numbers.Real) or not 0 <= gain < 1:
                raise DynBatchValueError(
                    f"min_gain={gain!r} must be a number in [0, 1); e.g. 0.03 asks a 3% faster "
                    "predicted step before planning more micro-batches, 0 takes any gain."
                )
        object.__setattr__(self, "min_gain", float(gain))
        if self.overhead_assumed is None:
            object.__setattr__(self, "overhead_assumed", not self.cost.overhead_known)
        elif not isinstance(self.overhead_assumed, bool):
            raise DynBatchValueError(
                f"overhead_assumed={self.overhead_assumed!r} must be True, False or None (None: "
                "whether the cost model's microbatch_overhead is unset)."
            )
        multiple = self.parallel.sample_multiple
        if self.memory is not None and self.memory.row_cap(1) < multiple:
            model = self.memory.model
            resting = max(model.resting(s) for s in model.dims.stages())
            if resting >= self.memory.budget_bytes:
                # Recomputing activations cannot help where the state at rest alone is over.
                # The least budget named holds one padded sample, not only the state at rest (a
                # probe: "above 0.024" was refused again at 0.026).
                least = (
                    f"to at least {self.memory.least_gib(multiple):.3f}"
                    if not self.memory.counted_caps
                    else f"above {resting / 2**30:.3f}"
                )
                fix = (
                    f"the state at rest alone (weights, gradients, optimizer) is over it; raise "
                    f"--max-memory-gib {least}"
                    + (
                        ""
                        if model.distributed_optimizer
                        else ", shard the optimizer state " "(--use-distributed-optimizer)"
                    )
                    + ", or shard the model further (a larger tp_size or pp_size)."
                )
            else:
                fix = "raise --max-memory-gib, or recompute activations (--recompute-*)."
            raise DynBatchValueError(
                f"the memory budget ({self.memory.budget_bytes / 2**30:.4g} GiB) cannot hold one "
                f"micro-batch of {multiple} tokens on every pipeline stage (predicted at rest: "
                f"{resting / 2**30:.3f} GiB); {fix}"
            )
        if self.token_cap < multiple:
            # cp only where it multiplies the budget, as cap_source names it.
            times = f" (x cp_size={self.parallel.cp_size})" if self.parallel.cp_size > 1 else ""
            raise DynBatchValueError(
                f"{self.budget_flag}={self.max_tokens_per_gpu}{times} is "
                f"smaller than one padded sample: every sample is padded to a multiple of {multiple} "
                f"(tp_size={self.parallel.tp_size}, cp_size={self.parallel.cp_size}); raise "
                f"{self.budget_flag} to at least {ceil_div(multiple, self.parallel.cp_size)}."
            )
        # Every consumer (planner, verify, plots) sees one concrete model: the overhead assumed
        # here, once, from the cap (the min_gain default above was read from the model as given).
        object.__setattr__(self, "cost", self.cost.resolved(self.token_cap, self.layout))
        # At start-up, where a host builds its config, not at the first step (the planner checks
        # again with the longest sample, which may be over the cap).
        check_cost_is_finite(self.cost, self.token_cap)

    @property
    def variable_row_multiple(self) -> int:
        """What a variable row is rounded up to: ``row_multiple`` and the sample multiple."""
        return math.lcm(self.row_multiple, self.parallel.sample_multiple)

    @property
    def token_cap(self) -> int:
        """Cap on one micro-batch's padded footprint: the per-GPU budget times cp (CP splits it),
        and with a memory budget at most the longest one-row micro-batch it allows."""
        cap = self.max_tokens_per_gpu * self.parallel.cp_size
        if self.memory is not None:
            cap = min(cap, self.memory.row_cap(1))
        return cap

    @property
    def longest_fitting(self) -> int:
        """The longest sample whose padded length fits :attr:`token_cap`: the cap rounded down
        to the sample multiple (``round_up(L, m) > cap`` exactly when ``L`` is over it), what
        ``truncate`` keeps of a longer one."""
        multiple = self.parallel.sample_multiple
        return (self.token_cap // multiple) * multiple

    @property
    def cap_source(self) -> str:
        """Where :attr:`token_cap` comes from, for messages that name it: the token budget, or
        the memory budget when that is smaller (issue 44: a cap set by ``--max-memory-gib`` was
        reported as ``max_tokens_per_gpu=...`` with advice to raise that flag)."""
        # The budget by its own flag or key (a probe: the launch's oversize warning named the
        # field, max_tokens_per_gpu=128 x cp_size=1); cp only where it multiplies it.
        cp = self.parallel.cp_size
        budget = f"{self.budget_flag}={self.max_tokens_per_gpu}" + (
            f" x cp_size={cp}" if cp > 1 else ""
        )
        if (
            self.memory is not None
            and self.token_cap < self.max_tokens_per_gpu * self.parallel.cp_size
        ):
            gib = self.memory.budget_bytes / 2**30
            if self.max_tokens_per_gpu == memory_only_budget(self.parallel.cp_size):
                return f"the longest row --max-memory-gib {gib:.3f} allows; no token budget is set"
            return f"the longest row --max-memory-gib {gib:.3f} allows; {budget} is more"
        return budget

    @property
    def cap_flag(self) -> str:
        """The flag that raises :attr:`token_cap` (see :attr:`cap_source`)."""
        if (
            self.memory is not None
            and self.token_cap < self.max_tokens_per_gpu * self.parallel.cp_size
        ):
            return "--max-memory-gib"
        return self.budget_flag

    def oversize_way(self, *choices: Tuple[str, str]) -> str:
        """``", or pass --oversize-samples truncate (cut ...) or allow (...)"``: the policies
        ``choices`` (``(value, what it does)``) as a way out of an oversize refusal, in the
        option's own form (``key='allow'`` for a config key); ``""`` where the host decides it."""
        flag = self.oversize_flag
        if flag is None:
            return ""
        if flag.startswith("-"):
            return ", or pass " + flag + " " + " or ".join(f"{v} ({what})" for v, what in choices)
        return ", or set " + " or ".join(f"{flag}={v!r} ({what})" for v, what in choices)

    def cap_to_hold(self, padded: int) -> str:
        """``<flag> to at least N``, what to raise so that a row of ``padded`` tokens fits the
        cap (the budget is per GPU: N is the row over cp). Under a smaller memory cap, only the
        flag (the memory a row needs is the memory model's)."""
        flag = self.cap_flag
        cp = self.parallel.cp_size
        if self.memory is not None and not self.memory.counted_caps:
            # The least budget whose one-row cap holds the row (a probe: "raise
            # --max-memory-gib" with no value, and 0.22 still refused where 0.23 planned),
            # and the other budget too where it is also short of the row, whichever binds
            # first (probes: the second try was refused for it, in both directions).
            parts = []
            if self.memory.row_cap(1) < padded:
                parts.append(f"--max-memory-gib to at least {self.memory.least_gib(padded):.3f}")
            budget = self.max_tokens_per_gpu * cp
            if budget < padded and self.max_tokens_per_gpu != memory_only_budget(cp):
                parts.append(f"{self.budget_flag} to at least {ceil_div(padded, cp)}")
            if len(parts) == 2 or flag == "--max-memory-gib":
                return " and ".join(parts) or flag
        if flag == "--max-memory-gib" or (cp > 1 and flag != "--max-tokens-per-gpu"):
            # A host whose budget caps the whole row (not a GPU's share) under CP has its own
            # check with its own value (integrations/hosts.py, check_host_oversize).
            return flag
        return f"{flag} to at least {-(-padded // cp)}"

    @property
    def multi_row_cap(self) -> int:
        """Cap on the footprint ``B * S`` of a micro-batch of ``B > 1`` rows: the token budget
        times cp. A memory budget bounds such shapes by its own ``row_cap(B)``, which may allow
        more tokens than one row holds (B short rows keep less of ``S x S`` scores)."""
        return self.max_tokens_per_gpu * self.parallel.cp_size


#: A value that works for each term of the cost model, as Megatron-LM's flags set it.
_EXAMPLES = {
    "token_weight": "--dynamic-batch-cost-token-weight 1 (a token's linear work is the unit)",
    "attention_weight": "--dynamic-batch-cost-attention-weight 4e-5 (about 1/(6*hidden_size))",
    "response_weight": "--dynamic-batch-cost-response-weight 0.1 (a fraction of a token's work)",
    "microbatch_overhead": "--dynamic-batch-cost-microbatch-overhead 330 (2% of a 16k-token row)",
}


def check_cost_is_finite(model: CostModel, longest_row: int) -> None:
    """Refuse weights whose cost of one micro-batch overflows a float (inf, then NaN in sums).

    Args:
        model: The cost model.
        longest_row: The most padded tokens a micro-batch row can hold (the longer of the cap and
            the longest sample).

    Raises:
        ValueError: naming the weights and the row length, with the fix.
    """
    s = float(longest_row)
    worst: Dict[str, float] = {
        "token_weight": model.token_weight * s,
        "attention_weight": 2.0 * model.attention_weight * s * s,
        "response_weight": model.response_weight * s,
        "microbatch_overhead": model.overhead,
    }
    # A step sums thousands of micro-batches and simulates their backward passes: keep headroom.
    total = sum(worst.values()) * 1e9
    if not math.isfinite(total):
        # Name the term that overflows (the largest), with a value that works for it.
        name = max(worst, key=lambda term: worst[term] if math.isfinite(worst[term]) else math.inf)
        raise DynBatchValueError(
            f"the cost model overflows a float for rows of {longest_row} tokens ("
            + ", ".join(f"{term}={getattr(model, term)!r}" for term in worst)
            + f"); the weights are relative, and {name} is the one too large: e.g. "
            f"{_EXAMPLES[name]}."
        )
