"""One planned step through Megatron's schedules: agree on the plan, train, or gather outputs.

The pieces a trainer needs between the pure plan and ``get_forward_backward_func()``:

* :func:`check_plan_agreement` (from :mod:`.agreement`, which also has ``step_agreement`` for a
  step's whole local part): every rank hashes its plan and compares it with the others' before the
  schedule runs, so a rank that planned differently fails loudly instead of deadlocking in a
  pipeline send that never gets its receive;
* :func:`configure_loss`: Megatron's own exact-normalisation mechanism
  (``calculate_per_token_loss=True`` and a ``finalize_model_grads_func``) for an aggregation;
* :func:`train_microbatches` and :func:`forward_only_outputs`: run this rank's materialized
  micro-batches, and return forward-only outputs per sample. Plan and materialize inside
  ``step_agreement`` first (see ``megatron_dynbatch.tools.verify.bodies.dynamic_body``): their
  own checks raise on the calling rank only, while its peers would wait in the schedule;
* :func:`gather_in_order`: outputs of all ranks back in the original sample order, strictly.

On CPU call :func:`megatron_dynbatch.cpu.core_shim.apply_cpu_shim` before importing this module.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.mcore.agreement import step_agreement
from megatron_dynbatch.mcore.contained import contained_schedule
from megatron_dynbatch.mcore.forward import make_forward_step
from megatron_dynbatch.mcore.schedule import (
    check_schedule_inputs,
    data_parallel_size,
    run_forward_backward,
)
from megatron_dynbatch.planning import StepPlan
from megatron_dynbatch.runtime import (
    detach_masked_positions,
    microbatch_loss,
    restore_order,
    split_outputs,
)
from megatron_dynbatch.runtime.aggregation import check_aggregation

__all__ = [
    "configure_loss",
    "gather_in_order",
    "make_loss_func",
    "train_microbatches",
    "forward_only_outputs",
]

TokenLoss = Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]


def make_loss_func(aggregation: str, token_loss: Optional[TokenLoss] = None) -> Callable:
    """Loss function for :func:`make_forward_step`: ``(batch, per-token CE) -> 3-tuple``.

    Args:
        aggregation: One of :data:`megatron_dynbatch.runtime.aggregation.AGGREGATIONS`.
        token_loss: Optional ``(batch, ce [B, S]) -> loss [B, S]`` (e.g. a policy-gradient loss
            weighted by ``batch["advantages"]``); plain cross entropy when None. It gets the
            cross entropy through :func:`~megatron_dynbatch.runtime.detach_masked_positions`, so
            whatever it computes on masked positions (NaN included) gives them zero gradient.
    """
    check_aggregation(aggregation)

    def loss_func(batch, per_token_ce):
        if token_loss is None:
            per_token = per_token_ce
        else:
            per_token = token_loss(batch, detach_masked_positions(per_token_ce, batch))
        return microbatch_loss(aggregation, per_token, batch)

    return loss_func


def _finalize_without_division(model, num_tokens, *args, **kwargs):
    """``sum`` aggregation: reduce gradients over DP like Megatron, never divide them."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, *args, **kwargs)


def configure_loss(model_chunks: Sequence[torch.nn.Module], aggregation: str) -> None:
    """Set what a Megatron config needs for exact loss normalisation under dynamic batching.

    ``calculate_per_token_loss=True`` makes the schedule sum each micro-batch's denominator instead
    of dividing every loss by ``num_microbatches`` (which is wrong as soon as micro-batches carry
    different amounts of loss, and counts placeholders); ``finalize_model_grads`` then all-reduces
    that denominator over DP and divides the gradients by it. DDP sums (not averages) gradients
    over DP under that flag. For ``sum`` nothing is divided.
    """
    from megatron.core.distributed import finalize_model_grads

    check_aggregation(aggregation)
    for chunk in model_chunks:
        config = chunk.config
        if not config.calculate_per_token_loss:
            raise DynBatchValueError(
                "TransformerConfig.calculate_per_token_loss is False; dynamic batching needs it True "
                "so micro-batches with different token counts are weighted exactly (set "
                "--calculate-per-token-loss, or the field, before building the model: Megatron's "
                "DDP reads it at construction)."
            )
        config.finalize_model_grads_func = (
            _finalize_without_division if aggregation == "sum" else finalize_model_grads
        )


