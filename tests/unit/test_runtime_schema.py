"""BatchSchema / FieldSpec: declaration checks and per-sample validation messages."""

import pytest
import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime import BatchSchema, FieldSpec

pytestmark = pytest.mark.unit


def _schema():
    return BatchSchema(
        fields=(
            FieldSpec(name="advantages", kind="token", dtype=torch.float32),
            FieldSpec(name="reward", kind="sample", dtype=torch.float32, pad_value=0.0),
            FieldSpec(name="hidden", kind="token", dtype=torch.bfloat16, trailing_shape=(3,)),
        ),
        pad_token_id=5,
    )


def _sample(length=4, **overrides):
    sample = {
        "tokens": torch.arange(length, dtype=torch.int64),
        "advantages": torch.ones(length),
        "reward": torch.tensor(1.0),
        "hidden": torch.zeros(length, 3, dtype=torch.bfloat16),
    }
    sample.update(overrides)
    return sample


def test_valid_sample_default_mask_is_ones():
    checked = _schema().check_sample(3, _sample())
    assert checked.index == 3 and checked.length == 4
    assert checked.loss_mask.dtype == torch.float32
    assert checked.loss_mask.tolist() == [1, 1, 1, 1]


def test_prompt_length_masks_the_prompt():
    checked = _schema().check_sample(0, _sample(prompt_length=3))
    assert checked.loss_mask.tolist() == [0, 0, 0, 1]
    checked = _schema().check_sample(0, _sample(prompt_length=torch.tensor(4)))
    assert checked.loss_mask.tolist() == [0, 0, 0, 0]


def test_bool_loss_mask_is_accepted():
    mask = torch.tensor([False, True, True, False])
    assert _schema().check_sample(0, _sample(loss_mask=mask)).loss_mask.tolist() == [0, 1, 1, 0]


@pytest.mark.parametrize(
    "sample, message",
    [
        ({"advantages": torch.ones(4)}, "sample 9: no 'tokens' key"),
        (_sample(tokens=torch.arange(4, dtype=torch.int32)), "'tokens' has dtype torch.int32"),
        (_sample(tokens=torch.zeros(2, 2, dtype=torch.int64)), r"'tokens' has shape \(2, 2\)"),
        (_sample(length=0), "'tokens' is empty"),
        ({k: v for k, v in _sample().items() if k != "reward"}, "sample 9: missing key 'reward'"),
        (_sample(advantages=torch.ones(5)), r"key 'advantages' has shape \(5,\), expected \(4,\)"),
        (_sample(advantages=torch.ones(4, dtype=torch.float64)), "dtype torch.float64"),
        (_sample(reward=torch.ones(1)), r"key 'reward' has shape \(1,\), expected \(\)"),
        (_sample(hidden=torch.zeros(4, 2, dtype=torch.bfloat16)), r"expected \(4, 3\)"),
        (_sample(reward=1.0), "key 'reward' must be a tensor"),
        (_sample(extra=torch.ones(4)), r"keys \['extra'\] are not declared"),
        (_sample(loss_mask=torch.ones(3)), r"'loss_mask' has shape \(3,\), expected \(4,\)"),
        (_sample(loss_mask=torch.tensor([0.0, 0.5, 1.0, 1.0])), "other than 0 and 1"),
        (_sample(loss_mask=torch.ones(4), prompt_length=1), "both 'loss_mask' and 'prompt_length'"),
        (_sample(prompt_length=5), r"prompt_length=5 must be an integer in \[0, L=4\]"),
        (_sample(prompt_length=-1), "prompt_length=-1"),
        ([1, 2, 3], "expected a mapping"),
    ],
)
def test_invalid_samples_name_index_key_and_shape(sample, message):
    with pytest.raises(DynBatchValueError, match=message):
        _schema().check_sample(9, sample)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="labels", kind="token", dtype=torch.int64), "runtime produces itself"),
        (dict(name="x", kind="row", dtype=torch.int64), "kind='row'"),
        (dict(name="x", kind="token", dtype="float32"), "must be a torch.dtype"),
        (
            dict(name="x", kind="token", dtype=torch.int64, pad_value=0.5),
            "not exactly representable",
        ),
        (
            dict(name="x", kind="token", dtype=torch.int8, pad_value=1000),
            "not exactly representable",
        ),
        (dict(name="x", kind="token", dtype=torch.float32, trailing_shape=(0,)), "trailing_shape"),
        (
            dict(name="x", kind="sample", dtype=torch.float32, shift_to_labels=True),
            "shift_to_labels",
        ),
        (dict(name="", kind="token", dtype=torch.float32), "non-empty string"),
    ],
)
def test_invalid_field_specs(kwargs, message):
    with pytest.raises(DynBatchValueError, match=message):
        FieldSpec(**kwargs)


def test_field_spec_normalises_trailing_shape_and_rejects_non_finite_pad():
    spec = FieldSpec(name="x", kind="token", dtype=torch.float32, trailing_shape=[2, 3])
    assert spec.trailing_shape == (2, 3)
    # A NaN pad reaches ce * pad on every padding position: NaN gradients (issue 10, item 3).
    for pad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(DynBatchValueError, match="is not finite"):
            FieldSpec(name="y", kind="token", dtype=torch.float32, pad_value=pad)


def test_schema_rejects_duplicates_and_bad_pad_token():
    spec = FieldSpec(name="x", kind="token", dtype=torch.float32)
    with pytest.raises(DynBatchValueError, match=r"\['x'\] more than once"):
        BatchSchema(fields=(spec, spec))
    with pytest.raises(DynBatchValueError, match="pad_token_id=-1"):
        BatchSchema(pad_token_id=-1)
    with pytest.raises(DynBatchValueError, match="sequence of FieldSpec"):
        BatchSchema(fields=("x",))
    assert BatchSchema(fields=[spec]).field("x") is spec
