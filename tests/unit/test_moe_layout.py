"""MoE's ``seq_aux_loss`` in the Megatron-LM entry: one sample a row (the padded layout), since
the loss takes each row for one sequence and a packed row holds several samples."""

import types

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    dynbatch_config_from_args,
    validate_dynamic_batch_args,
)

pytestmark = pytest.mark.unit


def _args(**overrides):
    values = dict(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=1024,
        calculate_per_token_loss=True,
        global_batch_size=8,
        micro_batch_size=1,
        seq_length=256,
        num_experts=4,
        moe_router_load_balancing_type="seq_aux_loss",
        # Megatron computes seq_aux_loss only at a coefficient > 0 (its default is 0).
        moe_aux_loss_coeff=0.01,
        transformer_impl="local",
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


@pytest.mark.parametrize("kind", ["seq_aux_loss", ["seq_aux_loss", "aux_loss"]])
def test_seq_aux_loss_defaults_to_one_sample_a_row(kind):
    assert dynbatch_config_from_args(_args(moe_router_load_balancing_type=kind)).layout == "padded"


def test_other_losses_and_dense_models_keep_packed_rows():
    assert dynbatch_config_from_args(_args(moe_router_load_balancing_type="aux_loss")).layout == (
        "packed"
    )
    assert dynbatch_config_from_args(_args(num_experts=None)).layout == "packed"


def test_packed_rows_with_seq_aux_loss_are_refused_naming_the_fix():
    with pytest.raises(DynBatchValueError, match="--dynamic-batch-layout padded"):
        validate_dynamic_batch_args(_args(dynamic_batch_layout="packed"))


def test_seq_aux_loss_at_coefficient_0_keeps_packed_rows():
    # Megatron's _apply_seq_aux_loss returns at once at coefficient 0: nothing per row to keep.
    assert dynbatch_config_from_args(_args(moe_aux_loss_coeff=0.0)).layout == "packed"