def _seq_length_and_mbs(
    step: StepPlan, microbatches: Sequence[Mapping[str, torch.Tensor]], pg_collection=None
):
    """The step's row ``(S, B)``, checked. A sharded plan's step leaves its rows to each rank's
    own samples (``seq_length=None``): then they are the rank's materialized rows, as
    ``materialize_microbatches`` sized them (ranks of one pipeline share them)."""
    # A probe: the whole Plan, or a dict of micro-batches, was a bare AttributeError / TypeError.
    if not hasattr(step, "num_microbatches") or not hasattr(step, "rank_microbatches"):
        raise DynBatchValueError(
            f"step is a {type(step).__name__}, not one step of a plan; pass plan.steps[s] (a "
            "sharded plan: plan.scheduled_steps()[s])."
        )
    if not isinstance(microbatches, (list, tuple)):
        raise DynBatchValueError(
            f"microbatches is a {type(microbatches).__name__}; pass the list "
            "materialize_microbatches returned for this rank and step."
        )
    if len(microbatches) != step.num_microbatches:
        raise DynBatchValueError(
            f"{len(microbatches)} micro-batches for a step planned with num_microbatches="
            f"{step.num_microbatches}; materialize this rank's micro-batches from the same plan."
        )
    # A plan for more DP ranks than run would train only the first ranks' samples, silently.
    dp = data_parallel_size(pg_collection)
    if dp is not None and len(step.ranks) != dp:
        raise DynBatchValueError(
            f"the step was planned for {len(step.ranks)} data-parallel rank(s) but "
            f"{dp} run this schedule; plan with ParallelLayout(dp_size={dp}) (the data-parallel "
            "size of the model's process groups), or every sample planned for a missing rank is "
            "never trained."
        )
    if step.seq_length is None and microbatches and "tokens" in microbatches[0]:
        rows, length = microbatches[0]["tokens"].shape[:2]
        return int(length), int(rows)
    return step.seq_length, step.micro_batch_size


def _check_chunks(model_chunks) -> None:
    """A probe: one module for the list of chunks was "object is not iterable" in the schedule."""
    if isinstance(model_chunks, torch.nn.Module):
        raise DynBatchValueError(
            f"model_chunks is one {type(model_chunks).__name__}; pass this rank's model chunks "
            "as a list ([model], or one chunk per virtual pipeline stage)."
        )


def _agreed_schedule(
    model_chunks, step, microbatches, pg_collection, check_group, what: str
) -> Tuple[int, int]:
    """The step's row, after every rank checked its schedule inputs and agreed: a rank whose
    micro-batches, plan or model chunks do not fit would otherwise raise alone while its peers
    wait in the schedule's first p2p or all-reduce (the same error on every rank instead)."""
    if not dist.is_initialized():  # Megatron's schedules need it anyway: say so where they do
        _check_chunks(model_chunks)
        return _seq_length_and_mbs(step, microbatches, pg_collection)
    with step_agreement(check_group, what=what):
        _check_chunks(model_chunks)
        seq_length, micro_batch_size = _seq_length_and_mbs(step, microbatches, pg_collection)
        check_schedule_inputs(
            list(model_chunks),
            microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            pg_collection=pg_collection,
            variable_rows=bool(step.row_lengths),
        )
    return seq_length, micro_batch_size


