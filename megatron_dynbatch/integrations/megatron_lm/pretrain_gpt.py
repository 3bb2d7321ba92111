"""GPT training through Megatron-LM's ``pretrain()``, with or without dynamic batching.

The body of ``launch/pretrain_gpt_dynbatch.py`` (which first makes ``megatron.training`` the
patched tree and, without CUDA, applies the CPU shim; see that script). Three modes, chosen by
flags:

* neither flag: Megatron-LM's ``pretrain_gpt.py`` (``gpt_stock``): ``GPTDataset`` windows of
  ``--seq-length`` tokens, fixed micro-batches.
* ``--document-samples``: one sample per document (``documents``), each padded to
  ``--seq-length``, through Megatron's own data loader and fixed micro-batches: the baseline that
  trains on the same samples as dynamic batching.
* ``--use-dynamic-batch-size``: the same document samples, planned into token-budget micro-batches
  by the patched training loop (``hooks``).

With ``--sft`` the documents of both modes are the JSONL conversations of ``--data-path``, with loss
on the responses only (``conversations``).

In both document modes the loss is the token mean over ``loss_mask`` (reported as ``lm loss``, as
``pretrain_gpt.py`` does), attention stays inside each sample (block-diagonal mask with the local
transformer implementation, THD ``cu_seqlens`` with transformer-engine), and ``--seq-length`` is the
longest sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import socket
import sys
from functools import partial
from typing import Any, Callable, List, NoReturn, Optional, Sequence

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.enums import AttnMaskType
from megatron.training import get_args, get_timers, get_tokenizer, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

from megatron_dynbatch.cpu.training_shim import (
    add_cpu_defaults,
    check_cpu_args,
    check_cpu_args_before_validation,
)
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    add_dynamic_batch_args,
    dynbatch_config_from_args,
    grouping_dependent_moe,
    truncation_from_args,
    validation_cut_note,
)
from megatron_dynbatch.integrations.megatron_lm.attention import (
    THD_ATTENTIONS,
    attention_of_args,
    stock_rows_are_thd,
)
from megatron_dynbatch.integrations.megatron_lm.console import (
    fail,
    model_config_error,
    print_rank_0,
)
from megatron_dynbatch.integrations.megatron_lm.data.blends import BLEND_WEIGHTS
from megatron_dynbatch.integrations.megatron_lm.data.conversations import conversation_tokenizer
from megatron_dynbatch.integrations.megatron_lm.data.documents import (
    DEFAULT_SPLIT,
    MOCK_SPLIT,
    SPLIT_NAMES,
    DocumentBatchStream,
    DocumentSampleDataset,
    check_first_samples,
    document_splits,
    split_bookends,
    stream_starts,
)
from megatron_dynbatch.integrations.megatron_lm.data.indexed_check import (
    IndexSummary,
    validate_data_paths,
)
from megatron_dynbatch.integrations.megatron_lm.gpt_stock import (
    check_stock_args,
    checked_loss,
    stock_datasets_provider,
    stock_forward_step,
)
from megatron_dynbatch.integrations.megatron_lm.hooks import current_hooks, entry_check
from megatron_dynbatch.integrations.megatron_lm.layout_checks import (
    check_fixed_interleaved_counts,
    one_rank_without_torchrun,
)
from megatron_dynbatch.integrations.megatron_lm.memory import TrainingPeak
from megatron_dynbatch.integrations.megatron_lm.progress import count_progress_tokens
from megatron_dynbatch.integrations.megatron_lm.resume import (
    data_mode,
    refuse_resume_in_another_mode,
)
from megatron_dynbatch.integrations.moe_args import check_moe_args
from megatron_dynbatch.mcore.forward import (
    make_forward_step,
)
from megatron_dynbatch.mcore.schedule import unwrapped_model
from megatron_dynbatch.mcore.thd_attention import (
    ThdReferenceAttention,
    with_self_attention,
    with_thd_reference_attention,
)
from megatron_dynbatch.runtime import microbatch_loss

__all__ = [
    "add_launch_args",
    "count_fixed_row_lengths",
    "document_datasets_provider",
    "document_forward_step",
    "extra_args_provider",
    "main",
]

# What pretrain_gpt.py passes to parse_and_validate_args.
_ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def add_launch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The launch script's own flag (besides Megatron-LM's and the plugin's)."""
    group = parser.add_argument_group(title="document samples (launch/pretrain_gpt_dynbatch.py)")
    group.add_argument(
        "--document-samples",
        action="store_true",
        help="Train on one sample per document (cut at --seq-length) instead of --seq-length "
        "windows of the concatenated documents. Implied by --use-dynamic-batch-size; without it "
        "every sample is padded to --seq-length and Megatron's fixed micro-batches run unchanged "
        "(the baseline for the same samples).",
    )
    group.add_argument(
        "--blend-weights",
        choices=BLEND_WEIGHTS,
        default=None,
        help="What the weights of a blend (--data-path 0.3 A 0.7 B) are shares of, with document "
        "samples: tokens (default; Megatron's meaning, as its samples are --seq-length windows) "
        "or samples (documents). Without --document-samples / --use-dynamic-batch-size, "
        "Megatron's GPTDataset blends by tokens and this flag is refused.",
    )
    return parser


