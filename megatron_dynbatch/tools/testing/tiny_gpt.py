"""A tiny, layout-independent GPTModel for tests and the CPU demo.

The model is a real Megatron-Core ``GPTModel`` (local layer spec, fp32, RoPE, untied embeddings).
Its weights depend only on a seed and each parameter's *global* name, so a single-process reference
and any layout (pp, vpp, tp: a tensor-parallel rank holds its slice of the full tensor) hold
identical numbers, and gradients can be compared by name.

Call :func:`megatron_dynbatch.cpu.core_shim.apply_cpu_shim` before using this module on CPU.
Test and self-check support (``verify``, the benchmarks), not library surface.
"""

import dataclasses
import hashlib
import re
from typing import Iterator, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.mcore.schedule import check_schedule_config

__all__ = [
    "TINY_VOCAB_SIZE",
    "tiny_transformer_config",
    "logprobs_from_logits",
    "response_outputs",
    "make_schedule_config_safe",
    "tiny_layer_spec",
    "build_tiny_gpt",
    "wrap_in_ddp",
    "reinit_params_deterministically",
    "named_global_params",
    "named_global_grads",
]

TINY_VOCAB_SIZE = 128
# Standard deviation of the deterministic init for matrices and biases; small enough that a
# 4-layer model gives well-conditioned logits, large enough that gradients are far from zero.
_INIT_STD = 0.02
# Norm weights start near 1 (not exactly 1) so their gradients are not all alike.
_NORM_INIT_STD = 0.1

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")


def tiny_transformer_config(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    num_layers: int = 4,
    hidden_size: int = 32,
    num_attention_heads: int = 4,
    calculate_per_token_loss: bool = True,
    batch_p2p_comm: Optional[bool] = None,
    num_moe_experts: Optional[int] = None,
    moe_router_topk: int = 2,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> TransformerConfig:
    """Return the ``TransformerConfig`` of the tiny GPT for a model-parallel layout.

    Args:
        tensor_model_parallel_size: Tensor-parallel ranks (no sequence parallelism); must divide
            the attention heads.
        pipeline_model_parallel_size: Pipeline stages (must match the pipeline process group).
        virtual_pipeline_model_parallel_size: Model chunks per stage, or None for no interleaving.
        microbatch_group_size_per_vp_stage: Megatron's interleaving group (micro-batches a model
            chunk runs before the next chunk's); None: Megatron's default, the pipeline size.
        num_layers: Global number of transformer layers; must split evenly over pp * vpp.
        hidden_size: Hidden width.
        num_attention_heads: Attention heads.
        calculate_per_token_loss: Whether the schedule hands the summed token count to
            ``finalize_model_grads`` (the 3-tuple loss) instead of dividing by the micro-batch
            count.
        batch_p2p_comm: Batched p2p sends; None picks the safe value for the layout (False for
            interleaving at pp = 2, see :func:`check_schedule_config`).
        num_moe_experts: None: dense MLPs. Otherwise every layer's MLP is a mixture of this many
            experts (local spec, all-to-all dispatcher, expert parallel size 1, no load-balancing
            loss and no linear biases: the expert bias path of megatron.core 0.19.2 adds in place
            to a view at tp = 1, which autograd refuses).
        moe_router_topk: Experts per token with ``num_moe_experts``.
        expert_model_parallel_size: Expert-parallel size (must match the initialised expert
            groups: it decides whether expert gradients are reduced over the expert data-parallel
            group or, wrongly at EP > 1, over the whole data-parallel group).
        context_parallel_size: Context-parallel size (must match the initialised groups). The
            local attention cannot split a sequence: build such a model without attention
            (``build_tiny_gpt(..., attention=False)``).

    Returns:
        A config ready for the three Megatron schedules on CPU.
    """
    interleaved = virtual_pipeline_model_parallel_size is not None
    if batch_p2p_comm is None:
        batch_p2p_comm = not (interleaved and pipeline_model_parallel_size == 2)
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=4 * hidden_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        # fp32 end to end: p2p buffers are allocated with pipeline_dtype.
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        # Dropout off: layouts must give bitwise-comparable numbers.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fused CUDA kernels are unavailable on CPU; the unfused torch paths are used instead.
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        calculate_per_token_loss=calculate_per_token_loss,
        # Every micro-batch of a step has the same (micro_batch_size, seq_length): the p2p receive
        # buffers are sized from the schedule's seq_length, and no shape exchange is needed.
        variable_seq_lengths=False,
        batch_p2p_comm=batch_p2p_comm,
        expert_model_parallel_size=expert_model_parallel_size,
        context_parallel_size=context_parallel_size,
        **_moe_fields(num_moe_experts, moe_router_topk),
    )
    check_schedule_config(config)
    return config


