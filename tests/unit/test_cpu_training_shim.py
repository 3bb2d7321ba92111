"""The CPU support of Megatron-LM's pretrain(): flag defaults, refusals, gradient clipping.

(That pretrain() itself runs with it is test_pretrain.py's business.)
"""

import argparse

import pytest
import torch

from megatron_dynbatch.cpu import training_shim as cpu_training_shim
from megatron_dynbatch.cpu.core_shim import apply_cpu_shim
from megatron_dynbatch.errors import DynBatchValueError

pytestmark = pytest.mark.unit

apply_cpu_shim()


def _megatron_parser():
    import typing

    import typing_extensions

    if not hasattr(typing, "override"):  # megatron.training uses Python 3.12's typing.override
        typing.override = typing_extensions.override
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    return cpu_training_shim.add_cpu_defaults(add_megatron_arguments(parser))


def test_without_cuda_a_stock_command_line_gets_the_cpu_values():
    assert not torch.cuda.is_available()
    args = _megatron_parser().parse_args([])
    for dest, (value, _, _) in cpu_training_shim.CPU_DEFAULTS.items():
        assert getattr(args, dest) == value, dest
    cpu_training_shim.check_cpu_args(args)  # the defaults pass the check


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--transformer-impl", "transformer_engine"], "--transformer-impl local"),
        (["--distributed-backend", "nccl"], "--distributed-backend gloo"),
        (["--bf16"], "remove --bf16"),
        (["--use-distributed-optimizer"], "remove it"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "remove it"),
        # A probe: both stopped the first step with torch's "not compiled with CUDA", no flag.
        (["--num-experts", "4", "--moe-grouped-gemm"], "remove it"),
        (["--mtp-num-layers", "1"], "remove it"),
        # A probe: Megatron's MoE layer refused it at the first forward (needs --sequence-parallel).
        (
            ["--num-experts", "4", "--tensor-model-parallel-size", "2"],
            "--tensor-model-parallel-size 1",
        ),
        # A probe: each stopped the run after the model was built, in every mode.
        (["--check-weight-hash-across-dp-replicas-interval", "2"], "remove it"),
        (["--log-memory-to-tensorboard"], "remove it"),
        (["--iterations-to-skip", "2"], "remove it"),
    ],
)
def test_values_that_need_cuda_are_refused_with_the_flag_to_change(argv, flag):
    args = _megatron_parser().parse_args(argv)
    with pytest.raises(DynBatchValueError, match="no CUDA|not supported on CPU") as error:
        cpu_training_shim.check_cpu_args(args)
    assert flag in str(error.value)


def test_grouped_gemm_is_refused_before_megatrons_validation_reads_the_gpu():
    """A probe (Megatron-LM's Mixtral script): Megatron's ``validate_args`` reads
    ``torch.cuda.get_device_capability()`` for --moe-grouped-gemm, which stopped the run with
    "Torch not compiled with CUDA enabled" before ``check_cpu_args`` ran; the launch's entry
    check (before ``validate_args``) refuses it first, on the parsed flags."""
    from megatron.training import arguments as megatron_arguments

    args = _megatron_parser().parse_args(["--num-experts", "4", "--moe-grouped-gemm"])
    with pytest.raises(AssertionError, match="CUDA"):
        megatron_arguments.torch.cuda.get_device_capability()  # what validate_args would hit
    with pytest.raises(DynBatchValueError, match="--moe-grouped-gemm is not supported on CPU"):
        cpu_training_shim.check_cpu_args_before_validation(args)
    cpu_training_shim.check_cpu_args_before_validation(_megatron_parser().parse_args([]))


def test_gradient_clipping_scales_like_megatron():
    clip = cpu_training_shim._clip_grad_by_total_norm_fp32
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for param, grad in zip(params, ([3.0, 0.0, 4.0], [0.0, 0.0]), strict=True):
        param.grad = torch.tensor(grad)
    clip(params, max_norm=1.0, total_norm=5.0)
    assert params[0].grad.tolist() == pytest.approx([0.6, 0.0, 0.8], rel=1e-5)
    clip(params, max_norm=10.0, total_norm=1.0)  # below the threshold: unchanged
    assert params[0].grad.tolist() == pytest.approx([0.6, 0.0, 0.8], rel=1e-5)
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    half.grad = torch.zeros(2, dtype=torch.float16)
    with pytest.raises(AssertionError, match="fp32"):
        clip([half], max_norm=1.0, total_norm=5.0)


def test_every_flag_that_needs_cuda_is_named_at_once_before_megatrons_validation():
    """A re-probe: --use-distributed-optimizer, --sequence-parallel (tp 2) and --bf16 were
    refused one at a time, --bf16 after Megatron's argument dump."""
    argv = ["--use-distributed-optimizer", "--bf16"]
    argv += ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    args = _megatron_parser().parse_args(argv)
    for check in (
        cpu_training_shim.check_cpu_args_before_validation,
        cpu_training_shim.check_cpu_args,
    ):
        with pytest.raises(DynBatchValueError, match="3 settings need CUDA") as error:
            check(args)
        message = str(error.value)
        for flag in ("--use-distributed-optimizer", "--bf16", "--sequence-parallel"):
            assert f"{flag} is not supported on CPU" in message, (flag, message)
    # At tp 1 Megatron turns --sequence-parallel off itself: not refused before it does.
    alone = _megatron_parser().parse_args(["--sequence-parallel"])
    cpu_training_shim.check_cpu_args_before_validation(alone)
