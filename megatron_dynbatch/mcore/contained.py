"""A failure inside Megatron's schedule, on one stage, becomes the same error on every rank.

Inside the schedule a stage that raises (its forward, the caller's ``token_loss``, an autograd
error in its backward, an out-of-memory error) leaves at once, while its pipeline neighbours wait
in a send or receive and its data-parallel peers in the gradient all-reduce. When that process
exits, gloo's closed connection stops them; when it lives on (a Ray actor that logs the error and
takes the next request), they wait until the process-group timeout, and aborting a gloo group
does not wake a peer's pending receive (tried on torch 2.13).

So :func:`contained_schedule` keeps the failing stage in the schedule: from its first failure on,
its forward steps, loss calls and backward steps hand Megatron zero stand-ins of the shapes its
peers expect (the received activation times zero, or zeros of the stage's output shape; zero
gradients back), so every send meets its receive and the schedule ends on every rank (models
whose collectives stand-ins cannot pair run uncontained: :func:`_containable`). Then one
agreement over the check group raises the first failure, with its micro-batch and phase, as the
same :class:`~megatron_dynbatch.mcore.agreement.StepAgreementError` everywhere. The step's
gradients are not valid then: do not step the optimizer (the error says so).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_dynbatch.errors import DynBatchRuntimeError
from megatron_dynbatch.mcore.agreement import StepAgreementError, step_agreement
from megatron_dynbatch.mcore.schedule import data_parallel_size, unwrapped_model

__all__ = ["contained_schedule"]


#: What a stage contains: any failure but a generator's close (Python's own protocol). A
#: KeyboardInterrupt or SystemExit inside the schedule of a process that lives on (a cancelled
#: Ray task) left its peers in p2p until the process-group timeout (a probe); contained, the
#: peers get the agreed error and this rank its own interrupt back, after the schedule.
_CONTAINED = (Exception, KeyboardInterrupt, SystemExit)


class _Failure:
    """The first exception this rank met inside the schedule, and where."""

    def __init__(self) -> None:
        self.error: Optional[BaseException] = None
        self.where = ""

    def record(self, error: BaseException, where: str) -> None:
        if self.error is None:
            self.error, self.where = error, where


def _received(model: torch.nn.Module) -> tuple[bool, Optional[torch.Tensor]]:
    """``(known, activation)``: what the schedule handed this stage through ``set_input_tensor``
    (None on a first stage). Not known for a model without a GPT-like ``decoder``."""
    inner = unwrapped_model(model)
    holder = getattr(inner, "decoder", None)
    if holder is None or not hasattr(holder, "input_tensor"):
        return False, None
    received = holder.input_tensor
    if isinstance(received, (list, tuple)):
        received = received[0] if received else None
    return True, received


def _containable(
    models: Sequence[torch.nn.Module], *, forward_only: bool, dp_size: Optional[int]
) -> bool:
    """Whether stand-ins keep every collective of the step paired: none may run inside a stage's
    forward or backward, and the gradient reduction must not depend on the backward's order.

    * Tensor, context or expert parallelism, and a router's ``global_aux_loss`` (token counts
      all-reduced over data-parallel ranks in the forward, a probe's hang): a rank failing alone
      leaves its group inside a collective that stand-ins never enter, and the failing process
      would wait too, where uncontained it exits and its peers' connections close.
    * DDP's ``overlap_grad_reduce``: each rank issues its bucket all-reduces as the backward
      readies them, an order stand-ins do not reproduce (a probe: a hang, and silently wrong
      gradients in the next step).

    Such models run uncontained, as before; the last two in training only (a forward-only pass
    has no backward and no load-balancing loss), ``global_aux_loss`` only with more than one
    data-parallel rank (``dp_size``; None: unknown, taken as more). Overlapped buckets also at
    dp 1: a later step's ``finish_grad_sync`` asserts that the skipped backward issued them."""
    for model in models:
        config = unwrapped_model(model).config
        for name in (
            "tensor_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
        ):
            if (getattr(config, name, 1) or 1) != 1:
                return False
        if forward_only:
            continue
        ddp_config = getattr(model, "ddp_config", None)
        if getattr(ddp_config, "overlap_grad_reduce", False):
            return False
        moe = getattr(config, "num_moe_experts", None)
        if moe and dp_size != 1 and _global_aux_loss_configured(config):
            return False
    return True