def _one_line_parser_errors(parser: argparse.ArgumentParser) -> None:
    """argparse prints its ~780-line usage per rank on a bad value; print one line instead."""

    def error(message: str) -> NoReturn:
        fail(f"{message} (see --help)")

    parser.error = error


def _help_that_formats(parser: argparse.ArgumentParser) -> None:
    """Escape a bare ``%`` in help texts argparse cannot format: megatron-core 0.19.2's
    ``--moe-paged-stash-buffer-size-factor-cuda`` says "10%)", and ``--help`` stopped with
    "unsupported format character ')'" instead of printing (issue 44: the help must say how
    the entry is launched)."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.help or action.help is argparse.SUPPRESS:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: launch, dynamic-batching and CPU-default flags."""
    _one_line_parser_errors(parser)
    # --help says how it is launched (issue 44: `megatron-dynbatch pretrain` read as a launcher).
    parser.description = (
        "Megatron-LM GPT pretraining with megatron_dynbatch (one rank; run it under torchrun: "
        "torchrun --nproc-per-node N -m megatron_dynbatch pretrain ..., or torchrun "
        "--nproc-per-node N launch/pretrain_gpt_dynbatch.py ... in a checkout)."
    )
    parser = add_dynamic_batch_args(add_launch_args(add_cpu_defaults(parser)))
    _help_that_formats(parser)
    return parser


def _uses_documents(args: Any) -> bool:
    return data_mode(args) == "documents"


