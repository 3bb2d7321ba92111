"""Issue 44: every minimum a memory refusal names starts and trains, and a cap set by the memory
budget is named with ``--max-memory-gib``.

* The start-up check (``check_memory_budget``, run by ``hooks._step_memory``) uses the first
  step's model (counted activations x ``UNCALIBRATED_SAFETY``): the smallest budget it names
  plans ``--seq-length`` rows at the first step, also when the process holds more at rest than
  estimated (before, the first step refused the run's own samples: "6 sample(s) exceed the token
  cap 235 ... Raise --max-tokens-per-gpu").
* The planner names the flag that sets its cap (``PlannerConfig.cap_source`` / ``cap_flag``).
* ``plan`` labels the cap and warns when a predicted peak exceeds ``--max-memory-gib``.
The same through the launch script, trained: ``tests/megatron/test_megatron_lm_entry.py``.
"""

import dataclasses
import json
import re

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm import memory as step_memory
from megatron_dynbatch.planning import PlannerConfig, SampleSet, plan_samples
from megatron_dynbatch.planning.memory import GIB, MIB, MemoryLimit, MemoryModel
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.registry import run_planner
from megatron_dynbatch.planning.spec import ParallelLayout
from megatron_dynbatch.tools.cli import main

pytestmark = pytest.mark.unit

SEQ = 256


def _memory(budget_bytes, monkeypatch, now):
    monkeypatch.setattr(step_memory, "process_memory_now", lambda: float(now))
    monkeypatch.setattr(step_memory, "_reset_peak", lambda: float(now))
    dims = ModelDims(
        num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=512,
        parallel=ParallelLayout(pp_size=2),
    )  # fmt: skip
    model = MemoryModel(dims=dims, attention="dense", base_bytes=200 * MIB)
    return step_memory.StepMemory(model=model, budget=budget_bytes, min_row=SEQ)


def _named_minimum(memory) -> float:
    """What the start-up check says for a budget of 1 MiB (as ``hooks._step_memory`` runs it)."""
    limit = MemoryLimit(model=memory.current, budget_bytes=MIB, row_multiple=memory.row_multiple)
    with pytest.raises(DynBatchValueError) as refused:
        step_memory.check_memory_budget(limit, SEQ, "--max-memory-gib")
    message = str(refused.value)
    assert "counted x2 until measured" in message
    return float(re.search(r"raise --max-memory-gib to at least ([0-9.]+)", message).group(1))


@pytest.mark.parametrize("extra_at_rest_mib", [0, 150])
def test_the_named_minimum_passes_start_up_and_plans_seq_length_rows(
    monkeypatch, capsys, extra_at_rest_mib
):
    probe = _memory(MIB, monkeypatch, 200 * MIB)
    gib = _named_minimum(probe)
    # The named value passes the same check...
    memory = _memory(int(gib * GIB), monkeypatch, (200 + extra_at_rest_mib) * MIB)
    step_memory.check_memory_budget(
        MemoryLimit(model=memory.current, budget_bytes=memory.budget, row_multiple=1),
        SEQ,
        "--max-memory-gib",
    )
    # ...and the first step plans --seq-length rows, even when the process holds more at rest
    # than estimated (measured by before_plan): said, not refused.
    memory.before_plan(0, None)
    limit = memory.limit()
    assert limit.row_cap(1) >= SEQ
    config = PlannerConfig(max_tokens_per_gpu=1024, parallel=memory.model.dims.parallel,
                           memory=limit, oversize_samples="error")  # fmt: skip
    plan = plan_samples(SampleSet.build([SEQ] * 6 + [100, 17]), config)
    assert sum(len(mb) for rank in plan.steps[0].ranks for mb in rank) == 8
    said = "planning micro-batches of such rows at most" in capsys.readouterr().out
    assert said == (extra_at_rest_mib > 10)


def _limited_config(gib, oversize="error"):
    dims = ModelDims(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=257)
    model = MemoryModel(dims=dims, attention="dense")
    limit = MemoryLimit(model=model, budget_bytes=int(gib * GIB), row_multiple=1)
    return PlannerConfig(max_tokens_per_gpu=4096, memory=limit, oversize_samples=oversize)


