"""The memory and step-time models count the layers each pipeline stage really builds: Megatron's
uneven splits (--decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split,
--pipeline-model-parallel-layout) as megatron.core's own get_num_layers_to_build gives them."""

import itertools
from types import SimpleNamespace

import pytest

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()  # importing megatron.core needs the triton stand-in on this machine

from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402

from megatron_dynbatch.integrations.model_args import (  # noqa: E402
    memory_model_from_flags,
    model_dims_from_args,
)
from megatron_dynbatch.planning.memory import predicted_step_peaks  # noqa: E402
from megatron_dynbatch.planning.model_cost import CPU_RATES, physical_cost  # noqa: E402
from megatron_dynbatch.planning.spec import ParallelLayout  # noqa: E402

pytestmark = pytest.mark.unit


def _args(num_layers, **split):
    return SimpleNamespace(
        num_layers=num_layers,
        hidden_size=512,
        num_attention_heads=4,
        vocab_size=257,
        seq_length=128,
        max_position_embeddings=128,
        position_embedding_type="rope",
        **split,
    )


def test_every_stage_counts_the_layers_megatron_builds():
    compared = 0
    grid = itertools.product(
        range(1, 10), (2, 4), (1, 2), (None, 1, 3), (None, 2), (False, True), (False, True)
    )
    for layers, pp, vpp, first, last, embedding, loss in grid:
        split = dict(
            decoder_first_pipeline_num_layers=first,
            decoder_last_pipeline_num_layers=last,
            account_for_embedding_in_pipeline_split=embedding,
            account_for_loss_in_pipeline_split=loss,
        )
        if first is None and last is None and not embedding and not loss:
            continue
        config = SimpleNamespace(
            pipeline_model_parallel_layout=None,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=embedding,
            account_for_loss_in_pipeline_split=loss,
            num_layers=layers,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        )
        try:
            built = [
                [get_num_layers_to_build(config, c if vpp > 1 else None, s) for c in range(vpp)]
                for s in range(pp)
            ]
        except AssertionError:
            continue  # Megatron refuses the split; its own check names it
        if min(map(min, built)) < 0:
            continue
        dims = model_dims_from_args(
            _args(layers, **split), ParallelLayout(pp_size=pp, vpp_size=vpp)
        )
        case = (layers, pp, vpp, split)
        assert [[dims.chunk_layers(s, c) for c in range(vpp)] for s in range(pp)] == built, case
        compared += 1
    assert compared > 50


def test_a_layout_string_is_read_with_megatrons_parser():
    dims = model_dims_from_args(
        _args(4, pipeline_model_parallel_layout="Ettt|tL"), ParallelLayout(pp_size=2)
    )
    assert (dims.stage_layers(0), dims.stage_layers(1)) == (3, 1)
    dims = model_dims_from_args(
        _args(8, pipeline_model_parallel_layout="Ett|t|t|t|t|t|t|L"),
        ParallelLayout(pp_size=4, vpp_size=2),
    )
    assert [dims.chunk_layers(s, c) for s in range(4) for c in range(2)] == [2, 1, 1, 1, 1, 1, 1, 0]


def test_the_heavy_stage_sets_the_memory_and_the_pace():
    """--decoder-first-pipeline-num-layers 7 of 8 at pp 2 (a probe's case: the first stage was
    predicted at 683 MiB and measured 744 when the model split the layers evenly)."""
    parallel = ParallelLayout(pp_size=2)
    even = _args(8)
    uneven = _args(8, decoder_first_pipeline_num_layers=7)
    shape = [[(1, 128)] * 4]
    peaks = {}
    for name, args in (("even", even), ("uneven", uneven)):
        model = memory_model_from_flags(args, parallel, "dense")
        peaks[name] = [stage.total for stage in predicted_step_peaks(model, shape)]
    assert peaks["uneven"][0] > peaks["even"][0] and peaks["uneven"][1] < peaks["even"][1]
    paced = {
        name: physical_cost(model_dims_from_args(args, parallel), "dense", CPU_RATES)
        for name, args in (("even", even), ("uneven", uneven))
    }
    assert paced["uneven"].token_seconds > 1.5 * paced["even"].token_seconds
