"""``--dynamic-batch-attention``: what ``auto`` picks on each machine, what is refused, and the
cost model's attention kind it feeds (packed THD rows by default on CUDA, CPU unchanged)."""

from types import SimpleNamespace

import pytest

from megatron_dynbatch.config import config_from_mapping
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm import attention
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    add_dynamic_batch_args,
    dynbatch_config_from_args,
    validate_dynamic_batch_args,
)

pytestmark = pytest.mark.unit

_MACHINES = {
    "cuda-bf16": dict(cuda=True, half=True, varlen=True),
    "cuda-fp32": dict(cuda=True, half=False, varlen=True),
    "cuda-old-torch": dict(cuda=True, half=True, varlen=False),
    "cpu": dict(cuda=False, half=False, varlen=False),
}


@pytest.mark.parametrize(
    "impl, machine, thd_rows, expected",
    [
        ("transformer_engine", "cuda-bf16", False, "transformer-engine"),
        (None, "cuda-bf16", False, "transformer-engine"),  # Megatron's default implementation
        ("local", "cuda-bf16", False, "torch-varlen"),
        ("local", "cuda-bf16", True, "torch-varlen"),
        ("local", "cuda-fp32", False, "local"),
        ("local", "cuda-fp32", True, "reference"),
        ("local", "cuda-old-torch", True, "reference"),
        ("local", "cpu", False, "local"),  # today's CPU path: block-diagonal masks
        ("local", "cpu", True, "reference"),  # stock THD rows, which local attention refuses
    ],
)
def test_auto_picks_by_implementation_and_machine(impl, machine, thd_rows, expected):
    got = attention.resolve_attention("auto", impl, thd_rows=thd_rows, **_MACHINES[machine])
    assert got == expected
    # What auto picks always passes the start-up check on that machine.
    attention.check_attention("auto", got, impl, te=True, **_MACHINES[machine])


@pytest.mark.parametrize(
    "requested, impl, machine, te, message",
    [
        (
            "torch-varlen", "local", "cpu", False,
            "--dynamic-batch-attention torch-varlen runs torch's flash kernels, which need CUDA, "
            "and this machine has none; use --dynamic-batch-attention reference (or auto).",
        ),
        ("torch-varlen", "local", "cuda-fp32", False, "take bf16 / fp16 only"),
        ("torch-varlen", "local", "cuda-old-torch", False, "needs torch.nn.attention.varlen"),
        (
            "torch-varlen", "transformer_engine", "cuda-bf16", True,
            "but --transformer-impl is transformer_engine; pass --transformer-impl local",
        ),
        ("reference", "transformer_engine", "cpu", False, "pass --transformer-impl local"),
        ("transformer-engine", "local", "cuda-bf16", True, "pass --transformer-impl transformer_"),
        ("transformer-engine", "transformer_engine", "cpu", False, "does not import"),
        ("auto", "transformer_engine", "cuda-bf16", False, "(resolved to transformer-engine)"),
    ],
)  # fmt: skip
def test_a_choice_that_cannot_run_here_is_refused_in_one_line(
    requested, impl, machine, te, message
):
    resolved = attention.resolve_attention(requested, impl, thd_rows=False, **_MACHINES[machine])
    with pytest.raises(DynBatchValueError) as error:
        attention.check_attention(requested, resolved, impl, te=te, **_MACHINES[machine])
    text = str(error.value)
    assert message in text and "\n" not in text
    assert "--dynamic-batch-attention" in text


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_without_transformer_engine_the_fixes_named_run_here(impl):
    """A probe: ``--dynamic-batch-attention transformer-engine`` with the local implementation
    was told to pass ``--transformer-impl transformer_engine``, then that transformer_engine does
    not import; the fixes named now run where it does not."""
    cpu = _MACHINES["cpu"]
    resolved = attention.resolve_attention("transformer-engine", impl, thd_rows=False, **cpu)
    with pytest.raises(DynBatchValueError) as error:
        attention.check_attention("transformer-engine", resolved, impl, te=False, **cpu)
    text = str(error.value)
    assert "does not import" in text and "transformer-impl transformer_engine" not in text, text
    assert ("with --transformer-impl local" in text) == (impl != "local"), text
    for requested in ("auto", "reference"):
        got = attention.resolve_attention(requested, "local", thd_rows=False, **cpu)
        attention.check_attention(requested, got, "local", te=False, **cpu)
    # Nor is transformer-engine offered to a local attention where it does not import.
    with pytest.raises(DynBatchValueError) as error:
        attention.check_attention("reference", "reference", "transformer_engine", te=False,
                                  **cpu)  # fmt: skip
    assert "transformer-engine" not in str(error.value).split("pass ", 1)[1], error.value