def test_a_cap_the_memory_budget_sets_is_named_with_its_flag():
    config = _limited_config(0.05)
    assert config.token_cap < 4096 and config.cap_flag == "--max-memory-gib"
    assert config.cap_source.startswith("the longest row --max-memory-gib 0.050 allows")
    with pytest.raises(DynBatchValueError) as refused:
        plan_samples(SampleSet.build([config.token_cap + 10, 5]), config)
    message = str(refused.value)
    assert "Raise --max-memory-gib" in message and "Raise --max-tokens-per-gpu" not in message
    # So does the fixed planner's refusal (it told to raise --max-tokens-per-gpu, which the
    # memory budget's cap would refuse again).
    fixed = dataclasses.replace(config, planner="fixed", layout="padded", oversize_samples="allow")
    with pytest.raises(DynBatchValueError) as refused:
        run_planner(SampleSet.build([config.token_cap + 10, 5]), fixed)
    message = str(refused.value)
    assert "raise --max-memory-gib" in message and "--max-tokens-per-gpu or" not in message
    # The token budget's own cap keeps its name.
    plain = PlannerConfig(max_tokens_per_gpu=64, oversize_samples="error")
    assert plain.cap_flag == "--max-tokens-per-gpu"
    with pytest.raises(DynBatchValueError, match=r"\(--max-tokens-per-gpu=64\).*"
                       r"Raise --max-tokens-per-gpu"):  # fmt: skip
        plan_samples(SampleSet.build([100, 5]), plain)


def test_a_budget_under_the_state_at_rest_is_not_told_to_recompute():
    # Recomputing activations frees none of the weights, gradients and optimizer state: where
    # those alone are over the budget, the refusal names the minimum and what shards them.
    dims = ModelDims(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=257)
    for distributed in (False, True):
        model = MemoryModel(dims=dims, attention="dense", distributed_optimizer=distributed)
        resting = max(model.resting(s) for s in dims.stages())
        for gib, at_rest in ((resting * 0.9 / GIB, True), (resting * 1.0001 / GIB, False)):
            limit = MemoryLimit(model=model, budget_bytes=int(gib * GIB), row_multiple=1)
            with pytest.raises(DynBatchValueError) as refused:
                PlannerConfig(max_tokens_per_gpu=4096, memory=limit)
            message = str(refused.value)
            assert ("recompute" not in message) == at_rest, message
            # The least budget that holds one padded sample, not only the state at rest: a
            # probe's "above 0.024" was refused again at 0.026.
            least = limit.least_gib(1)
            assert least > resting / GIB
            assert (f"--max-memory-gib to at least {least:.3f}," in message) == at_rest, message
            assert ("--use-distributed-optimizer" in message) == (at_rest and not distributed)
            if at_rest:
                fixed = MemoryLimit(model=model, budget_bytes=int(least * GIB), row_multiple=1)
                assert PlannerConfig(max_tokens_per_gpu=4096, memory=fixed).token_cap >= 1


_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def test_plan_labels_the_cap_and_warns_when_a_peak_exceeds_the_budget(tmp_path, capsys):
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([300, 200, 600, 1200]))
    args = ["plan", str(samples), "--max-tokens-per-gpu", "4096", *_MODEL]
    assert main([*args, "--max-memory-gib", "0.1"]) == 0
    out = capsys.readouterr()
    assert "(the longest row --max-memory-gib 0.100 allows; --max-tokens-per-gpu=4096" in out.out
    warning = re.search(r"warning: 1 step\(s\) are predicted to exceed --max-memory-gib 0.1 "
                        r"\(102 MiB\); the largest, step 0, holds (\d+) MiB", out.err)  # fmt: skip
    assert warning and int(warning.group(1)) > 102, out.err
    # JSON keeps stdout one object; the warning goes to stderr all the same.
    assert main([*args, "--max-memory-gib", "0.1", "--json"]) == 0
    out = capsys.readouterr()
    json.loads(out.out)
    assert "are predicted to exceed --max-memory-gib" in out.err
    # Within the budget: no warning.
    assert main([*args, "--max-memory-gib", "4"]) == 0
    assert "predicted to exceed" not in capsys.readouterr().err


