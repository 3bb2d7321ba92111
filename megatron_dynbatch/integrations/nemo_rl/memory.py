"""``policy.megatron_cfg.dynbatch.max_memory_gib`` in NeMo-RL: the per-stage memory model of the
policy's model and Megatron layout, the budget every pass is planned under, and the config-time
check that one micro-batch of the longest sample NeMo-RL allows fits it.

NeMo-RL describes the model by its Hugging Face config (``policy.model_name``; NeMo-RL's own
``get_default_hf_config`` reads it, as its FLOPs tracker does) and the Megatron layout by
``policy.megatron_cfg``. Both are read here into the names Megatron's flags use, so the model is
the one every host plans with (:func:`~megatron_dynbatch.integrations.model_args.
memory_model_from_flags`). As in slime, the driver sees no training GPU: nothing is calibrated,
activations are counted x :data:`~megatron_dynbatch.planning.memory.UNFITTED_SAFETY` and the
budget counts tensors (leave room for the CUDA context, NCCL and the allocator's cache).

Standard library and the pure planner only.
"""

from __future__ import annotations

import types
from typing import Any, Mapping, Optional

from megatron_dynbatch.config import attention_from_megatron
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.host_memory import check_row_fits, parse_gib
from megatron_dynbatch.integrations.hosts import NEMO_RL
from megatron_dynbatch.integrations.model_args import memory_model_from_flags
from megatron_dynbatch.planning.memory import MemoryLimit, MemoryModel, gib_to_bytes
from megatron_dynbatch.planning.spec import LAYOUT_FLAGS, ParallelLayout, round_up

__all__ = [
    "KEY",
    "check_memory_budget",
    "nemo_rl_max_memory_gib",
    "nemo_rl_memory_limit",
    "nemo_rl_memory_model",
]

#: The key, as a NeMo-RL user sets it.
KEY = "policy.megatron_cfg.dynbatch.max_memory_gib"
#: Hugging Face activations that gate the MLP (Megatron's ``--swiglu``).
_GATED = ("silu", "swiglu", "swish")


def nemo_rl_max_memory_gib(policy_cfg: Mapping[str, Any]) -> Optional[float]:
    """The budget in GiB, or ``None`` where it is not set (``null`` included)."""
    section = (policy_cfg.get("megatron_cfg") or {}).get("dynbatch") or {}
    # One reading for every host: a number, or a string of one ("70" from an interpolation).
    return parse_gib(section.get("max_memory_gib"), KEY)


def _megatron_args(policy_cfg: Mapping[str, Any], hf_config: Any) -> Any:
    """The Hugging Face config and ``policy.megatron_cfg`` in Megatron's flag names."""
    megatron_cfg = policy_cfg.get("megatron_cfg") or {}
    hf = hf_config
    heads = int(hf.num_attention_heads)
    groups = int(getattr(hf, "num_key_value_heads", None) or heads)
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0
    precision = str(policy_cfg.get("precision", "bfloat16"))
    optimizer = megatron_cfg.get("optimizer") or {}
    return types.SimpleNamespace(
        num_layers=int(hf.num_hidden_layers),
        hidden_size=int(hf.hidden_size),
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=getattr(hf, "head_dim", None),
        ffn_hidden_size=int(getattr(hf, "intermediate_size", None) or 4 * int(hf.hidden_size)),
        swiglu=str(getattr(hf, "hidden_act", "")) in _GATED,
        vocab_size=int(hf.vocab_size),
        tensor_model_parallel_size=int(megatron_cfg.get("tensor_model_parallel_size", 1) or 1),
        add_bias_linear=bool(getattr(hf, "attention_bias", False)),
        normalization="RMSNorm" if hasattr(hf, "rms_norm_eps") else "LayerNorm",
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=not bool(getattr(hf, "tie_word_embeddings", False)),
        bf16=precision in ("bfloat16", "bf16"),
        fp16=precision in ("float16", "fp16"),
        sequence_parallel=bool(megatron_cfg.get("sequence_parallel", False)),
        num_experts=int(experts) or None,
        moe_ffn_hidden_size=getattr(hf, "moe_intermediate_size", None),
        moe_router_topk=getattr(hf, "num_experts_per_tok", None),
        expert_model_parallel_size=int(megatron_cfg.get("expert_model_parallel_size", 1) or 1),
        recompute_granularity="full" if megatron_cfg.get("activation_checkpointing") else None,
        use_distributed_optimizer=bool(optimizer.get("use_distributed_optimizer", False)),
    )