def _check_document_args(args: Any) -> None:
    for name, flag in (
        ("fim_data", "--fim-data"),
        ("full_validation", "--full-validation"),
        ("multiple_validation_sets", "--multiple-validation-sets"),
        ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
    ):
        if getattr(args, name, False):
            raise DynBatchValueError(
                f"{flag} cannot be combined with --use-dynamic-batch-size / --document-samples, "
                f"which read one sample per document themselves; remove {flag}."
            )
    if args.sft:
        if args.mock_data:
            raise DynBatchValueError(
                "--sft with --mock-data: SFT reads conversations from JSONL; pass --data-path "
                'FILE.jsonl (one {"messages": [...]} object per line) instead of --mock-data.'
            )
        # Megatron reads args.sft only in evaluate(), to average the validation loss per
        # micro-batch: with planned micro-batches that would depend on the grouping and count
        # placeholders, so validation keeps the token mean over the whole batch instead.
        args.sft = False
        args.sft_conversations = True
    if not args.use_dynamic_batch_size:
        check_fixed_interleaved_counts(args)
    if args.context_parallel_size > 1:
        raise DynBatchValueError(
            f"--context-parallel-size {args.context_parallel_size}: the document-sample forward "
            "step of launch/pretrain_gpt_dynbatch.py does not split rows over context-parallel "
            "ranks yet; use --context-parallel-size 1."
        )
    config = _run_config(args)
    if config is not None:
        # The resolved settings (flags over the YAML): a budget or policy set in the YAML counts.
        if config.max_tokens_per_gpu < args.seq_length:
            # Under --oversize-samples error this was refused with the arguments (arguments.py).
            print_rank_0(
                f"--max-tokens-per-gpu {config.max_tokens_per_gpu} < --seq-length "
                f"{args.seq_length}: document samples over the budget are handled by "
                f"--oversize-samples {config.oversize_samples}."
            )
    note = validation_cut_note(args, config)
    if note:
        print_rank_0(note)
    if getattr(args, "data_cache_path", None):
        print_rank_0(
            f"--data-cache-path {args.data_cache_path}: not used by document samples; their "
            "order and blend index are computed in memory at start-up (well under a second), "
            "only Megatron's GPTDataset (without --use-dynamic-batch-size / --document-samples) "
            "caches its indices there."
        )
    if args.dataloader_type not in (None, "single"):
        # 'external' too: it says the provider returns the user's own iterators, and
        # Megatron stops on this script's datasets ("not an iterator") with the switch off.
        raise DynBatchValueError(
            f"--dataloader-type {args.dataloader_type}: document samples are read in Megatron's "
            "'single' order (fixed micro-batches) or by the planner (dynamic); remove the flag."
        )
    if args.mock_data and args.split is not None:
        print_rank_0(
            f"--split {args.split}: not used with --mock-data, which Megatron splits "
            f"{MOCK_SPLIT} (document samples too)."
        )
    if args.use_dynamic_batch_size and getattr(args, "document_samples", False):
        # A probe appended --document-samples to a dynamic command for its reference run: it ran
        # dynamic, and compare_runs.py then compared the run with itself.
        print_rank_0(
            "note: --document-samples is implied by --use-dynamic-batch-size: this run plans "
            "dynamic micro-batches. For the per-sample reference (Megatron's fixed micro-batches "
            "over the same samples) drop --use-dynamic-batch-size and its flags."
        )
    grouped = grouping_dependent_moe(args) if args.use_dynamic_batch_size else []
    if grouped:
        print_rank_0(
            f"note: with {' and '.join(grouped)} the loss depends on how samples are grouped "
            "into micro-batches, and planned micro-batches group them differently from fixed "
            "ones: it is close to the fixed-batch loss, not exactly it (1e-5 to 1e-4 relative on "
            "a tiny MoE; docs/moe.md). Everything else trains per token, exactly."
        )


def _discard_tensorboard_file(args: Any) -> None:
    """Remove the events file Megatron opened for this run when the run stops before training.

    ``parse_and_validate_args`` opens the TensorBoard writer (on the last rank); a run refused by
    the start-up checks would otherwise leave an empty run in ``--tensorboard-dir``. Only this
    process's files are removed (TensorBoard names them ``...tfevents.<time>.<host>.<pid>...``).
    """
    directory = getattr(args, "tensorboard_dir", None)
    if not directory:
        return
    from megatron.training.global_vars import get_tensorboard_writer

    writer = get_tensorboard_writer()
    if writer is None:
        return
    writer.close()
    pattern = f"events.out.tfevents.*.{socket.gethostname()}.{os.getpid()}.*"
    for path in glob.glob(os.path.join(glob.escape(directory), pattern)):
        os.remove(path)