def test_a_refusal_under_both_budgets_names_both_values_that_plan(tmp_path, capsys):
    """A probe: the refusal named --max-memory-gib alone; at that value the token budget, also
    short of the longest sample, was refused next."""
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([10, 94, 101]))
    args = ["plan", str(samples), *_MODEL, "--dp-size", "4", "--tp-size", "2", "--json"]
    args += ["--oversize-samples", "error"]
    assert main([*args, "--max-tokens-per-gpu", "100", "--max-memory-gib", "0.05"]) == 2
    err = capsys.readouterr().err
    named = re.search(
        r"Raise --max-memory-gib to at least (\d+\.\d+) and --max-tokens-per-gpu to at least "
        r"(\d+),",
        err,
    )
    assert named, err
    gib, tokens = named.groups()
    assert main([*args, "--max-tokens-per-gpu", tokens, "--max-memory-gib", gib]) == 0
    capsys.readouterr()


def test_each_memory_refusal_and_warning_names_a_budget_that_plans(tmp_path, capsys):
    """A probe: under --max-memory-gib the oversize refusal said "Raise --max-memory-gib" with no
    value (0.22 still refused, 0.23 planned), and so did the warning of a step over it."""
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([100, 50, 300]))
    args = ["plan", str(samples), "--max-tokens-per-gpu", "4096", *_MODEL, "--json"]
    assert main([*args, "--oversize-samples", "error", "--max-memory-gib", "0.06"]) == 2
    err = capsys.readouterr().err
    named = re.search(r"Raise --max-memory-gib to at least (\d+\.\d+)", err)
    assert named, err
    gib = float(named.group(1))
    assert main([*args, "--oversize-samples", "error", "--max-memory-gib", str(gib)]) == 0
    capsys.readouterr()
    assert main([*args, "--oversize-samples", "error", "--max-memory-gib", f"{gib - 0.001}"]) == 2
    capsys.readouterr()
    # Under allow the step runs over the budget, and the warning names the same least budget.
    assert main([*args, "--max-memory-gib", "0.1"]) == 0
    err = capsys.readouterr().err
    assert f"raise --max-memory-gib to at least {gib:.3f}" in err, err
    assert main([*args, "--max-memory-gib", str(gib)]) == 0
    assert "predicted to exceed" not in capsys.readouterr().err


def test_under_truncate_the_budget_is_checked_at_the_row_samples_are_cut_to(monkeypatch):
    """A probe: ``--oversize-samples truncate --max-tokens-per-gpu 512 --max-memory-gib 0.4``
    with ``--seq-length 2048`` was refused for one 2,048-token row, which the run never holds
    (cut at 512, it peaked at 406 of 410 MiB once allowed); the memory model kept a 2,048 row's
    need as its budget after the first step too."""
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()  # the hooks import megatron.core, which needs the triton stand-in here
    from megatron_dynbatch.integrations.megatron_lm import hooks
    from megatron_dynbatch.integrations.megatron_lm.arguments import dynbatch_config_from_args
    from tests._support import megatron_lm_args

    probe = _memory(MIB, monkeypatch, 200 * MIB)
    monkeypatch.setattr(hooks, "memory_model_from_args", lambda *a, **k: probe.model)
    limit = MemoryLimit(model=probe.current, budget_bytes=MIB, row_multiple=1)
    with pytest.raises(DynBatchValueError) as refused:
        step_memory.check_memory_budget(limit, 2 * SEQ, "--max-memory-gib")
    named = float(re.search(r"at least ([0-9.]+)", str(refused.value)).group(1))
    with pytest.raises(DynBatchValueError) as refused:
        step_memory.check_memory_budget(limit, SEQ, "--max-memory-gib")
    enough = float(re.search(r"at least ([0-9.]+)", str(refused.value)).group(1))
    assert enough < named
    argv = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(SEQ)]
    argv += ["--max-memory-gib", str(enough)]
    for policy, fits in (("truncate", True), ("error", False), ("allow", False)):
        args = megatron_lm_args(
            argv + ["--oversize-samples", policy],
            seq_length=2 * SEQ, num_layers=4, hidden_size=256, num_attention_heads=8,
            data_parallel_size=1, pipeline_model_parallel_size=2,
        )  # fmt: skip
        config = dynbatch_config_from_args(args)
        if fits:
            memory = hooks._step_memory(args, config)
            assert (memory.min_row, memory.min_row_name) == (SEQ, "--max-tokens-per-gpu")
        else:  # a sample of --seq-length can run whole: its row is the one to fit
            with pytest.raises(DynBatchValueError, match=f"one --seq-length {2 * SEQ} sample"):
                hooks._step_memory(args, config)


