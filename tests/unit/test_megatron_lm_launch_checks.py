"""Start-up refusals of the Megatron-LM launch that used to come late (a probe of
``launch/pretrain_gpt_dynbatch.py``): interleaving Megatron derives only after our checks (a group
below the pipeline size, virtual stages that do not divide a stage's layers, interleaving without
a pipeline), the calibration flags' values and output directory, a launch without torchrun, and
the entry's attention check run before Megatron's argument dump. In-process, through the functions
the patched ``parse_and_validate_args`` and the entry's ``main`` call; the launches themselves are
``tests/megatron/test_megatron_lm_entry.py``'s.
"""

import math
import re

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm import arguments
from megatron_dynbatch.integrations.megatron_lm.arguments import validate_dynamic_batch_args
from megatron_dynbatch.integrations.megatron_lm.layout_checks import (
    PRETRAIN_PROGRAM,
    one_rank_without_torchrun,
    virtual_pipeline_size,
)
from megatron_dynbatch.integrations.moe_args import check_moe_args
from tests._support import megatron_lm_args

pytestmark = pytest.mark.unit

_ON = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "256"]


def _args(argv=(), **values):
    """The probe's tiny run (seq 256, 4 samples a step, dp 1) as parsed, before Megatron's
    ``validate_args`` (no ``virtual_pipeline_model_parallel_size`` derived yet)."""
    base = dict(
        num_layers=2,
        seq_length=256,
        global_batch_size=4,
        micro_batch_size=1,
        data_parallel_size=1,
        num_virtual_stages_per_pipeline_rank=None,
        num_layers_per_virtual_pipeline_stage=None,
        microbatch_group_size_per_vp_stage=None,
    )
    base.update(values)
    return megatron_lm_args(list(argv), **base)


# -- B1: the interleaving group, with the chunks per stage Megatron derives later -----------------


@pytest.mark.parametrize(
    "vpp_flag",
    [
        dict(num_virtual_stages_per_pipeline_rank=2),
        dict(num_layers_per_virtual_pipeline_stage=1),
    ],
    ids=["--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"],
)
def test_a_group_below_pp_is_refused_at_start_up_from_either_interleaving_flag(vpp_flag):
    layout = dict(num_layers=4, pipeline_model_parallel_size=2, **vpp_flag)
    assert virtual_pipeline_size(_args(**layout)) == 2
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(_ON, microbatch_group_size_per_vp_stage=1, **layout))
    message = str(refused.value)
    assert "microbatch_group_size_per_vp_stage=1 is smaller than pp_size=2" in message
    assert "--microbatch-group-size-per-virtual-pipeline-stage" in message
    # The fixes it names pass: a group of pp, or Megatron's default.
    validate_dynamic_batch_args(_args(_ON, microbatch_group_size_per_vp_stage=2, **layout))
    validate_dynamic_batch_args(_args(_ON, **layout))


def test_the_derived_chunks_follow_megatron():
    assert virtual_pipeline_size(_args()) is None
    # After Megatron's validation its own value is read.
    assert virtual_pipeline_size(_args(virtual_pipeline_model_parallel_size=4)) == 4
    # A split Megatron refuses derives nothing (check_model_layout names it); the embedding
    # counted as a layer is counted, as Megatron does.
    per_layer = dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    assert virtual_pipeline_size(_args(num_layers=3, **per_layer)) is None
    embedding = dict(account_for_embedding_in_pipeline_split=True)
    assert virtual_pipeline_size(_args(num_layers=5, **per_layer, **embedding)) == 3
    # Two interleaving flags at once: Megatron refuses them itself.
    both = dict(num_layers=4, num_virtual_stages_per_pipeline_rank=2, **per_layer)
    assert virtual_pipeline_size(_args(**both)) is None


# -- B2 / minor: virtual stages against the layers of a stage, and interleaving needs a pipeline --


