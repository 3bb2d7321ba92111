"""Exact loss normalisation over uneven micro-batches and DP ranks, in Megatron's 3-tuple form.

Every aggregation is written as one global ratio ``sum(numerators) / sum(denominators)`` whose
parts are additive over micro-batches and DP ranks:

====================  ==========================================  ===========================
aggregation           numerator of one micro-batch                denominator
====================  ==========================================  ===========================
token-mean            sum of masked token losses                  masked tokens
seq-mean-token-mean   sum over its sequences of their token-mean  real sequences
seq-mean-token-sum    sum over its sequences of their token-sum   real sequences
sum                   sum of masked token losses                  0 (no normalisation)
====================  ==========================================  ===========================

Megatron (``TransformerConfig.calculate_per_token_loss=True``) back-propagates the first element
of the loss function's ``(loss, num_tokens, log)`` tuple unscaled, sums the second over the
step's micro-batches and hands it to ``finalize_model_grads(model, num_tokens)``, which sums it
over DP (x CP) ranks and multiplies the gradients by ``1 / num_tokens`` when it is > 0. Returning
:func:`microbatch_loss`'s tuple therefore yields exactly the gradient of :func:`reference_loss`,
however samples are spread over micro-batches and ranks, placeholders included (they add 0 to
both parts). For ``sum`` the trainer passes ``num_tokens=None`` to ``finalize_model_grads`` (a
wrapper set as ``config.finalize_model_grads_func``); the 0 denominator also makes stock
Megatron skip the division, but the wrapper states the intent.

Conventions:

* A sequence is the set of tokens with one ``sample_index >= 0`` in the micro-batch; the
  materializer never splits a sample over micro-batches.
* A sequence with no loss token (e.g. one-token samples, fully masked responses) contributes 0 to
  the numerator and still counts 1 in the denominator of the ``seq-mean-*`` aggregations, as in
  ``torch.mean`` over per-sequence values. :func:`reference_loss` applies the same rule.
* A global denominator of 0 (nothing to learn from) gives loss 0 and zero gradients.
* Masked positions are inert: their values never reach the loss (``torch.where`` selects, it does
  not multiply by the mask), and their gradients are exactly 0 as long as the inputs of the token
  loss are finite there. ``where`` alone cannot promise that: for ``ce * advantage`` with a NaN
  advantage on a masked token, backward still computes ``0 * NaN`` for d(loss)/d(ce). The
  materializer therefore gives finite declared fields everywhere (``schema.py``), and
  :func:`detach_masked_positions` cuts the gradient of masked positions before the token loss,
  whatever it computes there (``megatron_dynbatch.mcore.step.make_loss_func`` applies it).
* ``seq-mean-*`` need whole sequences in one loss call; with context parallelism (each CP rank
  sees a slice of every sequence) only ``token-mean`` and ``sum`` are exact as written.

Why not weight each micro-batch's mean by its share of the samples (as some dynamic-batching
trainers do)? For a sequence mean it is exact: a micro-batch's mean over its ``n_m`` sequences
times ``n_m / N`` is its sequences' sum over ``N``. For a token mean it is wrong, because the
micro-batch's token mean must be weighted by its share of *tokens*, not of samples. Example, one
sample per micro-batch: A has 2 loss tokens of loss 1.0, B has 8 loss tokens of loss 0.0.
Sample-share: 0.5 * 1.0 + 0.5 * 0.0 = 0.5; token-mean: (1 + 1) / (2 + 8) = 0.2.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime.aggregation import AGGREGATIONS, check_aggregation
from megatron_dynbatch.runtime.placeholders import is_placeholder

__all__ = [
    "AGGREGATIONS",
    "detach_masked_positions",
    "microbatch_loss",
    "finalize_loss",
    "reference_loss",
]


# Megatron accumulates num_tokens in a torch.int tensor; returning the same dtype keeps its
# in-place ``total_num_tokens += num_tokens`` free of casts.
_DENOMINATOR_DTYPE = torch.int32


def detach_masked_positions(
    per_token: torch.Tensor, batch: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``per_token`` with the same values, but no gradient through loss-masked positions.

    Apply it to the model output (e.g. the per-token cross entropy) *before* a token loss combines
    it with batch fields. On a masked position, whatever the token loss computes there (``ce *
    NaN``, ``x / 0``), backward then delivers exactly 0 to the model: ``where``'s backward selects
    the gradient, where the multiplication's would compute ``0 * NaN``.

    Args:
        per_token: ``[B, S]`` (or ``[B, S, ...]``) differentiable tensor.
        batch: A micro-batch dict with ``loss_mask`` ``[B, S]``.

    Returns:
        A tensor equal to ``per_token`` whose gradient is zero wherever ``loss_mask`` is 0.
    """
    loss_mask = batch["loss_mask"]
    if tuple(per_token.shape[:2]) != tuple(loss_mask.shape):
        raise DynBatchValueError(
            f"per_token has shape {tuple(per_token.shape)} but the micro-batch's loss_mask is "
            f"{tuple(loss_mask.shape)}; pass the model's per-position output [B, S, ...]."
        )
    mask = (loss_mask > 0).to(per_token.device)
    mask = mask.reshape(*mask.shape, *([1] * (per_token.dim() - 2)))
    return torch.where(mask, per_token, per_token.detach())


