"""The first plan's cost model from the model's dimensions (issue 35): the FLOPs ratio, the same
as slime's estimate, read from Megatron's arguments by the entry and by ``megatron-dynbatch plan``;
per-micro-batch rows by default where shapes are exchanged over NCCL."""

import argparse
import json
import types

import pytest

from megatron_dynbatch.integrations.megatron_lm.arguments import (
    VARIABLE_SEQ_LENGTHS_DEST,
    add_dynamic_batch_args,
    dynbatch_config_from_args,
    variable_seq_lengths,
)
from megatron_dynbatch.integrations.slime.flops import cost_model as slime_cost_model
from megatron_dynbatch.planning.model_cost import (
    CPU_RATES,
    ESTIMATED_MIN_GAIN,
    forward_flops,
    physical_cost,
)
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.tools.cli import main

pytestmark = pytest.mark.unit

#: Qwen2.5-7B's shape.
QWEN7B = dict(
    num_layers=28,
    hidden_size=3584,
    num_attention_heads=28,
    num_query_groups=4,
    ffn_hidden_size=18944,
    vocab_size=152064,
)


def test_flops_of_a_small_model_by_hand():
    # 2 layers, h 8, 2 heads of 4, 1 kv group, ffn 16 gated, vocab 10.
    dims = ModelDims(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        ffn_hidden_size=16,
        vocab_size=10,
        gated_linear_unit=True,
    )
    qkv = 8 * (8 + 2 * 4)
    proj = 8 * 8
    mlp = 8 * 32 + 16 * 8
    linear, attention = forward_flops(dims)
    assert linear == 2 * (2 * (qkv + proj + mlp) + 8 * 10)
    assert attention == 2 * 2 * 8


def test_ratio_equals_slimes_flops_estimate():
    """slime's calculate_fwd_flops (as our slime drop-in reads it) gives the same ratio."""
    slime_args = types.SimpleNamespace(
        **QWEN7B,
        kv_channels=128,
        num_experts=None,
        multi_latent_attention=False,
    )
    linear, attention = forward_flops(ModelDims(**QWEN7B, gated_linear_unit=True))
    assert attention / linear == pytest.approx(
        slime_cost_model(slime_args).attention_weight, rel=1e-12
    )


def _entry_args(argv, **model):
    args = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(argv)
    for key, value in model.items():
        setattr(args, key, value)
    return args


MEGATRON_7B = dict(
    num_layers=28,
    hidden_size=3584,
    num_attention_heads=28,
    group_query_attention=True,
    num_query_groups=4,
    ffn_hidden_size=18944,
    swiglu=True,
    padded_vocab_size=152064,
)


def test_entry_first_plan_uses_the_models_ratio_unless_given():
    """The entry's default is the physical model (issue 42): the FLOPs ratio at the device's
    rates (one stage: the whole model), and a per-micro-batch overhead of the model's operators,
    with the gain threshold of an estimated overhead."""
    args = _entry_args(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"], **MEGATRON_7B)
    linear, attention = forward_flops(ModelDims(**QWEN7B, gated_linear_unit=True))
    expected = attention / linear
    config = dynbatch_config_from_args(args)
    rates = CPU_RATES  # no CUDA in the unit tests
    assert config.cost_attention == "segment"  # transformer-engine's default backend, packed
    assert config.cost_attention_weight == pytest.approx(
        expected * rates.linear_flops / rates.attention_flops
    )
    physical = physical_cost(ModelDims(**QWEN7B, gated_linear_unit=True), "segment", CPU_RATES)
    assert config.cost_microbatch_overhead == pytest.approx(
        physical.overhead_seconds / physical.token_seconds
    )
    assert config.cost_microbatch_overhead > 0 and config.min_gain == ESTIMATED_MIN_GAIN
    given = _entry_args(
        ["--max-tokens-per-gpu", "4096", "--dynamic-batch-cost-attention-weight", "0"],
        **MEGATRON_7B,
    )
    assert dynbatch_config_from_args(given).cost_attention_weight == 0.0
    bare = _entry_args(["--max-tokens-per-gpu", "4096"])
    assert dynbatch_config_from_args(bare).cost_attention_weight == 0.0
    assert dynbatch_config_from_args(bare).cost_microbatch_overhead is None


def test_the_shipped_yaml_keeps_the_models_own_weights():
    """``--dynamic-batch-config configs/dynbatch.yaml`` (every setting "with its default") plans
    as the same flags without it: the file wrote ``cost_attention_weight: 0.0``, which switched
    off the weight the entry derives from the model (a probe: every iteration line then said
    "step time predicted: none")."""
    from tests._support import REPO

    argv = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]
    bare = dynbatch_config_from_args(_entry_args(argv, **MEGATRON_7B))
    shipped = str(REPO / "configs" / "dynbatch.yaml")
    with_file = _entry_args(argv + ["--dynamic-batch-config", shipped], **MEGATRON_7B)
    assert dynbatch_config_from_args(with_file) == bare
    assert bare.cost_attention_weight > 0
    # seq_aux_loss: the layout the entry derives (padded), with the file as without it.
    moe = dict(
        MEGATRON_7B,
        num_experts=4,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.01,
    )
    bare = dynbatch_config_from_args(_entry_args(argv, **moe))
    with_file = _entry_args(argv + ["--dynamic-batch-config", shipped], **moe)
    assert dynbatch_config_from_args(with_file) == bare and bare.layout == "padded"


