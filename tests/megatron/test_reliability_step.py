"""One broken or killed rank of a real Megatron step fails every rank fast; NaNs stay inert.

Issue 10, items 1 and 3. Before the fixes: a planning or materialize error on one rank left the
others waiting in p2p until the process-group timeout (``rank 0: after 30.0 s -> Timed out``), and
a NaN advantage on a fully masked sample gave NaN gradients in every parameter on both ranks.
"""

import math
import os
import signal
import time

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

# Results unpickled here may reference megatron modules, which import only with the shim on CPU.
apply_cpu_shim()

from megatron_dynbatch.tools.testing.workers import (  # noqa: E402
    DistributedTestError,
    Layout,
    run_on_ranks,
)
from tests._support import FAIL_FAST_S  # noqa: E402

pytestmark = pytest.mark.gloo

# Every rank must fail within FAIL_FAST_S (measured: well under a second; see tests/_support.py).
FAIL_WITHIN_S = FAIL_FAST_S
LENGTHS = (30, 52, 18, 44, 61, 12, 25, 40)
# Sample 7 is fully masked: its prompt is the whole sample, so it bears no loss.
PROMPTS = (5, 10, 4, 8, 12, 3, 5, 40)
ADVANTAGES = (0.5, -1.0, 1.5, 0.25, -0.75, 2.0, -0.5, 0.3)
FULLY_MASKED = 7
CAP = 96
SEED = 7


def _sample(index, advantages):
    from megatron_dynbatch.tools.testing.tiny_gpt import TINY_VOCAB_SIZE

    generator = torch.Generator().manual_seed(1000 + index)
    return {
        "tokens": torch.randint(0, TINY_VOCAB_SIZE, (LENGTHS[index],), generator=generator),
        "prompt_length": PROMPTS[index],
        "advantages": torch.tensor(advantages.get(index, ADVANTAGES[index])),
    }


def _advantage_loss(batch, ce):
    return ce * batch["advantages"]


def _killed_at_second_loss(batch, ce, calls=[]):  # noqa: B006 - a per-process call counter
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return _advantage_loss(batch, ce)


class _RaisesInBackward(torch.autograd.Function):
    """Identity forward; its backward raises (an autograd error of a caller's own loss)."""

    @staticmethod
    def forward(ctx, ce):
        return ce.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a backward of the caller's own loss failed")


