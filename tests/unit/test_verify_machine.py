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
from megatron_dynbatch.tools.verify import machine as verify_machine
from megatron_dynbatch.tools.verify import spec as verify_spec

pytestmark = pytest.mark.unit


def _spec(dp=1, cap=128, samples=None):
    config = PlannerConfig(max_tokens_per_gpu=cap, parallel=ParallelLayout(dp_size=dp),
                           oversize_samples="allow")  # fmt: skip
    return verify_spec.build_spec(config, samples=samples)


def test_more_ranks_than_the_machine_runs_are_refused_naming_a_size_that_fits():
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(_spec(dp=64), cores=2, available_bytes=24 * 2**30)
    message = str(refused.value)
    assert message.startswith("--dp-size 64 x --pp-size 1 x --tp-size 1 = 64 rank processes")
    assert "at most 8 ranks" in message
    fits = int(re.search(r"at --dp-size (\d+)", message).group(1))
    verify_machine.check_fits_machine(_spec(dp=fits), cores=2, available_bytes=24 * 2**30)
    # Memory bounds it too: 1 GiB available holds two 400 MiB ranks.
    with pytest.raises(DynBatchValueError, match="at most 2 ranks"):
        verify_machine.check_fits_machine(_spec(dp=4), cores=64, available_bytes=2**30)
    # Under torchrun the processes exist already: only the work is checked.
    verify_machine.check_fits_machine(_spec(dp=64), cores=2, start_ranks=False)


def _with_long_sample(length):
    return verify_spec.bundled_samples() + [{"length": length, "rollout": "long"}]


def test_a_plan_too_long_for_the_cpu_is_refused_and_the_named_cap_fits():
    samples = _with_long_sample(3480)
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(_spec(samples=samples), cores=2)
    message = str(refused.value)
    assert "micro-batches of [1x3480]" in message
    cap = int(re.search(r"raise --max-tokens-per-gpu to (\d+)", message).group(1))
    verify_machine.check_fits_machine(_spec(cap=cap, samples=samples), cores=2)
    # The bundled set at the default cap is far within the limit.
    verify_machine.check_fits_machine(_spec(), cores=2)


