"""Issue 44: ``megatron-dynbatch verify`` refuses up front what it cannot finish on the machine
(more rank processes than the cores and memory run; a plan of more tokens a rank than it runs in
minutes on CPU), in one line with a fix that works, and prints the oversize warning of its
default ``--oversize-samples allow``. Refused before any rank starts (exit 2): no processes here.
The fixes run (checked by hand: 2 x [1x3480] at --max-tokens-per-gpu 3480 PASS in 56 s)."""

import json
import re

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import ParallelLayout, PlannerConfig
from megatron_dynbatch.tools.cli import main
from megatron_dynbatch.tools.verify import spec as verify_spec

pytestmark = pytest.mark.unit


def _spec(dp=1, cap=128, samples=None):
    config = PlannerConfig(max_tokens_per_gpu=cap, parallel=ParallelLayout(dp_size=dp),
                           oversize_samples="allow")  # fmt: skip
    return verify_spec.build_spec(config, samples=samples)


def test_more_ranks_than_the_machine_runs_are_refused_naming_a_size_that_fits():
    with pytest.raises(DynBatchValueError) as refused:
        verify_spec.check_fits_machine(_spec(dp=64), cores=2, available_bytes=24 * 2**30)
    message = str(refused.value)
    assert message.startswith("--dp-size 64 x --pp-size 1 x --tp-size 1 = 64 rank processes")
    assert "at most 8 ranks" in message
    fits = int(re.search(r"at --dp-size (\d+)", message).group(1))
    verify_spec.check_fits_machine(_spec(dp=fits), cores=2, available_bytes=24 * 2**30)
    # Memory bounds it too: 1 GiB available holds two 400 MiB ranks.
    with pytest.raises(DynBatchValueError, match="at most 2 ranks"):
        verify_spec.check_fits_machine(_spec(dp=4), cores=64, available_bytes=2**30)
    # Under torchrun the processes exist already: only the work is checked.
    verify_spec.check_fits_machine(_spec(dp=64), cores=2, start_ranks=False)


def _with_long_sample(length):
    return verify_spec.bundled_samples() + [{"length": length, "rollout": "long"}]


def test_a_plan_too_long_for_the_cpu_is_refused_and_the_named_cap_fits():
    samples = _with_long_sample(3480)
    with pytest.raises(DynBatchValueError) as refused:
        verify_spec.check_fits_machine(_spec(samples=samples), cores=2)
    message = str(refused.value)
    assert "micro-batches of [1x3480]" in message
    cap = int(re.search(r"raise --max-tokens-per-gpu to (\d+)", message).group(1))
    verify_spec.check_fits_machine(_spec(cap=cap, samples=samples), cores=2)
    # The bundled set at the default cap is far within the limit.
    verify_spec.check_fits_machine(_spec(), cores=2)


def test_many_samples_within_the_cap_are_refused_with_a_fix_that_works():
    # Two hundred samples of 100 tokens (none over the cap of 128) were told to "raise
    # --max-tokens-per-gpu to 100" and that a sample was over it; no cap helps: 20,000 tokens a
    # rank at dp 1 whatever it is.
    samples = [100] * 200
    with pytest.raises(DynBatchValueError) as refused:
        verify_spec.check_fits_machine(_spec(samples=samples), cores=2)
    message = str(refused.value)
    assert "over --max-tokens-per-gpu" not in message and "truncate" not in message, message
    dp = int(re.search(r"\(--dp-size (\d+)\)", message).group(1))
    verify_spec.check_fits_machine(_spec(dp=dp, samples=samples), cores=2)
    fewer = int(re.search(r"about (\d+) tokens at --dp-size 1", message).group(1))
    verify_spec.check_fits_machine(_spec(samples=[100] * (fewer // 100)), cores=2)


def test_one_sample_over_what_a_rank_runs_is_told_to_go_or_be_cut():
    # A sample of 10**6 tokens was told to use --dp-size 124: no dp splits one sample.
    samples = [1_000_000, 50]
    with pytest.raises(DynBatchValueError) as refused:
        verify_spec.check_fits_machine(_spec(cap=2_000_000, samples=samples), cores=2)
    message = str(refused.value)
    assert "alone is more than that" in message and "--dp-size" not in message, message
    cap = int(re.search(r"truncate with --max-tokens-per-gpu (\d+)", message).group(1))
    config = PlannerConfig(max_tokens_per_gpu=cap, oversize_samples="truncate")
    verify_spec.check_fits_machine(verify_spec.build_spec(config, samples=samples), cores=2)


def test_the_cli_refuses_before_any_rank_and_the_oversize_warning_is_printed(
    tmp_path, capsys, monkeypatch
):
    assert main(["verify", "--dp-size", "64"]) == 2
    assert "rank processes, more than this machine runs" in capsys.readouterr().err
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(_with_long_sample(3480)))
    assert main(["verify", "--samples", str(path)]) == 2
    assert "raise --max-tokens-per-gpu to 3480" in capsys.readouterr().err
    # A sample over the cap under the default `allow`: warned before the ranks run (stopped
    # here, at the ranks, to start no process).
    from megatron_dynbatch.tools.verify import cli as verify_cli

    def no_ranks(spec):
        raise SystemExit(0)

    monkeypatch.setattr(verify_cli, "run_verify", no_ranks)
    path.write_text(json.dumps(_with_long_sample(200)))
    with pytest.raises(SystemExit):
        main(["verify", "--samples", str(path)])
    err = capsys.readouterr().err
    assert "megatron-dynbatch verify: warning: 1 sample(s) exceed the token cap 128" in err


@pytest.mark.parametrize(
    "samples",
    [[1, 1, 1], [{"length": 40, "prompt_length": 40}, {"length": 3, "prompt_length": 3}]],
)
def test_samples_without_a_loss_token_are_refused_not_passed(samples):
    # [1, 1, 1] passed with every loss and gradient difference 0.0: nothing was compared.
    with pytest.raises(DynBatchValueError, match="no loss tokens"):
        _spec(samples=samples)
    _spec(samples=samples + [2])  # one target is enough
