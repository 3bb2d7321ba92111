"""What slime's patched Megatron backend calls when ``--use-dynamic-batch-size`` is on.

``patches/slime/`` changes a few lines of slime (see its README for the pinned commit); the work is
here. With the patches, slime's own ``get_batch``, ``train_one_step`` and ``forward_only`` run:

* :func:`data_iterators` (from ``get_data_iterator``): :class:`SlimeDataIterator`, slime's
  ``DataIterator`` interface plus the step's uniform row length. A placeholder micro-batch (an
  empty index list from :func:`~megatron_dynbatch.adapters.slime.build_dp_schedule`) yields one
  full-length, fully loss-masked placeholder sample with every key the real samples carry, so
  ``get_batch`` never sees an empty micro-batch (slime #1860) and pads every packed row of the
  step to the same length.
* :func:`agree_on_step` (in ``train_one_step``) and :func:`forward_only_iterators` (in
  ``forward_only``): this rank's micro-batches are checked before any pipeline communication,
  inside :func:`~megatron_dynbatch.mcore.agreement.step_agreement`, so a bad sample on one rank
  stops every rank with the same error instead of hanging the others in a send.
* :func:`wrap_loss_function` (in ``train_one_step``): slime's own ``loss_function``, called as
  it is; around it the per-token normaliser is made exact (placeholders count no token) and every
  logit stays in the graph.
* :func:`forward_only_iterators` and :func:`restore_rollout_order` (in ``forward_only``): log-prob
  passes planned under ``--log-probs-max-tokens-per-gpu`` on this rank's samples, outputs back in
  the rank's rollout order, strictly (a missing or duplicated sample is an error).

Imports slime only inside the function that calls its loss, so everything else is testable
without slime.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.slime.config import RESPONSE_FLOAT_KEYS
from megatron_dynbatch.integrations.slime.dp_schedule import (
    LOGPROB_MICRO_BATCHES_KEY,
    LOGPROB_ROW_LENGTHS_KEY,
    MEMORY_BUDGET_KEY,
    PREDICTED_PEAK_KEY,
    ROW_LENGTHS_KEY,
    SEQ_LENGTHS_KEY,
    uniform_row_lengths,
)
from megatron_dynbatch.integrations.slime.empty_rank import add_phantom_sample
from megatron_dynbatch.integrations.slime.placeholders import cp_local, placeholder_sample
from megatron_dynbatch.integrations.slime.step_memory import STEP_PEAKS
from megatron_dynbatch.mcore.agreement import step_agreement
from megatron_dynbatch.planning import round_up
from megatron_dynbatch.planning.spec import check_int
from megatron_dynbatch.runtime import restore_order
from megatron_dynbatch.runtime.placeholders import is_placeholder

__all__ = [
    "SlimeDataIterator",
    "agree_on_step",
    "data_iterators",
    "forward_only_iterators",
    "wrap_loss_function",
    "placeholder_sample",
    "restore_rollout_order",
]


class SlimeDataIterator:
    """slime's ``DataIterator`` (``get_next``, ``reset``, ``micro_batch_indices``, ``offset``),
    plus the planned row length of every micro-batch and placeholders for empty index lists.

    Args:
        rollout_data: This rank's per-sample lists (slime's ``rollout_data``).
        micro_batch_indices: Local sample indices per micro-batch; ``[]`` is a placeholder.
        row_lengths: Per micro-batch, the packed row length on one GPU (per CP rank).
        cp_size: Context-parallel size: a placeholder sample holds ``row_length * cp_size`` tokens,
            which slime's CP slicing turns into exactly one row per CP rank.
        forward_only: ``(micro_batch_indices, row_lengths)`` of this rank's log-prob passes as
            the rollout side planned them; ``None``: they run the training micro-batches.
    """

    def __init__(
        self,
        rollout_data: Dict[str, Any],
        micro_batch_indices: Sequence[Sequence[int]],
        row_lengths: Sequence[int],
        cp_size: int = 1,
        forward_only: Optional[Tuple[List[List[int]], List[int]]] = None,
    ) -> None:
        if len(row_lengths) != len(micro_batch_indices):
            raise DynBatchValueError(
                f"{len(row_lengths)} row lengths for {len(micro_batch_indices)} micro-batches; "
                "the dynamic-batch schedule shipped with the rollout data is inconsistent."
            )
        self.rollout_data = rollout_data
        self.micro_batch_indices = [list(mb) for mb in micro_batch_indices]
        self.row_lengths = [int(s) for s in row_lengths]
        self.cp_size = check_int("cp_size", cp_size, 1, "pass the context-parallel size.")
        self.forward_only = forward_only
        self.offset = 0
        #: Row length of the micro-batch last returned by :meth:`get_next` (read by get_batch).
        self.row_length: Optional[int] = None
        #: With --max-memory-gib: per step, per pipeline stage, this DP rank's predicted peak
        #: (MiB), and the budget (MiB), as the rollout side planned them (:func:`data_iterators`).
        self.predicted_peaks_mib: Optional[List[List[float]]] = None
        self.memory_budget_mib: Optional[float] = None

    def get_next(self, keys: Sequence[str]) -> Dict[str, Any]:
        if self.offset >= len(self.micro_batch_indices):
            raise DynBatchValueError(
                f"micro-batch {self.offset} requested but this rank's schedule has "
                f"{len(self.micro_batch_indices)}; num_microbatches and the schedule disagree."
            )
        indices = self.micro_batch_indices[self.offset]
        self.row_length = self.row_lengths[self.offset]
        self.offset += 1
        if is_placeholder(indices):
            sample = placeholder_sample(
                self.rollout_data, keys, self.row_length * self.cp_size, cp_size=self.cp_size
            )
            return {key: None if value is None else [value] for key, value in sample.items()}
        batch: Dict[str, Any] = {}
        for key in keys:
            values = self.rollout_data.get(key, None)
            batch[key] = None if values is None else [values[i] for i in indices]
        return batch

    def reset(self) -> "SlimeDataIterator":
        self.offset = 0
        self.row_length = None
        return self

    def row_shape(self, index: int) -> Tuple[int, int]:
        """Micro-batch ``index``'s packed row as the first stage holds it: ``(1, row length)``
        (what :mod:`megatron_dynbatch.mcore.contained` stands in for)."""
        return 1, self.row_lengths[index]

    def routed_experts_for_row(
        self,
        rollout_routed_experts: Sequence[torch.Tensor],
        tokens: Sequence[torch.Tensor],
        *,
        num_experts: int,
        data_pad_size_multiplier: int,
        sequence_parallel: bool,
        allgather_cp: bool,
    ) -> torch.Tensor:
        """R3: slime's ``prepare_routed_experts_for_routing_replay`` for the micro-batch
        :meth:`get_next` last returned, padded to that micro-batch's row length.

        Called by the patched ``fill_routing_replay`` (same arguments as slime's function). slime
        pads the routed experts to the next multiple of ``tp * data_pad_size_multiplier``, the
        pad of its own ``get_batch``; the patched ``get_batch`` pads the row to the step's row
        length instead. Calling slime's function with ``tp * multiplier`` equal to that row length
        pads every micro-batch (whose tokens never exceed its row) to exactly the row, through
        slime's own code: per-sample pad row, context-parallel slicing, sequence-parallel split.

        Raises:
            DynBatchValueError: when no micro-batch was taken yet, when the row length is not a
                multiple of the tensor-parallel size, or when the result does not fill the row.
        """
        from megatron.core import mpu
        from slime.backends.megatron_utils.cp_utils import (
            prepare_routed_experts_for_routing_replay,
        )

        del data_pad_size_multiplier  # replaced by the row length
        row = self.row_length
        if row is None:
            raise DynBatchValueError(
                "routed_experts_for_row was called before get_next: the R3 rows are built for "
                "the micro-batch the iterator last returned."
            )
        tp = mpu.get_tensor_model_parallel_world_size()
        if row % tp:
            raise DynBatchValueError(
                f"row length {row} is not a multiple of the tensor-parallel size {tp}; R3's "
                "routed experts cannot be split like the tokens. Keep --data-pad-size-multiplier "
                "so that rows stay multiples of tp."
            )
        experts = prepare_routed_experts_for_routing_replay(
            rollout_routed_experts,
            tokens,
            num_experts=num_experts,
            data_pad_size_multiplier=row // tp,
            sequence_parallel=sequence_parallel,
            allgather_cp=allgather_cp,
        )
        want = row // tp if sequence_parallel else row
        if experts.shape[0] != want:
            raise DynBatchValueError(
                f"micro-batch {self.offset - 1}: R3 routed experts have {experts.shape[0]} rows "
                f"but the training row holds {want} tokens; the rollout's routed experts and "
                "tokens disagree (each sample needs total_lengths - 1 rows)."
            )
        return experts

    # -- checks before the schedule --------------------------------------------------------------

    def check_microbatches(self, count: int) -> None:
        """Validate the next ``count`` micro-batches' samples (raises ``ValueError``)."""
        end = self.offset + count
        if end > len(self.micro_batch_indices):
            raise DynBatchValueError(
                f"the step needs micro-batches {self.offset}..{end - 1} but this rank's schedule "
                f"has {len(self.micro_batch_indices)}."
            )
        data = self.rollout_data
        for m in range(self.offset, end):
            packed = 0
            for i in self.micro_batch_indices[m]:
                packed += _check_sample(data, i, self.cp_size)
            if packed > self.row_lengths[m]:
                raise DynBatchValueError(
                    f"micro-batch {m}: its samples need {packed} tokens per GPU, more than the "
                    f"step's row length {self.row_lengths[m]}; the schedule and the data differ."
                )


def _check_sample(data: Mapping[str, Any], i: int, cp_size: int) -> int:
    """Check local sample ``i``; return its packed token count on one CP rank."""
    tokens = torch.as_tensor(data["tokens"][i])
    total = int(data["total_lengths"][i])
    response = int(data["response_lengths"][i])
    where = f"local sample {i}"
    if "partition" in data and i < len(data["partition"]):
        where += f" (rollout position {int(data['partition'][i])})"
    if tokens.dim() != 1 or tokens.numel() != total:
        raise DynBatchValueError(
            f"{where}: tokens has shape {tuple(tokens.shape)} but total_lengths={total}."
        )
    if tokens.dtype.is_floating_point:
        raise DynBatchValueError(
            f"{where}: tokens have dtype {tokens.dtype}; token ids must be integers."
        )
    if not 1 <= response <= total - 1:
        raise DynBatchValueError(
            f"{where}: response_lengths={response} must be in [1, total_lengths - 1 = "
            f"{total - 1}]: slime needs at least one prompt token and one response token."
        )
    mask = torch.as_tensor(data["loss_masks"][i])
    if mask.numel() != response:
        raise DynBatchValueError(
            f"{where}: loss_masks has {mask.numel()} values for response_lengths={response}."
        )
    keep = mask.reshape(-1) > 0
    local_keep = None
    for key in RESPONSE_FLOAT_KEYS:
        values = data.get(key)
        if values is None or len(values) <= i:
            continue
        value = values[i]
        if not isinstance(value, torch.Tensor):
            continue
        kept = keep
        if value.numel() != response and cp_size > 1:
            # slime keeps what its forward pass computes (and the rollout's log-probs, once the
            # actor sliced them) per context-parallel rank: this rank's zigzag chunks only.
            if local_keep is None:
                local_keep = cp_local(keep, total, response, cp_size)
            kept = local_keep
        if value.numel() != kept.numel():
            expected = (
                f"{response} (one per response token)"
                if cp_size == 1
                else f"{response} (one per response token) or {kept.numel()} (this context-"
                "parallel rank's chunks, as slime slices them)"
            )
            raise DynBatchValueError(
                f"{where}: {key} has {value.numel()} values for response_lengths={response}; "
                f"expected {expected}."
            )
        bad = kept & ~torch.isfinite(value.reshape(-1).float())
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise DynBatchValueError(
                f"{where}: {key}[{j}]={float(value.reshape(-1)[j])} is not finite on a "
                "loss-bearing token; it would turn every gradient into NaN."
            )
    multiple = 2 * cp_size if cp_size > 1 else 1
    return round_up(total, multiple) // cp_size


def data_iterators(
    rollout_data: Dict[str, Any], vpp_size: int, cp_size: int
) -> List[SlimeDataIterator]:
    """One :class:`SlimeDataIterator` per model chunk over the training schedule of this rank.

    Takes the schedule's own keys (:meth:`DPSchedule.rank_fields
    <megatron_dynbatch.integrations.slime.dp_schedule.DPSchedule.rank_fields>`) out of
    ``rollout_data``: slime's ``log_rollout_data`` logs every list it finds there as a rollout
    metric. A rank that holds no sample gets one fully masked phantom sample
    (:func:`add_phantom_sample`), so slime's per-sample code (advantages, KL, whitening, logging)
    runs on it like on its peers.
    """
    if SEQ_LENGTHS_KEY not in rollout_data:
        raise DynBatchValueError(
            f"rollout data without {SEQ_LENGTHS_KEY!r}: the rollout side did not ship "
            "megatron_dynbatch's schedule (apply every patch in patches/slime to both sides)."
        )
    # A new rollout: the last one's last step is read now (slime's step has no end hook).
    STEP_PEAKS.close()
    seq_lengths = [int(s) for s in rollout_data.pop(SEQ_LENGTHS_KEY)]
    predicted = rollout_data.pop(PREDICTED_PEAK_KEY, None)
    budget = rollout_data.pop(MEMORY_BUDGET_KEY, None)
    row_lengths = [int(s) for s in rollout_data.pop(ROW_LENGTHS_KEY, None) or ()]
    forward_only = None
    if LOGPROB_MICRO_BATCHES_KEY in rollout_data:
        micro_batches = [list(mb) for mb in rollout_data.pop(LOGPROB_MICRO_BATCHES_KEY)]
        rows = [int(s) for s in rollout_data.pop(LOGPROB_ROW_LENGTHS_KEY)]
        if len(rows) != len(micro_batches):
            raise DynBatchValueError(
                f"{len(rows)} log-prob row lengths for {len(micro_batches)} log-prob "
                "micro-batches; the rollout side and the trainer run different megatron_dynbatch "
                "versions."
            )
        forward_only = (micro_batches, rows)
    nums = [int(n) for n in rollout_data["num_microbatches"]]
    if len(nums) != len(seq_lengths):
        raise DynBatchValueError(
            f"{len(nums)} steps in num_microbatches but {len(seq_lengths)} row lengths; the "
            "rollout side and the trainer run different megatron_dynbatch versions."
        )
    if not rollout_data.get("partition"):
        forward_only = add_phantom_sample(rollout_data, forward_only, cp_size)
    if not row_lengths:
        # Uniform rows (a schedule that ships only the steps' rows).
        row_lengths = uniform_row_lengths(seq_lengths, nums)
    iterators = [
        SlimeDataIterator(
            rollout_data, rollout_data["micro_batch_indices"], row_lengths, cp_size, forward_only
        )
        for _ in range(vpp_size)
    ]
    if predicted is not None:
        if len(predicted) != len(nums):
            raise DynBatchValueError(
                f"{len(predicted)} steps of predicted peaks for {len(nums)} steps; the rollout "
                "side and the trainer run different megatron_dynbatch versions."
            )
        for iterator in iterators:
            iterator.predicted_peaks_mib = [[float(p) for p in step] for step in predicted]
            iterator.memory_budget_mib = float(budget)
    return iterators


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _check_interleaving(args: Any, vpp: int) -> None:
    """slime runs Megatron with ``variable_seq_lengths``: at pp = 2 the interleaved schedule then
    hangs without ``overlap_p2p_comm`` (see ``megatron.schedule.check_schedule_config``)."""
    from megatron_dynbatch.mcore.schedule import interleaved_shape_exchange_hangs

    pp = getattr(args, "pipeline_model_parallel_size", None) or 1
    overlap = getattr(args, "overlap_p2p_comm", True)
    if interleaved_shape_exchange_hangs(pp, vpp > 1, True, bool(overlap)):
        raise DynBatchValueError(
            f"interleaving (virtual pipeline size {vpp}) at --pipeline-model-parallel-size 2 "
            "with --no-overlap-p2p-communication hangs megatron.core's batched exchange of the "
            "variable row shapes slime uses; drop --no-overlap-p2p-communication (Megatron-LM "
            "requires the overlap there) or use pp > 2."
        )


def agree_on_step(
    args: Any, data_iterator: Sequence[SlimeDataIterator], num_microbatches: int, step_id: int
) -> None:
    """Check this rank's micro-batches of the step, then agree with every rank before the schedule.

    Raises:
        StepAgreementError: on every rank when any rank's data is bad (naming rank and sample),
            or PlanMismatchError when ranks hold different schedules.
    """
    first = data_iterator[0]
    with step_agreement(what=f"slime training step {step_id}") as agreement:
        _check_interleaving(args, len(data_iterator))
        if not isinstance(first, SlimeDataIterator):
            raise DynBatchValueError(
                "--use-dynamic-batch-size training got slime's stock DataIterator; the rollout "
                "side did not ship megatron_dynbatch's schedule (apply every patch in "
                "patches/slime to both sides)."
            )
        first.check_microbatches(num_microbatches)
        # Rows differ between DP ranks (each micro-batch its own); the count is common to all.
        agreement.fingerprint = _fingerprint(step_id, num_microbatches)
    if first.predicted_peaks_mib is not None:
        # --max-memory-gib: this step's peak is measured from here (step_memory.py).
        STEP_PEAKS.begin(step_id, first.predicted_peaks_mib[step_id], first.memory_budget_mib)


def forward_only_iterators(
    args: Any, data_iterator: Sequence[SlimeDataIterator]
) -> Tuple[List[SlimeDataIterator], List[int]]:
    """Iterators and micro-batch counts of one log-prob pass over this rank's samples.

    The rollout side planned the pass for every DP rank at once
    (:class:`~megatron_dynbatch.integrations.slime.dp_schedule.ForwardOnlySchedule`: this rank's
    samples under ``--log-probs-max-tokens-per-gpu``, counts equal on every rank by construction,
    so an expert-parallel all-to-all never waits on a rank that has finished). Under MoE routing
    replay none was shipped: the pass runs the training micro-batches, step by step, so routing
    recorded here replays onto the same micro-batches in training. Every rank checks its samples,
    then all agree (and compare their counts) before any p2p.
    """
    first = data_iterator[0]
    STEP_PEAKS.close()  # a training step's peak ends before a log-prob pass
    with step_agreement(what="slime forward-only pass") as agreement:
        if not isinstance(first, SlimeDataIterator):
            raise DynBatchValueError(
                "--use-dynamic-batch-size forward_only got slime's stock DataIterator; apply every "
                "patch in patches/slime (the rollout side ships the schedule)."
            )
        rollout_data = first.rollout_data
        if first.forward_only is None:
            iterators = list(data_iterator)
            counts = [int(n) for n in rollout_data["num_microbatches"]]
        else:
            microbatches, rows = first.forward_only
            iterators = [
                SlimeDataIterator(rollout_data, microbatches, rows, first.cp_size)
                for _ in data_iterator
            ]
            counts = [len(microbatches)]
        for iterator in iterators:
            iterator.reset()
        iterators[0].check_microbatches(sum(counts))
        # Equal counts on every rank are a property of the schedule; the agreement checks it.
        agreement.fingerprint = _fingerprint("forward-only", counts)
    return iterators, counts


def restore_rollout_order(
    values_per_microbatch: Sequence[Sequence[Any]], iterator: SlimeDataIterator
) -> List[Any]:
    """Forward-only outputs (one list per micro-batch, in schedule order) in local sample order.

    A placeholder micro-batch's single output is dropped; a count that does not match the schedule
    is an error instead of a silently shifted pairing.
    """
    schedule = iterator.micro_batch_indices
    if len(values_per_microbatch) != len(schedule):
        raise DynBatchValueError(
            f"{len(values_per_microbatch)} forward-only outputs for {len(schedule)} scheduled "
            "micro-batches on this rank."
        )
    per_sample: Dict[int, Any] = {}
    for m, (values, indices) in enumerate(zip(values_per_microbatch, schedule, strict=True)):
        placeholder = is_placeholder(indices)
        expected = 1 if placeholder else len(indices)
        if len(values) != expected:
            raise DynBatchValueError(
                f"micro-batch {m}: {len(values)} outputs for {expected} sample(s) "
                f"({'placeholder' if placeholder else indices})."
            )
        if not placeholder:
            per_sample.update(zip(indices, values, strict=True))
    return restore_order(per_sample, len(iterator.rollout_data["total_lengths"]))


def contained_schedule(forward_backward_func: Callable[..., Any], what: str) -> Callable[..., Any]:
    """slime's ``forward_backward_func``, called as slime calls it, with a failure inside the
    schedule on one rank (slime's loss, the model's forward or backward) contained: that rank
    finishes the schedule on zero stand-ins and every rank raises the same error after it
    (:mod:`megatron_dynbatch.mcore.contained`), instead of its peers waiting in their p2p until
    the process-group timeout while the Ray actor that failed lives on."""
    from megatron_dynbatch.mcore.contained import contained_schedule as contain

    def run(*, forward_step_func: Callable[..., Any], model: Any, **kwargs: Any) -> Any:
        chunks = model if isinstance(model, (list, tuple)) else [model]
        return contain(
            lambda step: forward_backward_func(forward_step_func=step, model=model, **kwargs),
            forward_step_func,
            what=what,
            consequence=(
                "no output of this pass is kept"
                if kwargs.get("forward_only")
                else "slime stops the step before its optimizer step"
            ),
            models=chunks,
            forward_only=bool(kwargs.get("forward_only")),
        )

    return run


# -- the loss -------------------------------------------------------------------------------------


def wrap_loss_function(loss_function: Callable[..., Any]) -> Callable[..., Any]:
    """slime's own ``loss_function``, with its normaliser made exact around it.

    Patch 0004 hands in the ``loss_function`` slime's ``model.py`` imported and uses what this
    returns instead. slime computes the loss (its dispatch over ``args.loss_type``, its reducers,
    its scaling by ``num_microbatches / step_global_batch_size * dp`` for the per-rollout mean,
    which Megatron's division by ``num_microbatches`` and DDP's DP average cancel whatever the
    micro-batches hold), so a fix to slime's loss reaches this path unchanged. Around it:

    * with ``--calculate-per-token-loss`` the normaliser (and ``values[0]``, what slime's
      ``reduce_train_step_metrics`` divides by) becomes the exact count of loss tokens: slime
      counts a fully masked sample as 1 token (``clamp_min(loss_mask.sum(), 1)``), so every
      placeholder micro-batch would add one token to the denominator Megatron divides every
      gradient by;
    * ``loss + 0 * logits.sum()`` keeps every logit in the graph: a placeholder's loss is 0 but
      its backward must run through every pipeline stage (slime adds the same term under
      ``--allgather-cp``).

    A placeholder's loss is exactly 0 through slime's reducers: its loss mask is 0 and its logits
    finite (it holds real tokens), so ``x * mask`` adds 0.
    """

    @functools.wraps(loss_function)
    def exact_normaliser(
        args: Any,
        batch: Dict[str, Any],
        num_microbatches: int,
        step_global_batch_size: int,
        logits: torch.Tensor,
    ) -> Tuple[torch.Tensor, Any, Dict[str, Any]]:
        loss, normaliser, log = loss_function(
            args, batch, num_microbatches, step_global_batch_size, logits
        )
        loss = loss + 0 * logits.sum()
        if args.calculate_per_token_loss:
            exact = sum(int((mask > 0).sum()) for mask in batch["loss_masks"])
            normaliser = torch.tensor(exact, dtype=torch.int, device=logits.device)
            values = log["values"].clone()
            values[0] = exact
            log = {**log, "values": values}
        return loss, normaliser, log

    return exact_normaliser