def _check_validation_data(args: Any, splits: Optional[list]) -> None:
    """Validation asked for (``--eval-iters`` > 0) needs validation data: say so at start-up.

    Megatron 0.19 runs ``evaluate()`` whenever ``--eval-iters`` > 0, even on a missing validation
    split, and fails only there: after training and its checkpoint, naming the dataset provider.
    ``splits``: the document splits (document modes), or ``None`` (stock mode: read ``--split``).
    """
    if not args.eval_iters or args.eval_iters <= 0:
        return
    per_split = args.train_data_path is not None or getattr(args, "per_split_data_args_path", None)
    if splits is not None:
        missing = splits[1] is None
    elif per_split:
        missing = args.valid_data_path is None and not getattr(
            args, "per_split_data_args_path", None
        )
    elif args.data_path is not None:
        from megatron.core.datasets.blended_megatron_dataset_config import (
            parse_and_normalize_split,
        )

        missing = parse_and_normalize_split(args.split or DEFAULT_SPLIT)[1] == 0
    else:
        return  # mock data: Megatron splits it 1,1,1 whatever --split says
    if not missing:
        return
    fix = "pass --eval-iters 0 to train without validation, or "
    if per_split:
        raise DynBatchValueError(
            f"no validation data (no --valid-data-path), but --eval-iters {args.eval_iters} asks "
            f"for validation; {fix}give --valid-data-path."
        )
    split = args.split or DEFAULT_SPLIT
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    documents = _document_count(splits)
    if parse_and_normalize_split(split)[1] > 0 and documents is not None:
        # A validation share that rounds to no document (issue 44: 98,2,0 of 3 documents was
        # told to pass 98,2,0): name a split that gives it one.
        fix += (
            f"give --split a validation share of at least one document, e.g. --split "
            f"{documents - 1},1,0"
            if documents > 1
            else "give --data-path more than one document"
        )
        raise DynBatchValueError(
            f"--split {split!r} gives validation (its second number) a share of the "
            f"{documents} document(s) that rounds to none, but --eval-iters {args.eval_iters} "
            f"asks for validation; {fix}."
        )
    raise DynBatchValueError(
        f"--split {split!r} leaves the validation split (its second "
        f"number) without data, but --eval-iters {args.eval_iters} asks for validation; {fix}"
        "give --split a validation share (e.g. 98,2,0) and enough documents for it."
    )


def _check_stock_split_documents(args: Any, summaries: Sequence[IndexSummary]) -> None:
    """Every split Megatron's ``GPTDataset`` will build from ``--split`` has a document.

    Megatron cuts each ``--data-path`` dataset at ``round(share x documents)``. A split with a
    share that rounds to no document is still built, and counting its epochs never ends (no
    tokens an epoch): rank 0 hangs in "Build and save the GPTDataset ... indices" until the
    process group's timeout. The training split is always built; validation and test when
    ``--eval-iters`` > 0. ``summaries``: the checked ``.idx`` of every data prefix.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    if args.data_path is None:
        return  # per-split paths are not cut; Megatron splits its mock data 1,1,1
    split = args.split or DEFAULT_SPLIT
    shares = parse_and_normalize_split(split)
    needed = [0] + ([1, 2] if args.eval_iters and args.eval_iters > 0 else [])
    for summary in summaries:  # --data-path's datasets, each cut by --split
        ranges = split_bookends(split, summary.num_sequences)
        empty = [i for i in needed if shares[i] > 0 and ranges[i] is None]
        if not empty:
            continue
        names = " and ".join(SPLIT_NAMES[i] for i in empty)
        # The smallest dataset's one document for validation (a larger one gets more), no test.
        fewest = min(other.num_sequences for other in summaries)
        if 1 not in needed:
            fix = "--split 1,0,0"
        else:
            fix = f"--split {fewest - 1},1,0" if fewest > 1 else "more documents in --data-path"
        if 0 not in empty:
            fix += ", or --eval-iters 0 to train without validation"
        raise DynBatchValueError(
            f"--split {split!r} gives the {names} split a share of {summary.prefix}'s "
            f"{summary.num_sequences} document(s) that rounds to none: Megatron's GPTDataset "
            f"would wait forever building it; pass {fix}."
        )


def _document_count(splits: Optional[list]) -> Optional[int]:
    """The documents the splits were cut from (one collection, not a blend), or ``None``."""
    for split in splits or ():
        documents = getattr(split, "documents", None)
        if documents is not None:
            return len(documents)
    return None


def _tokenizer_eod() -> Optional[int]:
    """The end-of-document token of the run's tokenizer (built with the arguments), or None."""
    try:
        eod = get_tokenizer().eod
    except (AttributeError, NotImplementedError, AssertionError):
        return None
    return eod if isinstance(eod, int) else None