def test_torch_varlen_on_this_cpu_machine_is_refused_by_the_launch_check():
    # The real check of the launch (attention_of_args reads the machine: no CUDA here).
    args = SimpleNamespace(
        dynamic_batch_attention="torch-varlen", transformer_impl="local", bf16=True
    )
    with pytest.raises(DynBatchValueError, match="which need CUDA, and this machine has none"):
        attention.attention_of_args(args, document_samples=True)


def test_the_retired_flag_is_an_alias_of_reference():
    args = SimpleNamespace(dynamic_batch_reference_thd_attention=True)
    assert attention.requested_attention(args) == "reference"
    args.dynamic_batch_attention = "torch-varlen"
    with pytest.raises(DynBatchValueError, match="retired.*contradicts"):
        attention.requested_attention(args)
    assert attention.requested_attention(SimpleNamespace(), yaml_value="reference") == "reference"
    assert attention.requested_attention(SimpleNamespace()) == "auto"


def _args(argv):
    import argparse

    parser = add_dynamic_batch_args(argparse.ArgumentParser())
    parser.add_argument("--transformer-impl", default="local")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args(argv)
    args.calculate_per_token_loss, args.seq_length = True, 128
    return args


def test_cuda_plans_packed_thd_rows_by_default_and_padded_stays_available(monkeypatch):
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention, "varlen_importable", lambda: True)
    budget = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--bf16"]
    config = dynbatch_config_from_args(_args(budget))
    assert (config.layout, config.cost_attention, config.attention) == ("packed", "segment", "auto")
    padded = dynbatch_config_from_args(_args(budget + ["--dynamic-batch-layout", "padded"]))
    assert (padded.layout, padded.cost_attention) == ("padded", "causal")


def test_cpu_keeps_todays_dense_default_and_reference_plans_segments():
    budget = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]
    assert dynbatch_config_from_args(_args(budget)).cost_attention == "dense"
    chosen = _args(budget + ["--dynamic-batch-attention", "reference"])
    assert dynbatch_config_from_args(chosen).cost_attention == "segment"
    assert dynbatch_config_from_args(chosen).attention == "reference"


def test_the_option_works_without_dynamic_batching_and_yaml_values_are_checked(tmp_path):
    # Every mode of the launch takes it: not refused as a stray dynamic-batching flag.
    assert validate_dynamic_batch_args(_args(["--dynamic-batch-attention", "reference"])) is None
    with pytest.raises(DynBatchValueError, match=r"--dynamic-batch-max-tokens|given without"):
        validate_dynamic_batch_args(_args(["--max-tokens-per-gpu", "64"]))
    with pytest.raises(DynBatchValueError, match=r"attention='flash'.*--dynamic-batch-attention"):
        config_from_mapping({"max_tokens_per_gpu": 64, "attention": "flash"})
    path = tmp_path / "dynbatch.yaml"
    path.write_text("max_tokens_per_gpu: 4096\nattention: reference\n")
    args = _args(["--use-dynamic-batch-size", "--dynamic-batch-config", str(path)])
    assert dynbatch_config_from_args(args).cost_attention == "segment"