@pytest.mark.parametrize(
    "layers, stages, per_stage, fixes",
    [
        (2, 2, 1, "--num-layers 4 (2 layers a stage, 1 a chunk)"),
        (
            4,
            3,
            2,
            "--num-virtual-stages-per-pipeline-rank 2 (model chunks per stage), "
            "--num-layers 6 (3 layers a stage, 1 a chunk)",
        ),
    ],
)
def test_virtual_stages_that_do_not_divide_a_stage_are_refused_naming_values_that_work(
    layers, stages, per_stage, fixes
):
    layout = dict(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=stages)
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(_ON, num_layers=layers, **layout))
    message = str(refused.value)
    assert message.startswith(
        f"--num-virtual-stages-per-pipeline-rank {stages} does not divide the {per_stage} layers "
        f"of each pipeline stage (--num-layers {layers} / --pipeline-model-parallel-size 2)"
    ), message
    assert f"use {fixes}, or drop --num-virtual-stages-per-pipeline-rank" in message, message
    for value in re.findall(r"--num-virtual-stages-per-pipeline-rank (\d+) \(", message):
        fixed = dict(layout, num_virtual_stages_per_pipeline_rank=int(value))
        validate_dynamic_batch_args(_args(_ON, num_layers=layers, **fixed))
    for value in re.findall(r"--num-layers (\d+) \(", message):
        validate_dynamic_batch_args(_args(_ON, num_layers=int(value), **layout))
    validate_dynamic_batch_args(_args(_ON, num_layers=layers, pipeline_model_parallel_size=2))
    # Without the switch Megatron's own behaviour is kept (its assert at model build).
    assert validate_dynamic_batch_args(_args(num_layers=layers, **layout)) is None


def _stages(stages):
    return dict(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=stages)


def test_virtual_stages_over_layers_megatron_cannot_split_name_the_layer_count():
    with pytest.raises(
        DynBatchValueError,
        match=r"--num-layers 3 is not a multiple of "
        r"--pipeline-model-parallel-size 2.*use --num-layers 2 or --num-layers 4",
    ):
        validate_dynamic_batch_args(_args(_ON, num_layers=3, **_stages(2)))
    with pytest.raises(DynBatchValueError, match="must be 1 or more"):
        validate_dynamic_batch_args(_args(_ON, num_layers=4, **_stages(0)))


@pytest.mark.parametrize(
    "vpp_flag, named",
    [
        (dict(num_virtual_stages_per_pipeline_rank=2), "--num-virtual-stages-per-pipeline-rank"),
        (dict(num_layers_per_virtual_pipeline_stage=1), "--num-layers-per-virtual-pipeline-stage"),
    ],
)
def test_interleaving_without_a_pipeline_names_the_flag_and_the_fix(vpp_flag, named):
    named += f" {next(iter(vpp_flag.values()))}"
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(_ON, **vpp_flag))
    message = str(refused.value)
    assert message.startswith(f"{named} interleaves 2 model chunks per pipeline stage"), message
    assert f"drop {named.split()[0]} (no interleaving)" in message
    assert "set --pipeline-model-parallel-size 2 or more" in message
    args = _args(_ON, overlap_p2p_comm=False, **vpp_flag)
    with pytest.raises(DynBatchValueError, match="--pipeline-model-parallel-size 3 or more"):
        validate_dynamic_batch_args(args)
    # One chunk a stage is no interleaving: accepted, as Megatron does.
    validate_dynamic_batch_args(_args(_ON, num_virtual_stages_per_pipeline_rank=1))


# -- B3 / B4 / B5: the calibration flags -----------------------------------------------------------


