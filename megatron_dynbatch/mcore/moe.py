"""Mixture-of-experts routers under planned micro-batches: the padding mask and placeholders.

Megatron-Core 0.19.2 takes ``padding_mask`` in ``GPTModel.forward`` (``[B, S]`` bool, **True =
padding**: ``z_loss_func``, ``compute_routing_scores_for_aux_loss`` and the expert-bias update all
read it that way, though some inner docstrings say the opposite) and hands it to every MoE
router, which then leaves padding out of

* the z-loss (a mean over the real tokens, pre-multiplied by their count under
  ``calculate_per_token_loss``);
* the load-balancing statistics of ``aux_loss``, ``seq_aux_loss`` and ``global_aux_loss`` (tokens
  per expert, the token counts they are divided by, and the per-token weight of the loss);
* the expert-bias token counts (``moe_router_enable_expert_bias``), once
  :func:`expert_bias_takes_the_mask` has given Megatron's update a mask of the routing map's
  shape (0.19.2's own ``[tokens]`` mask cannot broadcast against it: every step raised).

It does not leave padding out of the dispatch: the routing map sent to the token dispatcher is the
unmasked top-k, so padding tokens still travel through the all-to-all and through the experts
(their outputs are discarded by the zero loss mask). What they still cost is their share of the
expert FLOPs and of the all-to-all volume.

One case breaks in Megatron itself: a micro-batch that is padding from end to end (a placeholder)
gives the load-balancing losses zero tokens and a ``0 / 0`` (NaN gradients on every router weight;
the z-loss clamps its count and stays finite). :func:`placeholder_routing` runs such a micro-batch
with those losses off, which is exactly its weight under the rule "each loss over real tokens
only": zero.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime.placeholders import is_placeholder

__all__ = [
    "expert_bias_takes_the_mask",
    "global_aux_loss_in",
    "is_moe_model",
    "masked_routing",
    "padding_mask_of",
    "placeholder_routing",
]


def is_moe_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a GPTModel, possibly wrapped in DDP / Float16Module) has MoE layers."""
    from megatron.core.utils import get_model_config

    return bool(getattr(get_model_config(model), "num_moe_experts", None))