def test_many_samples_within_the_cap_are_refused_with_a_fix_that_works():
    # Two hundred samples of 100 tokens (none over the cap of 128) were told to "raise
    # --max-tokens-per-gpu to 100" and that a sample was over it; no cap helps: 20,000 tokens a
    # rank at dp 1 whatever it is.
    samples = [100] * 200
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(_spec(samples=samples), cores=2)
    message = str(refused.value)
    assert "over --max-tokens-per-gpu" not in message and "truncate" not in message, message
    dp = int(re.search(r"\(--dp-size (\d+)\)", message).group(1))
    verify_machine.check_fits_machine(_spec(dp=dp, samples=samples), cores=2)
    fewer = int(re.search(r"about (\d+) tokens at --dp-size 1", message).group(1))
    verify_machine.check_fits_machine(_spec(samples=[100] * (fewer // 100)), cores=2)


def test_one_sample_over_what_a_rank_runs_is_told_to_go_or_be_cut():
    # A sample of 10**6 tokens was told to use --dp-size 124: no dp splits one sample.
    samples = [1_000_000, 50]
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(_spec(cap=2_000_000, samples=samples), cores=2)
    message = str(refused.value)
    assert "alone is more than that" in message and "--dp-size" not in message, message
    cap = int(re.search(r"truncate with --max-tokens-per-gpu from 2 to (\d+)", message).group(1))
    config = PlannerConfig(max_tokens_per_gpu=cap, oversize_samples="truncate")
    verify_machine.check_fits_machine(verify_spec.build_spec(config, samples=samples), cores=2)


def test_the_cut_named_for_a_long_sample_leaves_its_prompt_a_target():
    """A probe: a 9,000-token sample with a 500-token prompt was told to truncate "with
    --max-tokens-per-gpu 128 or less", which then left no loss token and was refused again."""
    samples = [{"length": 9000, "prompt_length": 500}]
    spec = verify_spec.build_spec(PlannerConfig(max_tokens_per_gpu=128), samples=samples)
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(spec, cores=2)
    message = str(refused.value)
    cap = int(re.search(r"truncate with --max-tokens-per-gpu (\d+) ", message).group(1))
    assert cap == 501, message
    cut = PlannerConfig(max_tokens_per_gpu=cap, oversize_samples="truncate")
    verify_machine.check_fits_machine(verify_spec.build_spec(cut, samples=samples), cores=2)
    # Without prompts the cut may go as low as two tokens (one target).
    spec = verify_spec.build_spec(PlannerConfig(max_tokens_per_gpu=128), samples=[9000])
    with pytest.raises(DynBatchValueError, match="--max-tokens-per-gpu from 2 to 128 "):
        verify_machine.check_fits_machine(spec, cores=2)


def test_one_long_sample_among_many_is_told_the_cut_and_the_ranks_that_fit_together():
    """A probe (verl #3035's shape): 1 sample of 10,000 tokens and 199 of 100, padded, was told
    to truncate at 2,048, which was refused again with the same words (22,528 tokens a rank);
    the fix named now is planned with everything it needs, and fits."""
    samples = [10_000] + [100] * 199
    config = PlannerConfig(max_tokens_per_gpu=20_000, layout="padded", oversize_samples="allow")
    spec = verify_spec.build_spec(config, samples=samples)
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(spec, cores=2, available_bytes=24 * 2**30)
    message = str(refused.value)
    found = re.search(
        r"truncate with --max-tokens-per-gpu from \d+ to (\d+), --dynamic-batch-layout packed and "
        r"--dp-size (\d+)",
        message,
    )
    assert found, message
    cap, dp = map(int, found.groups())
    fixed = PlannerConfig(
        max_tokens_per_gpu=cap, parallel=ParallelLayout(dp_size=dp), oversize_samples="truncate"
    )
    verify_machine.check_fits_machine(
        verify_spec.build_spec(fixed, samples=samples), cores=2, available_bytes=24 * 2**30
    )


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


# -- a probe of verify --json (seventh stop) --------------------------------------------------------


@pytest.mark.parametrize(
    "samples, cap",
    [
        (None, 1),  # the bundled set, every sample cut to its first token
        ([{"length": 100, "prompt_length": 60}, {"length": 90, "prompt_length": 60}], 60),
    ],
)
def test_truncation_that_leaves_no_loss_token_is_refused_not_passed(samples, cap):
    # It passed, comparing a loss of 0.0 with 0.0: every response token was cut.
    config = PlannerConfig(max_tokens_per_gpu=cap, oversize_samples="truncate")
    with pytest.raises(DynBatchValueError) as refused:
        verify_spec.build_spec(config, samples=samples)
    message = str(refused.value)
    assert "no sample has a loss token left" in message, message
    need = int(re.search(r"--max-tokens-per-gpu to at least (\d+)", message).group(1))
    fixed = PlannerConfig(max_tokens_per_gpu=need, oversize_samples="truncate")
    verify_spec.build_spec(fixed, samples=samples)


def test_moe_with_tensor_parallelism_is_refused_before_any_rank():
    # Every rank failed in Megatron's words (MoE with tp needs sequence parallelism).
    config = PlannerConfig(max_tokens_per_gpu=128, parallel=ParallelLayout(tp_size=2))
    with pytest.raises(DynBatchValueError, match="verify --moe cannot run --tp-size 2"):
        verify_spec.build_spec(config, moe=verify_spec.MoESettings())
    verify_spec.build_spec(config)  # dense at tp 2
    verify_spec.build_spec(PlannerConfig(max_tokens_per_gpu=128), moe=verify_spec.MoESettings())


def test_a_model_copy_over_the_machine_is_not_told_a_dp_size():
    # pp 4 x tp 4 was told to verify "the same --pp-size and --tp-size at --dp-size 1": refused
    # again, as no dp fits.
    config = PlannerConfig(max_tokens_per_gpu=128, parallel=ParallelLayout(pp_size=4, tp_size=4))
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(
            verify_spec.build_spec(config), cores=2, available_bytes=24 * 2**30
        )
    message = str(refused.value)
    assert "--pp-size 4 x --tp-size 4 alone is 16" in message, message
    assert "at --dp-size" not in message


def _fixes(message):
    return message.split("tokens in all; ")[1].rstrip(".").split("; or ")


def test_a_group_forcing_many_micro_batches_names_the_group():
    # Told to verify fewer of 1,426 tokens (about 4,096) or --dp-size 4, both refused again.
    parallel = ParallelLayout(pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=200)
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(
            verify_spec.build_spec(PlannerConfig(max_tokens_per_gpu=128, parallel=parallel)),
            cores=2,
        )
    [fix] = _fixes(str(refused.value))
    assert fix.startswith("lower --microbatch-group-size-per-vp-stage to 2"), fix
    smaller = ParallelLayout(pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    config = PlannerConfig(max_tokens_per_gpu=128, parallel=smaller)
    verify_machine.check_fits_machine(verify_spec.build_spec(config), cores=2)


def test_padded_rows_of_a_long_sample_are_told_what_works():
    # [3480, 50, 60] padded was told to raise the cap to 3480, then refused again there.
    samples = [3480, 50, 60]
    for cap in (128, 3480):
        config = PlannerConfig(max_tokens_per_gpu=cap, layout="padded", oversize_samples="allow")
        with pytest.raises(DynBatchValueError) as refused:
            verify_machine.check_fits_machine(
                verify_spec.build_spec(config, samples=samples), cores=2
            )
        fixes = _fixes(str(refused.value))
        assert fixes and not any("raise --max-tokens-per-gpu" in fix for fix in fixes), fixes
        for fix in fixes:  # each fix named, applied, passes the check
            if "--dynamic-batch-layout packed" in fix:
                changed = dict(layout="packed")
            elif "truncate" in fix:
                changed = dict(oversize_samples="truncate")
            else:
                dp = int(re.search(r"--dp-size (\d+)", fix).group(1))
                changed = dict(parallel=ParallelLayout(dp_size=dp))
            fixed = PlannerConfig(
                **{**dict(max_tokens_per_gpu=cap, layout="padded", oversize_samples="allow"),
                   **changed}
            )  # fmt: skip
            verify_machine.check_fits_machine(
                verify_spec.build_spec(fixed, samples=samples), cores=2
            )


def test_attention_over_the_memory_is_refused_with_a_cap_that_fits():
    # [8192] x 4 at dp 4 passed the checks and needed about 30 GB on a 24 GB machine (one 8,192-
    # token sample peaked at 7.9 GB resident).
    samples = [8192] * 4
    config = PlannerConfig(max_tokens_per_gpu=8192, parallel=ParallelLayout(dp_size=4))
    spec = verify_spec.build_spec(config, samples=samples)
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(spec, cores=2, available_bytes=24 * 2**30)
    message = str(refused.value)
    assert "its reference keeps every sample's attention scores" in message, message
    cap = int(re.search(r"truncate --max-tokens-per-gpu (\d+)", message).group(1))
    fixed = PlannerConfig(
        max_tokens_per_gpu=cap, parallel=ParallelLayout(dp_size=4), oversize_samples="truncate"
    )
    verify_machine.check_fits_machine(
        verify_spec.build_spec(fixed, samples=samples), cores=2, available_bytes=24 * 2**30
    )
    # One such sample alone fits 24 GB (7.9 GB measured).
    one = verify_spec.build_spec(PlannerConfig(max_tokens_per_gpu=8192), samples=[8192])
    verify_machine.check_fits_machine(one, cores=2, available_bytes=24 * 2**30)
    # A work-check fix is named only where the memory holds it too: more ranks of 8,192 tokens
    # (each holding its row's attention) would not.
    two = PlannerConfig(max_tokens_per_gpu=8192, parallel=ParallelLayout(dp_size=2))
    with pytest.raises(DynBatchValueError) as refused:
        verify_machine.check_fits_machine(
            verify_spec.build_spec(two, samples=samples), cores=2, available_bytes=24 * 2**30
        )
    fixes = _fixes(str(refused.value))
    assert not any(fix.startswith("share the samples") for fix in fixes), fixes


def test_the_report_echoes_the_settings_that_shape_the_plan():
    settings = verify_spec.build_spec(PlannerConfig(max_tokens_per_gpu=128)).settings()
    for key in ("min_gain", "cost_attention", "cost_shape_exchange_overhead"):
        assert key in settings, key
    # At vpp 1 the group is read by nothing: not echoed as if it ran.
    parallel = ParallelLayout(pp_size=2, microbatch_group_size_per_vp_stage=3)
    config = PlannerConfig(max_tokens_per_gpu=128, parallel=parallel)
    assert verify_spec.build_spec(config).settings()["microbatch_group_size_per_vp_stage"] is None


def test_verify_warnings_do_not_offer_a_flag_verify_lacks(tmp_path):
    spec = _spec(samples=_with_long_sample(200))
    [message] = verify_spec.plan_warnings(spec)
    assert "exceed the token cap" in message and "--variable-seq-lengths" not in message


def test_a_cut_sample_is_not_blamed_and_the_rest_is_named_when_it_is_too_much():
    """A re-probe: 30,000 + 399 x 300 tokens; truncated to 2,048 it was still told to leave the
    (cut) long sample out, and dropping it led to a second refusal for the rest."""
    samples = [30_000] + [300] * 399
    for config, said in (
        (
            PlannerConfig(max_tokens_per_gpu=40_000, oversize_samples="allow"),
            "the other samples (119700 tokens) are more than a rank runs too: verify fewer",
        ),
        (
            PlannerConfig(max_tokens_per_gpu=2048, oversize_samples="truncate"),
            "verify fewer samples (about 4096 tokens at --dp-size 1)",
        ),
    ):
        spec = verify_spec.build_spec(config, samples=samples)
        with pytest.raises(DynBatchValueError) as refused:
            verify_machine.check_fits_machine(spec, cores=2, available_bytes=24 * 2**30)
        message = str(refused.value)
        assert said in message, message
        if config.oversize_samples == "truncate":
            assert "alone is more than that" not in message, message
