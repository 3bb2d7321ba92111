"""Megatron-LM's layout and launch errors users meet first, in one line with flags and a fix
(issue 44; ``integrations/megatron_lm/layout_checks.py``). Each refusal's fix is checked to pass
the same check, and the checks refuse exactly what Megatron's ``validate_args`` asserts.
The issue's command lines through the launch script: ``tests/megatron/test_megatron_lm_entry.py``.
"""

import re
from types import SimpleNamespace

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.layout_checks import (
    check_model_layout,
    check_world_size,
    torchrun_command,
)

pytestmark = pytest.mark.unit


def _args(**values):
    base = dict(
        num_layers=4,
        pipeline_model_parallel_size=1,
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        num_layers_per_virtual_pipeline_stage=None,
        seq_length=256,
        max_position_embeddings=256,
        position_embedding_type="learned_absolute",
        world_size=None,
    )
    base.update(values)
    return SimpleNamespace(**base)


def test_layers_not_divisible_by_pp_name_both_flags_and_counts_that_work():
    with pytest.raises(DynBatchValueError) as refused:
        check_model_layout(_args(num_layers=3, pipeline_model_parallel_size=2))
    message = str(refused.value)
    assert "--num-layers 3 is not a multiple of --pipeline-model-parallel-size 2" in message
    fixes = [int(n) for n in re.findall(r"--num-layers (\d+)", message.split("use ", 1)[1])]
    assert fixes == [2, 4]
    for layers in fixes:  # each named fix passes
        check_model_layout(_args(num_layers=layers, pipeline_model_parallel_size=2))


def test_virtual_pipeline_chunks_that_do_not_divide_a_stage_name_the_divisors():
    args = _args(num_layers=6, pipeline_model_parallel_size=2)
    args.num_layers_per_virtual_pipeline_stage = 2
    with pytest.raises(DynBatchValueError) as refused:
        check_model_layout(args)
    message = str(refused.value)
    assert message.startswith(
        "--num-layers-per-virtual-pipeline-stage 2 does not divide the 3 layers of each pipeline "
        "stage (--num-layers 6 / --pipeline-model-parallel-size 2); use "
        "--num-layers-per-virtual-pipeline-stage 1"
    ), message
    check_model_layout(_args(num_layers=6, pipeline_model_parallel_size=2,
                             num_layers_per_virtual_pipeline_stage=1))  # fmt: skip
    check_model_layout(_args(num_layers=8, pipeline_model_parallel_size=2,
                             num_layers_per_virtual_pipeline_stage=2))  # fmt: skip
    assert "--num-layers 8 (4 layers a stage, 2 chunks)" in message


def test_a_sequence_longer_than_the_positions_names_both_fixes():
    with pytest.raises(DynBatchValueError) as refused:
        check_model_layout(_args(seq_length=512))
    message = str(refused.value)
    assert "--seq-length 512 is longer than --max-position-embeddings 256" in message
    assert "raise --max-position-embeddings to 512" in message
    assert "lower --seq-length to 256" in message
    assert "checkpoint of 256 positions will not load" in message  # learned positions
    with pytest.raises(DynBatchValueError, match="rope holds no weights for it"):
        check_model_layout(_args(seq_length=512, position_embedding_type="rope"))
    check_model_layout(_args(seq_length=512, max_position_embeddings=512))


def test_a_launch_without_torchrun_is_told_the_torchrun_command():
    args = _args(pipeline_model_parallel_size=2, world_size=1)  # as parse_args sets it
    with pytest.raises(DynBatchValueError) as refused:
        check_world_size(args, environ={})
    message = str(refused.value)
    assert "started as one process, without torchrun" in message
    assert "--pipeline-model-parallel-size 2 splits the model over 2 ranks" in message
    assert "torchrun --nproc-per-node 2 -m megatron_dynbatch pretrain ..." in message
    # The launch script is named as such; the console script gets the module form.
    assert "torchrun --nproc-per-node 2 launch/pretrain_gpt_dynbatch.py" in torchrun_command(
        2, "/x/launch/pretrain_gpt_dynbatch.py"
    )
    assert torchrun_command(4, "megatron-dynbatch pretrain") == (
        "torchrun --nproc-per-node 4 -m megatron_dynbatch pretrain ..."
    )
    # A namespace not parsed from a launch (no world_size): nothing to say about the launch.
    check_world_size(_args(pipeline_model_parallel_size=2), environ={})
    # Under torchrun with a world that fits: nothing to say.
    check_world_size(
        _args(pipeline_model_parallel_size=2, world_size=4), environ={"WORLD_SIZE": "4"}
    )