def _in_schedule_fault(fault, chunks, token_loss):
    """This rank's token loss (or model) with ``fault`` planted at its second micro-batch:
    ``loss raises``, ``backward raises`` or ``forward raises``."""
    calls = []

    def faulty_loss(batch, ce):
        calls.append(1)
        if len(calls) == 2 and fault == "loss raises":
            raise ValueError("the caller's token loss failed at its second call")
        if len(calls) == 2 and fault == "loss interrupted":
            raise KeyboardInterrupt("a cancelled task, at the second loss call")
        if len(calls) == 2 and fault == "backward raises":
            ce = _RaisesInBackward.apply(ce)
        return token_loss(batch, ce)

    if fault == "forward raises":
        model = chunks[0].module
        forward = model.forward

        def failing_forward(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise IndexError("the model's forward failed at its second micro-batch")
            return forward(*args, **kwargs)

        model.forward = failing_forward
    return faulty_loss


_IN_SCHEDULE = ("loss raises", "loss interrupted", "backward raises", "forward raises")


class _Lazy(list):
    """Micro-batches built when read (a trainer's lazy list): the second fails every time it is
    read, the schedule's read and the stand-in's alike."""

    def __getitem__(self, index):
        if index == 1:
            raise OSError("micro-batch 1 could not be built")
        return super().__getitem__(index)


def _step_body(
    fault=None,
    advantages=None,
    kill_rank=None,
    plan_dp=None,
    rows=None,
    fault_rank=1,
    vpp=None,
    forward_only=False,
    moe=None,
):
    """Plan, agree, materialize and train one step; return the gradients or the agreed error.

    Args:
        fault: Break rank 1 only: ``plan`` (a prompt longer than its sample in the planner's
            input), ``sample`` (int32 tokens), ``materialize`` (a sample the plan gives it is
            missing), ``schedule`` (it hands the schedule one micro-batch fewer than planned:
            checked by ``train_microbatches`` alone, after the agreement above), ``vocab`` (a
            token id over the model's vocabulary), ``whole plan`` (the Plan for its step), ``one
            module`` (a model chunk, not the list of them).
        advantages: Sample index -> advantage overrides (every rank).
        kill_rank: This rank SIGKILLs itself at its second loss computation, inside the schedule.
        plan_dp: Plan for this many data-parallel ranks instead of the ranks that run.
        rows: ``exchanged`` or ``fixed``: plan rows of each micro-batch's own length
            (``variable_row_lengths``), with the model's ``variable_seq_lengths`` on or off.
        fault_rank: The rank of an in-schedule fault (``loss raises``, ``backward raises``,
            ``forward raises``: see :func:`_in_schedule_fault`); its process lives on.
        vpp: Virtual pipeline stages (the plan aligned to them).
        forward_only: Gather the log-probs (``forward_only_outputs``) instead of training.
        moe: A tiny MoE instead (4 experts): ``expert bias`` (sigmoid routing with an expert bias
            Megatron updates at the schedule's end) or ``global aux loss`` (token counts
            all-reduced over data-parallel ranks in the forward).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dynbatch.mcore.agreement import StepAgreementError, step_agreement
    from megatron_dynbatch.mcore.step import (
        configure_loss,
        forward_only_outputs,
        train_microbatches,
    )
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, plan_schedule
    from megatron_dynbatch.runtime import BatchSchema, FieldSpec, materialize_microbatches
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    rank = dist.get_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    schema = BatchSchema(fields=(FieldSpec(name="advantages", kind="sample", dtype=torch.float32),))
    config = PlannerConfig(
        max_tokens_per_gpu=CAP,
        parallel=ParallelLayout(
            dp_size=plan_dp or parallel_state.get_data_parallel_world_size(),
            # Interleaving needs whole pipeline groups of micro-batches.
            pp_size=pp_size if vpp else 1,
            vpp_size=vpp or 1,
        ),
        variable_row_lengths=rows is not None,
    )
    started = time.monotonic()
    try:
        with step_agreement(what="step 0") as agreement:
            prompts = list(PROMPTS)
            if fault == "plan" and rank == 1:
                prompts[0] = 99
            plan = plan_schedule(LENGTHS, None, prompts, config=config)
            agreement.fingerprint = plan.fingerprint()
            [step] = plan.steps
            indices = sorted(i for mb in step.rank_microbatches(dp_rank) for i in mb)
            mine = {i: _sample(i, advantages or {}) for i in indices}
            if fault == "sample" and rank == 1:
                mine[indices[0]]["tokens"] = mine[indices[0]]["tokens"].int()
            if fault == "materialize" and rank == 1:
                del mine[indices[0]]
            microbatches = materialize_microbatches(
                step,
                dp_rank,
                mine,
                schema,
                layout=plan.layout,
                sample_multiple=plan.sample_multiple,
            )
    except StepAgreementError as error:
        return {"type": type(error).__name__, "error": str(error), "s": time.monotonic() - started}
    model_config = tiny_transformer_config(
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vpp,
        calculate_per_token_loss=True,
        **({"num_moe_experts": 4} if moe else {}),
    )
    model_config.variable_seq_lengths = rows == "exchanged"
    if moe == "expert bias":
        model_config.moe_router_enable_expert_bias = True
        model_config.moe_router_score_function = "sigmoid"
        model_config.moe_router_bias_update_rate = 0.1
        model_config.moe_router_load_balancing_type = "none"
    if moe == "aux loss":
        model_config.moe_router_load_balancing_type = "aux_loss"
        model_config.moe_aux_loss_coeff = 0.01
        model_config.moe_z_loss_coeff = 0.001
    if moe == "global aux loss":
        model_config.moe_router_load_balancing_type = "global_aux_loss"
        model_config.moe_aux_loss_coeff = 0.01
    chunks = wrap_in_ddp(build_tiny_gpt(model_config, seed=SEED))
    biases = [b for c in chunks for name, b in c.named_buffers() if "expert_bias" in name]
    kept = [b.clone() for b in biases]
    metrics = _moe_metrics()
    configure_loss(chunks, "token-mean")
    token_loss = _killed_at_second_loss if rank == kill_rank else _advantage_loss
    if fault in _IN_SCHEDULE and rank == fault_rank:
        token_loss = _in_schedule_fault(fault, chunks, token_loss)
    if fault == "lazy micro-batch" and rank == fault_rank:
        microbatches = _Lazy(microbatches)
    if fault == "schedule" and rank == 1:
        microbatches = microbatches[:-1]
    if fault == "vocab" and rank == 1:
        microbatches[0]["tokens"][0, 0] = 10**5
    started = time.monotonic()
    try:
        if forward_only:
            return {"logprobs": forward_only_outputs(chunks, step, microbatches)}
        train_microbatches(
            chunks[0] if fault == "one module" and rank == 1 else chunks,
            plan if fault == "whole plan" and rank == 1 else step,
            microbatches,
            aggregation="token-mean",
            token_loss=token_loss,
        )
    except (StepAgreementError, KeyboardInterrupt) as error:
        return {
            "type": type(error).__name__,
            "error": str(error),
            "s": time.monotonic() - started,
            "biases kept": bool(biases) and all(map(torch.equal, biases, kept)),
            # As before the step, or zeros where the failed step made the entry.
            "metrics kept": {
                name: torch.equal(values, metrics.get(name, torch.zeros_like(values)))
                for name, values in _moe_metrics().items()
            },
        }
    rows_seen = sorted({tuple(b["tokens"].shape) for b in microbatches})
    return {"grads": named_global_grads(chunks), "rows": rows_seen}


def _moe_metrics():
    """Megatron's MoE metrics tracker (what a trainer logs after the step), copied."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return {name: e.values.clone() for name, e in get_moe_metrics_tracker().metrics.items()}


def _sharded_body():
    """The samples already sharded over the two DP ranks (rank r holds every other sample from
    r), planned by ``plan_sharded_step`` and trained through ``train_microbatches``: the step's
    rows come from each rank's own samples."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dynbatch.mcore.step import configure_loss, train_microbatches
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig
    from megatron_dynbatch.planning.sharded import plan_sharded_step
    from megatron_dynbatch.runtime import BatchSchema, FieldSpec, materialize_microbatches
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    owned = [list(range(r, len(LENGTHS), dp)) for r in range(dp)]
    config = PlannerConfig(max_tokens_per_gpu=CAP, parallel=ParallelLayout(dp_size=1))
    plan = plan_sharded_step([[LENGTHS[i] for i in ids] for ids in owned], config)
    [step] = plan.scheduled_steps()
    schema = BatchSchema(fields=(FieldSpec(name="advantages", kind="sample", dtype=torch.float32),))
    mine = {local: _sample(i, {}) for local, i in enumerate(owned[dp_rank])}
    microbatches = materialize_microbatches(
        step, dp_rank, mine, schema, layout="packed", sample_multiple=1
    )
    chunks = wrap_in_ddp(
        build_tiny_gpt(tiny_transformer_config(calculate_per_token_loss=True), seed=SEED)
    )
    configure_loss(chunks, "token-mean")
    train_microbatches(
        chunks, step, microbatches, aggregation="token-mean", token_loss=_advantage_loss
    )
    return {"grads": named_global_grads(chunks), "rank": dist.get_rank()}


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("plan", "ValueError: sample 0: prompt_length=99"),
        ("sample", "'tokens' has dtype torch.int32"),
        ("materialize", "ValueError: dp_rank=1, micro-batch"),
        # Checked in train_microbatches, after the step's agreement: rank 1 raised alone while
        # rank 0 waited in the schedule until the process-group timeout (a probe of the host API).
        ("schedule", "1 micro-batches for a step planned with num_microbatches=2"),
        # Probes of the Python API: a bare IndexError in the embedding of one stage, and a bare
        # AttributeError, each on rank 1 alone.
        ("vocab", "tokens holds id 100000 (sample "),
        ("whole plan", "step is a Plan, not one step of a plan; pass plan.steps[s]"),
        ("one module", "model_chunks is one DistributedDataParallel; pass this rank's model"),
    ],
)
def test_one_broken_rank_stops_every_rank_with_the_same_error(fault, reason):
    results = run_on_ranks(2, _step_body, fault, layout=Layout())
    assert {r.get("type") for r in results} == {"StepAgreementError"}, results
    messages = {r["error"] for r in results}
    assert len(messages) == 1, messages
    [message] = messages
    where = "(step 0)" if fault in ("plan", "sample", "materialize") else "(training step)"
    assert "1 of 2 rank(s) failed: rank 1: " in message and where in message, message
    assert reason in message, message
    seconds = [r["s"] for r in results]
    print(f"{fault}: every rank failed after {max(seconds):.3f} s")
    assert max(seconds) < FAIL_WITHIN_S


def test_a_rank_killed_inside_the_pipeline_schedule_fails_the_run_fast():
    """pp = 2: rank 1 (last stage) dies at its second loss while rank 0 waits in 1F1B p2p."""
    run_on_ranks(2, _step_body, layout=Layout(pp=2))  # warm: time the failure, not the start
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_on_ranks(2, _step_body, kill_rank=1, layout=Layout(pp=2))
    seconds = time.monotonic() - started
    error = caught.value
    print(f"pp=2, rank 1 killed in the schedule: run failed after {seconds:.2f} s")
    assert seconds < FAIL_WITHIN_S
    assert error.exit_codes == {1: -signal.SIGKILL}
    assert "rank 1 died (exit code -9, SIGKILL)" in str(error)
    # The survivor's pending receive fails when gloo sees the closed connection.
    assert error.errors[0][0] == "RuntimeError" and "Connection" in error.errors[0][1], error


@pytest.mark.parametrize(
    "layout, fault, fault_rank, where",
    [
        (Layout(pp=2), "loss raises", 1, "micro-batch 1, loss: ValueError: the caller's token"),
        (Layout(pp=2), "backward raises", 1, "a backward step: RuntimeError: a backward of"),
        (Layout(pp=2), "forward raises", 0, "micro-batch 1, forward: IndexError: the model's"),
        (Layout(), "loss raises", 0, "micro-batch 1, loss: ValueError: the caller's token"),
        (Layout(pp=2, vpp=2), "loss raises", 1, "loss: ValueError: the caller's token loss"),
        (Layout(pp=2, vpp=2), "forward raises", 0, "forward: IndexError: the model's forward"),
        # Probes: a micro-batch that fails again when the stand-in reads its rows escaped the
        # containment on either stage (its peer hung), and so did a KeyboardInterrupt.
        (Layout(pp=2), "lazy micro-batch", 0, "micro-batch 1, forward: OSError: micro-batch 1"),
        (Layout(pp=2), "lazy micro-batch", 1, "micro-batch 1, forward: OSError: micro-batch 1"),
        (Layout(pp=2), "loss interrupted", 1, "loss: KeyboardInterrupt: a cancelled task"),
    ],
    ids=[
        "1f1b-loss",
        "1f1b-backward",
        "1f1b-forward",
        "dp2-loss",
        "vpp-loss",
        "vpp-forward",
        "1f1b-lazy-first-stage",
        "1f1b-lazy-last-stage",
        "1f1b-interrupt",
    ],
)
def test_an_error_inside_the_schedule_on_a_living_rank_stops_every_rank_with_it(
    layout, fault, fault_rank, where
):
    """The failing process lives on (the worker pool's, as a Ray actor's would): its peers
    waited in their p2p (pipeline) or gradient all-reduce (data parallel) until the process-group
    timeout. Now its schedule ends on stand-ins and every rank raises the same error."""
    results = run_on_ranks(
        2, _step_body, fault, fault_rank=fault_rank, vpp=layout.vpp, layout=layout
    )
    if fault == "loss interrupted":
        # The interrupted rank gets its own interrupt back, after its peers were told.
        interrupted = results.pop(fault_rank)
        assert interrupted["type"] == "KeyboardInterrupt", interrupted
        assert max(r["s"] for r in [*results, interrupted]) < FAIL_WITHIN_S
    assert {r.get("type") for r in results} == {"StepAgreementError"}, results
    messages = {r["error"] for r in results}
    assert len(messages) == 1, messages
    [message] = messages
    assert f"1 of 2 rank(s) failed: rank {fault_rank}: " in message, message
    assert where in message and "inside Megatron's schedule" in message, message
    assert message.endswith(
        "do not step the optimizer (zero the gradient buffers before the next step)"
    )
    assert max(r["s"] for r in results) < FAIL_WITHIN_S
    # The same workers train the next step as if nothing had happened.
    for result in run_on_ranks(2, _step_body, vpp=layout.vpp, layout=layout):
        _assert_finite(result["grads"])


def test_an_error_in_a_forward_only_pass_on_a_living_rank_stops_every_rank_with_it():
    """pp = 2, forward-only (log-probs): the first stage's forward fails at its second
    micro-batch while the last stage waits for its activation."""
    results = run_on_ranks(
        2, _step_body, "forward raises", fault_rank=0, forward_only=True, layout=Layout(pp=2)
    )
    messages = {r.get("error") for r in results}
    assert len(messages) == 1 and None not in messages, results
    [message] = messages
    assert "(forward-only pass) inside Megatron's schedule" in message, message
    assert "rank 0: micro-batch 1, forward: IndexError: the model's forward" in message, message
    assert message.endswith("; no output of this pass is returned"), message
    assert max(r["s"] for r in results) < FAIL_WITHIN_S


def _assert_finite(grads):
    bad = [name for name, g in grads.items() if not bool(torch.isfinite(g).all())]
    assert not bad, f"non-finite gradients in {len(bad)}/{len(grads)} parameters: {bad[:3]}"


def test_nan_advantage_on_a_fully_masked_sample_leaves_gradients_finite_and_unchanged():
    poisoned = run_on_ranks(2, _step_body, advantages={FULLY_MASKED: math.nan}, layout=Layout())
    clean = run_on_ranks(2, _step_body, layout=Layout())
    for rank, (got, want) in enumerate(zip(poisoned, clean, strict=True)):
        _assert_finite(got["grads"])
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in got["grads"].items():
            assert torch.equal(grad, want["grads"][name]), (rank, name)


def test_nan_advantage_on_a_loss_bearing_sample_is_an_error_on_every_rank():
    results = run_on_ranks(2, _step_body, advantages={2: math.inf}, layout=Layout())
    messages = {r.get("error") for r in results}
    assert len(messages) == 1, results
    [message] = messages
    assert "sample 2: field 'advantages' = inf is NaN or Inf" in message, message


def test_a_plan_for_more_data_parallel_ranks_than_run_is_refused_on_every_rank():
    # An integrator's probe: planned at dp 4 and run at dp 2, the step trained ranks 0 and 1's
    # samples only (74 of 136 tokens) and said nothing.
    results = run_on_ranks(2, _step_body, None, None, None, 4, layout=Layout())
    messages = {r.get("error") for r in results}
    assert len(messages) == 1 and {r.get("type") for r in results} == {"StepAgreementError"}
    [message] = messages
    assert "2 of 2 rank(s) failed" in message, message
    for rank in (0, 1):
        said = f"rank {rank}: megatron_dynbatch.errors.DynBatchValueError: the step was planned"
        assert f"{said} for 4 data-parallel" in message, message
    assert "ParallelLayout(dp_size=2)" in message, message


def test_a_sharded_plans_step_trains_through_train_microbatches_as_the_global_plan():
    """A probe of the host API: a step of plan_sharded_step was refused by the runner ("tokens
    have shape (1, 60) but the schedule was given micro_batch_size=4, seq_length=None"). Now it
    trains, and the gradients are the global plan's on the same samples (the loss is exact)."""
    sharded = run_on_ranks(2, _sharded_body, layout=Layout())
    whole = run_on_ranks(2, _step_body, layout=Layout())
    for got, want in zip(sharded, whole, strict=True):
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in got["grads"].items():
            scale = float(want["grads"][name].abs().max()) or 1.0
            error = float((grad - want["grads"][name]).abs().max()) / scale
            assert error < 1e-5, (got["rank"], name, error)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_plan_of_variable_rows_trains_through_train_microbatches_exactly(pp):
    """A probe: a plan of ``variable_row_lengths=True`` materialized rows of their own lengths,
    then ``train_microbatches`` refused them ("materialize them from one StepPlan", which they
    were). They run where no stage receives a fixed shape (one stage, or the model's
    ``variable_seq_lengths``), with the gradients of the uniform-row plan."""
    variable = run_on_ranks(
        2, _step_body, None, None, None, None, "exchanged", layout=Layout(pp=pp)
    )
    uniform = run_on_ranks(2, _step_body, layout=Layout(pp=pp))
    assert any(len({s for _, s in r["rows"]}) > 1 for r in variable), variable[0]["rows"]
    for got, want in zip(variable, uniform, strict=True):
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in got["grads"].items():
            scale = float(want["grads"][name].abs().max()) or 1.0
            assert float((grad - want["grads"][name]).abs().max()) / scale < 1e-5, name


def test_variable_rows_on_fixed_pipeline_shapes_are_refused_on_every_rank_naming_the_fix():
    results = run_on_ranks(2, _step_body, None, None, None, None, "fixed", layout=Layout(pp=2))
    messages = {r.get("error") for r in results}
    assert len(messages) == 1 and {r.get("type") for r in results} == {"StepAgreementError"}
    [message] = messages
    assert "variable_seq_lengths=True" in message and "variable_row_lengths=False" in message


def test_an_error_inside_the_schedule_leaves_the_routers_expert_bias_as_it_was():
    """A probe: Megatron updated the expert bias at the failed step's end, from its stand-ins'
    token counts, and the next clean step trained on it."""
    results = run_on_ranks(2, _step_body, "loss raises", moe="expert bias", layout=Layout())
    assert {r.get("type") for r in results} == {"StepAgreementError"}, results
    assert all(r["biases kept"] for r in results), results


def test_an_error_inside_the_schedule_leaves_megatrons_moe_metrics_as_they_were():
    """A probe: the failed step's load-balancing and z-losses stayed in Megatron's MoE metrics
    tracker, and the next logged step reported them with its own."""
    failed = run_on_ranks(2, _step_body, "loss raises", moe="aux loss", layout=Layout(pp=2))
    assert {r.get("type") for r in failed} == {"StepAgreementError"}, failed
    # The failing step did add to the tracker on some rank (else the check could not fail).
    assert any(r["metrics kept"] for r in failed), failed
    assert all(all(r["metrics kept"].values()) for r in failed), failed


def _containable_body(moe):
    from megatron.core import parallel_state

    from megatron_dynbatch.mcore.contained import _containable
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    config = tiny_transformer_config(
        num_moe_experts=4,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )
    config.moe_router_load_balancing_type = moe
    config.moe_aux_loss_coeff = 0.01
    return _containable(
        wrap_in_ddp(build_tiny_gpt(config, seed=SEED)), forward_only=False, dp_size=2
    )


def _stage_without_experts_body():
    """A stage of a model whose config asks for global_aux_loss but whose own layers are dense
    (``moe_layer_freq`` putting the experts on later stages)."""
    from megatron_dynbatch.mcore.contained import _containable
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    chunks = wrap_in_ddp(build_tiny_gpt(tiny_transformer_config(), seed=SEED))
    config = chunks[0].module.config
    config.num_moe_experts = 4
    config.moe_router_load_balancing_type = ["global_aux_loss"]
    return _containable(chunks, forward_only=False, dp_size=2)


def test_a_stage_without_routers_decides_as_the_stages_with_them():
    """A probe: with the first layers dense, the first stage (no router) ran contained and
    waited in the agreement while the MoE stage ran uncontained: a clean step hung. Decided
    from the config, which every stage shares."""
    assert run_on_ranks(2, _stage_without_experts_body, layout=Layout()) == [False] * 2


def test_a_router_that_reduces_over_data_parallel_ranks_in_its_forward_runs_uncontained():
    """A probe: with global_aux_loss the failing rank's stand-ins skipped the forward's
    data-parallel all-reduce, and both ranks hung."""
    assert run_on_ranks(2, _containable_body, "global_aux_loss", layout=Layout()) == [False] * 2
    assert run_on_ranks(2, _containable_body, "aux_loss", layout=Layout()) == [True] * 2