@pytest.mark.parametrize("bound", [-1.0, 0.0, math.nan, math.inf])
def test_a_calibration_error_bound_that_no_fit_can_use_is_refused(bound):
    flags = ["--dynamic-batch-calibration-max-error", str(bound)]
    for argv in (_ON + flags, flags):  # our flag: with the switch on or off
        with pytest.raises(DynBatchValueError) as refused:
            validate_dynamic_batch_args(_args(argv))
        message = str(refused.value)
        assert message.startswith(f"--dynamic-batch-calibration-max-error {bound!r} is refused")
        assert "must be a finite number > 0" in message and "pass e.g. 0.2" in message
        # A probe applied the old third fix (--dynamic-batch-calibration-steps 0): refused again.
        assert "calibration-steps" not in message and "or drop the flag" in message, message
        with pytest.raises(DynBatchValueError, match="must be a finite number > 0"):
            validate_dynamic_batch_args(_args(argv + ["--dynamic-batch-calibration-steps", "0"]))
    for good in ("0.2", "0.5", "3"):
        validate_dynamic_batch_args(_args(_ON + ["--dynamic-batch-calibration-max-error", good]))


def test_negative_calibration_steps_are_refused_and_0_turns_calibration_off():
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(_ON + ["--dynamic-batch-calibration-steps", "-1"]))
    message = str(refused.value)
    assert message.startswith("--dynamic-batch-calibration-steps=-1 must be >= 0"), message
    assert "or 0 to turn calibration off" in message
    validate_dynamic_batch_args(_args(_ON + ["--dynamic-batch-calibration-steps", "0"]))


def test_one_calibration_step_is_refused_at_start_up_and_two_run():
    # A probe: 1 was accepted, and the fit after the first measured step needs 2 (a refusal
    # that stopped the run iterations in).
    with pytest.raises(DynBatchValueError, match="needs at least 2 measured steps") as refused:
        validate_dynamic_batch_args(_args(_ON + ["--dynamic-batch-calibration-steps", "1"]))
    assert "pass 2 or more" in str(refused.value)
    validate_dynamic_batch_args(_args(_ON + ["--dynamic-batch-calibration-steps", "2"]))


@pytest.mark.parametrize(
    "flags",
    [
        ["--dynamic-batch-calibration-steps", "0"],
        ["--dynamic-batch-calibration-max-error", "0.5"],
        ["--dynamic-batch-recalibrate"],
        ["--dynamic-batch-calibration-output", "/tmp/somewhere"],
    ],
)
def test_calibration_flags_without_the_switch_are_refused_as_stray(flags):
    # Like every other flag of ours: without the switch they would be ignored (fixed
    # micro-batches run, nothing calibrates), which a user would not know.
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(flags))
    message = str(refused.value)
    assert message.startswith(f"{flags[0]} given without --use-dynamic-batch-size"), message
    assert "add --use-dynamic-batch-size or drop them" in message
    validate_dynamic_batch_args(_args(_ON + flags))