def _schedule(
    model_chunks, forward_step, check_group, what: str, consequence: str, **kwargs
) -> list:
    """Megatron's schedule over this rank's chunks; with a process group, a failure inside it on
    one rank is contained and agreed on (:mod:`.contained`), so no peer waits in its p2p."""
    chunks = list(model_chunks)

    def run(step_func):
        return run_forward_backward(chunks, forward_step=step_func, **kwargs)

    if not dist.is_initialized():
        return run(forward_step)
    return contained_schedule(
        run,
        forward_step,
        check_group=check_group,
        what=what,
        consequence=consequence,
        models=chunks,
        forward_only=bool(kwargs.get("forward_only")),
        pg_collection=kwargs.get("pg_collection"),
    )


def train_microbatches(
    model_chunks: Sequence[torch.nn.Module],
    step: StepPlan,
    microbatches: List[Dict[str, torch.Tensor]],
    *,
    aggregation: str,
    token_loss: Optional[TokenLoss] = None,
    pg_collection=None,
    check_group=None,
) -> list:
    """Forward and backward over this rank's micro-batches of ``step``; returns the loss logs.

    Every rank of ``check_group`` (default: the world; every rank that runs the model) calls it
    for the step: the schedule's inputs are checked and agreed on first, so an error on one rank
    stops every rank with the same :class:`~.agreement.StepAgreementError`. So does an error
    inside the schedule (the caller's ``token_loss``, the model's forward or backward on one
    stage): the schedule runs to its end on zero stand-ins first, and the step's gradients are
    then not valid (do not step the optimizer).
    """
    seq_length, micro_batch_size = _agreed_schedule(
        model_chunks, step, microbatches, pg_collection, check_group, "training step"
    )
    return _schedule(
        model_chunks,
        make_forward_step(make_loss_func(aggregation, token_loss)),
        check_group,
        "training step",
        "this step's gradients are not valid: do not step the optimizer (zero the gradient "
        "buffers before the next step)",
        microbatches=microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        pg_collection=pg_collection,
        variable_rows=bool(step.row_lengths),
    )


def forward_only_outputs(
    model_chunks: Sequence[torch.nn.Module],
    step: StepPlan,
    microbatches: List[Dict[str, torch.Tensor]],
    *,
    pg_collection=None,
    check_group=None,
) -> Dict[int, torch.Tensor]:
    """Per-token log-probs of every real sample of this rank: ``{sample index: [L_i]}``.

    Entry ``j`` is the log-probability of token ``j + 1`` (the last entry has no target).
    Non-empty on the last pipeline stage only; placeholders give nothing. Agreed first as
    :func:`train_microbatches` is.
    """
    seq_length, micro_batch_size = _agreed_schedule(
        model_chunks, step, microbatches, pg_collection, check_group, "forward-only pass"
    )
    with torch.no_grad():
        outputs = _schedule(
            model_chunks,
            make_forward_step(collect_logprobs=True),
            check_group,
            "forward-only pass",
            "no output of this pass is returned",
            microbatches=microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
            collect_non_loss_data=True,
            pg_collection=pg_collection,
            variable_rows=bool(step.row_lengths),
        )
    per_sample: Dict[int, torch.Tensor] = {}
    if not outputs:
        return per_sample
    # zip strict: one output per micro-batch on the last stage, or a sample would silently vanish.
    for batch, output in zip(microbatches, outputs, strict=True):
        for index, values in split_outputs(batch, output["logprobs"]).items():
            assert index not in per_sample, f"sample {index} computed twice"
            per_sample[index] = values.clone()
    return per_sample


def gather_in_order(
    per_sample: Mapping[int, torch.Tensor], expected, group=None
) -> List[torch.Tensor]:
    """All-gather every rank's ``{sample index: output}`` and return them in sample order.

    Raises ValueError if a sample is missing or present twice across the ranks.
    """
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, {i: t.cpu() for i, t in per_sample.items()}, group=group)
    return restore_order([g for g in gathered if g], expected)
