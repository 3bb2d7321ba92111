"""verl's config checks for ``use_dynamic_batch_size``, where verl checks its configs.

``patches/verl/0001`` calls :func:`check_role_config` from ``McoreActorConfig.__post_init__`` and
``McoreCriticConfig.__post_init__`` whenever ``megatron.use_dynamic_batch_size`` is not ``False``.
verl's driver builds those dataclasses in ``validate_config`` (``main_ppo.py``), before any worker
starts, so a setting the planned path does not support is refused there, in one line naming
verl's key and the fix, instead of inside the first ``forward_backward_batch`` after the model is
built and a rollout is done. (The reference model's engine follows the actor's setting.)

The flag must be a real boolean. Hydra's command line hands ``...use_dynamic_batch_size=off`` over
as the string ``'off'`` and verl's ``hydra.utils.instantiate`` passes it on unconverted: Python
reads a non-empty string as true, OmegaConf's ``BooleanNode`` as false. Neither reading may win
silently, so any value that is not ``True``/``False`` is refused, naming how OmegaConf reads it.

Where: ``patches/verl/0001`` calls :func:`check_verl_config` from verl's ``validate_config``
(``verl/utils/config.py``, run by ``main_ppo.main`` before any worker or Ray actor starts) when the
actor's or the critic's ``megatron.use_dynamic_batch_size`` is not ``False``: it sees the whole
trainer config, so each pass's own budget key is checked where the user set it (training:
``actor_rollout_ref.actor.ppo_max_token_len_per_gpu``; old log-probs:
``actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu``; reference log-probs:
``actor_rollout_ref.ref.log_prob_max_token_len_per_gpu``; critic: ``critic.ppo_max_token_len_per_gpu``
and ``critic.ppo_infer_max_token_len_per_gpu``), and the memory budget
``...megatron.dynbatch.max_memory_gib`` is planned against the model's ``config.json``
(:mod:`megatron_dynbatch.integrations.host_memory`).

Standard library only (``omegaconf`` only to say how it would read a value): it runs on verl's
driver.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import (
    VERL,
    check_budget,
    check_budget_holds_a_sample,
    check_host_planner,
    check_overhead,
    host_size,
)
from megatron_dynbatch.integrations.moe_args import refuse_quantile_balancing
from megatron_dynbatch.planning.spec import LAYOUT_FLAGS, ParallelLayout, setting_flags

__all__ = [
    "BUDGET_KEYS",
    "budget_key",
    "check_engine_config",
    "check_role_config",
    "check_verl_config",
    "dynbatch_settings",
    "parse_flag",
]

#: Where verl's actor keeps its Megatron engine config (the critic's is ``critic.megatron``).
ACTOR = "actor_rollout_ref.actor"
#: The budget key of each engine and pass, as verl's workers read them at the pinned commit:
#: ``(engine, forward_only) -> key``. The actor's log-prob pass reads the rollout's key, the
#: reference's its own (``engine_workers.py``); verl's v1 trainer (``trainer.use_v1``, its default)
#: gives the critic's training pass ``ppo_infer_max_token_len_per_gpu`` too (``trainer_base.py``).
BUDGET_KEYS = {
    ("actor", False): f"{ACTOR}.ppo_max_token_len_per_gpu",
    ("actor", True): "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    ("ref", True): "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    ("critic", False): "critic.ppo_max_token_len_per_gpu (critic.ppo_infer_max_token_len_per_gpu "
    "with trainer.use_v1=true)",
    ("critic", True): "critic.ppo_infer_max_token_len_per_gpu",
}
#: The critic's training budget outside verl's v1 trainer.
_CRITIC_TRAINING = "critic.ppo_max_token_len_per_gpu"


def budget_key(engine: str, forward_only: bool, engine_config: Any = None) -> str:
    """verl's budget key of ``engine`` (``actor``, ``ref``, ``critic``) for a pass.

    ``engine_config``: the engine's own config, where known (at step time). verl's trainers copy
    the critic's budgets into it (``max_token_len_per_gpu``, ``infer_max_token_len_per_gpu``);
    the v1 trainer copies ``ppo_infer_max_token_len_per_gpu`` into both, so two different values
    come from the other trainer, which trains the critic at ``critic.ppo_max_token_len_per_gpu``:
    that key alone is named. Equal values leave both keys named (raising both works either way).
    """
    if engine == "ref":
        return BUDGET_KEYS[("ref", True)]
    if engine == "critic" and not forward_only and engine_config is not None:
        train = getattr(engine_config, "max_token_len_per_gpu", None)
        infer = getattr(engine_config, "infer_max_token_len_per_gpu", None)
        if train is not None and infer is not None and train != infer:
            return _CRITIC_TRAINING
    return BUDGET_KEYS[(engine, forward_only)]


def _omegaconf_reading(value: Any) -> Optional[bool]:
    """How OmegaConf's ``BooleanNode`` reads ``value`` (``None``: it refuses it too)."""
    try:
        from omegaconf import BooleanNode
    except ImportError:  # pragma: no cover - verl always has omegaconf
        return None
    try:
        return BooleanNode(value=value)._value()
    except Exception:  # omegaconf's ValidationError: not a boolean in its grammar either
        return None