def test_a_calibration_output_that_cannot_become_a_directory_is_refused(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    flag = "--dynamic-batch-calibration-output"
    with pytest.raises(DynBatchValueError, match=f"{flag} {afile} is a file, not a directory"):
        validate_dynamic_batch_args(_args(_ON + [flag, str(afile)]))
    with pytest.raises(DynBatchValueError, match=f"{afile} is a file, so no directory can be"):
        validate_dynamic_batch_args(_args(_ON + [flag, str(afile / "sub" / "dir")]))
    # A missing directory under a writable one is made when calibration writes: not here.
    missing = tmp_path / "new" / "dir"
    validate_dynamic_batch_args(_args(_ON + [flag, str(missing)]))
    assert not (tmp_path / "new").exists()
    # Only global rank 0 writes the files: the other ranks do not look (another node's paths).
    validate_dynamic_batch_args(_args(_ON + [flag, str(afile)], rank=1))
    # A directory this user cannot write (root writes anywhere: the permission is stood in).
    monkeypatch.setattr(arguments.os, "access", lambda path, mode: path != str(tmp_path))
    unwritable = f"{tmp_path}, where it would be made, is not writable by this user"
    with pytest.raises(DynBatchValueError, match=unwritable):
        validate_dynamic_batch_args(_args(_ON + [flag, str(tmp_path / "out")]))


# -- B6: a launch without torchrun ----------------------------------------------------------------


def test_a_launch_without_torchrun_runs_as_one_rank_with_the_switch_or_our_subcommand():
    # It stopped in an ~890-line traceback about MASTER_ADDR; the README promises the console
    # script runs one rank unless started by torchrun.
    script = "/x/launch/pretrain_gpt_dynbatch.py"
    on, off = _args(_ON), _args()
    fixed = _args(document_samples=True)  # the README's fixed baseline (a probe: the traceback)
    for args, program in ((on, script), (fixed, script), (off, PRETRAIN_PROGRAM)):
        environ = {}
        chosen = one_rank_without_torchrun(args, environ=environ, program=program)
        assert environ == chosen and environ["RANK"] == "0" and environ["WORLD_SIZE"] == "1"
        assert environ["MASTER_ADDR"] == "127.0.0.1" and int(environ["MASTER_PORT"]) > 0
    # Stock mode of the launch script: as stock pretrain_gpt.py (Megatron's own failure).
    environ = {}
    assert one_rank_without_torchrun(off, environ=environ, program=script) is None
    assert environ == {}
    # A model over more ranks than one: check_world_size names the ranks it needs.
    split = _args(_ON, pipeline_model_parallel_size=2, world_size=1)
    assert one_rank_without_torchrun(split, environ={}, program=script) is None
    # Under torchrun (or a launcher that sets the rendezvous by hand): nothing is set.
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        environ = {name: "0"}
        assert one_rank_without_torchrun(on, environ=environ, program=script) is None
        assert environ == {name: "0"}


def test_the_subcommand_is_recognised_by_the_program_name_the_cli_gives_it():
    from megatron_dynbatch.tools.cli import PRETRAIN_PROGRAM as CLI_PROGRAM

    assert PRETRAIN_PROGRAM == CLI_PROGRAM


# -- B7: the entry's attention check runs before Megatron's validation (its argument dump) ------


def test_configure_runs_the_entry_check_before_megatron_validates():
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch-varlen runs where CUDA is: nothing to refuse")
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()  # the hooks import megatron.core, which needs the triton stand-in here
    from megatron_dynbatch.integrations.megatron_lm import attention, hooks

    def launch_attention(args):  # as launch/pretrain_gpt_dynbatch.py's main registers it
        attention.attention_of_args(args, document_samples=True)

    args = _args(["--dynamic-batch-attention", "torch-varlen"], transformer_impl="local")
    try:
        with hooks.entry_check(launch_attention):
            with pytest.raises(DynBatchValueError, match="which need CUDA, and this machine"):
                hooks.configure(args)
        hooks.configure(args)  # outside the entry: not this host's check
    finally:
        hooks.reset_dynamic_batch_state()


# -- a validation batch of no samples ---------------------------------------------------------------


@pytest.mark.parametrize(
    "values, flag",
    [
        (dict(eval_global_batch_size=0), "--eval-global-batch-size"),
        (dict(eval_global_batch_size=-4), "--eval-global-batch-size"),
        (dict(eval_micro_batch_size=0), "--eval-micro-batch-size"),
    ],
)
def test_a_validation_batch_size_of_0_is_refused_not_read_as_left_out(values, flag):
    # `eval_global_batch_size or global_batch_size` read a 0 given as the default (left out).
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(_ON, **values))
    message = str(refused.value)
    assert message.startswith(f"{flag}="), message
    # Left out (None) it is the training batch, as Megatron defaults it.
    validate_dynamic_batch_args(_args(_ON, eval_global_batch_size=None, eval_micro_batch_size=None))


# -- the baseline planner 'fixed' has no oversize policy ---------------------------------------------