def nemo_rl_memory_model(
    policy_cfg: Mapping[str, Any], hf_config: Any, parallel: ParallelLayout
) -> MemoryModel:
    """The planner's per-stage memory model of the policy (uncalibrated, activations counted x
    ``UNFITTED_SAFETY``; attention as NeMo-RL's sequence packing runs it: THD segments).

    Raises:
        DynBatchValueError: the model config lacks a dimension, naming ``policy.model_name``.
    """
    try:
        args = _megatron_args(policy_cfg, hf_config)
        # NeMo-RL's sequence packing runs transformer-engine's THD attention: per-sample segments.
        with NEMO_RL.flags():
            return memory_model_from_flags(
                args, parallel, attention_from_megatron(None, None, "packed"), unfitted=True
            )
    except DynBatchValueError as error:
        if f"multiples of {LAYOUT_FLAGS['NeMo-RL']['tp_size']}" in str(error):
            raise  # the layout's, named by its key (the model's config is fine)
        raise DynBatchValueError(
            f"{KEY} needs the model's dimensions from policy.model_name="
            f"{policy_cfg.get('model_name')!r}'s config ({error}); use a model whose config "
            f"gives them, or drop {KEY}."
        ) from error
    except (AttributeError, TypeError, ValueError) as error:
        raise DynBatchValueError(
            f"{KEY} needs the model's dimensions from policy.model_name="
            f"{policy_cfg.get('model_name')!r}'s config ({error}); use a model whose config "
            f"gives them, or drop {KEY}."
        ) from error


def nemo_rl_memory_limit(
    policy_cfg: Mapping[str, Any], hf_config: Any, parallel: ParallelLayout
) -> Optional[MemoryLimit]:
    """The budget the planner keeps every stage's predicted peak within; ``None`` without it."""
    gib = nemo_rl_max_memory_gib(policy_cfg)
    if gib is None:
        return None
    return MemoryLimit(
        model=nemo_rl_memory_model(policy_cfg, hf_config, parallel),
        budget_bytes=gib_to_bytes(gib),
        row_multiple=parallel.sample_multiple,
    )


def check_memory_budget(policy_cfg: Mapping[str, Any], limit: MemoryLimit) -> None:
    """Refuse, at config time, a budget under which the longest sample NeMo-RL allows
    (``policy.max_total_sequence_length``, or the training budget where that is smaller) cannot
    train alone in one micro-batch: then no plan exists for it.

    Raises:
        DynBatchValueError: naming the key, its value, the stage, and the smallest budget that works.
    """
    packing = policy_cfg.get("sequence_packing") or {}
    pad = int(policy_cfg.get("make_sequence_length_divisible_by", 1) or 1)
    # The key that bounds the longest sample is the one named (and the one to lower).
    bounds = [
        (int(value), key)
        for key, value in (
            ("policy.max_total_sequence_length", policy_cfg.get("max_total_sequence_length")),
            ("policy.sequence_packing.train_mb_tokens", packing.get("train_mb_tokens")),
        )
        if value
    ]
    if not bounds:
        return  # nothing bounds a sample here: each step's plan checks its own rows
    longest, bound_key = min(bounds)
    row = round_up(longest, max(pad, limit.row_multiple))
    what = f"one micro-batch of {row} tokens (a sample of {bound_key}={longest}, padded)"
    check_row_fits(
        limit,
        row,
        setting=f"{KEY}={nemo_rl_max_memory_gib(policy_cfg):g}",
        what=what,
        fix=lambda smallest: (
            f"raise {KEY} to at least {smallest:.3f}, set "
            f"policy.megatron_cfg.activation_checkpointing=true, or lower {bound_key}"
        ),
    )
