"""Megatron command-line flags of dynamic batching, and their check after Megatron's own validation.

Use :func:`add_dynamic_batch_args` as (or inside) the ``extra_args_provider`` of
``megatron.training.arguments.parse_and_validate_args``. The patched ``parse_and_validate_args``
(``patches/0001-*``) calls :func:`validate_dynamic_batch_args` right after Megatron's
``validate_args`` when ``--use-dynamic-batch-size`` is on; launch scripts on an unpatched tree call
it themselves after parsing. It must run after Megatron's validation: that validation derives
``data_parallel_size`` and sets values our checks read (it also forces ``variable_seq_lengths`` off,
which dynamic batching does not need: every micro-batch of a step has the step's shape).

Imports only argparse, the config and the pure planner: flag errors are testable without megatron.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

from megatron_dynbatch.config import (
    FLAGS,
    DynBatchConfig,
    attention_from_megatron,
    config_from_mapping,
    load_yaml_config,
)
from megatron_dynbatch.planning.spec import (
    ATTENTION_KINDS,
    LAYOUTS,
    OVERSIZE_POLICIES,
    ParallelLayout,
)

__all__ = [
    "add_dynamic_batch_args",
    "dynbatch_config_from_args",
    "parallel_layout_from_args",
    "validate_dynamic_batch_args",
]

# argparse destination of every config field (the flag without its dashes, Megatron-style).
_DESTS: Dict[str, str] = {field: flag[2:].replace("-", "_") for field, flag in FLAGS.items()}

# Megatron features that choose the micro-batch count or the data themselves, each with the flag
# that turns it off and why it cannot be combined with a planned schedule. Read with getattr: not
# every Megatron version has every argument.
_INCOMPATIBLE = (
    (
        "rampup_batch_size",
        lambda value: value is not None,
        "--rampup-batch-size",
        "the batch-size ramp-up picks the micro-batch count itself; remove --rampup-batch-size",
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
)


def add_dynamic_batch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the dynamic-batching flags to Megatron's parser; an ``extra_args_provider``.

    Every flag but ``--use-dynamic-batch-size`` defaults to ``None`` so that
    :func:`validate_dynamic_batch_args` can tell a flag given on the command line (which overrides
    the ``--dynamic-batch-config`` YAML) from one left out (YAML value, then dataclass default).
    Chain with another provider as ``lambda parser: my_provider(add_dynamic_batch_args(parser))``.
    """
    group = parser.add_argument_group(title="dynamic batching (megatron_dynbatch)")
    group.add_argument(
        "--use-dynamic-batch-size",
        action="store_true",
        help="Plan every step's micro-batches under a token budget (needs the megatron_dynbatch "
        "patches); the training iterator then yields rollout batches.",
    )
    group.add_argument(
        FLAGS["max_tokens_per_gpu"],
        type=int,
        default=None,
        help="Token budget of one training micro-batch on one GPU, padding included.",
    )
    group.add_argument(
        FLAGS["log_probs_max_tokens_per_gpu"],
        type=int,
        default=None,
        help="Token budget of one forward-only (log-prob) micro-batch; default: "
        "--max-tokens-per-gpu.",
    )
    group.add_argument(
        FLAGS["layout"],
        choices=LAYOUTS,
        default=None,
        help="packed: one row of concatenated samples per micro-batch; padded: [B, S] rows. "
        "Default: packed.",
    )
    group.add_argument(
        FLAGS["rollouts_per_step"],
        type=int,
        default=None,
        help="Rollouts (prompt groups) per optimizer step; default: one step per batch the "
        "iterator yields. In Megatron-LM's training loop it must equal --global-batch-size, "
        "which then counts rollouts instead of samples.",
    )
    for field, what in (
        ("cost_token_weight", "the sample length L (default 1.0)"),
        ("cost_attention_weight", "L**2, the attention term (default 0.0)"),
        ("cost_response_weight", "the response length (default 0.0)"),
        (
            "cost_microbatch_overhead",
            "one micro-batch, its fixed cost (default: unknown, 2%% of a full row assumed)",
        ),
        (
            "cost_shape_exchange_overhead",
            "one micro-batch's shape exchange when row lengths vary (default 0.0)",
        ),
    ):
        group.add_argument(
            FLAGS[field], type=float, default=None, help=f"Planner cost-model weight of {what}."
        )
    group.add_argument(
        FLAGS["cost_attention"],
        choices=ATTENTION_KINDS,
        default=None,
        help="What the attention runs, for the cost model: segment (THD / flash varlen), causal "
        "(one causal row), dense (masked S x S, --transformer-impl local). Default: from "
        "--transformer-impl and --attention-backend.",
    )
    group.add_argument(
        FLAGS["min_gain"],
        type=float,
        default=None,
        help="Relative predicted gain more micro-batches per rank must promise to be planned "
        "(default 0.03 with an unknown micro-batch overhead, 0 with a given one).",
    )
    group.add_argument(
        FLAGS["oversize_samples"],
        choices=OVERSIZE_POLICIES,
        default=None,
        help="A sample longer than the budget: error (default) refuses the batch, truncate cuts "
        "it to the budget, allow runs it alone over the budget.",
    )
    group.add_argument(
        "--dynamic-batch-config",
        type=str,
        default=None,
        help="YAML file of dynamic-batching settings (keys: see configs/dynbatch.yaml); flags "
        "given on the command line override it.",
    )
    group.add_argument(
        "--dynamic-batch-reference-thd-attention",
        action="store_true",
        help="With --transformer-impl local: pass packed rows to the model as THD PackedSeqParams "
        "(the transformer-engine path) and attend with megatron_dynbatch's torch reference of "
        "TE's THD attention. Tests the GPU path on machines without CUDA; slow (dense scores).",
    )
    from .calibration import add_calibration_args  # torch: only where Megatron parses flags

    add_calibration_args(group)
    return parser