@pytest.mark.parametrize("policy", ["error", "allow", "truncate"])
def test_the_fixed_planner_under_seq_length_is_refused_at_start_up_whatever_the_policy(policy):
    # It was refused at the first step holding a --seq-length sample (with allow or truncate), or
    # told to pass allow / truncate, which planner 'fixed' ignores.
    fixed = ["--dynamic-batch-planner", "fixed", "--dynamic-batch-layout", "padded"]
    argv = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "128", "--oversize-samples", policy]
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(argv + fixed))
    message = str(refused.value)
    assert message.startswith("--max-tokens-per-gpu 128 is smaller than --seq-length 256"), message
    assert "--dynamic-batch-planner fixed pads every sample" in message
    assert "raise --max-tokens-per-gpu to at least 256" in message
    # Each named fix works: the budget raised, or the default planner (with a policy over error).
    validate_dynamic_batch_args(_args(argv[:2] + ["256"] + argv[3:] + fixed))
    if policy != "error":
        validate_dynamic_batch_args(_args(argv))


def test_moe_settings_that_depend_on_the_grouping_are_named():
    # A probe: aux-loss and capacity-factor runs differ from fixed micro-batches by 1e-5 to 1e-4
    # (docs/moe.md) and said nothing at start-up; the launch now prints them in a note.
    from types import SimpleNamespace

    from megatron_dynbatch.integrations.megatron_lm.arguments import grouping_dependent_moe

    def moe(**values):  # Megatron's defaults as its parser leaves them
        base = dict(
            num_experts=4,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.0,
            moe_expert_capacity_factor=None,
        )
        return SimpleNamespace(**{**base, **values})

    cases = [
        (moe(num_experts=None, moe_aux_loss_coeff=0.01), []),  # a dense model
        (moe(), []),  # aux_loss at coefficient 0: no loss
        (moe(moe_aux_loss_coeff=[0.01]), ["--moe-router-load-balancing-type aux_loss"]),
        (
            moe(
                moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss", "none"],
                moe_aux_loss_coeff=[0.0, 0.01, 0.0],
            ),
            ["--moe-router-load-balancing-type global_aux_loss"],
        ),
        (moe(moe_router_load_balancing_type=["none"], moe_aux_loss_coeff=0.01), []),
        (
            moe(moe_expert_capacity_factor=1.0),
            ["--moe-expert-capacity-factor 1.0"],
        ),
        # A later probe: Sinkhorn balancing reads no padding mask (1.9e-4 from the per-sample
        # reference), input jitter draws per shape (9.5e-5); the note said "exactly".
        (
            moe(moe_router_load_balancing_type="sinkhorn"),
            ["--moe-router-load-balancing-type sinkhorn"],
        ),
        (moe(moe_input_jitter_eps=0.1), ["--moe-input-jitter-eps 0.1"]),
    ]
    for args, expected in cases:
        assert grouping_dependent_moe(args) == expected, (vars(args), expected)


def test_a_sliding_window_is_refused_where_it_would_cross_the_samples_of_a_row():
    """A probe's ``--window-size 256,0`` trained packed documents that attended to each other
    (Megatron's local attention builds its window mask and drops the block-diagonal one): losses
    6.1e-5 off --document-samples. Padded rows (one sample each) keep the window exact."""
    window = dict(window_size=(16, 0), transformer_impl="local")
    with pytest.raises(
        DynBatchValueError,
        match=r"--window-size 16,0 with packed rows \(--dynamic-batch-layout packed\): "
        r"Megatron's local attention replaces .* pass --dynamic-batch-layout padded",
    ):
        validate_dynamic_batch_args(_args(_ON, **window))
    with pytest.raises(
        DynBatchValueError,
        match="--window-size 16,0: --dynamic-batch-attention reference implements full causal",
    ):
        validate_dynamic_batch_args(
            _args(_ON + ["--dynamic-batch-attention", "reference", "--dynamic-batch-layout",
                         "padded"], **window)
        )  # fmt: skip
    assert (
        validate_dynamic_batch_args(
            _args(_ON + ["--dynamic-batch-layout", "padded"], **window)
        ).layout
        == "padded"
    )
    # No window; or transformer-engine's attention, which passes the window to its kernels with
    # the THD segments (not installable here, so not run).
    assert validate_dynamic_batch_args(_args(_ON, transformer_impl="local")) is not None
    assert validate_dynamic_batch_args(_args(_ON, window_size=(16, 0))) is not None