def padding_mask_of(batch: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """Megatron's ``padding_mask`` of a planned micro-batch: ``[B, S]`` bool, True on padding.

    Padding is every position whose ``sample_index`` is the placeholder marker
    (:func:`~megatron_dynbatch.runtime.placeholders.is_placeholder`): a row's padding tail, the
    rounding pad after a sample (``sample_multiple``) and every token of a placeholder micro-batch.
    None when the micro-batch has no ``sample_index`` (a user forward step's own dict).
    """
    sample_index = batch.get("sample_index")
    if sample_index is None:
        return None
    return is_placeholder(sample_index)


#: Marks the wrapped expert-bias update (installed once per process).
_MASK_PER_TOKEN = "_dynbatch_mask_per_token"


def expert_bias_takes_the_mask() -> None:
    """Let megatron.core's expert-bias update take the padding mask it is handed.

    ``TopKRouter.routing`` flattens ``padding_mask`` to ``[tokens]`` and ``_apply_expert_bias``
    ANDs it into the ``[tokens, experts]`` routing map: the shapes do not broadcast, so every
    training forward of a model with ``moe_router_enable_expert_bias`` raised a RuntimeError once a
    mask was passed (stock Megatron-LM passes none; our forward steps pass one to every MoE
    model). The wrapper hands the update a ``[tokens, 1]`` mask, which clears each padding token's
    row of the map: the token counts that move the bias are real tokens only. A mask of the map's
    rank (a Megatron that fixed it) goes through unchanged. Wrapped once, at the first forward
    with a mask, and only by our paths: with dynamic batching off nothing is wrapped.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    update = TopKRouter._apply_expert_bias
    if getattr(update, _MASK_PER_TOKEN, False):
        return

    # Not functools.wraps: it would copy torch.compile's attributes of the fused original.
    def apply_expert_bias(self, routing_map, padding_mask=None):
        if padding_mask is not None and padding_mask.dim() == routing_map.dim() - 1:
            padding_mask = padding_mask.unsqueeze(-1)
        return update(self, routing_map, padding_mask=padding_mask)

    setattr(apply_expert_bias, _MASK_PER_TOKEN, True)
    TopKRouter._apply_expert_bias = apply_expert_bias


# The load-balancing losses a router computes (Megatron's names) and whether each one's token count
# is reduced over data-parallel ranks (global_aux_loss) or only over tensor/context-parallel ranks.
_LOCAL_LOSSES = ("aux_loss", "seq_aux_loss")
_GLOBAL_LOSSES = ("global_aux_loss",)
# Each loss's name in Megatron's MoE metrics tracker, and whether it is averaged over DP ranks
# (TopKRouter._apply_*_loss -> attach_and_log_load_balancing_loss).
_METRICS = {
    "aux_loss": ("load_balancing_loss", True),
    "seq_aux_loss": ("seq_load_balancing_loss", True),
    "global_aux_loss": ("global_load_balancing_loss", False),
}
# What a switched-off loss is renamed to for one forward: Megatron's coefficient lookup
# (``TopKRouter.get_aux_loss_coeff``) finds no coefficient for it, and the routing itself treats
# it like "none" (plain top-k).
_OFF = "none"


def _routers_with_aux_loss(model: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [
        module
        for module in model.modules()
        if isinstance(module, TopKRouter) and module.is_aux_loss_enabled()
    ]


def global_aux_loss_in(model: torch.nn.Module) -> bool:
    """Whether a router of ``model`` computes ``global_aux_loss``: its forward then reduces token
    counts over the data-parallel ranks (Megatron's loss, and :func:`placeholder_routing`'s
    check of a placeholder's group)."""
    return any(
        router.get_aux_loss_coeff("global_aux_loss") > 0 for router in _routers_with_aux_loss(model)
    )


def _any_real(has_real: torch.Tensor, group) -> torch.Tensor:
    if torch.distributed.get_world_size(group) > 1:
        has_real = has_real.clone()
        torch.distributed.all_reduce(has_real, op=torch.distributed.ReduceOp.MAX, group=group)
    return has_real


def _without(routing_type, losses: tuple):
    """``routing_type`` with ``losses`` switched off (a list keeps its positions, so the other
    losses keep their coefficients)."""
    if isinstance(routing_type, str):
        return _OFF if routing_type in losses else routing_type
    return [_OFF if name in losses else name for name in routing_type]


@contextlib.contextmanager
def placeholder_routing(
    model: torch.nn.Module, padding_mask: Optional[torch.Tensor]
) -> Iterator[None]:
    """Around one model-chunk forward: a load-balancing loss without real tokens is switched off.

    Megatron divides each load-balancing loss by the real tokens it covers (over the tensor- and
    context-parallel ranks for ``aux_loss`` and ``seq_aux_loss``, over data-parallel ranks too for
    ``global_aux_loss``), so a micro-batch of padding only would give NaN gradients. Inside this
    context a loss whose reduction group holds no real token in this micro-batch is switched off
    for this forward (its weight under "each loss over real tokens only" is zero anyway); the z-loss
    (finite: Megatron clamps its count) and the routing itself are unchanged. Megatron's MoE
    metric entries are created first, in its order, so every rank reduces the same names. Whether a
    group holds a real token is decided with one scalar all-reduce per group (the router's own
    collectives must then run on all of a group's ranks or on none). Models without a
    load-balancing loss are left untouched, with no communication.

    Activation recomputation of MoE layers re-runs the forward in backward, outside this context;
    it is refused for a placeholder with a load-balancing loss rather than giving NaN gradients.
    """
    if padding_mask is not None:
        expert_bias_takes_the_mask()
    # Without gradients (forward-only passes) Megatron computes no auxiliary loss at all.
    active = padding_mask is not None and torch.is_grad_enabled()
    routers = _routers_with_aux_loss(model) if active else []
    if not routers:
        yield
        return
    first = routers[0]
    _register_metrics(first, padding_mask.device)
    local = _any_real((~padding_mask).any().to(torch.int32).reshape(1), first.tp_cp_group)
    off: tuple = () if int(local.item()) else _LOCAL_LOSSES
    if global_aux_loss_in(model):
        if not int(_any_real(local, first.tp_dp_cp_group).item()):
            off += _GLOBAL_LOSSES
    if not off:
        yield
        return
    config = first.config
    if config.recompute_granularity is not None and (
        config.recompute_granularity == "full" or "moe" in (config.recompute_modules or ())
    ):
        raise DynBatchValueError(
            "a placeholder micro-batch (padding only) reached MoE layers with an auxiliary "
            f"load-balancing loss ({config.moe_router_load_balancing_type}) and activation "
            f"recomputation (recompute_granularity={config.recompute_granularity!r}, "
            f"recompute_modules={config.recompute_modules}); Megatron's recomputed router would "
            "divide by its zero real tokens (NaN gradients). Turn MoE recomputation off or set "
            "Megatron's moe_aux_loss_coeff to 0 (Megatron-LM and slime: --moe-aux-loss-coeff 0; "
            "verl: ...megatron.override_transformer_config.moe_aux_loss_coeff=0; NeMo-RL: "
            "policy.megatron_cfg.moe_aux_loss_coeff=0; SkyRL: "
            "trainer.policy.megatron_config.moe_aux_loss_coeff=0)."
        )
    saved = [router.routing_type for router in routers]
    try:
        for router in routers:
            router.routing_type = _without(router.routing_type, off)
        yield
    finally:
        for router, routing_type in zip(routers, saved, strict=True):
            router.routing_type = routing_type


def _register_metrics(router, device: torch.device) -> None:
    """Create, in Megatron's recording order, the MoE metric entries this router will record.

    Megatron's metrics tracker all-reduces, over pipeline and data-parallel ranks, every metric
    name a rank has recorded, in the order the rank first recorded them. A rank whose first
    micro-batch is a placeholder (losses switched off) would record them in another order, or not
    at all, and hang its peers in that reduction (SkyRL reduces it after every step). Adding 0 with
    the router's own groups, before the first forward on every rank, fixes names and order.
    """
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    config = router.config
    num_layers = config.num_layers + (config.mtp_num_layers or 0)
    layer = router.layer_number
    if layer is None:
        return
    if router.is_mtp_layer:
        layer += config.num_layers
    zero = torch.zeros((), device=device)
    if config.moe_z_loss_coeff is not None and "z_loss" not in tracker.metrics:
        tracker.record("z_loss", zero, layer, num_layers, avg_group=router.tp_dp_cp_group)
    for loss, (name, needs_dp_avg) in _METRICS.items():
        if router.get_aux_loss_coeff(loss) <= 0 or name in tracker.metrics:
            continue
        group = router.tp_dp_cp_group if loss in _GLOBAL_LOSSES else router.tp_cp_group
        tracker.record(name, zero, layer, num_layers, reduce_group=group, needs_dp_avg=needs_dp_avg)


@contextlib.contextmanager
def masked_routing(
    model: torch.nn.Module,
    model_kwargs: Dict[str, Any],
    mask_of: Callable[[], Optional[torch.Tensor]],
) -> Iterator[None]:
    """Around a host's own model call (NeMo-RL's and SkyRL's patched forwards): for a MoE model
    whose ``model_kwargs`` hold no ``padding_mask`` yet, ``model_kwargs["padding_mask"] =
    mask_of()`` and :func:`placeholder_routing` with it. Nothing for a dense model, for kwargs
    that already carry the host's own mask (SkyRL's router replay), or where ``mask_of`` returns
    None (a micro-batch the host built itself); ``mask_of`` may raise where a mask is required."""
    if "padding_mask" in model_kwargs or not is_moe_model(model):
        yield
        return
    mask = mask_of()
    if mask is None:
        yield
        return
    model_kwargs["padding_mask"] = mask
    with placeholder_routing(model, mask):
        yield