def parse_flag(value: Any, key: str) -> bool:
    """``value`` if it is a real boolean, else a ``DynBatchValueError`` naming ``key``."""
    if isinstance(value, bool):
        return value
    reading = _omegaconf_reading(value)
    how = (
        "OmegaConf does not read it as a boolean either"
        if reading is None
        else f"OmegaConf reads it as {str(reading).lower()}, Python as "
        f"{str(bool(value)).lower()}"
    )
    raise DynBatchValueError(f"{key}={value!r} is not a boolean ({how}); set {key}=true or false.")


def check_engine_config(config: Any, *, role: str = ACTOR) -> bool:
    """Check verl's ``McoreEngineConfig`` for ``use_dynamic_batch_size``; return the flag.

    Refused with the flag on, naming the key: a value that is not a boolean; dynamic context
    parallelism (verl's own micro-batch scheduler); router replay (its routed-expert tensors are
    restored by other indices); ``calculate_per_token_loss`` (set in
    ``override_transformer_config``, or turned on by Megatron-Bridge under context parallelism):
    verl then counts a micro-batch's tokens placeholders included.
    """
    key = f"{role}.megatron.use_dynamic_batch_size"
    if not parse_flag(getattr(config, "use_dynamic_batch_size", False), key):
        return False
    off = f"or set {key}=false"
    if getattr(config, "dynamic_context_parallel", False):
        raise DynBatchValueError(
            f"{role}.megatron.dynamic_context_parallel=true has its own micro-batch scheduler; "
            f"turn it off {off}."
        )
    _check_router_replay(config, f"{role}.megatron", key)
    overrides = getattr(config, "override_transformer_config", None) or {}
    refuse_quantile_balancing(
        overrides.get("moe_router_load_balancing_type"),
        f"{role}.megatron.override_transformer_config.moe_router_load_balancing_type",
        f"{key}=false",
    )
    if overrides.get("calculate_per_token_loss", False):
        raise DynBatchValueError(
            f"{role}.megatron.override_transformer_config.calculate_per_token_loss=true: verl "
            "counts a micro-batch's tokens placeholders included, so the gradient normalisation "
            f"would be off; remove it {off}."
        )
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1 and not getattr(config, "vanilla_mbridge", False):
        raise DynBatchValueError(
            f"{role}.megatron.context_parallel_size={cp} with Megatron-Bridge turns on "
            "calculate_per_token_loss, whose token count includes placeholders; use "
            f"{role}.megatron.context_parallel_size=1 (or {role}.megatron.vanilla_mbridge=true) "
            f"{off}."
        )
    return True