@pytest.mark.parametrize(
    "argv, backend, layout, expected",
    [
        ([], "nccl", "packed", True),
        ([], "gloo", "packed", False),
        ([], "nccl", "padded", False),
        (["--no-variable-seq-lengths"], "nccl", "packed", False),
        (["--variable-seq-lengths"], "gloo", "packed", True),
    ],
)
def test_per_micro_batch_rows_by_default_on_nccl(argv, backend, layout, expected):
    args = _entry_args(argv)
    assert variable_seq_lengths(args, backend, layout) is expected
    assert (getattr(args, VARIABLE_SEQ_LENGTHS_DEST) is None) == (not argv)


def test_plan_with_megatrons_model_flags_plans_what_the_entry_runs(tmp_path, capsys):
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([100, 2000, 16000, 300, 5000, 8000, 12000, 700]))
    model = (
        "--num-layers 28 --hidden-size 3584 --num-attention-heads 28 --num-query-groups 4 "
        "--ffn-hidden-size 18944 --swiglu --vocab-size 152064"
    ).split()
    common = [str(samples), "--max-tokens-per-gpu", "16384", "--pp-size", "4", "--dp-size", "2"]
    assert main(["plan", *common, *model, "--json"]) == 0
    with_model = json.loads(capsys.readouterr().out)
    rows = with_model["steps"][0]["row_lengths"]
    assert rows and all(row % 64 == 0 or row == 16000 for rank in rows for row in rank)
    assert main(["plan", *common, *model, "--no-variable-seq-lengths", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"][0]["row_lengths"] == []
    assert main(["plan", *common, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"][0]["row_lengths"] == []


def test_the_physical_default_by_attention_kind_and_stage():
    """The default model of issue 42, by hand for a small model: the slowest stage's linear work
    (its layers, plus the output layer on the last stage), attention per causal L**2 (dense also
    pays its scores' elementwise passes), and a per-micro-batch overhead of the stage's operators,
    Python and (with a pipeline) the p2p send."""
    from megatron_dynbatch.planning.model_cost import OPS_PER_LAYER
    from megatron_dynbatch.planning.spec import ParallelLayout

    dims = ModelDims(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=384,
        parallel=ParallelLayout(pp_size=2),
    )
    rates = CPU_RATES
    layer = 2.0 * (64 * 192 + 64 * 64 + 2 * 64 * 256)  # qkv, projection, fc1 + fc2
    segment = physical_cost(dims, "segment", rates)
    # The last stage is the slower: 2 layers and the output layer.
    assert segment.token_seconds == pytest.approx((2 * layer + 2 * 64 * 384) / rates.linear_flops)
    assert segment.attention_seconds == pytest.approx(2 * 2.0 * 64 / rates.attention_flops)
    assert segment.overhead_seconds == pytest.approx(
        2 * OPS_PER_LAYER * rates.op_seconds + rates.microbatch_seconds + rates.p2p_seconds
    )
    dense = physical_cost(dims, "dense", rates)
    assert dense.attention_seconds > segment.attention_seconds  # the S x S scores' passes
    assert dense.token_seconds == segment.token_seconds
    causal = physical_cost(dims, "causal", rates)
    assert causal.attention_seconds == segment.attention_seconds
    # Without a pipeline: no p2p send; the whole model on one stage.
    alone = physical_cost(
        ModelDims(**{**_fields(dims), "parallel": ParallelLayout()}), "segment", rates
    )
    assert alone.overhead_seconds == pytest.approx(
        4 * OPS_PER_LAYER * rates.op_seconds + rates.microbatch_seconds
    )
    assert alone.token_seconds > segment.token_seconds
    model = segment.cost_model()
    assert (
        model.token_weight == 1.0 and model.microbatch_overhead > 0 and model.attention_weight > 0
    )


def _fields(dims):
    return {name: getattr(dims, name) for name in dims.__dataclass_fields__}


def test_a_physical_default_plan_is_never_slower_than_fixed_micro_batches_under_it():
    """Item 2 of issue 42, under the default model itself: on the long/short mix and on short
    documents (tiny GPT, dense attention, pp 2, a budget of fixed's [4 x 256]), the planner's step
    is never predicted slower than fixed [4 x 256] micro-batches of the same samples."""
    import random

    from megatron_dynbatch.planning import plan_schedule
    from megatron_dynbatch.planning.calibration import Observation, predict_seconds
    from megatron_dynbatch.planning.spec import ParallelLayout, PlannerConfig

    dims = ModelDims(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=384,
        parallel=ParallelLayout(pp_size=2),
    )
    physical = physical_cost(dims, "dense", CPU_RATES)
    seconds = (physical.token_seconds, physical.attention_seconds, physical.overhead_seconds)
    config = PlannerConfig(
        max_tokens_per_gpu=1024,
        parallel=ParallelLayout(pp_size=2),
        cost=physical.cost_model(),
        min_gain=ESTIMATED_MIN_GAIN,
    )
    for seed in range(20):
        rng = random.Random(seed)
        mix = [256 if rng.random() < 0.5 else rng.randint(20, 120) for _ in range(32)]
        short = [rng.randint(20, 200) for _ in range(32)]
        for lengths in (mix, short):
            step = plan_schedule(lengths, config=config).steps[0]
            ours = Observation(
                seconds=1.0,
                seq_length=step.seq_length,
                micro_batch_size=step.micro_batch_size,
                attention="dense",
                pp_size=2,
                ranks=[[[lengths[i] for i in mb] for mb in rank] for rank in step.ranks],
                row_lengths=step.row_lengths or None,
            )
            fixed = Observation(
                seconds=1.0,
                seq_length=256,
                micro_batch_size=4,
                attention="dense",
                pp_size=2,
                ranks=[[[lengths[j] for j in range(i, i + 4)] for i in range(0, 32, 4)]],
            )
            assert predict_seconds(ours, seconds) <= predict_seconds(fixed, seconds) * 1.0001


def test_heads_that_do_not_split_over_tp_are_refused():
    # Megatron refuses 4 heads over tp 3; `plan --tp-size 3` estimated memory for it anyway.
    from megatron_dynbatch.errors import DynBatchValueError
    from megatron_dynbatch.planning.spec import ParallelLayout

    dims = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    ModelDims(**dims, parallel=ParallelLayout(tp_size=2))
    with pytest.raises(DynBatchValueError, match="multiples of tp_size=3"):
        ModelDims(**dims, parallel=ParallelLayout(tp_size=3))
    with pytest.raises(
        DynBatchValueError, match="num_query_groups=2 must be multiples of tp_size=4"
    ):
        ModelDims(**dims, num_query_groups=2, parallel=ParallelLayout(tp_size=4))
