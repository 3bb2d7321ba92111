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

Standard library only (``omegaconf`` only to say how it would read a value): it runs on verl's
driver.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["check_engine_config", "check_role_config", "parse_flag"]

#: Where verl's actor keeps its Megatron engine config (the critic's is ``critic.megatron``).
ACTOR = "actor_rollout_ref.actor"


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
    replay = getattr(getattr(config, "router_replay", None), "mode", "disabled")
    if replay not in (None, "disabled"):
        raise DynBatchValueError(
            f"{role}.megatron.router_replay.mode={replay!r} is not supported with {key}=true; "
            f"set it to disabled {off}."
        )
    overrides = getattr(config, "override_transformer_config", None) or {}
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
            f"context_parallel_size=1 (or vanilla_mbridge=true) {off}."
        )
    return True


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
    replay = getattr(getattr(config, "router_replay", None), "mode", "disabled")
    if replay not in (None, "disabled"):
        raise DynBatchValueError(
            f"{role}.router_replay.mode={replay!r} is not supported with {key}=true; set it to "
            f"disabled or {key}=false."
        )