def _check_router_replay(config: Any, where: str, key: str) -> None:
    """Router replay (``{where}.router_replay.mode``) off with the flag ``key`` on: its
    routed-expert tensors are restored by other indices than the planned micro-batches'."""
    replay = getattr(getattr(config, "router_replay", None), "mode", "disabled")
    if replay not in (None, "disabled"):
        raise DynBatchValueError(
            f"{where}.router_replay.mode={replay!r} is not supported with {key}=true; set it to "
            f"disabled or set {key}=false."
        )


def check_role_config(config: Any, *, role: str = ACTOR) -> None:
    """Check an actor's or critic's config (``McoreActorConfig`` / ``McoreCriticConfig``).

    Its Megatron engine config first (:func:`check_engine_config`); then, with the flag on,
    verl's own ``use_dynamic_bsz`` must be on too (it gives the token budget; without it our flag
    would be ignored), and the role's router replay off.

    Raises:
        DynBatchValueError: one line naming ``role``'s key and the fix.
    """
    engine = getattr(config, "megatron", None)
    key = f"{role}.megatron.use_dynamic_batch_size"
    if engine is None or not check_engine_config(engine, role=role):
        return
    if not parse_flag(getattr(config, "use_dynamic_bsz", False), f"{role}.use_dynamic_bsz"):
        raise DynBatchValueError(
            f"{key}=true plans verl's dynamic batches, but {role}.use_dynamic_bsz=false (fixed "
            f"micro-batches, no token budget): set {role}.use_dynamic_bsz=true with "
            f"{role}.ppo_max_token_len_per_gpu, or {key}=false."
        )
    _check_router_replay(config, role, key)


_ABSENT = object()


def _get(node: Any, dotted: str, default: Any = None) -> Any:
    """``node.a.b`` of an OmegaConf config, a mapping or an object; ``default`` where a key is
    absent (an explicit ``null`` is ``None``: a user's value, checked like any other)."""
    for part in dotted.split("."):
        if node is None or node is _ABSENT:
            return default
        if hasattr(node, "get") and not isinstance(node, type):
            node = node.get(part, _ABSENT)
        else:
            node = getattr(node, part, _ABSENT)
    return default if node is _ABSENT else node


#: The rows verl's Megatron engine runs, by the model's ``use_remove_padding``.
_LAYOUTS = {True: "packed", False: "padded"}

#: What ``megatron.dynbatch`` (verl's one dict option for megatron_dynbatch's settings) may hold.
DYNBATCH_KEYS = ("max_memory_gib", "planner", "cost_microbatch_overhead")


def _plain(value: Any) -> Any:
    """An OmegaConf mapping (or any mapping) as a plain dict, to compare and show; else as is."""
    return dict(value.items()) if hasattr(value, "items") else value


def _packed(config: Any, role: str, section: Any) -> Any:
    """Whether verl's Megatron engine runs the role's rows packed (THD): its worker sets the
    engine's ``use_remove_padding`` from the role's model config ("we use the one defined in
    model"), not from ``megatron.use_remove_padding`` (a probe: the check read that one)."""
    if role == ACTOR:
        return _get(config, "actor_rollout_ref.model.use_remove_padding", False)
    return _get(section, "model.use_remove_padding", False)


def dynbatch_settings(section: Any, role: str, packed: Any) -> dict:
    """``{role}.megatron.dynbatch`` as a plain dict (``null`` or absent: empty, as if not set);
    ``packed``: the role's rows (:func:`_packed`), which a named planner must plan.

    Raises:
        DynBatchValueError: a key it does not know (a typo would otherwise be ignored), a
            planner name nothing registers, or a per-micro-batch overhead that is not a finite
            number >= 0, naming verl's key.
    """
    raw = _get(section, "megatron.dynbatch", None)
    if raw is None:
        return {}
    items = _plain(raw)
    where = f"{role}.megatron.dynbatch"
    if not isinstance(items, dict):
        raise DynBatchValueError(
            f"{where}={raw!r} must be a mapping of {', '.join(DYNBATCH_KEYS)}, e.g. "
            f"+{where}.max_memory_gib=70."
        )
    unknown = sorted(set(items) - set(DYNBATCH_KEYS))
    if unknown:
        raise DynBatchValueError(
            f"{where} has unknown key(s) {unknown}; it takes {', '.join(DYNBATCH_KEYS)}."
        )
    planner = items.get("planner")
    if planner is not None:
        host = replace(VERL, keys={**VERL.keys, "planner": f"{where}.planner"})
        check_host_planner(
            host, planner, _LAYOUTS.get(packed) if isinstance(packed, bool) else None
        )
    overhead = items.get("cost_microbatch_overhead")
    key = f"{where}.cost_microbatch_overhead"
    check_overhead(overhead, f"{key}={overhead!r}", f"+{key}=330")
    return items