def _moe_fields(num_moe_experts: Optional[int], moe_router_topk: int) -> dict:
    if num_moe_experts is None:
        return {}
    if not 1 <= moe_router_topk <= num_moe_experts:
        raise DynBatchValueError(
            f"moe_router_topk={moe_router_topk} must be in [1, num_moe_experts="
            f"{num_moe_experts}]; lower the top-k or add experts."
        )
    return dict(
        num_moe_experts=num_moe_experts,
        moe_router_topk=moe_router_topk,
        # The allgather dispatcher refuses variable_seq_lengths (slime's setting).
        moe_token_dispatcher_type="alltoall",
        # An auxiliary loss depends on which tokens share a micro-batch: a packed row and a
        # sample alone would train differently.
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
    )


def make_schedule_config_safe(config: TransformerConfig) -> TransformerConfig:
    """Turn off ``batch_p2p_comm`` (and, with variable lengths, turn on ``overlap_p2p_comm``) where
    :func:`check_schedule_config` would refuse the config.

    Args:
        config: Modified in place (Megatron configs are shared by every model chunk).

    Returns:
        The same config object, now accepted by :func:`check_schedule_config`.
    """
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is not None and config.pipeline_model_parallel_size == 2:
        config.batch_p2p_comm = False
        if config.variable_seq_lengths:
            config.overlap_p2p_comm = True
    check_schedule_config(config)
    return config


def tiny_layer_spec(num_experts: Optional[int] = None, attention: bool = True):
    """Megatron's local GPT layer spec with self-attention taking the mask it is given.

    ``num_experts``: None for a dense MLP, else a mixture of experts (``config.num_moe_experts``).

    ``AttnMaskType.arbitrary`` instead of the spec's ``causal``: packed rows need the block-diagonal
    mask of :func:`megatron_dynbatch.mcore.forward.build_attention_mask`. With ``causal``, the
    unfused fp32 softmax happens to apply a passed mask, but the fused fp16/bf16 kernel
    (``masked_softmax_fusion``) drops it for its own causal mask without an error.
    """
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if not attention:
        # Layers of per-token work only (norms, MLP): what a data path under context parallelism
        # can be checked with on CPU, where the local attention cannot split a sequence.
        spec.submodules.self_attention = IdentityOp
        spec.submodules.self_attn_bda = IdentityFuncOp
        return spec
    self_attention = spec.submodules.self_attention
    spec.submodules.self_attention = dataclasses.replace(
        self_attention,
        params={**self_attention.params, "attn_mask_type": AttnMaskType.arbitrary},
    )
    return spec