def test_validation_cut_under_truncate_is_said_at_start_up(tmp_path):
    """A probe: under --oversize-samples truncate validation plans under the forward-only budget
    (by default the training one) and its documents were cut to it without a word, where
    --document-samples validates them whole (the launch prints this note at start-up)."""

    def note(argv=(), **values):
        base = ["--use-dynamic-batch-size", "--oversize-samples", "truncate"]
        return arguments.validation_cut_note(_args([*base, *argv], seq_length=512, **values))

    said = note(["--max-tokens-per-gpu", "128"])
    assert said.startswith("validation documents longer than 128 tokens (the forward-only "
                           "budget, --log-probs-max-tokens-per-gpu, default --max-tokens-per-gpu)"
                           ) and said.endswith(
        "pass --log-probs-max-tokens-per-gpu 512 to validate them whole."
    ), said  # fmt: skip
    said = note(["--max-tokens-per-gpu", "128", "--log-probs-max-tokens-per-gpu", "256"])
    assert "longer than 256 tokens (the forward-only budget, --log-probs-max-tokens-per-gpu)" in (
        said
    ), said
    # Rounded down to the sample multiple, as the planner cuts (tp 2: samples pad to 2).
    said = note(["--max-tokens-per-gpu", "129"], tensor_model_parallel_size=2)
    assert "longer than 128 tokens" in said, said
    # Set in the YAML alone (a review: the note read only the flags).
    yaml = tmp_path / "dyn.yaml"
    yaml.write_text("oversize_samples: truncate\nmax_tokens_per_gpu: 128\n")
    said = arguments.validation_cut_note(
        _args(["--use-dynamic-batch-size", "--dynamic-batch-config", str(yaml)], seq_length=512)
    )
    assert said is not None and "longer than 128 tokens" in said, said
    for whole in (
        ["--max-tokens-per-gpu", "128", "--log-probs-max-tokens-per-gpu", "512"],
        ["--max-tokens-per-gpu", "128", "--oversize-samples", "allow"],
        ["--max-tokens-per-gpu", "1024"],
    ):
        assert note(whole) is None, whole
    assert arguments.validation_cut_note(_args(["--max-tokens-per-gpu", "128"])) is None


@pytest.mark.parametrize(
    "yaml, named",
    [
        ("max_tokens_per_gpu: 256\nrollouts_per_step: 3\n", "rollouts_per_step: 3"),
        ("max_tokens_per_gpu: 64\n", "max_tokens_per_gpu: 64"),
        ("max_tokens_per_gpu: 256\nplanner: fixed\n", "planner: fixed"),
    ],
)
def test_a_refusal_of_a_yaml_setting_names_the_file_and_key(tmp_path, yaml, named):
    """A probe: settings the --dynamic-batch-config YAML alone set were refused by their flags
    ("drop --rollouts-per-step", which the user never passed and cannot drop)."""
    path = tmp_path / "dyn.yaml"
    path.write_text(yaml)
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(
            _args(["--use-dynamic-batch-size", "--dynamic-batch-config", str(path)], seq_length=128)
        )
    message = str(refused.value)
    assert message.endswith(
        f"({named} set in --dynamic-batch-config {path}: change it there, or override with the "
        "flag.)"
    ), message
    # The same values as flags: the message as it was, without the note.
    flags = [f"--{k.strip().replace('_', '-')}" for k in yaml.splitlines()[-1].split(":")[:1]]
    value = yaml.splitlines()[-1].split(":")[1].strip()
    flag = {"--planner": "--dynamic-batch-planner"}.get(flags[0], flags[0])
    argv = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", flag, value]
    if flag == "--max-tokens-per-gpu":
        argv = ["--use-dynamic-batch-size", flag, value]
    with pytest.raises(DynBatchValueError) as refused:
        validate_dynamic_batch_args(_args(argv, seq_length=128))
    assert "set in --dynamic-batch-config" not in str(refused.value)