def _check_batch_has(batch: Any, key: str) -> None:
    if not hasattr(batch, "get") or batch.get(key) is None:
        raise DynBatchValueError(
            f"the micro-batch has no {key!r}; pass a batch materialize_microbatches built (it "
            "carries loss_mask and sample_index), or add the key to your own."
        )


def microbatch_loss(
    aggregation: str,
    per_token_loss: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    *,
    log_key: str = "loss",
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """One micro-batch's additive share of the step loss, as Megatron's loss-function 3-tuple.

    Args:
        aggregation: One of :data:`AGGREGATIONS`.
        per_token_loss: ``[B, S]`` loss of predicting ``batch["labels"]`` at each position
            (differentiable). Values on masked positions are ignored, even if not finite; their
            gradient is 0 when what produced them is finite there (always true for declared
            fields of materialized batches; see :func:`detach_masked_positions` otherwise).
        batch: A dict from :func:`~megatron_dynbatch.runtime.materialize.materialize_microbatches`
            (``loss_mask`` and ``sample_index`` are used).
        log_key: Key of the reporting entry in the returned dict.

    Returns:
        ``(numerator, denominator, log)``: a differentiable 0-d numerator (connected to
        ``per_token_loss`` even when it is 0, so placeholder micro-batches still back-propagate
        through every pipeline stage), an int32 0-d denominator, and ``{log_key: [numerator,
        denominator]}`` as float32, which Megatron's training loop sums over micro-batches and DP
        and reports as their ratio (for ``sum`` the pair is ``[numerator, real samples]``, so
        the report is the step's sum per sample, the same whatever the plan; placeholders add
        nothing to either part).

    Raises:
        ValueError: On an unknown aggregation, a shape mismatch, or a loss-mask entry outside any
            sample (a batch that did not come from the materializer).
    """
    check_aggregation(aggregation)
    # A probe: a batch of the caller's own and a list loss were a bare KeyError / AttributeError.
    if not isinstance(per_token_loss, torch.Tensor):
        raise DynBatchValueError(
            f"per_token_loss must be a [B, S] tensor, got {type(per_token_loss).__name__}; pass "
            "the model's per-position loss."
        )
    _check_batch_has(batch, "loss_mask")
    loss_mask = batch["loss_mask"]
    if tuple(per_token_loss.shape) != tuple(loss_mask.shape):
        raise DynBatchValueError(
            f"per_token_loss has shape {tuple(per_token_loss.shape)} but the micro-batch's "
            f"loss_mask is {tuple(loss_mask.shape)}; compute one loss per [B, S] position."
        )
    mask = loss_mask > 0
    # where(), not loss * mask: a non-finite loss on a masked position (padding) must not turn the
    # sum into NaN.
    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    device = per_token_loss.device

    if aggregation == "token-mean":
        numerator = masked.sum()
        denominator = mask.sum().to(_DENOMINATOR_DTYPE)
        report_denominator = denominator.to(torch.float32)
    elif aggregation == "sum":
        numerator = masked.sum()
        denominator = torch.zeros((), dtype=_DENOMINATOR_DTYPE, device=device)
        # Reported per real sample (a probe: with 1 a micro-batch, placeholders counted and the
        # logged figure of the same samples halved at each doubling of dp): the step's sum over
        # its samples, whatever the plan, and a placeholder adds nothing to either part.
        report_denominator = torch.tensor(
            _sequences(batch, mask, device)[0].numel(), dtype=torch.float32, device=device
        )
    else:
        sequences, inverse, real = _sequences(batch, mask, device)
        num_sequences = sequences.numel()
        # Sums and counts accumulate in float32 at least (a probe: in bfloat16 index_add stops
        # counting at 256, so a 1,000-token sample's mean was twice its own). The numerator
        # returns to the loss's dtype, as masked.sum() does for the token mean.
        wide = torch.promote_types(per_token_loss.dtype, torch.float32)
        token_sums = torch.zeros(num_sequences, dtype=wide, device=device).index_add(
            0, inverse, masked.reshape(-1)[real].to(wide)
        )
        if aggregation == "seq-mean-token-sum":
            per_sequence = token_sums
        else:
            token_counts = torch.zeros(num_sequences, dtype=torch.int64, device=device)
            token_counts = token_counts.index_add(0, inverse, mask.reshape(-1)[real].long())
            # clamp: a sequence without loss tokens has token_sums 0 and contributes 0.
            per_sequence = token_sums / token_counts.clamp(min=1).to(wide)
        # Adding masked.sum() * 0 keeps the numerator attached to per_token_loss when the
        # micro-batch has no sequence (a placeholder), so backward still reaches every stage.
        numerator = per_sequence.sum().to(per_token_loss.dtype) + masked.sum() * 0
        denominator = torch.tensor(num_sequences, dtype=_DENOMINATOR_DTYPE, device=device)
        report_denominator = denominator.to(torch.float32)

    log = {log_key: torch.stack([numerator.detach().to(torch.float32), report_denominator])}
    return numerator, denominator, log


def _sequences(
    batch: Mapping[str, torch.Tensor], mask: torch.Tensor, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The micro-batch's sequences (their sample indices), each real position's place among
    them, and which flattened positions are real (not padding)."""
    _check_batch_has(batch, "sample_index")
    sample_index = batch["sample_index"].reshape(-1).to(device)
    real = ~is_placeholder(sample_index)
    if bool((mask.reshape(-1) & ~real).any()):
        raise DynBatchValueError(
            "loss_mask is non-zero on a position with sample_index -1 (padding); per-sequence "
            "aggregation needs micro-batches built by materialize_microbatches."
        )
    sequences, inverse = torch.unique(sample_index[real], return_inverse=True)
    return sequences, inverse, real


def finalize_loss(
    aggregation: str, numerator: torch.Tensor, denominator: torch.Tensor
) -> torch.Tensor:
    """The global loss from numerators and denominators summed over micro-batches and ranks.

    Mirrors what Megatron does to the gradients: divide by the denominator when it is > 0, and
    never divide for ``sum``.
    """
    check_aggregation(aggregation)
    if aggregation == "sum" or int(denominator) == 0:
        return numerator
    return numerator / denominator.to(numerator.dtype)


def reference_loss(
    aggregation: str,
    per_sample_token_losses: Sequence[torch.Tensor],
    per_sample_masks: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The global loss computed directly from per-sample tensors, without micro-batching.

    Args:
        aggregation: One of :data:`AGGREGATIONS`.
        per_sample_token_losses: One ``[L_i]`` tensor per sample of the step (all DP ranks).
        per_sample_masks: One ``[L_i]`` 0/1 tensor per sample, aligned with the losses (for
            next-token losses: the materializer's label-aligned ``loss_mask`` of the sample).

    Returns:
        A 0-d tensor, differentiable with respect to the losses.

    Raises:
        ValueError: On an unknown aggregation or mismatched counts/shapes.
    """
    check_aggregation(aggregation)
    if len(per_sample_token_losses) != len(per_sample_masks):
        raise DynBatchValueError(
            f"got {len(per_sample_token_losses)} loss tensors and {len(per_sample_masks)} masks; "
            "pass one mask per sample."
        )
    if not per_sample_token_losses:
        return torch.zeros(())
    token_sums = []
    token_counts = []
    for i, (loss, mask) in enumerate(zip(per_sample_token_losses, per_sample_masks, strict=True)):
        if tuple(loss.shape) != tuple(mask.shape) or loss.dim() != 1:
            raise DynBatchValueError(
                f"sample {i}: loss shape {tuple(loss.shape)} and mask shape {tuple(mask.shape)} "
                "must be the same [L_i]."
            )
        keep = mask > 0
        token_sums.append(torch.where(keep, loss, torch.zeros_like(loss)).sum())
        token_counts.append(int(keep.sum()))
    sums = torch.stack(token_sums)
    num_sequences = len(token_sums)
    if aggregation == "sum":
        return sums.sum()
    if aggregation == "token-mean":
        total = sum(token_counts)
        return sums.sum() / total if total > 0 else sums.sum()
    if aggregation == "seq-mean-token-sum":
        return sums.sum() / num_sequences
    counts = torch.tensor([max(c, 1) for c in token_counts], dtype=sums.dtype, device=sums.device)
    return (sums / counts).sum() / num_sequences
