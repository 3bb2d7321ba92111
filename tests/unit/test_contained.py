"""What ``mcore/contained.py`` decides on one rank, before any schedule: which models it contains
(the schedules themselves: ``tests/megatron/test_reliability_step.py``)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_dynbatch.mcore.contained import _only_pipeline_and_data_parallel, _stand_in

pytestmark = pytest.mark.unit


def _model(**sizes):
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(
        hidden_size=8, params_dtype=torch.float32, sequence_parallel=False, **sizes
    )
    return model


@pytest.mark.parametrize(
    "sizes, contained",
    [
        ({}, True),
        ({"tensor_model_parallel_size": 1, "expert_tensor_parallel_size": None}, True),
        ({"tensor_model_parallel_size": 2}, False),
        ({"context_parallel_size": 2}, False),
        ({"expert_model_parallel_size": 2}, False),
    ],
)
def test_models_with_collectives_inside_a_stage_run_uncontained(sizes, contained):
    # A rank that fails alone inside a layer's collective leaves its group waiting there; the
    # stand-ins never enter it, so the failing process would wait too instead of exiting.
    assert _only_pipeline_and_data_parallel(_model(**sizes)) is contained


def test_a_first_stage_stand_in_has_the_rows_shape_and_reaches_every_parameter():
    model = _model()
    model.decoder = SimpleNamespace(input_tensor=None)
    output = _stand_in(model, (3, 5))
    assert output.shape == (5, 3, 8) and not output.any()
    output.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    # A later stage: the received activation times zero, the gradient back to it zero.
    received = torch.randn(5, 3, 8, requires_grad=True)
    model.decoder.input_tensor = received
    output = _stand_in(model, None)
    output.sum().backward()
    assert output.shape == received.shape and not received.grad.any()