def _global_aux_loss_configured(config) -> bool:
    """Whether the model's config asks for ``global_aux_loss``: read from the config, which
    every stage shares, not from this stage's routers (a probe: with ``moe_layer_freq`` leaving
    the first stage without experts, that stage ran contained and waited in the agreement while
    the other ran uncontained: a hang on a clean step)."""
    kind = getattr(config, "moe_router_load_balancing_type", None)
    kinds = [kind] if isinstance(kind, str) else list(kind or ())
    return "global_aux_loss" in kinds


def _logged_metrics() -> list:
    """Megatron's global trackers the forward adds to, to be logged after the step: the MoE
    metrics (load-balancing and z-losses per layer) and the multi-token-prediction losses, their
    tensors. Empty where this Megatron has neither."""
    found: list = []
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        metrics = getattr(get_moe_metrics_tracker(), "metrics", {})
        found += [entry.values for entry in metrics.values()]
    except ImportError:
        pass
    try:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
        found += [value for value in tracker.values() if isinstance(value, torch.Tensor)]
    except ImportError:
        pass
    return found


@contextlib.contextmanager
def _model_state_kept(models: Sequence[torch.nn.Module]):
    """The routers' expert biases, and the metrics Megatron logs after the step, as they were
    before the step that failed: Megatron updates the biases in ``finalize_model_grads`` at the
    schedule's end, from the step's token counts (a probe: a failed step moved them, and the
    next clean step trained on them), and the forward adds to the MoE and MTP trackers, which
    the next logged step would have reported with the failed step's values in them."""
    biases = [
        (module.expert_bias, module.expert_bias.detach().clone())
        for model in models
        for module in model.modules()
        if isinstance(getattr(module, "expert_bias", None), torch.Tensor)
    ]
    metrics = [(tensor, tensor.detach().clone()) for tensor in _logged_metrics()]
    try:
        yield
    except (StepAgreementError, KeyboardInterrupt, SystemExit):  # a contained failure
        with torch.no_grad():
            for bias, value in biases:
                bias.copy_(value)
            for tensor in _logged_metrics():
                before = next((value for held, value in metrics if held is tensor), None)
                if before is not None and before.shape == tensor.shape:
                    tensor.copy_(before)
                else:  # first made in the failed step
                    tensor.zero_()
        raise


def _stand_in(model: torch.nn.Module, rows: Optional[tuple]) -> Optional[torch.Tensor]:
    """A zero output of the shape this stage sends: the received activation's on a later stage
    (a transformer stage keeps it), ``[S (/ tp under sequence parallelism), B, hidden]`` of the
    micro-batch's ``rows = (B, S)`` on a first stage; None where neither is known. Its backward
    never runs (:func:`_contained_backward` answers with zeros)."""
    _, received = _received(model)
    if received is not None:
        return received.detach() * 0
    if rows is None:
        return None
    config = unwrapped_model(model).config
    batch, length = rows
    if getattr(config, "sequence_parallel", False):
        length //= max(1, config.tensor_model_parallel_size)
    dtype = getattr(config, "pipeline_dtype", None) or config.params_dtype
    device = next(model.parameters()).device
    return torch.zeros(length, batch, config.hidden_size, dtype=dtype, device=device)


def _stand_in_loss(output: torch.Tensor, non_loss_data: bool = False):
    """Loss of a stand-in micro-batch: zero, no tokens, nothing logged (the step raises after
    the schedule; nothing of it is kept)."""
    if non_loss_data:
        return {}
    return output.float().sum() * 0, torch.zeros((), dtype=torch.int, device=output.device), {}


def _rows_of(data_iterator: Any, position: int) -> Optional[tuple]:
    """Micro-batch ``position``'s ``(rows, length)`` from the chunk's iterator, else another
    micro-batch's (one shape for the whole step unless rows vary, and with varying rows Megatron
    sends each shape first), else None. Reading it may fail as the micro-batch itself did (a
    lazily built one: a probe's failure escaped the stand-in, and its peer hung)."""
    others = range(len(getattr(data_iterator, "microbatches", ())) or position + 2)
    for index in [position, *(k for k in others if k != position)]:
        try:
            return tuple(data_iterator.row_shape(index))
        except BaseException:  # noqa: BLE001 - any unreadable micro-batch: try another
            continue
    return None


