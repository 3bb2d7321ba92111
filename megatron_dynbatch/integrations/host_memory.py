"""A memory budget in a host's own key (verl's ``...megatron.max_memory_gib``, SkyRL's
``trainer.max_memory_gib``), checked on the host's driver at config time.

Hosts that build their model from a Hugging Face checkpoint (verl, SkyRL) know its dimensions at
config time only from the checkpoint's ``config.json``: :func:`hf_model_dims` reads it (a local
directory, or the Hugging Face cache, never the network) into the :class:`ModelDims` the per-stage
memory model (:mod:`megatron_dynbatch.planning.memory`) counts, with the host's parallel layout.

What is checked, and why it is the plan's bound: these hosts pack a micro-batch into one THD row
of at most the token budget (a hard cap but for a single longer sample, which the host refuses or
runs alone), and a stage's predicted peak grows with a row's tokens. So if one row at the token
budget fits every stage, with as many micro-batches alive as the schedule ever keeps, every
micro-batch the planner makes fits; if it does not, the budget is refused at config time naming
the memory key, the stage, the smallest budget that works and the largest token budget that fits.

The prediction is the uncalibrated one slime's planner uses: activations counted x
:data:`~megatron_dynbatch.planning.memory.UNFITTED_SAFETY`, tensors only (the budget is what
``torch.cuda.max_memory_allocated`` would show at the peak), flash attention (no ``S x S`` scores),
Adam in bf16 mixed precision. Forward-only passes (log-probs, values) keep no activations for a
backward; they are not checked against the training model, which would refuse what fits.

Standard library and the pure planner only: it runs on the host's driver, before any worker.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Callable, Mapping, Optional

from megatron_dynbatch.config import GIB_RANGE, is_gib
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning.memory import (
    GIB,
    UNFITTED_SAFETY,
    MemoryLimit,
    MemoryModel,
    block_recompute_layers,
    budget_gib,
    gib_to_bytes,
)
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.spec import ParallelLayout, round_up

__all__ = [
    "check_memory_budget",
    "hf_model_config",
    "hf_model_dims",
    "host_memory_limit",
    "check_row_fits",
    "parse_gib",
]

#: Megatron-Bridge pads the vocabulary to a multiple of this times tp, as Megatron does.
VOCAB_MULTIPLE = 128
#: Hugging Face activations of a gated MLP (llama, qwen, mistral, gemma): ``fc1`` is two halves.
GATED_ACTIVATIONS = frozenset({"silu", "swish", "swiglu", "gelu_pytorch_tanh"})


def parse_gib(value: Any, key: str) -> Optional[float]:
    """``value`` as GiB (``None`` when not set), or a ``DynBatchValueError`` naming ``key``."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is None or not is_gib(number):
            raise DynBatchValueError(
                f"{key}={value!r} must be a number of GiB > 0 ({GIB_RANGE}: what one training GPU "
                f"may hold at its peak), e.g. {key}=70 on an 80 GiB GPU."
            )
        value = number
    if not is_gib(value):
        raise DynBatchValueError(
            f"{key}={value!r} must be a finite number of GiB > 0 ({GIB_RANGE}: what one training "
            f"GPU may hold at its peak), e.g. {key}=70 on an 80 GiB GPU."
        )
    return float(value)


def hf_model_config(path: Any, *, key: str, path_key: str) -> Mapping[str, Any]:
    """The checkpoint's ``config.json`` (a local directory, or the Hugging Face cache).

    Raises:
        DynBatchValueError: when it cannot be read here, naming ``key`` and ``path_key``.
    """
    candidates = []
    if path:
        candidates.append(os.path.join(os.path.expanduser(str(path)), "config.json"))
        try:  # the cache only: config time never downloads
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(path), "config.json")
            if isinstance(cached, str):
                candidates.append(cached)
        except Exception:  # no huggingface_hub, or not a repository id
            pass
    for candidate in candidates:
        if os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as handle:
                return json.load(handle)
    raise DynBatchValueError(
        f"{key} needs the model's dimensions at config time, from {path_key}={path!r}'s "
        "config.json, which is not a local directory or in the Hugging Face cache here; download "
        f"the checkpoint first, or drop {key} to plan by the token budget alone."
    )


