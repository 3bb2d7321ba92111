"""SkyRL's ``validate_cfg`` for ``trainer.use_dynamic_batch_size`` (patch 0001 calls it).

The flag changes only the Megatron worker's micro-batches, so a config that sets it where it would
do nothing is refused at start-up, one line naming the keys and the fix, instead of training as if
it were off (``strategy=fsdp``), failing at the first step (no ``max_tokens_per_microbatch``, or
one that is not a whole number of tokens) or reading a typo as on
(``use_dynamic_batch_size=yes_please`` is a non-empty string).

``trainer.max_memory_gib`` (patch 0001 adds it beside the flag): the GiB one training GPU may
hold at its peak. With the flag on it is planned at config time against the policy's (and a
critic's) ``config.json`` under their ``megatron_config`` layout: a micro-batch of
``max_tokens_per_microbatch`` tokens (SkyRL's budget caps the whole micro-batch, whatever the
context-parallel size) must fit every pipeline stage, else it is refused naming the key, the
smallest budget that works and the largest token budget that fits
(:mod:`megatron_dynbatch.integrations.host_memory`).

``trainer.dynamic_batch_cost_microbatch_overhead`` (patch 0001, beside the planner): one
micro-batch's fixed cost in tokens of one GPU's linear work, refused here unless a finite number
>= 0 (the worker reads it at every step; a bad value would otherwise fail only there).

Standard library only: SkyRL's config validation runs on the driver, before any worker.
"""

from __future__ import annotations

from typing import Any, Tuple

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import (
    SKYRL,
    check_budget_holds_a_sample,
    check_host_budget,
    check_host_planner,
    check_overhead,
    host_size,
)
from megatron_dynbatch.integrations.moe_args import refuse_quantile_balancing

__all__ = ["validate_trainer_config"]

SWITCH = "trainer.use_dynamic_batch_size"
BUDGET = SKYRL.key("max_tokens_per_gpu")
MEMORY = "trainer.max_memory_gib"
OVERHEAD = SKYRL.key("cost_microbatch_overhead")
#: Our keys in SkyRL's trainer config (patch 0001). Only the switch reads them: given with it off
#: they were ignored unseen (stock SkyRL refuses them as unknown keys).
OWN_KEYS = ("max_memory_gib", "dynamic_batch_planner", "dynamic_batch_cost_microbatch_overhead")


def _check_planner(name: Any) -> None:
    """``trainer.dynamic_batch_planner``: a planner registered by that name, planning the packed
    rows SkyRL's micro-batches are planned as (``None``: ours)."""
    if name is None:
        return
    check_host_planner(SKYRL, name, SKYRL.fixed["layout"])


#: Roles that run a Megatron model through the planned micro-batches (the reference too: its
#: log-prob pass is planned under the same budget).
ROLES = ("policy", "critic", "ref")


def _refuse_routing_replay(trainer: Any) -> None:
    """Router replay restores each micro-batch's recorded experts by position, and a placeholder
    row has none: its tokens would count in every router statistic (a probe). Refused, as verl
    refuses its router replay with the switch."""
    for role in ROLES:
        megatron = getattr(getattr(trainer, role, None), "megatron_config", None)
        if getattr(megatron, "moe_enable_routing_replay", False) is True:
            raise DynBatchValueError(
                f"trainer.{role}.megatron_config.moe_enable_routing_replay=true with {SWITCH}="
                "true: routing replay restores recorded experts per micro-batch, and the planned "
                "placeholder rows have none, so their tokens would count in the router's "
                f"statistics; set trainer.{role}.megatron_config.moe_enable_routing_replay=false "
                "(with generator.inference_engine.enable_return_routed_experts=false, which SkyRL "
                f"requires with it), or {SWITCH}=false (SkyRL's own micro-batches)."
            )