def _contained_forward(forward_step: Callable, failure: _Failure) -> Callable:
    sent: dict = {}  # per chunk: the rows of the last micro-batch it ran

    def forward(data_iterator, model: torch.nn.Module, *args, **kwargs):
        # Where the chunk's iterator stands (MicroBatchIterator, slime's SlimeDataIterator):
        # the micro-batch's index and rows, read before its forward may consume it.
        position = getattr(data_iterator, "offset", None)
        if failure.error is None:
            try:
                output, loss_func = forward_step(data_iterator, model, *args, **kwargs)
            # Any failure, KeyboardInterrupt too (a task cancelled in a process that lives on):
            # every one is agreed on after the schedule.
            except _CONTAINED as error:
                where = "" if position is None else f"micro-batch {position}, "
                failure.record(error, f"{where}forward")
            else:
                if isinstance(output, torch.Tensor) and output.dim() == 3:
                    sent[id(model)] = (output.shape[1], output.shape[0])
                return output, _contained_loss(loss_func, failure, position)
        rows = None
        if position is not None and hasattr(data_iterator, "row_shape"):
            data_iterator.offset = position + 1  # past the micro-batch it stands in for
            if _received(model)[1] is None:  # a later stage stands in from what it received
                rows = _rows_of(data_iterator, position) or sent.get(id(model))
        output = _stand_in(model, rows)
        if output is None:  # a first stage whose rows are unknown: as uncontained
            raise failure.error
        return output, _stand_in_loss

    return forward


def _contained_loss(loss_func: Callable, failure: _Failure, index: Optional[int]) -> Callable:
    def loss(output, *args, **kwargs):
        if failure.error is None:
            try:
                return loss_func(output, *args, **kwargs)
            except _CONTAINED as error:
                where = "" if index is None else f"micro-batch {index}, "
                failure.record(error, f"{where}loss")
        return _stand_in_loss(output, kwargs.get("non_loss_data", False))

    return loss


def _contained_backward(backward_step: Callable, failure: _Failure) -> Callable:
    def backward(input_tensor, output_tensor, output_tensor_grad, config):
        if failure.error is None:
            try:
                return backward_step(input_tensor, output_tensor, output_tensor_grad, config)
            except _CONTAINED as error:
                failure.record(error, "a backward step")
        # The gradient the previous stage waits for: zeros of what it sent.
        if isinstance(input_tensor, list):
            return [None if x is None else torch.zeros_like(x) for x in input_tensor]
        return None if input_tensor is None else torch.zeros_like(input_tensor)

    return backward


@contextlib.contextmanager
def _backward_steps_through(wrapper: Callable):
    """Megatron's schedules call the module-level ``backward_step`` by name: point it at
    ``wrapper`` for this schedule, and back whatever happens."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.backward_step
    schedules.backward_step = wrapper(original)
    try:
        yield
    finally:
        schedules.backward_step = original


def contained_schedule(
    run: Callable[[Callable], list],
    forward_step: Callable,
    *,
    check_group=None,
    what: str,
    consequence: str,
    models: Sequence[torch.nn.Module],
    forward_only: bool,
    pg_collection=None,
) -> list:
    """Run ``run(forward_step)`` (one call of Megatron's schedule) with failures contained, then
    agree on them over ``check_group``.

    ``consequence``: what of the step is not valid after a failure (the error ends with it).
    ``models``: this rank's model chunks; a model whose stage input cannot be read (no GPT-like
    ``decoder``), or one :func:`_containable` refuses (``forward_only``: the schedule has no
    backward; ``pg_collection``: the schedule's groups, None for Megatron's), runs uncontained,
    as before. After a failure the routers' expert biases are restored
    (:func:`_model_state_kept`).

    Raises:
        StepAgreementError: on every rank of ``check_group`` when any rank failed in the schedule.
    """
    known, _ = _received(models[0])
    dp_size = data_parallel_size(pg_collection)
    if not known or not _containable(models, forward_only=forward_only, dp_size=dp_size):
        return run(forward_step)
    failure = _Failure()
    with _model_state_kept(models):
        with _backward_steps_through(lambda original: _contained_backward(original, failure)):
            outputs = run(_contained_forward(forward_step, failure))
        error = failure.error
        try:
            with step_agreement(check_group, what=what, inside_schedule=consequence) as agreement:
                if error is not None:
                    agreement.where = failure.where
                    if not isinstance(error, Exception):
                        # Agreed on as an Exception (the agreement lets a bare interrupt out
                        # without collecting), then handed back to this rank as it was.
                        agreement.reason = f"{type(error).__name__}: {error}"
                        raise DynBatchRuntimeError(agreement.reason) from error
                    raise error
        except StepAgreementError as agreed:
            if error is not None and not isinstance(error, Exception):
                raise error from agreed
            raise
    return outputs