def test_a_world_size_the_model_size_does_not_divide_names_sizes_that_work():
    args = _args(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, world_size=6)
    with pytest.raises(DynBatchValueError) as refused:
        check_world_size(args, environ={"WORLD_SIZE": "6"})
    message = str(refused.value)
    assert message.startswith("6 ranks launched")
    assert "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4" in message
    assert "launch 4 or 8 ranks" in message
    check_world_size(_args(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                           world_size=8), environ={"WORLD_SIZE": "8"})  # fmt: skip


def test_layouts_megatron_accepts_pass():
    for args in (
        _args(),
        _args(
            num_layers=4, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1
        ),
        _args(num_layers=3, pipeline_model_parallel_size=2, hybrid_layer_pattern="M-M|M-"),
        _args(max_position_embeddings=None),
    ):
        check_model_layout(args)


def test_a_stage_of_one_layer_names_no_empty_chunk_size():
    """4 layers at pp 4 with 2 layers per virtual stage: no layers-per-chunk value makes two
    chunks of a one-layer stage, and the message named an empty list ("use
    --num-layers-per-virtual-pipeline-stage  (layers per model chunk)")."""
    args = _args(num_layers=4, pipeline_model_parallel_size=4)
    args.num_layers_per_virtual_pipeline_stage = 2
    with pytest.raises(DynBatchValueError) as refused:
        check_model_layout(args)
    message = str(refused.value)
    assert "does not divide the 1 layer of each" in message, message
    assert "--num-layers-per-virtual-pipeline-stage  " not in message
    assert "use --num-layers 16 (4 layers a stage, 2 chunks)" in message
    check_model_layout(_args(num_layers=16, pipeline_model_parallel_size=4,
                             num_layers_per_virtual_pipeline_stage=2))  # fmt: skip


@pytest.mark.parametrize("per_vp", [0, -1])
def test_zero_layers_a_chunk_names_fixes_that_pass(per_vp):
    """A probe: ``--num-layers-per-virtual-pipeline-stage 0`` was told "use --num-layers 4", and
    refused again with the same advice (no layer count makes empty chunks divide a stage)."""
    args = _args(num_layers=2, pipeline_model_parallel_size=2)
    args.num_layers_per_virtual_pipeline_stage = per_vp
    with pytest.raises(DynBatchValueError) as refused:
        check_model_layout(args)
    message = str(refused.value)
    assert message.startswith(f"--num-layers-per-virtual-pipeline-stage {per_vp} must be >= 1")
    assert "--num-layers " not in message, message
    check_model_layout(_args(num_layers=2, pipeline_model_parallel_size=2,
                             num_layers_per_virtual_pipeline_stage=1))  # fmt: skip
    check_model_layout(_args(num_layers=2, pipeline_model_parallel_size=2))  # dropped


def test_document_samples_fixed_counts_are_whole_interleaving_groups():
    """A probe: --document-samples (Megatron's fixed micro-batches) with virtual stages and a
    count that is not a multiple of the pipeline size failed in Megatron's interleaved schedule at
    the first step, after the model was built; refused at start-up naming a batch that works."""
    from types import SimpleNamespace

    from megatron_dynbatch.integrations.megatron_lm.layout_checks import (
        check_fixed_interleaved_counts,
    )

    def args(gbs, eval_iters=0, **over):
        values = dict(
            virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_size=2,
            data_parallel_size=1, global_batch_size=gbs, micro_batch_size=1,
            eval_iters=eval_iters, eval_global_batch_size=None, eval_micro_batch_size=None,
        )  # fmt: skip
        values.update(over)
        return SimpleNamespace(**values)

    with pytest.raises(DynBatchValueError, match="fixed 3 micro-batches .* --global-batch-size 4"):
        check_fixed_interleaved_counts(args(3))
    check_fixed_interleaved_counts(args(4))  # the named fix
    check_fixed_interleaved_counts(args(3, virtual_pipeline_model_parallel_size=None))
    with pytest.raises(DynBatchValueError, match="--eval-global-batch-size 6"):
        check_fixed_interleaved_counts(args(4, eval_iters=1, eval_global_batch_size=5))


