"""The one placeholder-tensor builder every trainer integration uses: shape, dtype, no data."""

import pytest
import torch

from megatron_dynbatch.runtime.placeholders import placeholder_tensor

pytestmark = pytest.mark.unit


def test_rows_of_the_trailing_shape_with_the_dtype_and_no_data():
    value = torch.arange(12, dtype=torch.int32).reshape(3, 4) + 1
    out = placeholder_tensor(value, rows=2)
    assert out.shape == (2, 4) and out.dtype == torch.int32 and not out.any()
    same = placeholder_tensor(torch.ones(3, 4, 5, dtype=torch.bfloat16))
    assert same.shape == (3, 4, 5) and same.dtype == torch.bfloat16 and not same.any()


def test_an_attention_mask_attends_to_its_first_token_only():
    out = placeholder_tensor(torch.ones(3, 6, dtype=torch.int64), rows=2, attend_first=True)
    assert out.tolist() == [[1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]


def test_a_nested_tensor_keeps_its_row_lengths():
    value = torch.nested.as_nested_tensor(
        [torch.ones(3), torch.full((5,), 7.0)], layout=torch.jagged
    )
    out = placeholder_tensor(value)
    assert out.is_nested and torch.equal(out.offsets(), value.offsets())
    assert not out.values().any()
    mask = placeholder_tensor(value, attend_first=True)
    assert [row.tolist() for row in mask.unbind()] == [[1, 0, 0], [1, 0, 0, 0, 0]]