def test_a_log_prob_budget_below_seq_length_is_refused_only_where_validation_runs():
    """A probe: with --eval-iters 0 the launch runs no forward-only pass, and a small
    --log-probs-max-tokens-per-gpu was refused for a pass that never came."""
    argv = _ON + ["--log-probs-max-tokens-per-gpu", "64"]
    with pytest.raises(DynBatchValueError, match="first validation and log-prob step"):
        validate_dynamic_batch_args(_args(argv, seq_length=128, eval_iters=1))
    assert validate_dynamic_batch_args(_args(argv, seq_length=128, eval_iters=0)) is not None


# -- MoE settings the planned forward cannot run (a launch probe met them at the first step) -----

_MOE = dict(num_experts=4, moe_router_topk=2)


def test_quantile_balancing_is_refused_at_start_up_in_both_document_modes():
    args = _args(_ON, moe_router_load_balancing_type="quantile_balancing", **_MOE)
    for dynamic, mode in ((True, "--use-dynamic-batch-size"), (False, "--document-samples")):
        with pytest.raises(DynBatchValueError, match=f"quantile_balancing cannot run with {mode}"):
            check_moe_args(args, dynamic=dynamic)
    check_moe_args(_args(_ON, moe_router_load_balancing_type="aux_loss", **_MOE), True)


def test_a_load_balancing_loss_with_moe_recomputation_is_refused_where_placeholders_run():
    moe = dict(_MOE, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    full = dict(moe, recompute_granularity="full", data_parallel_size=2)
    with pytest.raises(DynBatchValueError, match="Drop --recompute-granularity full, or set"):
        check_moe_args(_args(_ON, **full), dynamic=True)
    selective = dict(
        moe,
        recompute_granularity="selective",
        recompute_modules=["moe"],
        virtual_pipeline_model_parallel_size=2,
    )
    with pytest.raises(DynBatchValueError, match="Drop moe from --recompute-modules"):
        check_moe_args(_args(_ON, **selective), dynamic=True)
    # Each named fix runs; so do dp 1 without interleaving (no placeholder) and --document-samples.
    check_moe_args(_args(_ON, **dict(full, recompute_granularity=None)), dynamic=True)
    check_moe_args(_args(_ON, **dict(full, moe_aux_loss_coeff=0.0)), dynamic=True)
    check_moe_args(_args(_ON, **dict(full, data_parallel_size=1)), dynamic=True)
    check_moe_args(_args(_ON, **full), dynamic=False)


def test_seq_aux_loss_without_a_coefficient_keeps_packed_rows():
    # Megatron computes no seq_aux_loss at coefficient 0: packed rows were refused for nothing.
    moe = dict(_MOE, moe_router_load_balancing_type="seq_aux_loss")
    packed = ["--dynamic-batch-layout", "packed"]
    config = validate_dynamic_batch_args(_args(_ON + packed, moe_aux_loss_coeff=0.0, **moe))
    assert config.layout == "packed"
    with pytest.raises(DynBatchValueError, match="seq_aux_loss takes every row"):
        validate_dynamic_batch_args(_args(_ON + packed, moe_aux_loss_coeff=0.01, **moe))


def test_variable_rows_under_seq_aux_loss_name_the_fix_that_works():
    # A probe was told to pass --dynamic-batch-layout packed, which seq_aux_loss refuses.
    moe = dict(_MOE, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01)
    with pytest.raises(DynBatchValueError, match="drop --variable-seq-lengths, or pick"):
        validate_dynamic_batch_args(_args(_ON + ["--variable-seq-lengths"], **moe))
    validate_dynamic_batch_args(_args(_ON, **moe))