def _first(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def hf_model_dims(
    config: Mapping[str, Any],
    parallel: ParallelLayout,
    *,
    params_dtype: str = "bf16",
    sequence_parallel: bool = False,
    ep_size: int = 1,
) -> ModelDims:
    """:class:`ModelDims` of a Hugging Face ``config.json`` (llama / qwen / mistral / mixtral /
    deepseek-style keys, GPT-2's as a fallback), as Megatron-Bridge builds the model."""
    heads = int(_first(config, "num_attention_heads", "n_head"))
    hidden = int(_first(config, "hidden_size", "n_embd"))
    experts = int(_first(config, "num_experts", "num_local_experts", "n_routed_experts", default=0))
    act = str(_first(config, "hidden_act", "activation_function", default="gelu"))
    tp = parallel.tp_size
    return ModelDims(
        num_layers=int(_first(config, "num_hidden_layers", "n_layer")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(_first(config, "num_key_value_heads", default=heads)),
        kv_channels=_first(config, "head_dim"),
        vocab_size=round_up(int(config["vocab_size"]), VOCAB_MULTIPLE * tp),
        ffn_hidden_size=int(_first(config, "intermediate_size", "n_inner", default=4 * hidden)),
        gated_linear_unit=act in GATED_ACTIVATIONS,
        add_bias_linear=bool(config.get("mlp_bias", False)),
        normalization="RMSNorm" if "rms_norm_eps" in config else "LayerNorm",
        untie_embeddings=not bool(config.get("tie_word_embeddings", True)),
        params_dtype=params_dtype,
        sequence_parallel=sequence_parallel,
        num_experts=experts,
        moe_ffn_hidden_size=_first(config, "moe_intermediate_size") if experts else None,
        moe_router_topk=int(_first(config, "num_experts_per_tok", "moe_topk", default=2)),
        ep_size=ep_size if experts else 1,
        parallel=parallel,
    )


def host_memory_limit(
    gib: float,
    dims: ModelDims,
    *,
    distributed_optimizer: bool = True,
    recompute: Optional[str] = None,
    transformer_config: Optional[Any] = None,
) -> MemoryLimit:
    """The budget of ``gib`` GiB over the uncalibrated per-stage model of ``dims``.
    ``transformer_config``: the host's TransformerConfig overrides, whose ``recompute_*`` keys
    say what is recomputed (``recompute`` is their ``recompute_granularity``)."""
    overrides = transformer_config or {}
    if recompute is None:
        recompute = overrides.get("recompute_granularity")
    model = MemoryModel(
        dims=dims,
        attention="causal",
        recompute=recompute if recompute in ("selective", "full") else None,
        recompute_block_layers=block_recompute_layers(
            recompute, overrides.get("recompute_method"), overrides.get("recompute_num_layers")
        ),
        distributed_optimizer=distributed_optimizer,
    )
    model = replace(model, token_scale=UNFITTED_SAFETY, score_scale=UNFITTED_SAFETY)
    return MemoryLimit(
        model=model, budget_bytes=gib_to_bytes(gib), row_multiple=dims.parallel.sample_multiple
    )


def check_memory_budget(
    limit: MemoryLimit,
    tokens: int,
    *,
    key: str,
    gib: float,
    token_key: str,
    token_value: int,
) -> None:
    """Refuse a memory budget under which one micro-batch of ``tokens`` (a packed row at the token
    budget; ``token_key=token_value`` as the user set it) does not fit every pipeline stage.

    Raises:
        DynBatchValueError: naming ``key`` and its value, the stage, its predicted peak, the
            smallest budget that works and the largest token budget that fits this one.
    """
    row = round_up(tokens, limit.row_multiple)

    def fix(need: float) -> str:
        fitting = limit.row_cap(1)
        scale = tokens / token_value  # a micro-batch holds this many times the budget (verl cp)
        lower = (
            f", or lower {token_key} to at most {int(fitting / scale)}"
            if fitting >= limit.row_multiple
            else ""
        )
        return f"set {key} to at least {need:.3f}{lower}"

    check_row_fits(
        limit,
        row,
        setting=f"{key}={gib:g}",
        what=f"a micro-batch at {token_key}={token_value}",
        fix=fix,
    )


def check_row_fits(
    limit: MemoryLimit, row: int, *, setting: str, what: str, fix: Callable[[float], str]
) -> None:
    """Refuse a memory budget under which a micro-batch of one row of ``row`` tokens does not fit
    every pipeline stage: ``setting`` (the budget as the user set it) is too small for ``what``,
    the stage, its predicted peak and what it is made of, then ``fix(smallest)`` with the smallest
    budget in GiB that fits. Every host's config-time memory refusal is worded here.

    Raises:
        DynBatchValueError: as above.
    """
    if limit.fits((1, row)):
        return
    model = limit.model
    stage, peak = model.worst_stage((1, row))
    raise DynBatchValueError(
        f"{setting} is too small for {what}: pipeline stage {stage} is predicted to hold "
        f"{peak / GIB:.3f} GiB at its peak ({model.resting(stage) / GIB:.3f} GiB of weights, "
        f"gradients and optimizer state, the rest activations counted x{UNFITTED_SAFETY:g}); "
        f"{fix(budget_gib(peak))}."
    )