def _role_sizes(megatron: Any, role: str) -> Tuple[int, int, int]:
    """``(tp, pp, cp)`` of a role's ``megatron_config`` (1 where unset), each refused by its key
    (``trainer.{role}.megatron_config.<size>``) unless a whole number >= 1."""
    tp, pp, cp = (
        host_size(getattr(megatron, name, None), f"trainer.{role}.megatron_config.{name}")
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        )
    )
    return tp, pp, cp


def _check_padding(trainer: Any, budget: int) -> None:
    """The budget holds one padded sample of each trained model's layout (tp, 2 x cp): at
    config time, not at the first step."""
    from megatron_dynbatch.planning.spec import ParallelLayout

    for role in ROLES:
        megatron = getattr(getattr(trainer, role, None), "megatron_config", None)
        if megatron is None:
            continue
        tp, _pp, cp = _role_sizes(megatron, role)
        layout = ParallelLayout(tp_size=tp, cp_size=cp)
        check_budget_holds_a_sample(SKYRL, budget, layout, BUDGET)


def _check_interleaving(trainer: Any) -> None:
    """Each role's interleaving (``transformer_config_kwargs``' ``virtual_pipeline_model_parallel_size``
    and ``microbatch_group_size_per_vp_stage``, which SkyRL hands Megatron's provider as they
    are) as the first step's plan reads it: a group under the pipeline size passed SkyRL's
    ``validate_cfg`` and was refused at the first step (a probe)."""
    from megatron_dynbatch.planning.spec import ParallelLayout, setting_flags

    for role in ROLES:
        megatron = getattr(getattr(trainer, role, None), "megatron_config", None)
        if megatron is None:
            continue
        _tp, pp, _cp = _role_sizes(megatron, role)
        kwargs = getattr(megatron, "transformer_config_kwargs", None) or {}
        vpp, group = (
            kwargs.get(name) if hasattr(kwargs, "get") else None
            for name in (
                "virtual_pipeline_model_parallel_size",
                "microbatch_group_size_per_vp_stage",
            )
        )
        if vpp is None or vpp == 1:
            continue  # only the interleaved schedule reads the group
        section = f"trainer.{role}.megatron_config"
        keys = {
            "pp_size": f"{section}.pipeline_model_parallel_size",
            "vpp_size": f"{section}.transformer_config_kwargs.virtual_pipeline_model_parallel_size",
            "microbatch_group_size_per_vp_stage": (
                f"{section}.transformer_config_kwargs.microbatch_group_size_per_vp_stage"
            ),
        }
        with setting_flags(keys, tool="SkyRL"):
            ParallelLayout(pp_size=pp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group)