def _document_loss(batch, per_token_loss: torch.Tensor):
    """Token mean over ``loss_mask`` as Megatron's 3-tuple, reported as ``lm loss``."""
    numerator, denominator, report = microbatch_loss(
        "token-mean", per_token_loss, batch, log_key="lm loss"
    )
    checked_loss(numerator)
    return numerator, denominator, report


def document_forward_step(args: Any, attention: Optional[str] = None) -> Callable:
    """``forward_step_func`` for document samples, fixed or planned micro-batches alike.

    The library's one forward step (:func:`megatron_dynbatch.mcore.forward.make_forward_step`)
    with the token-mean loss: with Megatron's local attention (``attention`` ``local``) attention
    stays inside each sample by the block-diagonal mask of ``segment_ids`` (the layer spec takes
    it as an arbitrary mask); with transformer-engine, torch-varlen or the reference a packed row
    passes THD ``cu_seqlens`` and a padded row uses the causal mask (one sample per row).
    ``attention``: the resolved ``--dynamic-batch-attention`` (default: from
    ``--transformer-impl``).
    """
    if attention is None:
        attention = (
            "transformer-engine" if args.transformer_impl == "transformer_engine" else "local"
        )
    return make_forward_step(
        _document_loss,
        thd=attention in THD_ATTENTIONS,
        to_device=True,
        timers=get_timers(),
        on_batch=None if args.use_dynamic_batch_size else count_fixed_row_lengths,
    )


def count_fixed_row_lengths(batch: dict, model: Any) -> None:
    """``--document-samples``: give Megatron's FLOPs count (``--log-throughput``,
    ``num_floating_point_operations_so_far``) the real tokens of each fixed row, as the dynamic
    path gives its steps' (``hooks._count_real_lengths``). Megatron counted each padded row as
    ``--seq-length`` tokens with a full ``seq_length**2`` of attention: a probe read the fixed run
    at 3.7x the dynamic run's FLOPs for the same samples, and at twice its TFLOP/s where it ran
    half as fast. Once a micro-batch on every rank (the first model chunk), in training only."""
    if not model.training:  # evaluation: Megatron counts the training iterations' FLOPs
        return
    if getattr(unwrapped_model(model), "vp_stage", None) not in (None, 0):
        return
    training = sys.modules.get("megatron.training.training")
    update = getattr(training, "update_seqlen_stats_from_cu_seqlens", None)
    if update is None or "sample_index" not in batch:
        return
    lengths = (batch["sample_index"] >= 0).sum(dim=1).to(torch.int64)
    update(torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]))


def _run_config(args: Any) -> Optional[Any]:
    """The run's resolved dynamic-batching settings, as ``hooks.configure`` built them when
    Megatron parsed the arguments (not resolved again; resolved here only where no hooks exist);
    ``None`` with the switch off."""
    if not args.use_dynamic_batch_size:
        return None
    state = current_hooks()
    return dynbatch_config_from_args(args) if state is None else state.config


def _document_splits(args: Any) -> list:
    """The train / valid / test document splits (opens, reads and checks the data files)."""
    tokenizer = get_tokenizer()
    eod = tokenizer.eod if args.eod_mask_loss else None
    tokenize = None
    if getattr(args, "sft_conversations", False):
        tokenize = conversation_tokenizer(tokenizer, args.tokenizer_type)
    cut = truncation_from_args(args, _run_config(args))
    splits = document_splits(args, tokenizer.vocab_size, eod, tokenize, cut)
    check_first_samples(splits)  # token ids in the vocabulary, before the model is built
    return splits


