"""A failure inside Megatron's schedule, on one stage, becomes the same error on every rank.

Inside the schedule a stage that raises (its forward, the caller's ``token_loss``, an autograd
error in its backward, an out-of-memory error) leaves at once, while its pipeline neighbours wait
in a send or receive and its data-parallel peers in the gradient all-reduce. When that process
exits, gloo's closed connection stops them; when it lives on (a Ray actor that logs the error and
takes the next request), they wait until the process-group timeout, and aborting a gloo group
does not wake a peer's pending receive (tried on torch 2.13).

So :func:`contained_schedule` keeps the failing stage in the schedule: from its first failure on,
its forward steps, loss calls and backward steps hand Megatron zero stand-ins of the shapes its
peers expect (the received activation times zero, or zeros of the stage's output shape, tied to
every trainable parameter so each gradient hook still fires), so every send meets its receive and
the schedule ends on every rank. Then one agreement over the check group raises the first
failure, with its micro-batch and phase, as the same
:class:`~megatron_dynbatch.mcore.agreement.StepAgreementError` everywhere. The step's gradients
are not valid then: do not step the optimizer (the error says so).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from megatron_dynbatch.mcore.agreement import step_agreement

__all__ = ["contained_schedule"]


class _Failure:
    """The first exception this rank met inside the schedule, and where."""

    def __init__(self) -> None:
        self.error: Optional[BaseException] = None
        self.where = ""

    def record(self, error: BaseException, where: str) -> None:
        if self.error is None:
            self.error, self.where = error, where


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # DDP and Float16Module wrap the model
        model = model.module
    return model


def _received(model: torch.nn.Module) -> tuple[bool, Optional[torch.Tensor]]:
    """``(known, activation)``: what the schedule handed this stage through ``set_input_tensor``
    (None on a first stage). Not known for a model without a GPT-like ``decoder``."""
    inner = _unwrapped(model)
    holder = getattr(inner, "decoder", None)
    if holder is None or not hasattr(holder, "input_tensor"):
        return False, None
    received = holder.input_tensor
    if isinstance(received, (list, tuple)):
        received = received[0] if received else None
    return True, received


def _only_pipeline_and_data_parallel(model: torch.nn.Module) -> bool:
    """Whether no collective runs inside a stage's forward or backward: no tensor, context or
    expert parallelism. There a stage that fails on one rank of the group (an out-of-memory
    error) leaves its group peers inside a layer's collective that stand-ins never enter: the
    failing process would then wait too, where uncontained it exits and its peers' connections
    close. So such models run uncontained, as before."""
    config = _unwrapped(model).config
    sizes = (
        getattr(config, name, 1) or 1
        for name in (
            "tensor_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
        )
    )
    return all(size == 1 for size in sizes)


def _anchor(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """Zero, tied to one element of every trainable parameter: a stand-in's backward then gives
    each a zero gradient, so DDP's per-parameter hooks (overlapped gradient reduction) fire as
    in a real micro-batch."""
    terms = [p.reshape(-1)[:1].sum() for p in model.parameters() if p.requires_grad and p.numel()]
    return torch.stack([t.float() for t in terms]).sum() * 0 if terms else None


def _stand_in(model: torch.nn.Module, rows: Optional[tuple]) -> Optional[torch.Tensor]:
    """A zero output of the shape this stage sends: the received activation's on a later stage
    (a transformer stage keeps it), ``[S (/ tp under sequence parallelism), B, hidden]`` of the
    micro-batch's ``rows = (B, S)`` on a first stage; None where neither is known."""
    _, received = _received(model)
    if received is None and rows is None:
        return None
    anchor = _anchor(model) if torch.is_grad_enabled() else None
    if received is not None:
        output = received * 0
    else:
        config = _unwrapped(model).config
        batch, length = rows
        if getattr(config, "sequence_parallel", False):
            length //= max(1, config.tensor_model_parallel_size)
        dtype = getattr(config, "pipeline_dtype", None) or config.params_dtype
        device = next(model.parameters()).device
        output = torch.zeros(length, batch, config.hidden_size, dtype=dtype, device=device)
    if anchor is not None:
        output = output + anchor.to(output.dtype)
    return output


def _stand_in_loss(output: torch.Tensor, non_loss_data: bool = False):
    """Loss of a stand-in micro-batch: zero, no tokens, nothing logged (the step raises after
    the schedule; nothing of it is kept)."""
    if non_loss_data:
        return {}
    return output.float().sum() * 0, torch.zeros((), dtype=torch.int, device=output.device), {}


def _contained_forward(forward_step: Callable, failure: _Failure) -> Callable:
    def forward(data_iterator, model: torch.nn.Module, *args, **kwargs):
        # Where the chunk's iterator stands (MicroBatchIterator, slime's SlimeDataIterator):
        # the micro-batch's index and rows, read before its forward may consume it.
        position = getattr(data_iterator, "offset", None)
        if failure.error is None:
            try:
                output, loss_func = forward_step(data_iterator, model, *args, **kwargs)
            except (
                Exception
            ) as error:  # noqa: BLE001 - every failure is agreed on after the schedule
                where = "" if position is None else f"micro-batch {position}, "
                failure.record(error, f"{where}forward")
            else:
                return output, _contained_loss(loss_func, failure, position)
        rows = None
        if position is not None and hasattr(data_iterator, "row_shape"):
            data_iterator.offset = position + 1  # past the micro-batch it stands in for
            rows = data_iterator.row_shape(position)
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
            except Exception as error:  # noqa: BLE001
                where = "" if index is None else f"micro-batch {index}, "
                failure.record(error, f"{where}loss")
        return _stand_in_loss(output, kwargs.get("non_loss_data", False))

    return loss


def _contained_backward(backward_step: Callable, failure: _Failure) -> Callable:
    def backward(input_tensor, output_tensor, output_tensor_grad, config):
        if failure.error is None:
            try:
                return backward_step(input_tensor, output_tensor, output_tensor_grad, config)
            except Exception as error:  # noqa: BLE001
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
    first_model: torch.nn.Module,
) -> list:
    """Run ``run(forward_step)`` (one call of Megatron's schedule) with failures contained, then
    agree on them over ``check_group``.

    ``consequence``: what of the step is not valid after a failure (the error ends with it).
    ``first_model``: a model chunk of this rank; a model whose stage input cannot be read (no
    GPT-like ``decoder``), or with tensor, context or expert parallelism (collectives inside a
    stage), runs uncontained, as before.

    Raises:
        StepAgreementError: on every rank of ``check_group`` when any rank failed in the schedule.
    """
    known, _ = _received(first_model)
    if not known or not _only_pipeline_and_data_parallel(first_model):
        return run(forward_step)
    failure = _Failure()
    with _backward_steps_through(lambda original: _contained_backward(original, failure)):
        outputs = run(_contained_forward(forward_step, failure))
    with step_agreement(check_group, what=what, inside_schedule=consequence) as agreement:
        if failure.error is not None:
            agreement.where = failure.where
            raise failure.error
    return outputs
