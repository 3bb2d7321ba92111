"""Megatron-LM's GPT training path, as ``pretrain_gpt.py`` of Megatron-LM 0.19 runs it.

The launch script (``launch/pretrain_gpt_dynbatch.py``) trains exactly like Megatron-LM's
``pretrain_gpt.py`` when ``--use-dynamic-batch-size`` is off: the same datasets
(``GPTDataset`` over ``--data-path``, ``MockGPTDataset`` for ``--mock-data``, ``SFTDataset`` for
``--sft``, ``GPTFIMDataset`` for ``--fim-data``), the same batch (read on tensor-parallel rank 0
and broadcast to its peers, split over context-parallel ranks), the same per-token loss (a
``(loss_sum, num_tokens, report)`` 3-tuple reported as ``lm loss``) and the same NaN / spiky-loss
checks. ``pretrain_gpt.py`` is not part of the megatron-core wheel, so this module provides those
pieces, written against megatron-core's public helpers. What it leaves out (ModelOpt
distillation, cached-logits distillation, hybrid context parallelism) is refused by
:func:`check_stock_args` with the flag to remove.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List, Optional

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import (
    flatten_batch_for_packed_sequences,
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_timers, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.mcore.forward import thd_packed_seq_params

__all__ = [
    "check_stock_args",
    "gpt_dataset_config",
    "stock_datasets_provider",
    "stock_forward_step",
    "stage_reads_data",
]

# A loss ``SPIKY_LOSS_FACTOR`` times the largest seen so far is reported (--check-for-spiky-loss).
SPIKY_LOSS_FACTOR = 10

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")

# Megatron-LM features of pretrain_gpt.py this launch script does not carry, with the reason.
_UNSUPPORTED = (
    ("logits_load_dir", "--logits-load-dir (offline distillation from cached logits)"),
    ("modelopt_enabled", "ModelOpt (--export-* / distillation flags of megatron.post_training)"),
    ("hybrid_context_parallel", "--hybrid-context-parallel"),
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm (schedule plans)"),
)


def check_stock_args(args: Any) -> None:
    """Refuse the few ``pretrain_gpt.py`` features this launch script leaves out.

    Raises:
        ValueError: naming the flag to remove and where the feature is available.
    """
    for name, what in _UNSUPPORTED:
        if getattr(args, name, None):
            raise DynBatchValueError(
                f"{what} is not supported by launch/pretrain_gpt_dynbatch.py; remove it, or run "
                "Megatron-LM's own pretrain_gpt.py for it."
            )


def stage_reads_data(vp_stage: Optional[int]) -> bool:
    """Whether this model chunk needs the batch: first or last pipeline stage (or MTP, or THD)."""
    args = get_args()
    if args.sft or args.dataloader_inter_document_masking or args.mtp_num_layers:
        return True
    ignore_virtual = vp_stage is None
    return mpu.is_pipeline_first_stage(
        ignore_virtual=ignore_virtual, vp_stage=vp_stage
    ) or mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _get_batch(data_iterator, vp_stage: Optional[int]) -> Dict[str, Any]:
    """Read one micro-batch on TP rank 0, broadcast it over TP, keep this CP rank's share."""
    args = get_args()
    has_cu_seqlens = bool(args.sft or args.dataloader_inter_document_masking)
    if not stage_reads_data(vp_stage):
        return {key: None for key in _BATCH_KEYS}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: Dict[str, Any] = {}
    if tp_rank == 0:
        batch = dict(next(data_iterator))
        device = _device()
        for key, value in list(batch.items()):
            if isinstance(value, torch.Tensor):
                batch[key] = value.to(device, non_blocking=True)
    mtp_here = bool(args.mtp_num_layers)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=has_cu_seqlens,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = flatten_batch_for_packed_sequences(batch)
    return get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=False,
        cp_group=mpu.get_context_parallel_group(),
        use_per_sequence_balancing=bool(args.dataloader_inter_document_masking and not args.sft),
    )


def _packed_seq_params(batch: Dict[str, Any]) -> Optional[PackedSeqParams]:
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        return None
    cu_seqlens = cu_seqlens.squeeze(0)
    padded = batch.get("cu_seqlens_padded")
    if padded is not None:
        padded = padded.squeeze(0)
    return thd_packed_seq_params(
        cu_seqlens,
        int(batch["max_seqlen"].item()),
        padded=padded,
        tokens_per_sample=get_args().seq_length,
    )


def checked_loss(loss: torch.Tensor) -> None:
    """Megatron-LM's NaN / Inf / spiky-loss checks of a micro-batch loss (rerun state machine)."""
    args = get_args()
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for rejection, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=rejection,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked token losses, the token count, and the ``lm loss`` report."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    checked_loss(loss)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def stock_forward_step(data_iterator, model):
    """``forward_step_func`` of Megatron-LM's GPT pretraining (fixed micro-batches)."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    batch = _get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        packed_seq_params=_packed_seq_params(batch),
    )
    return output_tensor, partial(_loss_func, batch["loss_mask"])


def gpt_dataset_config(args: Any) -> GPTDatasetConfig:
    """Megatron's ``GPTDatasetConfig`` (or FIM config) from the arguments, as pretrain_gpt.py."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    kwargs = dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        hybrid_context_parallel=args.hybrid_context_parallel,
        inter_document_masking=args.dataloader_inter_document_masking,
    )
    if args.per_dataset_sequences_path is not None:
        import json

        with open(args.per_dataset_sequences_path, encoding="utf-8") as handle:
            kwargs["sequences_per_dataset"] = json.load(handle)
    if args.fim_data:
        from megatron.training.datasets.fim_dataset import GPTFIMDatasetConfig

        return GPTFIMDatasetConfig(
            **kwargs,
            fim_rate=args.fim_rate,
            fim_spm_rate=args.fim_spm_rate,
            fim_extra_tokens={
                "prefix": args.fim_prefix_token,
                "middle": args.fim_middle_token,
                "suffix": args.fim_suffix_token,
                "pad": args.fim_pad_token,
                "eod": args.fim_eod_token,
            },
            fim_split_sample=args.fim_split_sample,
            fim_fragment_rate=args.fim_fragment_rate,
            fim_no_prefix=args.fim_no_prefix,
        )
    return GPTDatasetConfig(**kwargs)


def _dataset_built_here(vp_stage: Optional[int], packed: bool) -> bool:
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return packed or stage_reads_data(vp_stage)


def stock_datasets_provider(num_samples: List[int], vp_stage: Optional[int] = None):
    """Train / valid / test datasets of Megatron-LM's GPT pretraining (is_distributed)."""
    args = get_args()
    config = gpt_dataset_config(args)
    packed = False
    if args.sft:
        from megatron.training.datasets.sft_dataset import SFTDataset

        dataset_type, packed = SFTDataset, True
    elif args.mock_data:
        dataset_type = MockGPTDataset
    elif args.fim_data:
        from megatron.training.datasets.fim_dataset import GPTFIMDataset

        dataset_type = GPTFIMDataset
    else:
        dataset_type = GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, num_samples, partial(_dataset_built_here, vp_stage, packed), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Megatron builds the datasets on every rank that needs them (TP rank 0 of the data stages).
stock_datasets_provider.is_distributed = True