def _check_memory(trainer: Any, budget: int) -> None:
    from megatron_dynbatch.integrations.host_memory import (
        check_memory_budget,
        hf_model_config,
        hf_model_dims,
        host_memory_limit,
        parse_gib,
    )
    from megatron_dynbatch.planning.spec import ParallelLayout, setting_flags

    gib = parse_gib(getattr(trainer, "max_memory_gib", None), MEMORY)
    if gib is None:
        return
    placement = getattr(trainer, "placement", None)
    for role in ("policy", "critic"):
        section = getattr(trainer, role, None)
        path = getattr(getattr(section, "model", None), "path", None)
        if section is None or (role == "critic" and not path):
            continue
        megatron = getattr(section, "megatron_config", None)
        tp, pp, cp = _role_sizes(megatron, role)
        gpus = host_size(
            getattr(placement, f"{role}_num_gpus_per_node", None),
            f"trainer.placement.{role}_num_gpus_per_node",
        ) * host_size(
            getattr(placement, f"{role}_num_nodes", None), f"trainer.placement.{role}_num_nodes"
        )
        parallel = ParallelLayout(
            dp_size=max(1, gpus // (tp * pp * cp)), tp_size=tp, pp_size=pp, cp_size=cp
        )
        hf = hf_model_config(path, key=MEMORY, path_key=f"trainer.{role}.model.path")
        # Heads that do not split over tp are named by this role's key, not `tp_size`.
        with setting_flags(
            {"tp_size": f"trainer.{role}.megatron_config.tensor_model_parallel_size"}, tool="SkyRL"
        ):
            dims = hf_model_dims(
                hf,
                parallel,
                # SkyRL turns Megatron's sequence parallelism on whenever tp > 1.
                sequence_parallel=tp > 1,
                ep_size=int(getattr(megatron, "expert_model_parallel_size", 1) or 1),
            )
        kwargs = getattr(megatron, "transformer_config_kwargs", None) or {}
        limit = host_memory_limit(gib, dims, distributed_optimizer=True, transformer_config=kwargs)
        check_memory_budget(
            limit, budget, key=MEMORY, gib=gib, token_key=BUDGET, token_value=budget
        )


def validate_trainer_config(trainer: Any) -> None:
    """Refuse a SkyRL ``trainer`` config whose ``use_dynamic_batch_size`` would do nothing, or
    whose budgets cannot be planned.

    Args:
        trainer: SkyRL's ``TrainerConfig`` (``cfg.trainer``). Read: ``use_dynamic_batch_size``,
            ``strategy``, ``max_tokens_per_microbatch``, ``dynamic_batch_planner``,
            ``dynamic_batch_cost_microbatch_overhead``, ``max_memory_gib``, and for the memory
            budget the policy's and critic's ``model.path`` and ``megatron_config`` and the
            placement's GPU counts.

    Raises:
        DynBatchValueError: the flag is not a boolean; it is off with one of our keys given
            (:data:`OWN_KEYS`: it would be ignored); it is on with a strategy other than
            ``megatron``; it is on without ``max_tokens_per_microbatch`` a whole number > 0; the
            planner is not registered; the per-micro-batch overhead is not a finite number >= 0;
            the memory budget is not a number of GiB > 0, or too small for one micro-batch; a
            role's interleaving group is under its pipeline size.
    """
    flag = trainer.use_dynamic_batch_size
    if not isinstance(flag, bool):
        raise DynBatchValueError(f"{SWITCH}={flag!r} is not a boolean; set it to true or false.")
    if not flag:
        given = [(k, getattr(trainer, k, None)) for k in OWN_KEYS]
        given = [(k, v) for k, v in given if v is not None]
        if given:
            key, value = given[0]
            raise DynBatchValueError(
                f"trainer.{key}={value!r} is read only by megatron_dynbatch's dynamic batching, "
                f"which is off ({SWITCH}=false): it would be ignored. Set {SWITCH}=true, or drop "
                f"trainer.{key}."
            )
        return
    if trainer.strategy != "megatron":
        raise DynBatchValueError(
            f"{SWITCH}=true plans the Megatron worker's micro-batches only; "
            f"trainer.strategy={trainer.strategy!r} would ignore it: set trainer.strategy=megatron "
            f"or {SWITCH}=false."
        )
    budget = check_host_budget(SKYRL, trainer.max_tokens_per_microbatch)
    _check_planner(getattr(trainer, "dynamic_batch_planner", None))
    _refuse_routing_replay(trainer)
    overhead = getattr(trainer, "dynamic_batch_cost_microbatch_overhead", None)
    check_overhead(overhead, f"{OVERHEAD}={overhead!r}", f"{OVERHEAD}=330")
    _check_padding(trainer, budget)
    _check_interleaving(trainer)
    _check_memory(trainer, budget)
    for role in ("policy", "critic"):
        megatron_config = getattr(getattr(trainer, role, None), "megatron_config", None)
        kwargs = getattr(megatron_config, "transformer_config_kwargs", None) or {}
        for where, kinds in (
            ("", getattr(megatron_config, "moe_router_load_balancing_type", None)),
            ("transformer_config_kwargs.", kwargs.get("moe_router_load_balancing_type")),
        ):
            refuse_quantile_balancing(
                kinds,
                f"trainer.{role}.megatron_config.{where}moe_router_load_balancing_type",
                f"{SWITCH}=false",
            )
