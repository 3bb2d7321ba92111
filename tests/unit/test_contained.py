"""What ``mcore/contained.py`` decides on one rank, before any schedule: which models it contains
and the stand-ins' shapes (the schedules themselves: ``tests/megatron/test_reliability_step.py``).
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_dynbatch.mcore.contained import _containable, _stand_in

pytestmark = pytest.mark.unit


def _model(overlap=False, **sizes):
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(
        hidden_size=8, params_dtype=torch.float32, sequence_parallel=False, **sizes
    )
    model.ddp_config = SimpleNamespace(overlap_grad_reduce=overlap)
    return model


@pytest.mark.parametrize(
    "settings, contained",
    [
        ({}, True),
        ({"tensor_model_parallel_size": 1, "expert_tensor_parallel_size": None}, True),
        ({"tensor_model_parallel_size": 2}, False),
        ({"context_parallel_size": 2}, False),
        ({"expert_model_parallel_size": 2}, False),
        # Each rank issues its bucket all-reduces in its own backward's order (a probe: a hang,
        # and wrong gradients in the next step).
        ({"overlap": True}, False),
    ],
)
def test_models_whose_collectives_stand_ins_cannot_pair_run_uncontained(settings, contained):
    # A rank that fails alone inside a layer's collective leaves its group waiting there; the
    # stand-ins never enter it, so the failing process would wait too instead of exiting.
    models = [_model(), _model(**settings)]
    assert _containable(models, forward_only=False, dp_size=2) is contained
    assert _containable(models, forward_only=False, dp_size=None) is contained


def test_overlapped_buckets_pair_no_rank_in_a_forward_only_pass():
    """A re-probe: forward-only passes of overlapped models were contained (and right) before
    overlapped models were excluded everywhere. Training stays uncontained at dp 1 too: a later
    step's finish_grad_sync asserts that the skipped backward issued its buckets."""
    models = [_model(overlap=True)]
    assert _containable(models, forward_only=True, dp_size=4)
    assert not _containable(models, forward_only=False, dp_size=1)
    assert not _containable(models, forward_only=False, dp_size=2)
    # Tensor parallelism pairs ranks inside every forward: never contained.
    tp = [_model(tensor_model_parallel_size=2)]
    assert not _containable(tp, forward_only=True, dp_size=1)


def test_stand_ins_have_the_shape_the_next_stage_receives():
    model = _model()
    model.decoder = SimpleNamespace(input_tensor=None)
    output = _stand_in(model, (3, 5))  # a first stage: [S, B, hidden] of the rows
    assert output.shape == (5, 3, 8) and not output.any()
    assert _stand_in(model, None) is None  # rows unknown: not contained
    received = torch.randn(5, 3, 8, requires_grad=True)
    model.decoder.input_tensor = received  # a later stage: the received activation's
    output = _stand_in(model, None)
    assert output.shape == received.shape and not output.any()