def document_datasets_provider(
    num_samples: List[Optional[int]], vp_stage: Optional[int] = None, *, splits=None
):
    """Train / valid / test document samples: datasets (fixed) or batch streams (dynamic).

    Built on every rank (``is_distributed``): with fixed micro-batches each rank's data loader
    reads its own rows; with dynamic batching each rank plans from the lengths and loads its own
    DP rank's samples (see ``hooks``). ``splits``: the data already opened by :func:`main`
    (before the model is built, so that bad data stops the run early); default: open it here.
    """
    del vp_stage
    args = get_args()
    if splits is None:
        splits = _document_splits(args)
    for split in splits:
        if split is not None:
            print_rank_0(
                f"> {split.documents.name}: split {split.split_index} has {len(split)} samples"
            )
    # Megatron's sizes are minimums (None with --full-validation): at least one epoch of a split.
    sizes = [
        None if split is None else max(int(count or 0), len(split))
        for split, count in zip(splits, num_samples, strict=True)
    ]
    if not args.use_dynamic_batch_size:
        return tuple(
            None if split is None else DocumentSampleDataset(split, size, args.seq_length)
            for split, size in zip(splits, sizes, strict=True)
        )
    eval_batch = args.eval_global_batch_size or args.global_batch_size
    starts = stream_starts(
        args.consumed_train_samples, args.consumed_valid_samples, bool(args.skip_train)
    )
    batch_sizes = (args.global_batch_size, eval_batch, eval_batch)
    return tuple(
        None if split is None else DocumentBatchStream(split, batch, start, size)
        for split, batch, start, size in zip(splits, batch_sizes, starts, sizes, strict=True)
    )


document_datasets_provider.is_distributed = True


def _arbitrary_mask_spec(base_spec_fn):
    """A layer-spec function whose self-attention takes the mask it is given (local impl)."""

    def _set(attention):
        if "attn_mask_type" not in getattr(attention, "params", {}):
            return attention
        return dataclasses.replace(
            attention, params={**attention.params, "attn_mask_type": AttnMaskType.arbitrary}
        )

    return with_self_attention(base_spec_fn, _set)


_ATTENTION_WHAT = {
    "transformer-engine": "Megatron's transformer-engine spec",
    "torch-varlen": "torch flash kernels: varlen on THD rows, SDPA flash on the others",
    "reference": "torch reference of transformer-engine's THD attention, dense",
    "local": "Megatron's local attention",
}


def _core_attention(attention: str) -> Optional[type]:
    """The ``core_attention`` module replacing the local spec's, or None (nothing replaced)."""
    if attention == "reference":
        return ThdReferenceAttention
    if attention == "torch-varlen":
        from megatron_dynbatch.mcore.varlen_attention import TorchVarlenAttention

        return TorchVarlenAttention
    return None


def _yaml_attention(args: Any) -> Optional[str]:
    """``attention`` of the ``--dynamic-batch-config`` YAML (read with dynamic batching only)."""
    path = getattr(args, "dynamic_batch_config", None)
    if not (args.use_dynamic_batch_size and path):
        return None
    from megatron_dynbatch.config import FLAGS, load_yaml_config

    # Only this key: the others were read and checked with the arguments, where a key the
    # command line overrides is skipped (issue 44); re-reading them here refused those again.
    return load_yaml_config(path, overridden=set(FLAGS) - {"attention"}).get("attention")


def _check_launch(args: Any) -> None:
    """The entry's checks of flags alone, run with ours before Megatron's argument dump
    (:func:`~.hooks.entry_check`): an unusable ``--dynamic-batch-attention`` was one line after
    ~850, a launch without torchrun a traceback of ~890 in ``pretrain()`` (now it runs as one
    rank)."""
    check_cpu_args_before_validation(args)
    _launch_attention(args)
    alone = one_rank_without_torchrun(args)
    if alone is not None:
        print(
            "megatron_dynbatch: started without torchrun: running as one rank (RANK=0, "
            f"WORLD_SIZE=1, MASTER_ADDR=127.0.0.1, MASTER_PORT={alone['MASTER_PORT']}); for more "
            "ranks, launch it under torchrun --nproc-per-node N.",
            file=sys.stderr,
            flush=True,
        )


