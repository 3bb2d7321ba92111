"""Megatron command-line flags of dynamic batching, and their check after Megatron's own validation.

The flags, their help texts and defaults are the rows of the settings table
(:mod:`megatron_dynbatch.settings`). Use :func:`add_dynamic_batch_args` as (or inside) the
``extra_args_provider`` of ``megatron.training.arguments.parse_and_validate_args``. The patched ``parse_and_validate_args``
(``patches/0001-*``) calls ``hooks.configure`` (which runs :func:`validate_dynamic_batch_args`)
right before Megatron's ``validate_args`` whenever these flags are registered: a refusal is then
one line, before Megatron's argument dump, and a flag given without ``--use-dynamic-batch-size``
is refused too. The checks read only flags given on the command line (the data-parallel size is
derived from the world size as Megatron does); the arguments are never changed.

Every batch-size feature of Megatron 0.19 is either meaningful with dynamic batching or refused
here: ``--global-batch-size`` (``--eval-global-batch-size``) is the samples (rollouts with
``--rollouts-per-step``) of one optimizer step (validation batch); ``--micro-batch-size`` and
``--eval-micro-batch-size`` are unused (the planner picks the micro-batches); ``--train-samples`` /
``--train-iters`` size the run as usual; ``--step-batch-size-schedule``, ``--rampup-batch-size``
and ``--decrease-batch-size-if-needed`` are refused.

Imports only argparse, the config and the pure planner: flag errors are testable without megatron.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

from megatron_dynbatch.config import (
    FLAGS,
    DynBatchConfig,
    attention_from_megatron,
    config_from_mapping,
    load_yaml_config,
)
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.console import world_size
from megatron_dynbatch.integrations.megatron_lm.layout_checks import (
    check_virtual_pipeline,
    virtual_pipeline_size,
)
from megatron_dynbatch.integrations.moe_args import balancing_types, load_balancing_losses
from megatron_dynbatch.planning.model_cost import ESTIMATED_MIN_GAIN
from megatron_dynbatch.planning.spec import (
    DEFAULT_PLANNER,
    ParallelLayout,
    ceil_div,
    check_int,
    layout_flags,
    memory_only_budget,
    round_up,
    sample_multiple,
)
from megatron_dynbatch.settings import (  # noqa: F401 - re-exported for the hooks and calibration
    CALIBRATION_JSON,
    CALIBRATION_YAML,
    DEFAULT_CALIBRATION_MAX_ERROR,
    DEFAULT_CALIBRATION_STEPS,
    SETTINGS,
    VARIABLE_SEQ_LENGTHS_DEST,
    add_training_args,
    config_settings,
    memory_gib,
)

__all__ = [
    "add_dynamic_batch_args",
    "apply_default_cost",
    "device_rates",
    "dynbatch_config_from_args",
    "grouping_dependent_moe",
    "physical_cost_from_args",
    "setting_given",
    "truncation_from_args",
    "parallel_layout_from_args",
    "validate_dynamic_batch_args",
    "variable_seq_lengths",
]

# argparse destination of every config field (the flag without its dashes, Megatron-style).
_DESTS: Dict[str, str] = {row.name: row.training_dest for row in config_settings()}

#: Why --ddp-average-in-collective goes (Megatron's DistributedDataParallel asserts on it with
#: --calculate-per-token-loss, which dynamic batching needs, after the model is built).
_AVERAGE_IN_COLLECTIVE = (
    "Megatron cannot average gradients in the collective with --calculate-per-token-loss, which "
    "dynamic batching needs (its DistributedDataParallel stops on the pair); remove "
    "--ddp-average-in-collective (the gradients are then divided by the step's loss tokens)"
)

# Megatron features that choose the micro-batch count or the data themselves, each with the flag
# that turns it off and why it cannot be combined with a planned schedule. Read with getattr: not
# every Megatron version has every argument.
_INCOMPATIBLE = (
    (
        "step_batch_size_schedule",
        lambda value: value is not None,
        "--step-batch-size-schedule",
        "Megatron would keep the batch at one sample per step while logging and counting the "
        "schedule's sizes; give a fixed --global-batch-size (samples per step) instead, and to "
        "grow the batch resume from a checkpoint with a larger --global-batch-size and "
        "--override-opt_param-scheduler (Megatron's learning-rate schedule counts samples: "
        "without it the resume stops on a warm-up that no longer matches)",
    ),
    (
        "rampup_batch_size",
        lambda value: value is not None,
        "--rampup-batch-size",
        "megatron-core 0.19 no longer ramps the batch up (it runs --global-batch-size from the "
        "first step, the flag ignored: 'setting number of microbatches to constant'), and the "
        "planner sizes every step; remove --rampup-batch-size",
    ),
    (
        "decrease_batch_size_if_needed",
        bool,
        "--decrease-batch-size-if-needed",
        "the planner already sizes every step; remove --decrease-batch-size-if-needed",
    ),
    (
        "iterations_to_skip",
        bool,
        "--iterations-to-skip",
        "a skipped iteration drains fixed-size micro-batches from the iterator, not a rollout "
        "batch; remove --iterations-to-skip",
    ),
    (
        "perform_rl_step",
        bool,
        "--perform-rl-step",
        "Megatron's RL loop builds its own sequence-packed iterator; feed rollout batches to the "
        "training iterator instead and remove --perform-rl-step",
    ),
    (
        "hybrid_context_parallel",
        bool,
        "--hybrid-context-parallel",
        "it changes the CP size per micro-batch, which the token budget does not model; remove "
        "--hybrid-context-parallel",
    ),
    (
        "ddp_average_in_collective",
        bool,
        "--ddp-average-in-collective",
        _AVERAGE_IN_COLLECTIVE,
    ),
)


#: With ``--variable-seq-lengths`` each micro-batch's row is its samples rounded up to this (and
#: to the sample multiple): at most 63 tokens of padding a row, while the number of distinct
#: shapes a run meets (kernel autotuning, allocator caching) stays bounded.
VARIABLE_ROW_MULTIPLE = 64

#: The calibration flags (their rows in :data:`megatron_dynbatch.settings.SETTINGS`).
_CALIBRATION_FLAGS = tuple(
    row.flag
    for row in SETTINGS
    if row.flag.startswith(("--dynamic-batch-calibration", "--dynamic-batch-recalibrate"))
)


def add_calibration_args(group: Any) -> None:
    """Add the calibration flags alone (:func:`add_dynamic_batch_args` adds them with the rest)."""
    for row in SETTINGS:
        if row.flag in _CALIBRATION_FLAGS:
            group.add_argument(row.flag, **row.argparse_kwargs())


def add_dynamic_batch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the dynamic-batching flags to Megatron's parser; an ``extra_args_provider``.

    One flag per row of :data:`megatron_dynbatch.settings.SETTINGS`, with its help text. Every
    config setting's flag defaults to ``None`` so that :func:`validate_dynamic_batch_args` can
    tell a flag given on the command line (which overrides the ``--dynamic-batch-config`` YAML)
    from one left out (YAML value, then dataclass default). Chain with another provider as
    ``lambda parser: my_provider(add_dynamic_batch_args(parser))``.
    """
    group = parser.add_argument_group(title="dynamic batching (megatron_dynbatch)")
    add_training_args(group)
    return parser


