"""Megatron's MoE arguments as dynamic batching meets them (Megatron-LM's launch and slime parse
the same flags): which load-balancing losses are on, and the MoE settings a planned forward
cannot run, refused at start-up in those flags' names.
"""

from __future__ import annotations

from typing import Any, List

from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "balancing_types",
    "check_moe_args",
    "load_balancing_losses",
    "refuse_quantile_balancing",
]


def balancing_types(value: Any) -> List[str]:
    """A ``moe_router_load_balancing_type`` as a list: Megatron takes one type or a list of them
    (``None``: none given)."""
    return [value] if isinstance(value, str) else list(value or ())


def load_balancing_losses(args: Any) -> List[str]:
    """The MoE load-balancing losses Megatron computes: each ``--moe-router-load-balancing-type``
    with a coefficient > 0 (Megatron's ``is_aux_loss_enabled``; none for a dense model)."""
    if not getattr(args, "num_experts", None):
        return []
    kinds = balancing_types(getattr(args, "moe_router_load_balancing_type", None))
    coeffs = getattr(args, "moe_aux_loss_coeff", None)

    def coeff(i: int) -> float:
        # As TopKRouter.get_aux_loss_coeff reads it: a list by the type's position, else the one
        # value for every type (a list shorter than the types: Megatron's own IndexError).
        if isinstance(coeffs, (list, tuple)):
            return coeffs[i] if i < len(coeffs) else 0.0
        return coeffs or 0.0

    return [
        kind
        for i, kind in enumerate(kinds)
        if kind in ("aux_loss", "seq_aux_loss", "global_aux_loss") and (coeff(i) or 0) > 0
    ]


def check_moe_args(args: Any, dynamic: bool) -> None:
    """MoE settings the planned forward cannot run, refused at start-up (a probe met both at the
    first step, after the model was built). ``dynamic``: ``--use-dynamic-batch-size`` (else the
    Megatron-LM launch's ``--document-samples``, which runs no placeholder).

    * ``quantile_balancing``: megatron-core 0.19.2 asserts "does not support padding masks yet",
      and both modes hand every MoE forward its padding mask (padding invisible to the routers).
    * a load-balancing loss with MoE recomputation, where a placeholder can occur (dp > 1 or
      interleaving): the recomputed router would divide by the placeholder's zero real tokens
      (:func:`megatron_dynbatch.mcore.moe.placeholder_routing` refuses it at that step).
    """
    if not getattr(args, "num_experts", None):
        return
    if "quantile_balancing" in balancing_types(
        getattr(args, "moe_router_load_balancing_type", None)
    ):
        mode = "--use-dynamic-batch-size" if dynamic else "--document-samples"
        raise DynBatchValueError(
            f"--moe-router-load-balancing-type quantile_balancing cannot run with {mode}: "
            "megatron-core 0.19.2's quantile balancing refuses a padding mask, and every MoE "
            "forward here gets one (so padding counts in no router statistic); pick aux_loss, "
            "seq_aux_loss, global_aux_loss or none, or drop " + mode + "."
        )
    granularity = getattr(args, "recompute_granularity", None)
    modules = getattr(args, "recompute_modules", None) or ()
    recomputed = granularity == "full" or (granularity == "selective" and "moe" in modules)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    placeholders = (getattr(args, "data_parallel_size", 1) or 1) > 1 or vpp > 1
    losses = load_balancing_losses(args)
    if dynamic and recomputed and losses and placeholders:
        what = (
            "--recompute-granularity full"
            if granularity == "full"
            else "moe from --recompute-modules"
        )
        raise DynBatchValueError(
            f"--moe-router-load-balancing-type {' '.join(losses)} with MoE recomputation ({what}) "
            "cannot run placeholder micro-batches (padding only), which dynamic batching runs "
            "where a rank has fewer real ones: Megatron's recomputed router would divide by "
            f"their zero real tokens (NaN gradients). Drop {what}, or set --moe-aux-loss-coeff 0."
        )


def refuse_quantile_balancing(kinds: Any, setting: str, switch_off: str) -> None:
    """Refuse Megatron's ``quantile_balancing`` router for a host whose MoE forward passes our
    padding mask (SkyRL, NeMo-RL; verl for its placeholders), at config time: megatron-core
    0.19.2 asserts on any mask at the first step. ``setting``: the host's key for the type;
    ``switch_off``: its way back."""
    if "quantile_balancing" in balancing_types(kinds):
        raise DynBatchValueError(
            f"{setting}={kinds!r} cannot run with dynamic batching: megatron-core 0.19.2's "
            "quantile balancing refuses a padding mask, and dynamic batching hands the MoE "
            "forward one (so placeholder tokens count in no router statistic); pick aux_loss, "
            f"seq_aux_loss, global_aux_loss or none, or set {switch_off}."
        )
