"""SkyRL's micro-batch iterator, planned: what the patched Megatron worker uses instead of
``TokenBasedBatchIterator`` when ``trainer.use_dynamic_batch_size`` is on.

It keeps the interface SkyRL's worker reads from ``TokenBasedBatchIterator`` (``data``,
``_microbatches``, ``num_padding_microbatches``, ``len``, iteration,
``reorder_and_combine_batches``) so the worker's training and log-prob paths run unchanged, and
changes what they get:

* the plan of :mod:`.plan` over every DP rank (equal micro-batch counts by construction, a multiple
  of the interleaved schedule's group, the same rows ``B`` in every micro-batch, so SkyRL's own
  ``_pad_microbatch_to_size`` has nothing to add);
* placeholders (rows and whole micro-batches) with every key of the real batch, its dtype and its
  width, ``loss_mask``/``advantages``/``response_mask`` 0 and one attended token, so they add
  exactly 0 to SkyRL's pre-scaled policy loss and are dropped from its masked means; each row's
  sample index (the placeholder marker on placeholder rows) is written into the worker's
  micro-batch dicts by :meth:`PlannedBatchIterator.mark_rows`, which is how :mod:`.moe` knows
  them (never by their content);
* the plan checked on every rank of the DP group, inside
  :func:`~megatron_dynbatch.mcore.agreement.step_agreement`, before any pipeline communication:
  an error on one rank is the same error on all of them;
* outputs restored to sample order strictly (:func:`~megatron_dynbatch.runtime.restore_order`):
  stacked tensors (:meth:`PlannedBatchIterator.restore`, the forward-only log-probs) and per-row
  Python values (:meth:`PlannedBatchIterator.restore_rows`, the training pass's per-sample
  ``loss_fn_outputs``).

SkyRL is never imported here: batches are built with ``type(data)`` (SkyRL's
``TrainingInputBatch``, a ``dict`` with ``metadata``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import SKYRL, check_host_budget, check_host_lengths
from megatron_dynbatch.integrations.skyrl.plan import SkyrlPlan, plan_skyrl_minibatch
from megatron_dynbatch.mcore.agreement import gather_lengths, step_agreement
from megatron_dynbatch.runtime import restore_order
from megatron_dynbatch.runtime.placeholders import (
    MARKER_KEY,
    PLACEHOLDER_INDEX,
    placeholder_tensor,
)

__all__ = [
    "PlannedBatchIterator",
    "planned_microbatch_iterator",
    "placeholder_rows",
]

#: Keys whose placeholder value must not be 0: SkyRL strips rows to their attended tokens, and a
#: row with none breaks its ``remove_left_padding`` / THD packing.
_ATTENTION_KEY = "attention_mask"


def placeholder_rows(data: Any, rows: int) -> Dict[str, Optional[torch.Tensor]]:
    """``rows`` loss-masked rows with every key of ``data``: its dtype, device and trailing shape.

    Every value is 0 (no loss weight, no advantage, no response) except the attended tokens of
    ``placeholder_tensor(..., attend_first=True)`` in ``attention_mask``, which keep the row valid
    for SkyRL's padding removal. The rows are known as placeholders by their marker
    (:meth:`PlannedBatchIterator.mark_rows`), not by these values.

    Raises:
        DynBatchValueError: for a value that is not a tensor (a ``TensorList``: VLM inputs or
            controller-side ``sub_seq_lengths``), which this iterator cannot split.
    """
    _check_tensors(data)
    out: Dict[str, Optional[torch.Tensor]] = {}
    for key, value in data.items():
        out[key] = (
            None
            if value is None
            else placeholder_tensor(value, rows=rows, attend_first=key == _ATTENTION_KEY)
        )
    return out


def _check_tensors(data: Any) -> None:
    """Refuse a batch with a value that is not a tensor, on every batch: a probe's VLM batch
    (``pixel_values`` as SkyRL's ``TensorList``) trained while no step needed a placeholder and
    stopped at the first that did; the refusal is now the same whatever the lengths."""
    for key, value in data.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise DynBatchValueError(
                f"key {key!r} is a {type(value).__name__}, not a tensor; use_dynamic_batch_size "
                "plans padded [batch, seq] tensors only. Turn off controller-side sequence packing "
                "and VLM inputs, or set trainer.use_dynamic_batch_size=false."
            )


def _real_tokens(data: Any) -> List[int]:
    mask = data.get(_ATTENTION_KEY)
    if mask is None:
        raise DynBatchValueError(
            "the batch has no attention_mask; use_dynamic_batch_size plans by real tokens "
            "(attention_mask.sum(-1)), so the batch must carry one."
        )
    return [int(n) for n in mask.sum(dim=1).tolist()]


class PlannedBatchIterator:
    """One DP rank's micro-batches of a :class:`~.plan.SkyrlPlan` (real first, then placeholders).

    Args:
        data: SkyRL's ``TrainingInputBatch`` (this DP rank's shard of the mini-batch).
        plan: The plan every rank derived.
        dp_rank: This rank's index in ``plan.ranks``.
    """

    #: What SkyRL's patched worker checks to restore log-probs in sample order with this iterator.
    restores_sample_order = True

    def __init__(self, data: Any, plan: SkyrlPlan, dp_rank: int):
        self.data = data
        self.plan = plan
        self.dp_rank = dp_rank
        self._num_samples = len(_real_tokens(data))
        planned = sorted(i for mb in plan.ranks[dp_rank] for i in mb)
        if planned != list(range(self._num_samples)):
            raise DynBatchValueError(
                f"the plan of DP rank {dp_rank} covers samples {planned}, but the rank holds "
                f"{self._num_samples}; every rank must plan the lengths gathered from every rank."
            )
        #: Real micro-batches (local indices); SkyRL's ``_reorder_megatron_forward_output`` reads it.
        self._microbatches = [list(mb) for mb in plan.ranks[dp_rank]]

    @property
    def num_padding_microbatches(self) -> int:
        """Placeholder micro-batches after the real ones (they carry no sample)."""
        return self.plan.placeholders(self.dp_rank)

    @property
    def micro_batch_size(self) -> int:
        """Rows of every micro-batch."""
        return self.plan.rows

    def __len__(self) -> int:
        return self.plan.num_microbatches

    def _batch(self, values: Dict[str, Any], placeholder: bool) -> Any:
        batch = type(self.data)(values)
        batch.metadata = dict(self.data.metadata or {})
        if placeholder:
            batch.metadata["is_padding_batch"] = True
        return batch

    def _microbatch(self, indices: List[int]) -> Any:
        pad = self.plan.rows - len(indices)
        fill = placeholder_rows(self.data, pad) if pad else {}
        index = torch.tensor(indices, dtype=torch.long)
        values = {}
        for key, value in self.data.items():
            if value is None:
                values[key] = None
                continue
            rows = value[index.to(value.device)]
            values[key] = torch.cat([rows, fill[key]]) if pad else rows
        return self._batch(values, placeholder=False)

    def __iter__(self) -> Iterator[Any]:
        for indices in self._microbatches:
            yield self._microbatch(indices)
        for m in range(self.num_padding_microbatches):
            # SkyRL's forward_backward drops the metrics of is_padding_batch micro-batches, then
            # all-reduces the metrics dict key by key over DP. A rank with no sample at all must
            # still report every key, or its all-reduces pair with other keys on the other ranks:
            # so its first placeholder is not flagged (its loss and gradients are 0 all the same).
            flagged = m > 0 or bool(self._microbatches)
            yield self._batch(placeholder_rows(self.data, self.plan.rows), placeholder=flagged)

    def row_indices(self) -> List[List[int]]:
        """Every micro-batch's per-row sample index, in schedule order: the local index of each
        real row, :data:`~megatron_dynbatch.runtime.placeholders.PLACEHOLDER_INDEX` on every
        placeholder row (the marker :mod:`.moe` reads)."""
        rows = self.plan.rows
        real = [[*mb, *[PLACEHOLDER_INDEX] * (rows - len(mb))] for mb in self._microbatches]
        return real + [[PLACEHOLDER_INDEX] * rows] * self.num_padding_microbatches

    def mark_rows(self, micro_batches: Sequence[Dict[str, Any]]) -> None:
        """Give each of the worker's micro-batch dicts (one per micro-batch of this iterator, in
        its order) the placeholder marker: ``[B]`` int64 under
        :data:`~megatron_dynbatch.runtime.placeholders.MARKER_KEY`, each row's sample index
        (:meth:`row_indices`). Patch 0002 calls it on ``forward_backward``'s micro-batch dicts;
        patch 0004 hands the key to :func:`.moe.router_padding`.

        Raises:
            DynBatchValueError: when the dicts are not this iterator's micro-batches (count, rows).
        """
        indices = self.row_indices()
        if len(micro_batches) != len(indices):
            raise DynBatchValueError(
                f"{len(micro_batches)} micro-batch dicts on DP rank {self.dp_rank}; the plan runs "
                f"{len(indices)}."
            )
        for m, (batch, rows) in enumerate(zip(micro_batches, indices, strict=True)):
            mask = batch[_ATTENTION_KEY]
            if mask.shape[0] != len(rows):
                raise DynBatchValueError(
                    f"micro-batch {m} has {mask.shape[0]} rows, the plan has {len(rows)}."
                )
            batch[MARKER_KEY] = torch.tensor(rows, dtype=torch.int64, device=mask.device)

    def restore_rows(self, rows: Sequence[Any]) -> List[Any]:
        """This rank's samples in sample order, from one value per row of every micro-batch.

        ``rows`` is what SkyRL's ``forward_backward`` collects from its loss function: one entry
        per row (``B`` per micro-batch, placeholders included) in schedule order, e.g. the
        per-sample ``loss_fn_outputs`` dicts. Placeholder rows and micro-batches are dropped.

        Raises:
            DynBatchValueError: when the number of rows is not the plan's ``num_microbatches *
                rows`` (a row lost or added on the way; the plan itself covers every sample once,
                checked when the iterator is built).
        """
        expected = len(self) * self.plan.rows
        if len(rows) != expected:
            raise DynBatchValueError(
                f"{len(rows)} per-row outputs on DP rank {self.dp_rank}; the plan runs "
                f"{len(self)} micro-batches of {self.plan.rows} rows ({expected})."
            )
        per_sample: Dict[int, Any] = {}
        for m, indices in enumerate(self._microbatches):
            start = m * self.plan.rows
            per_sample.update(zip(indices, rows[start : start + len(indices)], strict=True))
        return restore_order(per_sample, self._num_samples)

    def restore(self, per_microbatch: List[torch.Tensor]) -> torch.Tensor:
        """Stack per-micro-batch outputs (``[B, ...]`` each, schedule order) in sample order.

        Raises:
            DynBatchValueError: when the count or a row count does not match the plan.
        """
        if len(per_microbatch) != len(self):
            raise DynBatchValueError(
                f"{len(per_microbatch)} micro-batch outputs for {len(self)} planned micro-batches "
                f"on DP rank {self.dp_rank}."
            )
        for m, output in enumerate(per_microbatch):
            if output.shape[0] != self.plan.rows:
                raise DynBatchValueError(
                    f"micro-batch {m} returned {output.shape[0]} rows, the plan has "
                    f"{self.plan.rows}."
                )
        ordered = self.restore_rows([row for output in per_microbatch for row in output])
        if not ordered:
            ref = per_microbatch[0]
            return ref.new_zeros((0, *ref.shape[1:]))
        return torch.stack(ordered)

    def reorder_and_combine_batches(self, batches: List[Any]) -> Any:
        """SkyRL's interface: one batch of every key of ``batches`` in sample order."""
        combined = {
            key: None if value is None else self.restore([b[key] for b in batches])
            for key, value in batches[0].items()
        }
        out = type(batches[0])(combined)
        out.metadata = batches[0].metadata
        return out


