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


# Modules that build a placeholder or padding value: each must take its tensors from
# runtime/placeholders.py, so one rule (dtype, shape, what "no data" is) holds on every path.
_BUILDERS = (
    "runtime/materialize.py",
    "integrations/megatron_lm/hooks.py",
    "integrations/slime/placeholders.py",
    "integrations/slime/empty_rank.py",
    "integrations/skyrl/iterator.py",
    "integrations/verl/engine.py",
    "integrations/nemo_rl/shard.py",
)
_ALLOCATORS = {"zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like"}


def _allocations(path):
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _ALLOCATORS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            yield f"{path.name}:{node.lineno} torch.{node.func.attr}"


def test_placeholders_are_built_in_one_place():
    import pathlib

    import megatron_dynbatch

    package = pathlib.Path(megatron_dynbatch.__file__).parent
    found = [hit for name in _BUILDERS for hit in _allocations(package / name)]
    assert found == [], f"build these with megatron_dynbatch.runtime.placeholders: {found}"
    # The scanner itself sees an allocation where there is one.
    assert list(_allocations(package / "runtime" / "placeholders.py"))


def test_a_placeholder_microbatch_of_the_materializer_is_the_builders():
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, plan_schedule
    from megatron_dynbatch.runtime import BatchSchema, FieldSpec, materialize_microbatches
    from megatron_dynbatch.runtime.placeholders import placeholder_microbatch

    schema = BatchSchema(
        fields=(FieldSpec(name="advantages", kind="token", dtype=torch.float32, pad_value=0.5),),
        pad_token_id=3,
    )
    config = PlannerConfig(max_tokens_per_gpu=16, parallel=ParallelLayout(dp_size=2))
    plan = plan_schedule([12], config=config)
    step = plan.steps[0]
    b, s = step.micro_batch_size, step.seq_length
    idle = next(r for r in range(2) if not any(step.rank_microbatches(r)))
    (batch,) = materialize_microbatches(
        step, idle, {}, schema, layout=plan.layout, sample_multiple=plan.sample_multiple
    )
    expected = placeholder_microbatch(schema, b, s)
    assert set(batch) == set(expected) | {"cu_seqlens"}
    for key, value in expected.items():
        assert batch[key].dtype == value.dtype, key
        if key != "position_ids":  # an empty row is one padding segment, positions 0..S-1
            assert torch.equal(batch[key], value), key
    assert torch.equal(batch["position_ids"], torch.arange(s).expand(b, s))
    assert batch["sample_index"].eq(-1).all() and not batch["loss_mask"].any()