def _layout_size(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    return 1 if value is None else int(value)


def _data_parallel_size(args: Any) -> int:
    """``args.data_parallel_size``, or before Megatron's validation derives it, as it will."""
    value = getattr(args, "data_parallel_size", None)
    if value is not None:
        return int(value)
    model_parallel = 1
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        model_parallel *= _layout_size(args, name)
    return max(1, world_size() // model_parallel)


def parallel_layout_from_args(
    args: Any, *, dp_size: Optional[int] = None, vpp_size: Optional[int] = None
) -> ParallelLayout:
    """The planner's parallel layout from Megatron's (validated) arguments.

    Args:
        args: Megatron's argument namespace after ``validate_args``.
        dp_size: Data-parallel size, when known from a process group; default
            ``args.data_parallel_size``.
        vpp_size: Model chunks per stage, when known from the model; default
            ``args.virtual_pipeline_model_parallel_size`` (``None`` means 1).
    """
    with layout_flags("Megatron-LM"):
        return _parallel_layout(args, dp_size, vpp_size)


def _parallel_layout(args: Any, dp_size: Optional[int], vpp_size: Optional[int]) -> ParallelLayout:
    return ParallelLayout(
        dp_size=_data_parallel_size(args) if dp_size is None else dp_size,
        pp_size=_layout_size(args, "pipeline_model_parallel_size"),
        vpp_size=(
            _layout_size(args, "virtual_pipeline_model_parallel_size")
            if vpp_size is None
            else vpp_size
        ),
        microbatch_group_size_per_vp_stage=getattr(
            args, "microbatch_group_size_per_vp_stage", None
        ),
        tp_size=_layout_size(args, "tensor_model_parallel_size"),
        cp_size=_layout_size(args, "context_parallel_size"),
    )


def _given(args: Any) -> Dict[str, Any]:
    return {
        field: getattr(args, dest)
        for field, dest in _DESTS.items()
        if getattr(args, dest, None) is not None
    }


def setting_given(args: Any, field: str) -> bool:
    """Whether the user set ``field`` (a :class:`DynBatchConfig` field): on the command line or in
    the ``--dynamic-batch-config`` YAML, not by a default."""
    if field in _given(args):
        return True
    config_path = getattr(args, "dynamic_batch_config", None)
    return config_path is not None and load_yaml_config(config_path).get(field) is not None


def _per_row_aux_loss(args: Any) -> bool:
    """Whether a MoE load-balancing loss computes its statistics per row (``seq_aux_loss`` with
    a coefficient > 0: with 0 Megatron computes none, and packed rows are fine)."""
    return "seq_aux_loss" in load_balancing_losses(args)


def grouping_dependent_moe(args: Any) -> List[str]:
    """The MoE settings on whose micro-batch grouping the loss depends: a load-balancing loss
    (statistics per micro-batch, row or step's running sum) and token dropping (capacity per
    micro-batch)."""
    if not getattr(args, "num_experts", None):
        return []
    losses = load_balancing_losses(args)
    found = []
    if losses:
        found.append(f"--moe-router-load-balancing-type {' '.join(losses)}")
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        found.append(f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor}")
    if "sinkhorn" in balancing_types(getattr(args, "moe_router_load_balancing_type", None)):
        # Megatron's Sinkhorn balancing reads no padding mask: it balances over every token of
        # the micro-batch, padding included (a probe: 1.9e-4 from the per-sample reference).
        found.append("--moe-router-load-balancing-type sinkhorn")
    if getattr(args, "moe_input_jitter_eps", None):
        # Noise drawn per micro-batch shape, as dropout is (a probe: 9.5e-5).
        found.append(f"--moe-input-jitter-eps {args.moe_input_jitter_eps}")
    return found


def variable_seq_lengths(args: Any, backend: Optional[str], layout: str) -> bool:
    """Whether every micro-batch runs its own row: ``--[no-]variable-seq-lengths`` when given,
    else on where the process group's ``backend`` is NCCL (a shape exchange costs microseconds
    against milliseconds of compute), off elsewhere (gloo on CPU: about a millisecond a
    micro-batch, ``benchmarks/bench_shape_exchange.py``). Variable rows need the packed layout."""
    given = getattr(args, VARIABLE_SEQ_LENGTHS_DEST, None)
    if given is not None:
        return bool(given)
    return backend == "nccl" and layout == "packed"


def device_rates(args: Any):
    """The device the run computes on, as the default cost model assumes it
    (:data:`~megatron_dynbatch.planning.model_cost.GPU_RATES` by ``--bf16`` / ``--fp16`` where
    CUDA is available, else :data:`~megatron_dynbatch.planning.model_cost.CPU_RATES`). Reads torch
    only where the process already imported it (this module imports no torch)."""
    from megatron_dynbatch.planning.model_cost import CPU_RATES, GPU_RATES

    torch = sys.modules.get("torch")
    cuda = torch is not None and bool(torch.cuda.is_available())
    if not cuda:
        return CPU_RATES
    dtype = (
        "bf16"
        if getattr(args, "bf16", False)
        else "fp16" if getattr(args, "fp16", False) else "fp32"
    )
    return GPU_RATES[dtype]


def physical_cost_from_args(args: Any, attention: str):
    """The default cost model of the model Megatron's arguments describe, in seconds of its
    slowest pipeline stage (:func:`~megatron_dynbatch.planning.model_cost.physical_cost`), for
    attention kind ``attention`` on :func:`device_rates`; ``None`` without the model's dimensions.
    """
    if not all(
        getattr(args, name, None) for name in ("num_layers", "hidden_size", "num_attention_heads")
    ):
        return None
    from megatron_dynbatch.planning.model_cost import physical_cost

    from .model_args import model_dims_from_args

    try:
        dims = model_dims_from_args(args, _parallel_layout(args, 1, None))
    except (ValueError, TypeError, AttributeError):
        return None  # a layout Megatron refuses is refused with its own message elsewhere
    return physical_cost(dims, attention, device_rates(args))


def dynbatch_config_from_args(args: Any) -> DynBatchConfig:
    """The :class:`DynBatchConfig` of the arguments: flags given, over the YAML, over defaults.

    With MoE's ``seq_aux_loss`` the layout defaults to ``padded``: the loss takes each row for one
    sequence, and a padded row holds one sample (a packed row holds several). Without an attention
    weight the first plans use the model's own (its physical cost model, :func:`device_rates`);
    calibration then refits every weight from measured iterations.
    """
    values: Dict[str, Any] = {}
    config_path = getattr(args, "dynamic_batch_config", None)
    given = _given(args)
    if config_path is not None:
        # Keys the command line overrides are not read from the file (nor refused there).
        loaded = load_yaml_config(config_path, overridden=given)
        values.update({k: v for k, v in loaded.items() if v is not None})
    values.update(given)
    # Imported here: it reads the machine (CUDA) through torch, which this module does not import.
    from .attention import lenient_attention, requested_attention

    values["attention"] = requested_attention(args, values.get("attention"))
    if values.get("max_tokens_per_gpu") is None and values.get("max_memory_gib") is not None:
        # Only a memory budget: no token cap of its own; the planner's cap is the longest row
        # the memory budget allows (PlannerConfig.token_cap), re-derived as calibration refits.
        values["max_tokens_per_gpu"] = memory_only_budget(
            _layout_size(args, "context_parallel_size")
        )
    if values.get("layout") is None and _per_row_aux_loss(args):
        values["layout"] = "padded"
    if values.get("cost_attention") is None:
        # The cost model describes the attention that runs: read it from Megatron's own flags.
        # With torch-varlen (auto on CUDA) packed rows attend per segment: the default packed
        # layout then plans one THD row a micro-batch ("segment"), padded rows "causal".
        values["cost_attention"] = attention_from_megatron(
            getattr(args, "transformer_impl", None),
            getattr(args, "attention_backend", None),
            values.get("layout") or "packed",
            core_attention=lenient_attention(args, values["attention"]),
        )
    if (
        values.get("cost_attention_weight") is None
        or values.get("cost_microbatch_overhead") is None
    ):
        apply_default_cost(values, physical_cost_from_args(args, values["cost_attention"]))
    return config_from_mapping(values)


def apply_default_cost(values: Dict[str, Any], physical: Any) -> None:
    """Fill the cost weights ``values`` (config field -> value) leaves unset from ``physical``
    (:class:`~megatron_dynbatch.planning.model_cost.PhysicalCost`; ``None``: nothing to fill):
    the default of the model's own dimensions on the device, attention as it runs
    (docs/cost-model.md), which calibration fits scales of. One place for training and
    ``megatron-dynbatch plan``, so the command plans as a run's first steps do."""
    if physical is None:
        return
    model = physical.cost_model()
    token = float(values.get("cost_token_weight") or 1.0)
    if values.get("cost_attention_weight") is None:
        values["cost_attention_weight"] = model.attention_weight * token
    if values.get("cost_microbatch_overhead") is None:
        values["cost_microbatch_overhead"] = model.microbatch_overhead * token
        if values.get("min_gain") is None:
            # An estimated overhead, not a measured one: more micro-batches than the fewest
            # only for a clear gain (model_cost.ESTIMATED_MIN_GAIN).
            values["min_gain"] = ESTIMATED_MIN_GAIN


def validate_dynamic_batch_args(args: Any) -> Optional[DynBatchConfig]:
    """Check the dynamic-batching flags against Megatron's arguments; build the run's config
    (:func:`_validate_dynamic_batch_args`). A refusal that names the flag of a setting the
    ``--dynamic-batch-config`` YAML alone set also names the file and its key (:func:`_from_yaml`).
    """
    try:
        return _validate_dynamic_batch_args(args)
    except DynBatchValueError as error:
        note = _from_yaml(args, str(error))
        if not note:
            raise
        raise DynBatchValueError(f"{error} {note}") from error


def _from_yaml(args: Any, message: str) -> str:
    """Where ``message`` names the flag of settings the YAML alone set, a sentence naming the
    file, the keys and their values (a probe: a YAML ``rollouts_per_step: 3`` was refused with
    "drop --rollouts-per-step", a flag it never passed and cannot drop)."""
    path = getattr(args, "dynamic_batch_config", None)
    if path is None or not getattr(args, "use_dynamic_batch_size", False):
        return ""
    try:
        loaded = load_yaml_config(path, overridden=_given(args))
    except ValueError:
        return ""  # the file's own error is the message
    named = [
        f"{field}: {value}"
        for field, value in loaded.items()
        if value is not None and re.search(re.escape(FLAGS[field]) + r"(?![\w-])", message)
    ]
    if not named:
        return ""
    return (
        f"({'; '.join(named)} set in --dynamic-batch-config {path}: change "
        f"{'it' if len(named) == 1 else 'them'} there, or override with the flag.)"
    )


def _validate_dynamic_batch_args(args: Any) -> Optional[DynBatchConfig]:
    """Check the dynamic-batching flags against Megatron's arguments; build the run's config.

    With ``--use-dynamic-batch-size`` it merges the ``--dynamic-batch-config`` YAML under the flags
    given on the command line and checks that Megatron's settings fit a planned schedule: every
    budget (training and forward-only) against ``--seq-length`` and the oversize policy, and
    every Megatron batch-size feature. The arguments are not changed.

    Returns:
        The resolved config, or ``None`` when dynamic batching is off.

    Raises:
        DynBatchValueError: Naming the flag to change, e.g. a dynamic-batching flag without
            ``--use-dynamic-batch-size``, a missing ``--max-tokens-per-gpu``, a budget smaller than
            one padded sample or than ``--seq-length`` under ``--oversize-samples error``,
            ``--calculate-per-token-loss`` off, or an incompatible Megatron feature.
    """
    _check_one_data_source(args)
    _check_calibration_flags(args)
    given = _given(args)
    config_path = getattr(args, "dynamic_batch_config", None)
    variable = getattr(args, VARIABLE_SEQ_LENGTHS_DEST, None) is not None
    if not getattr(args, "use_dynamic_batch_size", False):
        # --dynamic-batch-attention picks the attention of every mode of the launch.
        stray = [FLAGS[field] for field in given if field != "attention"]
        if config_path is not None:
            stray.append("--dynamic-batch-config")
        if variable:
            stray.append("--variable-seq-lengths")
        if getattr(args, "dynamic_batch_plan_ahead", None) is not None:
            stray.append("--dynamic-batch-plan-ahead")
        # Calibration flags have real defaults, so a value other than the default was given.
        stray += [
            row.flag
            for row in SETTINGS
            if row.flag in _CALIBRATION_FLAGS
            and getattr(args, row.training_dest, row.default) != row.default
        ]
        if stray:
            raise DynBatchValueError(
                f"{', '.join(stray)} given without --use-dynamic-batch-size, so they would be "
                "ignored (fixed micro-batches would run); add --use-dynamic-batch-size or drop "
                "them."
            )
        return None

    config = dynbatch_config_from_args(args)
    if _per_row_aux_loss(args) and config.layout == "packed":
        raise DynBatchValueError(
            "--moe-router-load-balancing-type seq_aux_loss takes every row for one sequence, and "
            f"a packed row holds several samples; pass {FLAGS['layout']} padded (one sample a "
            "row, the default with seq_aux_loss) or another load-balancing type."
        )
    _check_window_attention(args, config)
    # Imported here, as config.py does: the registry imports the whole planner.
    from megatron_dynbatch.planning.registry import required_layout

    required = required_layout(config.planner)
    if required is not None and config.layout != required:
        # The planner would refuse the layout at the first step, after the model is built.
        raise DynBatchValueError(
            f"{FLAGS['planner']} {config.planner} plans {required} rows only, but "
            f"{FLAGS['layout']} is {config.layout}; pass {FLAGS['layout']} {required}, or another "
            f"{FLAGS['planner']} (default {DEFAULT_PLANNER})."
        )
    if getattr(args, VARIABLE_SEQ_LENGTHS_DEST, None) and _per_row_aux_loss(args):
        # The padded layout came from seq_aux_loss, which refuses packed rows (a probe was told
        # to pass --dynamic-batch-layout packed, refused in turn).
        raise DynBatchValueError(
            "--variable-seq-lengths needs packed rows, and --moe-router-load-balancing-type "
            "seq_aux_loss runs padded ones (one sample a row); drop --variable-seq-lengths, or "
            "pick another load-balancing type."
        )
    if getattr(args, VARIABLE_SEQ_LENGTHS_DEST, None) and config.layout != "packed":
        raise DynBatchValueError(
            f"--variable-seq-lengths needs {FLAGS['layout']} packed (padded [B, S] rows all have "
            "the longest sample's length); drop one of them."
        )

    if not getattr(args, "calculate_per_token_loss", False):
        # Megatron refuses the per-token loss with --ddp-average-in-collective: name both.
        also = (
            " (and remove --ddp-average-in-collective, which Megatron refuses with it)"
            if getattr(args, "ddp_average_in_collective", False)
            else ""
        )
        raise DynBatchValueError(
            "--use-dynamic-batch-size needs --calculate-per-token-loss: planned micro-batches hold "
            "different numbers of loss tokens (placeholders none), and without it Megatron divides "
            "every micro-batch's loss by num_microbatches, which weights tokens unequally; add "
            f"--calculate-per-token-loss{also} and return (loss_sum, num_tokens, log) from the "
            "loss function (megatron_dynbatch.runtime.microbatch_loss does)."
        )
    for name, is_on, flag, why in _INCOMPATIBLE:
        if is_on(getattr(args, name, None)):
            raise DynBatchValueError(
                f"--use-dynamic-batch-size cannot be combined with {flag}: {why}."
            )
    remat = getattr(args, "gtp_weight_remat_size", 1) or 1
    if remat != 1:
        raise DynBatchValueError(
            f"--use-dynamic-batch-size does not support gtp_weight_remat_size={remat} (each remat "
            "peer would need its own share of the plan); set --tensor-parallel-num-weight-shards "
            "so that it is 1."
        )

    gbs = getattr(args, "global_batch_size", None)
    if config.rollouts_per_step is not None and gbs != config.rollouts_per_step:
        raise DynBatchValueError(
            f"--rollouts-per-step {config.rollouts_per_step} differs from --global-batch-size "
            f"{gbs}: in Megatron-LM's training loop --global-batch-size is the size of one "
            "optimizer step, and --rollouts-per-step says that it counts rollouts (samples "
            f"sharing a rollout id) instead of samples; set both to the rollouts per step, or "
            "drop --rollouts-per-step to count samples."
        )
    # Interleaving Megatron accepts here but fails on when it builds the model (or words without
    # a flag); then the layout, with the chunks per stage Megatron derives only after this check
    # (else a group below --pipeline-model-parallel-size passed, to fail at the first step). Its
    # sizes (a data-parallel size of 0) are checked there, with their flags.
    check_virtual_pipeline(args)
    parallel = parallel_layout_from_args(args, vpp_size=virtual_pipeline_size(args))
    _check_budgets_fit_seq_length(args, config)
    _check_unused_micro_batch_sizes(args)

    # Fail now, not at the first step, when a budget cannot hold one padded sample of the layout.
    config.planner_config(parallel)
    config.planner_config(parallel, forward_only=True)
    return config


def _check_window_attention(args: Any, config: DynBatchConfig) -> None:
    """Refuse sliding-window attention where it would attend across the samples of a row.

    Megatron's local attention builds its sliding-window mask itself and drops the mask it is
    given, which for packed rows is the block-diagonal mask that keeps each document to itself
    (a probe's packed documents attended to each other: losses 6e-5 off ``--document-samples``);
    the reference and torch-varlen attentions implement full causal attention only. Padded rows
    hold one sample each, where the window alone is the right mask.
    """
    window = getattr(args, "window_size", None)
    if window is None:
        return
    from .attention import lenient_attention

    attention = lenient_attention(args, config.attention)
    shown = ",".join(map(str, window)) if isinstance(window, (tuple, list)) else str(window)
    if attention in ("reference", "torch-varlen"):
        raise DynBatchValueError(
            f"--window-size {shown}: {FLAGS['attention']} {attention} implements full causal "
            "attention, without a window; drop --window-size, or run transformer-engine "
            f"({FLAGS['attention']} transformer-engine)."
        )
    if attention == "local" and config.layout == "packed":
        raise DynBatchValueError(
            f"--window-size {shown} with packed rows ({FLAGS['layout']} packed): Megatron's local "
            "attention replaces the mask that keeps each packed sample to itself with its "
            "sliding-window mask, so the samples of a row would attend to each other; pass "
            f"{FLAGS['layout']} padded (one sample a row), or drop --window-size."
        )


def truncation_from_args(
    args: Any, config: Optional[DynBatchConfig] = None, *, forward_only: bool = False
) -> Optional[Tuple[int, str]]:
    """``(tokens, flag)`` that ``--oversize-samples truncate`` cuts a ``--seq-length`` sample to
    (:meth:`DynBatchConfig.truncation`, from the resolved settings: flags over the YAML), else
    ``None`` (switch off, another policy, or a budget that cuts nothing). ``config``: the run's
    resolved settings where the caller holds them (the launch: the hooks'); default: resolved
    here from ``args``."""
    if not getattr(args, "use_dynamic_batch_size", False):
        return None
    seq_length = getattr(args, "seq_length", None)
    if seq_length is None:
        return None
    if config is None:
        config = dynbatch_config_from_args(args)
    return config.truncation(parallel_layout_from_args(args), seq_length, forward_only=forward_only)


def validation_cut_note(args: Any, config: Optional[DynBatchConfig] = None) -> Optional[str]:
    """What the launch says at start-up when validation documents are cut: under
    ``--oversize-samples truncate`` validation plans under the forward-only budget (by default the
    training one) and cuts what is longer, where ``--document-samples`` validates documents whole
    (a probe saw validation cut without a word); ``None`` when nothing is cut. ``config``: as
    :func:`truncation_from_args`."""
    cut = truncation_from_args(args, config, forward_only=True)
    if cut is None:
        return None
    tokens, flag = cut
    return (
        f"validation documents longer than {tokens} tokens (the forward-only budget, {flag}) "
        f"are cut to it too (--oversize-samples truncate); pass "
        f"{FLAGS['log_probs_max_tokens_per_gpu']} {args.seq_length} to validate them whole."
    )


def _check_one_data_source(args: Any) -> None:
    """Name the flags when more than one data source is given (with the flag on or off).

    Megatron's own check (``validate_args``) says only "A single data source must be provided in
    training mode, else None", naming no flag (issue 37).
    """
    split_flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
    sources = [
        flag
        for flag, given in (
            ("--mock-data", bool(getattr(args, "mock_data", False))),
            ("--data-path", bool(getattr(args, "data_path", None))),
            (
                "/".join(split_flags),
                any(getattr(args, f[2:].replace("-", "_"), None) for f in split_flags),
            ),
        )
        if given
    ]
    if len(sources) == 2:
        first, second = sources
        raise DynBatchValueError(
            f"{first} and {second} both given, but Megatron trains on a single data source; drop "
            f"{first} to train on {second}, or drop {second} to train on {first}."
        )
    if len(sources) > 2:
        raise DynBatchValueError(
            f"{', '.join(sources)} all given, but Megatron trains on a single data source; keep "
            "one of them."
        )


def _check_calibration_flags(args: Any) -> None:
    """The calibration flags' values, with the switch on or off (the flags are ours).

    Read only once calibration runs, a bad value otherwise acted silently (``-1`` steps as ``0``,
    a ``nan`` or negative bound refusing every fit after the calibration steps were spent) or
    failed many iterations in (an output path that is a file, when the fit is written).
    """
    steps = getattr(args, "dynamic_batch_calibration_steps", None)
    if steps is not None:
        check_int(
            "--dynamic-batch-calibration-steps",
            steps,
            0,
            f"pass the measured iterations to fit (default {DEFAULT_CALIBRATION_STEPS}), or 0 to "
            "turn calibration off.",
        )
        if steps == 1:
            # A fit needs two measured steps; one fitted after the first and stopped the run.
            raise DynBatchValueError(
                "--dynamic-batch-calibration-steps 1 is refused: a calibration fit needs at least "
                f"2 measured steps; pass 2 or more (default {DEFAULT_CALIBRATION_STEPS}), or 0 "
                "to turn calibration off."
            )
    bound = getattr(args, "dynamic_batch_calibration_max_error", None)
    finite = isinstance(bound, (int, float)) and math.isfinite(bound)
    if bound is not None and not (finite and bound > 0):
        # The median relative error of a fit's predicted step times: 0 or less refuses every fit,
        # and a fit may be off by more than 100%, so any finite bound above 0 is meaningful.
        raise DynBatchValueError(
            f"--dynamic-batch-calibration-max-error {bound!r} is refused: it is the largest median "
            "relative error of a calibration fit that is planned with, so it must be a finite "
            f"number > 0 (default {DEFAULT_CALIBRATION_MAX_ERROR}, i.e. 20%); pass e.g. "
            f"{DEFAULT_CALIBRATION_MAX_ERROR}, a larger one such as 0.5 to accept noisier fits, "
            "or drop the flag (it is checked with calibration off too)."
        )
    _check_calibration_output(args)


def _check_calibration_output(args: Any) -> None:
    """``--dynamic-batch-calibration-output`` must be a directory, or a path one can be made at.

    Calibration writes its files there on global rank 0 after its measured steps
    (``os.makedirs(path, exist_ok=True)``, then two files): a path that is a file, lies under a
    file, or is not writable stopped the run there with a traceback, after the steps were spent.
    Nothing is created here (an unused path stays uncreated, as before); only rank 0 checks, as
    only rank 0 writes (another node need not have the path).
    """
    path = getattr(args, "dynamic_batch_calibration_output", None)
    if not path or int(getattr(args, "rank", 0) or 0) != 0:
        return  # empty: calibration writes into --save instead
    flag = f"--dynamic-batch-calibration-output {path}"
    fix = "pass a directory (it is created if missing), or leave the flag out to write into --save"
    if os.path.exists(path) and not os.path.isdir(path):
        raise DynBatchValueError(
            f"{flag} is a file, not a directory: calibration writes {CALIBRATION_YAML} and "
            f"{CALIBRATION_JSON} into that directory; {fix}."
        )
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise DynBatchValueError(
            f"{flag}: {existing} is a file, so no directory can be made under it for "
            f"{CALIBRATION_YAML} and {CALIBRATION_JSON}; {fix}."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "it" if existing == os.path.abspath(path) else f"{existing}, where it would be made,"
        raise DynBatchValueError(
            f"{flag}: {what} is not writable by this user, so calibration could not write "
            f"{CALIBRATION_YAML} and {CALIBRATION_JSON} there; pass a directory in a writable "
            "place (it is created if missing), or leave the flag out to write into --save."
        )


def _check_budgets_fit_seq_length(args: Any, config: DynBatchConfig) -> None:
    """Refuse at start-up a budget that a ``--seq-length`` sample would exceed under ``error``.

    ``--seq-length`` is the longest sample Megatron's model is sized for; a budget below it would
    otherwise fail only at the first such sample (for the evaluation budget, after training).
    """
    seq_length = getattr(args, "seq_length", None)
    # The baseline planner 'fixed' (Megatron's stock batching) has no oversize policy: a sample
    # over its budget stops it whatever --oversize-samples says.
    stock = config.planner == "fixed"
    if seq_length is None or (config.oversize_samples != "error" and not stock):
        return
    budgets = [("--max-tokens-per-gpu", config.max_tokens_per_gpu, "training")]
    forward_only = config.log_probs_max_tokens_per_gpu
    # Validation is the launch's one forward-only pass: with --eval-iters 0 none runs (a probe's
    # small log-prob budget was refused for a pass that never came).
    if forward_only is not None and getattr(args, "eval_iters", None) != 0:
        budgets.append(("--log-probs-max-tokens-per-gpu", forward_only, "validation and log-prob"))
    # The planner's cap is the budget times cp (CP splits each sample), and a sample takes its
    # length rounded up to what tp / cp split (planning.spec.sample_multiple): a budget of
    # --seq-length at tp 4 and --seq-length 1002 passed here and refused the first 1002-token
    # sample (1004 padded), and 2048 at cp 2 was refused for --seq-length 4096, which it holds.
    tp = _layout_size(args, "tensor_model_parallel_size")
    cp = _layout_size(args, "context_parallel_size")
    multiple = sample_multiple(tp, cp)
    padded = round_up(seq_length, multiple)
    least = ceil_div(padded, cp)
    longest = f"--seq-length {seq_length}"
    if padded != seq_length:
        parallel = "--tensor-model-parallel-size" + (
            " x --context-parallel-size x 2" if cp > 1 else ""
        )
        longest += f" ({padded} tokens padded to a multiple of {multiple}, {parallel})"
    if cp > 1:
        longest += f" split over --context-parallel-size {cp} ({least} tokens a GPU)"
    for flag, budget, what in budgets:
        if budget is None or budget * cp >= padded:
            continue
        if stock:
            raise DynBatchValueError(
                f"{flag} {budget} is smaller than {longest} (the longest sample), and "
                f"--dynamic-batch-planner fixed pads every sample of a step to its longest with no "
                f"oversize policy (--oversize-samples {config.oversize_samples} applies to planner "
                f"{DEFAULT_PLANNER!r} only), so a {seq_length}-token sample would stop the run at "
                f"its first {what} step; raise {flag} to at least {least}, lower --seq-length, or "
                f"pass --dynamic-batch-planner {DEFAULT_PLANNER}."
            )
        raise DynBatchValueError(
            f"{flag} {budget} is smaller than {longest} (the longest sample) and "
            f"--oversize-samples is error, so a {seq_length}-token sample would stop the run at "
            f"its first {what} step; raise {flag} to at least {least}, lower --seq-length, or "
            "pass --oversize-samples truncate (cut such samples to the budget) or allow (run "
            "them alone, over it)."
        )


def _check_unused_micro_batch_sizes(args: Any) -> None:
    """Say why Megatron would refuse a micro-batch size the plan does not even use.

    Megatron's checks still want every global batch (training and validation) to be a multiple of
    its micro-batch size times the data-parallel size, although the planner picks the micro-batches
    (issue 29: ``--micro-batch-size 3`` stopped a run on the validation batch's divisibility).
    """
    dp = _data_parallel_size(args)
    gbs = getattr(args, "global_batch_size", None)
    mbs = getattr(args, "micro_batch_size", None)
    # Megatron defaults a validation size left out (None) to the training one; a 0 given is not
    # left out (Megatron would validate on batches of no samples), so it is checked as given.
    eval_gbs = getattr(args, "eval_global_batch_size", None)
    eval_mbs = getattr(args, "eval_micro_batch_size", None)
    pairs = (
        ("--global-batch-size", gbs, "--micro-batch-size", mbs),
        (
            "--eval-global-batch-size",
            gbs if eval_gbs is None else eval_gbs,
            "--micro-batch-size" if eval_mbs is None else "--eval-micro-batch-size",
            mbs if eval_mbs is None else eval_mbs,
        ),
    )
    for batch_flag, batch, micro_flag, micro in pairs:
        # Megatron's own checks would refuse these too, later and by assert; name them first.
        if batch is not None:
            fix = (
                f"set {batch_flag} to the samples of one step."
                if batch_flag == "--global-batch-size"
                else f"set {batch_flag} to the samples of one validation batch, or leave it out "
                "(the --global-batch-size)."
            )
            batch = check_int(batch_flag, batch, 1, fix)
        if micro is not None:
            micro = check_int(micro_flag, micro, 1, f"set {micro_flag} 1 (the planner ignores it).")
        if batch is None or micro is None or batch % (micro * dp) == 0:
            continue
        if batch % dp == 0:
            # 1 always works; so does any divisor of every per-rank share this micro-batch size
            # must divide (the validation batch shares --micro-batch-size unless it has its own).
            batches = [b for _, b, flag, _ in pairs if flag == micro_flag and b is not None]
            common = (
                math.gcd(*(b // dp for b in batches)) if all(b % dp == 0 for b in batches) else 1
            )
            fix = f"set {micro_flag} 1" + (f" (or a divisor of {common})" if common > 1 else "")
        else:
            # No micro-batch size can divide a batch that does not split over the DP ranks.
            lower, upper = (batch // dp) * dp, (batch // dp + 1) * dp
            sizes = f"{lower} or {upper}" if lower > 0 else f"{upper}"
            fix = f"set {batch_flag} to a multiple of {dp}, e.g. {sizes}"
            rollouts = getattr(args, "rollouts_per_step", None)
            if batch_flag == "--global-batch-size" and rollouts is not None:
                # Checked equal before: changing one alone is refused by the other check.
                fix += f", and --rollouts-per-step {rollouts} to the same"
            if micro != 1:
                fix += f", and {micro_flag} 1"
        raise DynBatchValueError(
            f"{micro_flag} {micro} is not used by --use-dynamic-batch-size (the planner picks "
            f"every micro-batch), but Megatron still requires {batch_flag} {batch} to be a "
            f"multiple of {micro_flag} x data-parallel size ({micro} x {dp}); {fix}."
        )