def _launch_attention(args: Any) -> str:
    """The launch's checked core attention (:func:`attention_of_args`), from the flags alone."""
    return attention_of_args(
        args, document_samples=_uses_documents(args), yaml_value=_yaml_attention(args)
    )


def _embedding_ranks(pp_ranks: Sequence[int]) -> List[int]:
    """Ranks holding the word embeddings: first stage, and the last one when they are tied."""
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.add(pp_ranks[-1])
    return sorted(ranks)


def main(
    argv: Optional[Sequence[str]] = None,
    *,
    datasets_provider: Optional[Callable] = None,
    forward_step_func: Optional[Callable] = None,
) -> None:
    """Parse Megatron-LM's arguments (plus ours) and run ``pretrain()``.

    Args:
        argv: Arguments instead of ``sys.argv[1:]``.
        datasets_provider: Your own ``train_valid_test_datasets_provider`` (with
            ``--use-dynamic-batch-size`` its objects are iterators yielding ``RolloutBatch`` /
            ``LazyRolloutBatch``, see ``integrations/megatron_lm/hooks.py``; mark it ``is_distributed = True``).
            Default: the launch script's (stock, or document samples).
        forward_step_func: Your own ``forward_step_func``. Default: the stock GPT step, or the
            document step (token mean over ``loss_mask``) in the document modes.
    """
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        with entry_check(_check_launch):
            args = parse_and_validate_args(
                extra_args_provider=extra_args_provider, args_defaults=_ARGS_DEFAULTS
            )
    except (ValueError, AssertionError) as error:
        # A bad flag: ours (refused before Megatron prints the arguments, patch 0001) or
        # Megatron's own argument checks (ValueErrors and asserts): one line naming it.
        fail(error)
    try:
        check_cpu_args(args)
        check_stock_args(args)
        if args.use_dynamic_batch_size or _uses_documents(args):
            # Both modes hand the MoE forward its padding mask (mcore/forward.py).
            check_moe_args(args, dynamic=bool(args.use_dynamic_batch_size))
        # .idx/.bin checked before the model is built (issue 19), documents' ends too (issue 37)
        summaries = validate_data_paths(args, eod=_tokenizer_eod())
        attention = _launch_attention(args)  # checked before the dump; resolved again here
        splits = None
        if args.blend_weights is not None and (
            datasets_provider is not None or not _uses_documents(args)
        ):
            raise DynBatchValueError(
                f"--blend-weights {args.blend_weights} applies to document samples "
                "(--use-dynamic-batch-size, --document-samples with the launch script's data); "
                "Megatron's GPTDataset (and your own provider) blend by their own rule; remove it."
            )
        if datasets_provider is None and _uses_documents(args):
            _check_document_args(args)
            # Open and check the data now, before the model is built: a bad file or line stops
            # the run in seconds, naming it (the tokenizer exists once the arguments do).
            splits = _document_splits(args)
        if datasets_provider is None:  # a provider of the user's own reads its own splits
            if splits is None:
                _check_stock_split_documents(args, summaries)
            _check_validation_data(args, splits)
    except (ValueError, OSError) as error:
        # OSError: a data file that is missing or unreadable (its message names the path).
        _discard_tensorboard_file(args)
        fail(error)
    if args.eval_interval is None:
        # Megatron-LM's pretrain_gpt.py stops with a TypeError here; validate at the end instead.
        args.eval_interval = args.train_iters or max(
            1, (args.train_samples or 0) // args.global_batch_size
        )
    try:
        model_config = gpt_config_from_args(args)
    except (ValueError, AssertionError) as error:
        # Megatron's TransformerConfig checks what its argument checks left (a probe: a
        # traceback on every rank): one line, with the flags of the fields it names.
        _discard_tensorboard_file(args)
        fail(model_config_error(error))
    print_rank_0(f"> core attention: {attention} ({_ATTENTION_WHAT[attention]})")
    core = _core_attention(attention)
    if _uses_documents(args) or datasets_provider is not None:
        if args.use_dynamic_batch_size:
            # The planner, not a torch DataLoader, batches the samples (hooks).
            args.dataloader_type = "external"
        if args.transformer_impl == "local":
            from megatron.training.models.gpt import default_layer_spec

            spec = _arbitrary_mask_spec
            if core is not None:  # THD as on GPUs (mcore/thd_attention.py, varlen_attention.py)
                spec = partial(with_thd_reference_attention, core_attention=core)
            model_config.transformer_layer_spec = spec(default_layer_spec)
        provider = partial(document_datasets_provider, splits=splits)
        provider.is_distributed = True  # read by Megatron from the provider object
        forward_step = document_forward_step(args, attention)
    else:
        provider, forward_step = stock_datasets_provider, stock_forward_step
        if core is not None:
            # Megatron's stock path: windows (causal) and, with
            # --dataloader-inter-document-masking, THD rows, which the local attention refuses.
            from megatron.training.models.gpt import default_layer_spec

            model_config.transformer_layer_spec = with_thd_reference_attention(
                default_layer_spec, core_attention=core
            )
        if stock_rows_are_thd(args, document_samples=False) and (
            args.pipeline_model_parallel_size > 1 and args.micro_batch_size > 1
        ):
            # Megatron flattens a THD micro-batch to one row of MBS x S tokens, but its pipeline
            # sends use the fixed [S, MBS, H] shape: the next stage would read the row as MBS
            # rows of S (megatron-core 0.19.2). Exchanging each micro-batch's shape keeps it.
            model_config.transformer.variable_seq_lengths = True
    config = pretrain_cfg_container_from_args(args, model_config)
    if args.load:
        from megatron.training import checkpointing

        # A checkpoint of the other data unit (windows / documents), or of another order of the
        # documents read here, would resume at the wrong sample, silently: refused by name when
        # Megatron reads its arguments (resume.py).
        refuse_resume_in_another_mode(checkpointing, args, order=splits is not None)
    if getattr(args, "log_progress", False) and splits and splits[0] is not None:
        # progress.txt's tokens: the document samples' own lengths, not --seq-length each.
        count_progress_tokens(splits[0], get_args)
    # The training peak of fixed micro-batches too, measured as the planned steps' (memory.py).
    peak = TrainingPeak()
    try:
        pretrain(
            config,
            datasets_provider or provider,
            ModelType.encoder_or_decoder,
            peak.wrap(forward_step_func or forward_step),
            get_embedding_ranks=_embedding_ranks,
        )
    except DynBatchValueError as error:
        # Bad input met while running (a batch of the wrong size, a bad sample): one line, no
        # traceback. A StepAgreementError is the same on every rank: printed once (console.py).
        fail(error, code=1)
    _report_training_peak(args, peak)
    _close_process_groups()


def _report_training_peak(args: Any, peak: TrainingPeak) -> None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from megatron.core import parallel_state

    from megatron_dynbatch.integrations.megatron_lm import hooks

    state = hooks.current_hooks() if args.use_dynamic_batch_size else None
    peak.report(
        None if state is None else state.memory,
        parallel_state.get_pipeline_model_parallel_rank(),
        args.pipeline_model_parallel_size,
    )


def _close_process_groups() -> None:
    """Tear the process groups down while every rank is still alive.

    ``pretrain()`` returns with its groups open; left to interpreter exit, gloo's C++ threads were
    seen to abort one rank ("terminate called without an active exception", SIGABRT) after a run
    that had finished, failing torchrun's exit status. A barrier, then an explicit destroy, ends
    them in order on every rank.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
