"""slime's arguments as one :class:`~megatron_dynbatch.config.DynBatchConfig`, defaults in one place.

The rollout side (:mod:`.schedule`) and the trainer (:mod:`.backend`) both plan through
:func:`dynbatch_config_from_slime_args`, so the training and log-prob passes read slime's flags the
same way. The defaults, and why each is what it is:

* ``oversize_samples``: ``args.oversize_samples`` (the patched parser registers
  ``--oversize-samples allow|error``, default ``allow``), or ``allow`` for a bare namespace without
  the attribute (slime's own unit tests build one): slime's behaviour, a sample over the budget
  runs alone in its micro-batch, and the host entry
  (:func:`~megatron_dynbatch.integrations.hosts.check_host_oversize`) warns naming it; ``error`` (opt-in)
  stops before any model work. A working slime config must not stop because the patches are in.
  ``truncate`` is refused: slime's ``get_batch`` builds rows from whole samples, so a cut sample
  could not be materialised.
* ``layout``: ``packed``: slime always packs a micro-batch into one THD row.
* ``rollouts_per_step``: ``global_batch_size`` (slime's rollouts per optimizer step).
* cost model: tokens only, plus slime's own attention-to-linear FLOPs ratio when
  ``--balance-data`` or ``--balance-by-flops`` asks for FLOPs balancing (computed by the caller).
  The fixed cost of one micro-batch is ``--dynamic-batch-cost-microbatch-overhead`` (patch 0005,
  Megatron-LM's spelling, in tokens of one GPU's linear work) when given; otherwise unknown, and
  the planner assumes 2% of a full row, asks more micro-batches for a 3% gain, and keeps a small
  step within 0.5% of slime's own first fit at every overhead from none to 5% of a row. Told, the
  planner picks the count for that overhead: on tiny pipelined steps the right count moves with it.
* the pad multiple: ``tp_size * data_pad_size_multiplier`` (:data:`DATA_PAD_SIZE_MULTIPLIER` when
  the attribute is absent), what slime's ``get_batch`` pads a packed row to.

Standard library and the pure planner only: slime's rollout manager imports it without torch work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import re
import warnings
from typing import Any, Iterator, Optional

from megatron_dynbatch.config import DynBatchConfig, config_from_mapping
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import (
    SLIME,
    check_host_budget,
    check_host_planner,
    check_overhead,
)
from megatron_dynbatch.planning import CostModel, OversizeSampleWarning
from megatron_dynbatch.planning.spec import check_int

__all__ = [
    "DATA_PAD_SIZE_MULTIPLIER",
    "CP_SLICED_KEYS",
    "RESPONSE_FLOAT_KEYS",
    "SLIME_OVERSIZE_POLICIES",
    "dash",
    "dynbatch_config_from_slime_args",
    "flag",
    "microbatch_overhead",
    "oversize_policy",
    "planner_oversize_reported",
    "pad_size",
    "routing_replay",
    "slime_flags",
]

#: Keys with one value per *response* token (slime's convention), as float32.
RESPONSE_FLOAT_KEYS = (
    "log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "rollout_log_probs",
    "teacher_log_probs",
)

#: Keys that are cut to this rank's context-parallel chunks before training (``actor.py``).
CP_SLICED_KEYS = ("rollout_log_probs", "teacher_log_probs")

#: slime's ``--data-pad-size-multiplier`` default: ``get_batch`` pads every packed row to a
#: multiple of ``tp_size`` times this.
DATA_PAD_SIZE_MULTIPLIER = 128
#: What ``--oversize-samples`` accepts in the patched slime (no ``truncate``: see the module doc).
SLIME_OVERSIZE_POLICIES = ("error", "allow")


def oversize_policy(args: Any) -> str:
    """``args.oversize_samples``, or ``allow`` (slime's behaviour) when the namespace has none."""
    policy = getattr(args, "oversize_samples", None)
    if policy is None:
        return "allow"
    if policy == "truncate":
        raise DynBatchValueError(
            f"args.oversize_samples={policy!r}: slime's data path trains whole samples, so use "
            "--oversize-samples allow (default) or error; cut long responses at rollout time "
            "(--rollout-max-response-len) instead of truncating them here."
        )
    if policy not in SLIME_OVERSIZE_POLICIES:
        # A typo or another case ('Allow'): not a request to truncate.
        raise DynBatchValueError(
            f"--oversize-samples {policy!r} is not a policy slime runs; use --oversize-samples "
            "allow (the default: a sample over --max-tokens-per-gpu runs alone) or error."
        )
    return policy


def microbatch_overhead(args: Any) -> Optional[float]:
    """``--dynamic-batch-cost-microbatch-overhead``: one micro-batch's fixed cost in tokens of one
    GPU's linear work, or ``None`` (not given, or a bare namespace without it: unknown)."""
    value = getattr(args, "dynamic_batch_cost_microbatch_overhead", None)
    flag = SLIME.key("cost_microbatch_overhead")
    return check_overhead(value, f"{flag} {value!r}", f"{flag} 330")


def routing_replay(args: Any) -> bool:
    """Whether MoE routing is recorded in a forward pass and replayed in training (R2 or R3).

    Then the log-prob pass must run the training micro-batches: routing is recorded and replayed
    per micro-batch, in order.
    """
    return bool(getattr(args, "use_routing_replay", False)) or bool(
        getattr(args, "use_rollout_routing_replay", False)
    )


def pad_size(args: Any) -> int:
    """What slime's ``get_batch`` pads a packed row to: ``tp_size * data_pad_size_multiplier``."""
    tp = getattr(args, "tensor_model_parallel_size", None)
    tp = (
        1
        if tp is None
        else check_int(
            "args.tensor_model_parallel_size", tp, 1, "pass --tensor-model-parallel-size 1 or more."
        )
    )
    multiplier = getattr(args, "data_pad_size_multiplier", None)
    multiplier = (
        DATA_PAD_SIZE_MULTIPLIER
        if multiplier is None
        else check_int(
            "args.data_pad_size_multiplier", multiplier, 1, "pass --data-pad-size-multiplier >= 1."
        )
    )
    return tp * multiplier


def dynbatch_config_from_slime_args(
    args: Any, *, rollouts_per_step: Optional[int] = None, cost: Optional[CostModel] = None
) -> DynBatchConfig:
    """slime's namespace as a :class:`DynBatchConfig` (the defaults are in the module docstring).

    Args:
        args: slime's parsed arguments. Read: ``max_tokens_per_gpu`` (required),
            ``log_probs_max_tokens_per_gpu``, ``oversize_samples``, ``dynamic_batch_planner``,
            ``dynamic_batch_cost_microbatch_overhead``.
        rollouts_per_step: Rollouts per optimizer step (slime's ``global_batch_size``).
        cost: The balancing cost model (tokens when ``None``); an overhead it leaves unknown is
            ``--dynamic-batch-cost-microbatch-overhead`` when that is given.

    Raises:
        DynBatchValueError: a missing or bad budget, naming slime's flag.
    """
    budget = check_host_budget(SLIME, getattr(args, "max_tokens_per_gpu", None))
    full = budget
    margin = getattr(args, "packing_safety_margin", None)
    if margin is not None:
        # Newer slime packs training micro-batches to this fraction of the budget.
        if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 < margin <= 1:
            raise DynBatchValueError(
                f"--packing-safety-margin {margin!r} must be a number in (0, 1]: the share of "
                "--max-tokens-per-gpu a micro-batch may fill (above 1 it would exceed the "
                "budget); e.g. 0.9, or 1 for the whole budget."
            )
        budget = max(1, int(budget * margin))
    log_probs = getattr(args, "log_probs_max_tokens_per_gpu", None)
    if log_probs is not None:
        log_probs = check_host_budget(SLIME, log_probs, forward_only=True)
    elif budget != full:
        # As slime's validate_args sets it: the log-prob budget is --max-tokens-per-gpu in full,
        # not the margin's share of it (a probe: a 90-token sample was over "the token cap 50").
        log_probs = full
    planner = getattr(args, "dynamic_batch_planner", None)
    if planner is not None:
        # As slime's argument check does (hook.py): without it, planner 'fixed' (padded rows)
        # was told to pass --dynamic-batch-layout padded, a flag slime does not have.
        check_host_planner(SLIME, planner, SLIME.fixed["layout"])
    cost = cost or CostModel()
    if cost.microbatch_overhead is None:
        cost = dataclasses.replace(cost, microbatch_overhead=microbatch_overhead(args))
    return config_from_mapping(
        {
            "max_tokens_per_gpu": budget,
            "log_probs_max_tokens_per_gpu": log_probs,
            "oversize_samples": oversize_policy(args),
            "dynamic_batch_planner": planner,
        },
        table=SLIME.options,
        fixed={
            **SLIME.fixed,
            "rollouts_per_step": rollouts_per_step,
            "cost_token_weight": cost.token_weight,
            "cost_attention_weight": cost.attention_weight,
            "cost_response_weight": cost.response_weight,
            "cost_microbatch_overhead": cost.microbatch_overhead,
        },
        host="slime's arguments",
    )


@contextlib.contextmanager
def planner_oversize_reported() -> Iterator[None]:
    """Silence the planner's ``OversizeSampleWarning`` where
    :func:`~megatron_dynbatch.integrations.hosts.check_host_oversize` already named the samples
    with slime's flags (the planner's text offers ``--oversize-samples truncate``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        yield


#: "raise --max-tokens-per-gpu to at least N" in a refusal (not the log-prob budget's flag).
_RAISE_BUDGET = re.compile(r"([Rr]aise --max-tokens-per-gpu to at least )(\d+)")


def budget_for_packed(packed: int, margin: float) -> int:
    """The least ``--max-tokens-per-gpu`` whose ``--packing-safety-margin`` share (as
    :func:`dynbatch_config_from_slime_args` takes it, ``max(1, int(budget * margin))``) is at
    least ``packed``."""
    budget = max(1, math.ceil(packed / margin))
    while max(1, int(budget * margin)) < packed:  # float rounding below the exact quotient
        budget += 1
    while budget > 1 and max(1, int((budget - 1) * margin)) >= packed:
        budget -= 1
    return budget


@contextlib.contextmanager
def safety_margin_named(args: Any) -> Iterator[None]:
    """A refusal raised inside that names the training budget is told in the user's
    ``--max-tokens-per-gpu`` where newer slime's ``--packing-safety-margin`` packs to a share of
    it: the planner sees only the share, so its "raise --max-tokens-per-gpu to at least N" named
    the share (a fix refused again, with the same words)."""
    margin = getattr(args, "packing_safety_margin", None)
    try:
        yield
    except ValueError as error:
        text = str(error)
        if (
            margin is None
            or getattr(error, "names_full_budget", False)
            or isinstance(margin, bool)
            or not isinstance(margin, numbers.Real)
            or not 0 < margin < 1
            or len(error.args) != 1
            or "max_tokens_per_gpu" not in text
            and "--max-tokens-per-gpu" not in text
        ):
            raise
        budget = getattr(args, "max_tokens_per_gpu", None)
        text = _RAISE_BUDGET.sub(
            lambda m: m.group(1) + str(budget_for_packed(int(m.group(2)), margin)), text
        )
        error.args = (
            f"{text} (--packing-safety-margin {margin} packs each micro-batch to that share of "
            f"--max-tokens-per-gpu {budget}: the token budget and cap above are the share, the "
            "--max-tokens-per-gpu to raise is given in full.)",
        )
        raise


def slime_flags() -> Any:
    """Errors raised inside that name the parallel layout's fields also name slime's flags
    (Megatron-LM's: :data:`~megatron_dynbatch.planning.spec.LAYOUT_FLAGS`)."""
    return SLIME.flags()


def flag(args: Any, name: str, default: bool = False) -> bool:
    """A boolean of slime's namespace (``None`` or absent: ``default``); anything but a bool is
    refused in slime's flag name, where a truthy string would otherwise switch a path on."""
    value = getattr(args, name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise DynBatchValueError(
            f"args.{name}={value!r} must be True or False (slime's --{dash(name)})."
        )
    return value


def dash(name: str) -> str:
    """An argument's attribute name as slime's flag (``use_dynamic_batch_size`` ->
    ``use-dynamic-batch-size``)."""
    return name.replace("_", "-")