def test_both_uneven_stages_interleaved_at_two_stages_name_the_one_that_builds():
    """A probe: Megatron accepted them and divided by zero middle stages at model build."""
    uneven = dict(
        pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=2,
        decoder_first_pipeline_num_layers=1,
    )
    with pytest.raises(DynBatchValueError) as refused:
        check_model_layout(_args(**uneven, decoder_last_pipeline_num_layers=1))
    message = str(refused.value)
    # Not 1 alone (a re-probe: Megatron refused a first stage of 1 layer in 2 chunks next).
    assert "give --decoder-first-pipeline-num-layers 2 alone (the last stage takes" in message
    check_model_layout(_args(**{**uneven, "decoder_first_pipeline_num_layers": 2}))  # trained
    both = {**uneven, "pipeline_model_parallel_size": 3, "num_layers": 6}
    check_model_layout(_args(**both, decoder_last_pipeline_num_layers=2))


def test_query_groups_that_do_not_divide_the_heads_name_the_counts_that_do():
    """A probe: the first forward failed on a reshape, after the model was built."""
    gqa = dict(group_query_attention=True, num_attention_heads=4, tensor_model_parallel_size=2)
    with pytest.raises(DynBatchValueError) as refused:
        check_model_layout(_args(**gqa, num_query_groups=3))
    message = str(refused.value)
    assert "--num-query-groups 3 does not divide --num-attention-heads 4" in message, message
    fixes = [int(n) for n in re.findall(r"--num-query-groups (\d+)", message.split("use ", 1)[1])]
    assert fixes == [1, 2, 4]
    for groups in fixes:
        check_model_layout(_args(**gqa, num_query_groups=groups))
    # Without --group-query-attention Megatron ignores --num-query-groups.
    check_model_layout(_args(**{**gqa, "group_query_attention": False}, num_query_groups=3))


def test_full_recompute_alone_names_the_method_and_the_layer_count_at_once():
    """A probe: Megatron's model config asked for --recompute-method, then, given it, refused
    again for --recompute-num-layers (after the argument dump); the named pair trains (a
    two-rank launch at pp 2 with it ran two iterations)."""
    with pytest.raises(DynBatchValueError) as refused:
        check_model_layout(_args(recompute_granularity="full"))
    message = str(refused.value)
    assert "add --recompute-method uniform --recompute-num-layers 1" in message, message
    with pytest.raises(DynBatchValueError, match=r"needs --recompute-num-layers: add --recompute"):
        check_model_layout(_args(recompute_granularity="full", recompute_method="block"))
    with pytest.raises(DynBatchValueError, match=r"needs --recompute-method: add --recompute-m"):
        check_model_layout(_args(recompute_granularity="full", recompute_num_layers=2))
    fixed = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    check_model_layout(_args(**fixed))
    check_model_layout(_args(recompute_granularity="selective"))
    check_model_layout(_args())
    # Every way out it names, applied to what was given, is what Megatron's model config takes
    # (a re-probe: selective was named beside a --recompute-num-layers Megatron refuses with it).
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()
    from megatron.core.transformer.transformer_config import TransformerConfig

    for method, count in ((None, None), ("block", None), (None, 2)):
        given = dict(
            recompute_granularity="full", recompute_method=method, recompute_num_layers=count
        )
        with pytest.raises(DynBatchValueError) as refused:
            check_model_layout(_args(**given))
        message = str(refused.value)
        added = dict(
            re.findall(r"--recompute-(method|num-layers) (\w+)", message.split(", or ")[0])
        )
        first = {**given, "recompute_method": added.get("method", method)}
        first["recompute_num_layers"] = int(added.get("num-layers", count or 0)) or count
        second = dict(given, recompute_granularity="selective")
        for flag, field in (("method", "recompute_method"), ("num-layers", "recompute_num_layers")):
            if f"drop --recompute-{flag}" in message:
                second[field] = None
        for fields in (first, second):
            check_model_layout(_args(**fields))
            TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, **fields)