def planned_microbatch_iterator(
    data: Any,
    max_tokens_per_microbatch: int,
    *,
    dp_group=None,
    what: str = "SkyRL mini-batch",
    **plan_options: Any,
) -> PlannedBatchIterator:
    """Gather every DP rank's token counts, plan, agree, and return this rank's iterator.

    Every rank of ``dp_group`` must call it for the same mini-batch (SkyRL's workers all run
    ``forward_backward`` / ``_forward_logprobs`` together). Only lengths cross ranks.
    ``plan_options``: the parallel sizes, the planner and the per-micro-batch overhead, as
    :func:`~megatron_dynbatch.integrations.skyrl.plan.plan_skyrl_minibatch` takes them.

    Raises:
        StepAgreementError: on every rank when any rank's input or plan failed (naming the rank).
        PlanMismatchError: on every rank when the ranks derived different plans.
    """
    if not dist.is_initialized():
        _check_tensors(data)
        plan = plan_skyrl_minibatch([_real_tokens(data)], max_tokens_per_microbatch, **plan_options)
        return PlannedBatchIterator(data, plan, 0)
    # Local checks first, agreed over the group, so a bad batch on one rank stops every rank here
    # instead of leaving the others waiting in the gather below.
    with step_agreement(dp_group, what=f"{what}: checking this rank's samples"):
        _check_tensors(data)
        lengths = _real_tokens(data)
        check_host_lengths(SKYRL, [lengths])
        check_host_budget(SKYRL, max_tokens_per_microbatch)
    gathered = gather_lengths(lengths, dp_group)
    with step_agreement(dp_group, what=f"{what}: planning") as agreement:
        plan = plan_skyrl_minibatch(gathered, max_tokens_per_microbatch, **plan_options)
        iterator = PlannedBatchIterator(data, plan, dist.get_rank(dp_group))
        agreement.fingerprint = plan.fingerprint()
    return iterator