#: The parallel sizes a role's ``megatron`` section sets, as verl names them.
_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "virtual_pipeline_model_parallel_size",
)


def role_layout_flags(role: str) -> Dict[str, str]:
    """verl's option names of the parallel sizes for ``role`` (``ACTOR`` or ``critic``)."""
    return {
        field: flag.replace(f"{ACTOR}.megatron", f"{role}.megatron")
        for field, flag in LAYOUT_FLAGS["verl"].items()
    }


def _role_sizes(role: str, section: Any) -> Dict[str, int]:
    """The role's parallel sizes (:data:`_SIZES`), each a whole number >= 1 (1 where unset),
    refused by its key (``{role}.megatron.<size>``) otherwise."""
    megatron = _get(section, "megatron")
    return {name: host_size(_get(megatron, name), f"{role}.megatron.{name}") for name in _SIZES}


def _layout(role: str, section: Any, sizes: Dict[str, int], budget: int, key: str) -> None:
    """The role's pipeline layout at config time (verl's engine builds it at the first step),
    in verl's option names: interleaving without a pipeline, a group below pp; and a budget
    ``key`` that holds one sample padded to the role's tp (and 2 x cp)."""
    tp, pp, cp, vpp = (sizes[name] for name in _SIZES)
    check_budget_holds_a_sample(VERL, budget, ParallelLayout(tp_size=tp, cp_size=cp), key)
    megatron = _get(section, "megatron")
    group = _get(megatron, "override_transformer_config.microbatch_group_size_per_vp_stage")
    with setting_flags(role_layout_flags(role), tool="verl"):
        ParallelLayout(
            pp_size=pp,
            vpp_size=vpp,
            microbatch_group_size_per_vp_stage=group if vpp > 1 else None,
        )