def build_tiny_gpt(
    config: TransformerConfig,
    *,
    vocab_size: int = TINY_VOCAB_SIZE,
    max_sequence_length: int = 256,
    seed: int = 1234,
    pg_collection=None,
    attention: bool = True,
    layer_spec=None,
) -> list[GPTModel]:
    """Build this rank's model chunks of the tiny GPT, initialised from (seed, global names).

    Args:
        config: From :func:`tiny_transformer_config`; pp must match the pipeline process group.
        vocab_size: Vocabulary size (untied input embedding and output layer).
        max_sequence_length: Upper bound on positions.
        seed: Seed of the deterministic, layout-independent initialisation.
        pg_collection: Megatron ``ProcessGroupCollection``; None uses Megatron's default groups.
        attention: False: layers without self-attention (see :func:`tiny_layer_spec`).
        layer_spec: The transformer layer spec; None is :func:`tiny_layer_spec` (another attention
            core, e.g. THD, leaves the weights unchanged: they depend on seed and names only).

    Returns:
        One ``GPTModel`` per virtual stage held by this rank (a single one without interleaving).
    """
    check_schedule_config(config)
    if pg_collection is None:
        # What GPTModel would pick by itself; resolved here once so the stage flags below and the
        # model agree on the pipeline group.
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pp_size = config.pipeline_model_parallel_size
    vp_size = config.virtual_pipeline_model_parallel_size
    if pg_collection.pp.size() != pp_size:
        raise DynBatchValueError(
            f"config.pipeline_model_parallel_size={pp_size} but the pipeline process group has "
            f"{pg_collection.pp.size()} ranks; build the config for the initialised layout."
        )
    pp_rank = pg_collection.pp.rank()
    num_chunks = vp_size or 1
    if layer_spec is None:
        layer_spec = tiny_layer_spec(config.num_moe_experts, attention=attention)
    chunks = []
    for vp_stage in range(num_chunks):
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=layer_spec,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                pre_process=pp_rank == 0 and vp_stage == 0,
                post_process=pp_rank == pp_size - 1 and vp_stage == num_chunks - 1,
                # Untied: a tied copy on the last stage is synchronised with ``.cuda()`` in
                # LanguageModule.setup_embeddings_and_output_layer, which fails on CPU.
                share_embeddings_and_output_weights=False,
                # Without attention positions act on nothing (and RoPE's context-parallel slicing
                # pins host memory, which CPU torch cannot).
                position_embedding_type="rope" if attention else "none",
                vp_stage=vp_stage if vp_size is not None else None,
                pg_collection=pg_collection,
            )
        )
    reinit_params_deterministically(chunks, seed, tp_group=pg_collection.tp)
    return chunks