def _layout_size(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    return 1 if value is None else int(value)


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
    return ParallelLayout(
        dp_size=_layout_size(args, "data_parallel_size") if dp_size is None else dp_size,
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


def dynbatch_config_from_args(args: Any) -> DynBatchConfig:
    """The :class:`DynBatchConfig` of validated arguments (flags hold the resolved values)."""
    return config_from_mapping({field: getattr(args, dest, None) for field, dest in _DESTS.items()})


def validate_dynamic_batch_args(args: Any) -> Optional[DynBatchConfig]:
    """Check the dynamic-batching flags against Megatron's validated arguments.

    With ``--use-dynamic-batch-size`` it merges the ``--dynamic-batch-config`` YAML under the flags
    given on the command line, writes the resolved values back to ``args`` (so checkpoints store
    plain numbers and :func:`dynbatch_config_from_args` rebuilds the same config), and checks that
    Megatron's settings fit a planned schedule.

    Returns:
        The resolved config, or ``None`` when dynamic batching is off.

    Raises:
        ValueError: Naming the flag to change, e.g. a dynamic-batching flag without
            ``--use-dynamic-batch-size``, a missing ``--max-tokens-per-gpu``, a budget smaller than
            one padded sample, ``--calculate-per-token-loss`` off, or an incompatible Megatron
            feature.
    """
    given = {
        field: getattr(args, dest)
        for field, dest in _DESTS.items()
        if getattr(args, dest, None) is not None
    }
    config_path = getattr(args, "dynamic_batch_config", None)
    if not getattr(args, "use_dynamic_batch_size", False):
        stray = [FLAGS[field] for field in given]
        if config_path is not None:
            stray.append("--dynamic-batch-config")
        if stray:
            raise ValueError(
                f"{', '.join(stray)} given without --use-dynamic-batch-size, so they would be "
                "ignored; add --use-dynamic-batch-size or drop them."
            )
        return None

    values: Dict[str, Any] = {}
    if config_path is not None:
        values.update({k: v for k, v in load_yaml_config(config_path).items() if v is not None})
    values.update(given)
    if values.get("cost_attention") is None:
        # The cost model describes the attention that runs: read it from Megatron's own flags.
        values["cost_attention"] = attention_from_megatron(
            getattr(args, "transformer_impl", None),
            getattr(args, "attention_backend", None),
            values.get("layout") or "packed",
        )
    config = config_from_mapping(values)

    if not getattr(args, "calculate_per_token_loss", False):
        raise ValueError(
            "--use-dynamic-batch-size needs --calculate-per-token-loss: planned micro-batches hold "
            "different numbers of loss tokens (placeholders none), and without it Megatron divides "
            "every micro-batch's loss by num_microbatches, which weights tokens unequally; add "
            "--calculate-per-token-loss and return (loss_sum, num_tokens, log) from the loss "
            "function (megatron_dynbatch.runtime.microbatch_loss does)."
        )
    for name, is_on, flag, why in _INCOMPATIBLE:
        if is_on(getattr(args, name, None)):
            raise ValueError(f"--use-dynamic-batch-size cannot be combined with {flag}: {why}.")
    remat = getattr(args, "gtp_weight_remat_size", 1) or 1
    if remat != 1:
        raise ValueError(
            f"--use-dynamic-batch-size does not support gtp_weight_remat_size={remat} (each remat "
            "peer would need its own share of the plan); set --tensor-parallel-num-weight-shards "
            "so that it is 1."
        )

    gbs = getattr(args, "global_batch_size", None)
    if config.rollouts_per_step is not None and gbs is not None and config.rollouts_per_step != gbs:
        raise ValueError(
            f"--rollouts-per-step {config.rollouts_per_step} differs from --global-batch-size "
            f"{gbs}: in Megatron-LM's training loop --global-batch-size is the size of one "
            "optimizer step, and --rollouts-per-step says that it counts rollouts (samples "
            f"sharing a rollout id) instead of samples; set both to the rollouts per step, or "
            "drop --rollouts-per-step to count samples."
        )

    parallel = parallel_layout_from_args(args)
    # Fail now, not at the first step, when a budget cannot hold one padded sample of the layout.
    config.planner_config(parallel)
    config.planner_config(parallel, forward_only=True)

    for field, dest in _DESTS.items():
        setattr(args, dest, getattr(config, field))
    return config