def _memory(
    config: Any, role: str, section: Any, sizes: Dict[str, int], token_key: str, tokens: int
) -> None:
    """``{role}.megatron.dynbatch.max_memory_gib``: a micro-batch at the training budget fits."""
    from megatron_dynbatch.integrations.host_memory import (
        check_memory_budget,
        hf_model_config,
        hf_model_dims,
        host_memory_limit,
        parse_gib,
    )

    key = f"{role}.megatron.dynbatch.max_memory_gib"
    settings = dynbatch_settings(section, role, _packed(config, role, section))
    gib = parse_gib(settings.get("max_memory_gib"), key)
    if gib is None:
        return
    megatron = _get(section, "megatron")
    model_key = "actor_rollout_ref.model.path" if role == ACTOR else "critic.model.path"
    path = _get(config, model_key)
    hf = hf_model_config(path, key=key, path_key=model_key)
    tp, pp, cp, vpp = (sizes[name] for name in _SIZES)
    gpus = host_size(_get(config, "trainer.n_gpus_per_node"), "trainer.n_gpus_per_node") * (
        host_size(_get(config, "trainer.nnodes"), "trainer.nnodes")
    )
    parallel = ParallelLayout(
        dp_size=max(1, gpus // (tp * pp * cp)),
        tp_size=tp,
        pp_size=pp,
        cp_size=cp,
        vpp_size=vpp,
        microbatch_group_size_per_vp_stage=pp if vpp > 1 else None,
    )
    dims = hf_model_dims(
        hf,
        parallel,
        params_dtype="fp32" if str(_get(megatron, "dtype", "bfloat16")) == "float32" else "bf16",
        sequence_parallel=bool(_get(megatron, "sequence_parallel", True)) and tp > 1,
        ep_size=int(_get(megatron, "expert_model_parallel_size") or 1),
    )
    overrides = _get(megatron, "override_transformer_config", {}) or {}
    limit = host_memory_limit(
        gib,
        dims,
        distributed_optimizer=bool(_get(megatron, "use_distributed_optimizer", True)),
        transformer_config=overrides,
    )
    # verl's micro-batch holds cp x the per-GPU budget, split over the CP ranks.
    check_memory_budget(
        limit, tokens * cp, key=key, gib=gib, token_key=token_key, token_value=tokens
    )


def _holds_a_sample(budget: int, sizes: Dict[str, int], key: str) -> None:
    """``key``'s budget holds one sample padded to the engine's tp (and 2 x cp)."""
    parallel = ParallelLayout(
        tp_size=sizes["tensor_model_parallel_size"], cp_size=sizes["context_parallel_size"]
    )
    check_budget_holds_a_sample(VERL, budget, parallel, key)


def _ref_sizes(config: Any, actor_sizes: Dict[str, int]) -> Dict[str, int]:
    """The reference engine's parallel sizes: its own ``ref.megatron.<size>`` where set (verl's
    YAML interpolates the actor's), else the actor's."""
    megatron = _get(config, "actor_rollout_ref.ref.megatron")
    sizes = dict(actor_sizes)
    for name in _SIZES:
        value = _get(megatron, name)
        if value is not None:
            sizes[name] = host_size(value, f"actor_rollout_ref.ref.megatron.{name}")
    return sizes


def _ref_follows_the_actor(actor: Any, ref: Any) -> None:
    """The reference model's ``megatron.use_dynamic_batch_size`` and ``megatron.dynbatch`` follow
    the actor's (patch 0001's YAML interpolates them): set otherwise, they were never checked
    here and failed at the reference's first log-prob pass, on the workers (a probe)."""
    where = "actor_rollout_ref.ref.megatron"
    for key, default in (("use_dynamic_batch_size", False), ("dynbatch", None)):
        mine = _get(ref, f"megatron.{key}", _ABSENT)
        if mine is _ABSENT:  # a config without the key: the reference runs verl's own batching
            continue
        theirs = _get(actor, f"megatron.{key}", default)
        mine, theirs = _plain(mine), _plain(theirs)
        if (mine or default) != (theirs or default):
            raise DynBatchValueError(
                f"{where}.{key}={mine!r} differs from {ACTOR}.megatron.{key}={theirs!r}: the "
                "reference model's log-prob pass is planned as the actor's, whose setting it "
                f"follows; drop the {where}.{key} override and set {ACTOR}.megatron.{key}."
            )


def _settings_need_the_switch(role: str, section: Any) -> None:
    """Refuse ``{role}.megatron.dynbatch`` set with the role's switch off: only the switch reads
    it, so it was ignored unseen (patch 0001 calls :func:`check_verl_config` when it is set)."""
    settings = _get(section, "megatron.dynbatch", None)
    if not settings or _get(section, "megatron.use_dynamic_batch_size", False) is not False:
        return
    raise DynBatchValueError(
        f"{role}.megatron.dynbatch={_plain(settings)!r} is read only by megatron_dynbatch's dynamic "
        f"batching, which is off ({role}.megatron.use_dynamic_batch_size=false): it would be "
        f"ignored. Set {role}.megatron.use_dynamic_batch_size=true (with {role}.use_dynamic_bsz="
        f"true), or drop {role}.megatron.dynbatch."
    )


def check_verl_config(config: Any, *, use_reference_policy: bool, use_critic: bool) -> None:
    """verl's whole trainer config (``validate_config``), with the switch on in the actor or the
    critic: each role's settings (:func:`check_role_config`), each pass's budget key
    (:data:`BUDGET_KEYS`) and the memory budget, one line naming verl's key; and a role's
    ``megatron.dynbatch`` set with its switch off.

    Raises:
        DynBatchValueError: the first setting refused.
    """
    actor = _get(config, ACTOR)
    critic = _get(config, "critic")
    for role, section in ((ACTOR, actor), ("critic", critic if use_critic else None)):
        _settings_need_the_switch(role, section)
    if use_reference_policy:
        _ref_follows_the_actor(actor, _get(config, "actor_rollout_ref.ref"))
    if actor is not None and _get(actor, "megatron") is not None:
        flag = _get(actor, "megatron.use_dynamic_batch_size", False)
        if flag is not False:
            switch = f"{ACTOR}.megatron.use_dynamic_batch_size=true"
            check_role_config(actor, role=ACTOR)
            dynbatch_settings(actor, ACTOR, _packed(config, ACTOR, actor))
            key = BUDGET_KEYS[("actor", False)]
            tokens = check_budget(_get(actor, "ppo_max_token_len_per_gpu"), key, switch)
            rollout = "actor_rollout_ref.rollout"
            if not parse_flag(
                _get(config, f"{rollout}.log_prob_use_dynamic_bsz", False),
                f"{rollout}.log_prob_use_dynamic_bsz",
            ):
                # verl's worker asserts the two agree, after the cluster has started.
                raise DynBatchValueError(
                    f"{rollout}.log_prob_use_dynamic_bsz=false with {ACTOR}.use_dynamic_bsz=true: "
                    f"verl's worker requires them equal; set {rollout}.log_prob_use_dynamic_bsz="
                    f"true (with {BUDGET_KEYS[('actor', True)]})."
                )
            log_probs = check_budget(
                _get(config, f"{rollout}.log_prob_max_token_len_per_gpu"),
                BUDGET_KEYS[("actor", True)],
                switch,
            )
            ref = "actor_rollout_ref.ref"
            ref_log_probs = None
            if use_reference_policy and _get(config, f"{ref}.log_prob_use_dynamic_bsz", False):
                ref_log_probs = check_budget(
                    _get(config, f"{ref}.log_prob_max_token_len_per_gpu"),
                    BUDGET_KEYS[("ref", True)],
                    switch,
                )
            sizes = _role_sizes(ACTOR, actor)
            _layout(ACTOR, actor, sizes, tokens, key)
            # The log-prob passes' budgets hold one padded sample of their engine's layout (a
            # probe: a budget of 3 at tp 8 passed here and was refused at the first log-prob
            # pass, on the workers, after the rollout).
            _holds_a_sample(log_probs, sizes, BUDGET_KEYS[("actor", True)])
            if ref_log_probs is not None:
                _holds_a_sample(
                    ref_log_probs, _ref_sizes(config, sizes), BUDGET_KEYS[("ref", True)]
                )
            _memory(config, ACTOR, actor, sizes, key, tokens)
    if not use_critic or critic is None or _get(critic, "megatron") is None:
        return
    if _get(critic, "megatron.use_dynamic_batch_size", False) is False:
        return
    switch = "critic.megatron.use_dynamic_batch_size=true"
    check_role_config(critic, role="critic")
    dynbatch_settings(critic, "critic", _packed(config, "critic", critic))
    tokens = check_budget(_get(critic, "ppo_max_token_len_per_gpu"), _CRITIC_TRAINING, switch)
    infer = check_budget(
        _get(critic, "ppo_infer_max_token_len_per_gpu", 32768),
        BUDGET_KEYS[("critic", True)],
        switch,
    )
    if _get(config, "trainer.use_v1", False) is True:
        # verl's v1 trainer trains the critic at ppo_infer_max_token_len_per_gpu (trainer_base.py).
        tokens = infer
        key = BUDGET_KEYS[("critic", True)]
    else:
        key = _CRITIC_TRAINING
    sizes = _role_sizes("critic", critic)
    _layout("critic", critic, sizes, tokens, key)
    _holds_a_sample(infer, sizes, BUDGET_KEYS[("critic", True)])
    _memory(config, "critic", critic, sizes, key, tokens)