def wrap_in_ddp(
    model_chunks: list[torch.nn.Module], *, pg_collection=None
) -> list[DistributedDataParallel]:
    """Wrap model chunks in Megatron DDP so ``finalize_model_grads`` can reduce their grads.

    Grads then accumulate in ``param.main_grad`` (read them with :func:`named_global_grads`).
    With ``calculate_per_token_loss=True`` DDP sums over data-parallel ranks and
    ``finalize_model_grads`` divides by the global token count.

    Args:
        model_chunks: This rank's chunks, from :func:`build_tiny_gpt`.
        pg_collection: Megatron ``ProcessGroupCollection``; None uses Megatron's default groups.

    Returns:
        The wrapped chunks, in the same order.
    """
    wrapped = []
    for index, chunk in enumerate(model_chunks):
        # A fresh config per chunk: DDP writes bucket_size into it.
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                # Megatron-LM's convention: only the first chunk is bucketed.
                disable_bucketing=index > 0,
                pg_collection=pg_collection,
            )
        )
    return wrapped


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    # DDP and Float16Module keep the wrapped model in ``.module``; GPTModel has no such attribute.
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _iter_global_named_params(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Yield (global name, param): chunk-local layer indices replaced by global ones, and with
    expert parallelism, local expert indices by global ones."""
    model = _unwrap(chunk)
    local_to_global = {}
    experts = {}
    for name, module in model.named_modules():
        match = _LAYER_PREFIX.match(name + ".")
        if isinstance(module, TransformerLayer) and match:
            # layer_number is 1-based and already includes the pipeline / virtual stage offset.
            local_to_global[int(match.group(1))] = module.layer_number - 1
        if isinstance(getattr(module, "local_expert_indices", None), list):  # a MoE layer
            experts[f"{name}.experts.local_experts."] = module.local_expert_indices
    for name, param in model.named_parameters():
        for prefix, indices in experts.items():
            if name.startswith(prefix):
                local, rest = name[len(prefix) :].split(".", 1)
                name = f"{prefix}{indices[int(local)]}.{rest}"
        match = _LAYER_PREFIX.match(name)
        if match:
            global_index = local_to_global[int(match.group(1))]
            name = f"decoder.layers.{global_index}." + name[match.end() :]
        yield name, param


def named_global_params(model_chunks: list[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """Map global parameter names (global layer indices) to this rank's parameters."""
    params = {}
    for chunk in model_chunks:
        for name, param in _iter_global_named_params(chunk):
            assert name not in params, f"duplicate global parameter name {name}"
            params[name] = param
    return params


def _seed_for(seed: int, name: str) -> int:
    # A stable hash (Python's hash() is salted per process) so every rank derives the same stream.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _tp_split(param: torch.nn.Parameter, tp_group) -> bool:
    """Whether ``param`` is this rank's slice of a tensor split over ``tp_group``."""
    return (
        tp_group is not None
        and tp_group.size() > 1
        and bool(getattr(param, "tensor_model_parallel", False))
    )


@torch.no_grad()
def reinit_params_deterministically(
    model_chunks: list[torch.nn.Module], seed: int, *, tp_group=None
) -> None:
    """Overwrite every parameter with values drawn from (seed, its global name).

    Args:
        model_chunks: This rank's chunks (DDP-wrapped or not; do it before a distributed optimizer
            takes copies).
        seed: Base seed; the same seed gives the same weights in every layout.
        tp_group: The tensor-parallel group; a split parameter gets its contiguous slice along
            ``partition_dim`` of the full tensor (Megatron's own split), so tp = 1 and tp > 1 hold
            the same model.
    """
    for name, param in named_global_params(model_chunks).items():
        shape = list(param.shape)
        split = _tp_split(param, tp_group)
        if split:
            shape[param.partition_dim] *= tp_group.size()
        generator = torch.Generator().manual_seed(_seed_for(seed, name))
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if param.dim() == 1 and "norm" in name and name.endswith("weight"):
            values = 1.0 + _NORM_INIT_STD * values
        else:
            values = _INIT_STD * values
        if split:
            values = values.chunk(tp_group.size(), dim=param.partition_dim)[tp_group.rank()]
        param.copy_(values)


def named_global_grads(
    model_chunks: list[torch.nn.Module], *, tp_group=None
) -> dict[str, torch.Tensor]:
    """Map global parameter names to gradients (``main_grad`` under Megatron DDP, else ``grad``).

    Only this rank's parameters are included; gather across pipeline ranks to see the full model.
    Parameters that received no gradient map to zeros. With a ``tp_group`` of more than one rank
    (every rank of it must call this: it all-gathers), split parameters get their full gradient.
    """
    grads = {}
    for name, param in named_global_params(model_chunks).items():
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        grad = torch.zeros_like(param) if grad is None else grad.detach().clone()
        if _tp_split(param, tp_group):
            parts = [torch.empty_like(grad) for _ in range(tp_group.size())]
            torch.distributed.all_gather(parts, grad.contiguous(), group=tp_group)
            grad = torch.cat(parts, dim=param.partition_dim)
        grads[name] = grad
    return grads


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of every label under ``logits`` (full vocabulary, i.e. tp = 1 or gathered).

    Args:
        logits: ``[B, S, V]``.
        labels: ``[B, S]`` int64.

    Returns:
        ``[B, S]`` float32 log-probs.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def response_outputs(model: GPTModel, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """One sample alone through a single-process ``model``: its outputs (logits, or a value
    head's values) at the positions that score the response tokens, ``[len(response), ...]``.

    Response token ``t`` is predicted at position ``t - 1``, so the rows are positions
    ``len(prompt) - 1 .. len(prompt) + len(response) - 2``: what RL trainers read their
    log-probs and values from (the per-sample reference of the trainer tests).
    """
    from megatron_dynbatch.mcore.forward import build_attention_mask

    tokens = torch.cat([prompt, response])
    length = tokens.numel()
    out = model(
        tokens.unsqueeze(0),
        torch.arange(length).unsqueeze(0),
        build_attention_mask(torch.zeros(1, length, dtype=torch.int64)),
    )[0]
    return out[prompt.numel() - 1 : length - 1]