def test_the_refusal_names_only_the_fixes_that_are_left(monkeypatch):
    """A probe at pp 2 with --recompute-granularity full and a budget below what the process
    holds at rest was told to recompute activations or lower --seq-length."""
    base = _memory(MIB, monkeypatch, 200 * MIB).model

    def refusal(recompute, budget):
        model = dataclasses.replace(base, recompute=recompute)
        limit = MemoryLimit(model=model, budget_bytes=budget, row_multiple=1)
        with pytest.raises(DynBatchValueError) as refused:
            step_memory.check_memory_budget(limit, SEQ, "--max-memory-gib")
        return str(refused.value)

    # Over what any stage holds at rest, under the peak of one row.
    between = int(max(base.resting(stage) for stage in base.dims.stages())) + 1
    assert "(--recompute-granularity selective / full), or lower --seq-length." in refusal(
        None, between
    )
    assert "(--recompute-granularity full), or lower --seq-length." in refusal("selective", between)
    said = refusal("full", between)
    assert "recompute" not in said.split("); ")[-1] and said.endswith(", or lower --seq-length.")
    said = refusal(None, MIB)  # what is held at rest alone is over the budget
    assert re.search(r"\); raise --max-memory-gib to at least [0-9.]+ \(what is held at rest alone "
                     r"is over it\)\.$", said), said  # fmt: skip


def test_a_memory_budget_under_one_sample_under_error_names_what_the_longest_needs(
    tmp_path, capsys
):
    """A probe: "raise --max-memory-gib to at least 0.170" (one token's micro-batch), then, at
    0.170, refused for the longest sample ("at least 1.434"). Both values it names now plan."""
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([100, 500, 3000]))
    args = ["plan", str(samples), *_MODEL, "--vocab-size", "32000", "--json"]
    assert main([*args, "--oversize-samples", "error", "--max-memory-gib", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "the longest sample (3000 tokens) must fit one" in err, err
    found = re.findall(r"--max-memory-gib (?:to )?at least (\d+\.\d+)", err)
    least, other = (float(g) for g in found)
    assert least > other, err
    assert main([*args, "--oversize-samples", "error", "--max-memory-gib", str(least)]) == 0
    assert json.loads(capsys.readouterr().out)["token_cap"] >= 3000
    for policy in ("truncate", "allow"):
        assert main([*args, "--oversize-samples", policy, "--max-memory-gib", str(other)]) == 0
        capsys.readouterr()


def test_whichever_budget_binds_first_both_short_budgets_are_named(tmp_path, capsys):
    """Probes: with the token budget binding first (64 against a 4,820-token sample) the
    refusal named it alone, and the memory budget was refused next; with a memory budget under
    one micro-batch, the token budget likewise. Both are named, and both together plan."""
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([4820]))
    model = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8"]
    args = ["plan", str(samples), *model, "--vocab-size", "1000", "--dp-size", "2"]
    args += ["--tp-size", "2", "--device", "cuda", "--oversize-samples", "error", "--json"]
    pattern = r"--max-memory-gib to at least (\d+\.\d+) and --max-tokens-per-gpu to at least (\d+)"
    # The last: a token budget under one padded sample (tp 2: 2 tokens) beside a memory budget
    # short of the sample (a re-probe: the token budget was named alone, then the memory's).
    for gib, tokens in (("0.05", "64"), ("0.05", "4096"), ("0.001", "64"), ("0.05", "1")):
        assert main([*args, "--max-memory-gib", gib, "--max-tokens-per-gpu", tokens]) == 2
        err = capsys.readouterr().err
        named = re.search(pattern, err)
        assert named, (gib, tokens, err)
        fixed = ["--max-memory-gib", named.group(1), "--max-tokens-per-gpu", named.group(2)]
        assert main([*args, *fixed]) == 0, (gib, tokens)
        assert json.loads(capsys.readouterr().out)["token_cap"] >= 4820
