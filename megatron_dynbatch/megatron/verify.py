"""``megatron-dynbatch verify``: dynamic batching on real Megatron-Core against a fixed-batch reference.

It plans a step with the real planner, trains it through Megatron's schedule for the requested
layout (no pipelining, 1F1B or interleaved; DP over gloo on CPU, NCCL under torchrun on GPUs) with
a tiny GPT initialised identically on every layout, and compares with a single-process reference
that runs every sample alone in its own row with plain autograd:

* ``max_grad_rel_diff``: over parameters, the largest ``||g - g_ref|| / ||g_ref||`` (every rank's
  gradients are compared, so DP replicas that disagree fail too); ``max_grad_abs_diff`` the largest
  element-wise difference;
* ``max_logprob_abs_diff``: forward-only per-token log-probs, gathered back into sample order;
* the step loss against the reference loss.

The per-token loss is an RL-style ``cross_entropy * advantage`` with one advantage per sample, so a
declared per-sample field travels through materialization, placeholders and the pipeline.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from importlib import resources
from typing import Any, Dict, List

__all__ = ["GRAD_REL_TOL", "LOGPROB_ABS_TOL", "build_spec", "run_verify", "run_verify_cli"]

#: Pass threshold on the relative gradient difference (fp32; summation order differs by layout).
GRAD_REL_TOL = 1e-5
#: Pass threshold on log-prob differences (fp32 log-softmax over a 128-token vocabulary).
LOGPROB_ABS_TOL = 1e-5
#: Default token cap of the bundled set: small enough that it packs into several micro-batches.
DEFAULT_MAX_TOKENS_PER_GPU = 128
_SEED = 1234
_VOCAB = 128


def _bundled_samples() -> list:
    text = resources.files("megatron_dynbatch").joinpath("data/verify_samples.json").read_text()
    return json.loads(text)


def build_spec(
    *,
    dp_size: int = 1,
    pp_size: int = 1,
    vpp_size: int = 1,
    microbatch_group_size_per_vp_stage=None,
    max_tokens_per_gpu: int | None = None,
    layout: str = "packed",
    loss: str = "token-mean",
    samples: list | None = None,
) -> Dict[str, Any]:
    """Validate a verify request and return its picklable description (checked before launching)."""
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, parse_samples_json
    from megatron_dynbatch.runtime.loss import AGGREGATIONS

    if loss not in AGGREGATIONS:
        raise ValueError(f"--loss {loss!r} is not one of {AGGREGATIONS}.")
    data = _bundled_samples() if samples is None else samples
    sample_set = parse_samples_json(data)
    parallel = ParallelLayout(
        dp_size=dp_size,
        pp_size=pp_size,
        vpp_size=vpp_size,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
    )
    tiny_layers = 4
    if tiny_layers % (pp_size * vpp_size):
        raise ValueError(
            f"the verify model has {tiny_layers} layers, which do not split over pp_size={pp_size} "
            f"x vpp_size={vpp_size}; use pp*vpp in (1, 2, 4)."
        )
    config = PlannerConfig(
        max_tokens_per_gpu=max_tokens_per_gpu or DEFAULT_MAX_TOKENS_PER_GPU,
        parallel=parallel,
        layout=layout,
    )
    return {
        "lengths": list(sample_set.lengths),
        "rollouts": list(sample_set.rollout_ids),
        "prompts": list(sample_set.prompt_lengths),
        "planner": {
            "max_tokens_per_gpu": config.max_tokens_per_gpu,
            "layout": layout,
            "dp_size": dp_size,
            "pp_size": pp_size,
            "vpp_size": vpp_size,
            "microbatch_group_size_per_vp_stage": microbatch_group_size_per_vp_stage,
        },
        "loss": loss,
        "seed": _SEED,
    }


def _planner_config(spec):
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig

    p = spec["planner"]
    return PlannerConfig(
        max_tokens_per_gpu=p["max_tokens_per_gpu"],
        layout=p["layout"],
        parallel=ParallelLayout(
            dp_size=p["dp_size"],
            pp_size=p["pp_size"],
            vpp_size=p["vpp_size"],
            microbatch_group_size_per_vp_stage=p["microbatch_group_size_per_vp_stage"],
        ),
    )


def _plan(spec):
    import warnings

    from megatron_dynbatch.planning import OversizeSampleWarning, plan_schedule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)  # reported by the CLI already
        return plan_schedule(
            spec["lengths"], spec["rollouts"], spec["prompts"], config=_planner_config(spec)
        )


def _sample(spec, index: int) -> dict:
    """Deterministic tokens and advantage of one sample (every rank can build any sample)."""
    import torch

    generator = torch.Generator().manual_seed(spec["seed"] * 100_003 + index)
    length = spec["lengths"][index]
    return {
        "tokens": torch.randint(0, _VOCAB, (length,), generator=generator),
        "prompt_length": spec["prompts"][index],
        "advantages": torch.randn((), generator=generator),
    }


def _schema():
    import torch

    from megatron_dynbatch.runtime import BatchSchema, FieldSpec

    return BatchSchema(fields=(FieldSpec(name="advantages", kind="sample", dtype=torch.float32),))


def _advantage_loss(batch, per_token_ce):
    return per_token_ce * batch["advantages"]


def _max_sequence_length(spec) -> int:
    return max(256, max(spec["lengths"]))


def dynamic_body(spec) -> Dict[str, Any]:
    """On every rank of the layout: plan, check agreement, train one step, forward-only pass."""
    import torch
    from megatron.core import parallel_state

    from megatron_dynbatch.megatron.step import (
        check_plan_agreement,
        configure_loss,
        forward_only_outputs,
        gather_in_order,
        train_microbatches,
    )
    from megatron_dynbatch.megatron.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        tiny_transformer_config,
        wrap_in_ddp,
    )
    from megatron_dynbatch.runtime import materialize_microbatches

    plan = _plan(spec)
    check_plan_agreement(plan)
    [step] = plan.steps
    dp_rank = parallel_state.get_data_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    mine = {i: _sample(spec, i) for mb in step.rank_microbatches(dp_rank) for i in mb}
    microbatches = materialize_microbatches(
        step,
        dp_rank,
        mine,
        _schema(),
        layout=plan.layout,
        sample_multiple=plan.sample_multiple,
        device=device,
    )
    config = tiny_transformer_config(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        calculate_per_token_loss=True,
    )
    chunks = build_tiny_gpt(
        config, max_sequence_length=_max_sequence_length(spec), seed=spec["seed"]
    )
    if device is not None:
        chunks = [chunk.to(device) for chunk in chunks]
    chunks = wrap_in_ddp(chunks)
    configure_loss(chunks, spec["loss"])
    started = time.perf_counter()
    logs = train_microbatches(
        chunks, step, microbatches, aggregation=spec["loss"], token_loss=_advantage_loss
    )
    train_seconds = time.perf_counter() - started
    grads = {name: g.detach().cpu() for name, g in named_global_grads(chunks).items()}
    log_sums = [float(sum(float(entry["loss"][k]) for entry in logs)) for k in (0, 1)]
    logprobs = gather_in_order(
        forward_only_outputs(chunks, step, microbatches), list(range(len(spec["lengths"])))
    )
    return {
        "grads": grads,
        "log_sums": log_sums if logs else None,
        "logprobs": logprobs if torch.distributed.get_rank() == 0 else None,
        "train_seconds": train_seconds,
        "num_placeholders": plan.stats.num_placeholders,
        "num_microbatches": step.num_microbatches,
        "seq_length": step.seq_length,
        "micro_batch_size": step.micro_batch_size,
        "fingerprint": plan.fingerprint(),
    }


def reference_body(spec) -> Dict[str, Any] | None:
    """On rank 0 only: every sample alone in a row, one process, plain autograd."""
    import torch

    from megatron_dynbatch.megatron.forward import build_attention_mask
    from megatron_dynbatch.megatron.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        tiny_transformer_config,
    )
    from megatron_dynbatch.runtime import reference_loss

    if torch.distributed.get_rank() != 0:
        return None
    [model] = build_tiny_gpt(
        tiny_transformer_config(), max_sequence_length=_max_sequence_length(spec), seed=spec["seed"]
    )
    losses, masks, logprobs = [], [], []
    for index, length in enumerate(spec["lengths"]):
        sample = _sample(spec, index)
        tokens = sample["tokens"].unsqueeze(0)
        # Next-token targets of this sample only; the last token has none.
        labels = torch.zeros_like(tokens)
        labels[0, :-1] = tokens[0, 1:]
        target_mask = torch.zeros(length)
        target_mask[: length - 1] = (torch.arange(1, length) >= sample["prompt_length"]).float()
        positions = torch.arange(length).unsqueeze(0)
        mask = build_attention_mask(torch.zeros_like(tokens))
        ce = model(tokens, positions, mask, labels=labels)[0]
        losses.append(ce * sample["advantages"])
        masks.append(target_mask)
        logprobs.append((-ce).detach())
    loss = reference_loss(spec["loss"], losses, masks)
    loss.backward()
    return {
        "grads": {name: g.detach().clone() for name, g in named_global_grads([model]).items()},
        "loss": float(loss.detach()),
        "logprobs": logprobs,
    }


def compare(spec, dynamic: List[Dict[str, Any]], reference: Dict[str, Any]) -> Dict[str, Any]:
    """Reduce the per-rank results and the reference to the verify report."""
    import torch

    from megatron_dynbatch.runtime import finalize_loss

    ref_grads = reference["grads"]
    seen = set()
    max_rel, max_abs = 0.0, 0.0
    for result in dynamic:
        for name, grad in result["grads"].items():
            if name not in ref_grads:
                raise AssertionError(f"parameter {name} has no reference gradient")
            seen.add(name)
            ref = ref_grads[name]
            diff = (grad - ref).abs()
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float((grad - ref).norm() / ref.norm().clamp_min(1e-30)))
    missing = sorted(set(ref_grads) - seen)
    if missing:
        raise AssertionError(f"no rank returned gradients for {missing}")
    lengths = spec["lengths"]
    [logprobs] = [r["logprobs"] for r in dynamic if r["logprobs"] is not None]
    if len(logprobs) != len(lengths):
        raise AssertionError(f"{len(logprobs)} log-prob tensors for {len(lengths)} samples")
    max_lp = 0.0
    for index, (got, want) in enumerate(zip(logprobs, reference["logprobs"], strict=True)):
        if got.shape != want.shape:
            raise AssertionError(
                f"sample {index}: log-probs {tuple(got.shape)} vs {tuple(want.shape)}"
            )
        if lengths[index] > 1:  # the last position has no target
            max_lp = max(max_lp, float((got[:-1] - want[:-1]).abs().max()))
    numerator = sum(r["log_sums"][0] for r in dynamic if r["log_sums"] is not None)
    denominator = sum(r["log_sums"][1] for r in dynamic if r["log_sums"] is not None)
    # Every DP rank's last stage logs its own share; pipeline stages other than the last log none.
    loss = float(finalize_loss(spec["loss"], torch.tensor(numerator), torch.tensor(denominator)))
    passed = (
        max_rel <= GRAD_REL_TOL
        and max_lp <= LOGPROB_ABS_TOL
        and math.isclose(loss, reference["loss"], rel_tol=1e-5, abs_tol=1e-6)
        and len({r["fingerprint"] for r in dynamic}) == 1
    )
    first = dynamic[0]
    p = spec["planner"]
    return {
        "passed": passed,
        "max_grad_rel_diff": max_rel,
        "max_grad_abs_diff": max_abs,
        "max_logprob_abs_diff": max_lp,
        "loss": loss,
        "reference_loss": reference["loss"],
        "num_placeholders": first["num_placeholders"],
        "num_microbatches": first["num_microbatches"],
        "seq_length": first["seq_length"],
        "micro_batch_size": first["micro_batch_size"],
        "num_samples": len(lengths),
        "dp_size": p["dp_size"],
        "pp_size": p["pp_size"],
        "vpp_size": p["vpp_size"],
        "layout": p["layout"],
        "loss_mode": spec["loss"],
        "max_tokens_per_gpu": p["max_tokens_per_gpu"],
        "train_seconds_max_rank": max(r["train_seconds"] for r in dynamic),
    }


def run_verify(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Launch ``dp*pp`` gloo worker processes (reused across calls) and run the check."""
    from megatron_dynbatch.megatron.cpu_shim import apply_cpu_shim
    from megatron_dynbatch.megatron.workers import Layout, run_on_ranks

    # Results unpickled here may reference megatron modules, which import only with the shim on CPU.
    apply_cpu_shim()
    p = spec["planner"]
    world = p["dp_size"] * p["pp_size"]
    layout = Layout(pp=p["pp_size"], vpp=p["vpp_size"] if p["vpp_size"] > 1 else None)
    started = time.perf_counter()
    dynamic = run_on_ranks(world, dynamic_body, spec, layout=layout)
    [reference, *_] = run_on_ranks(world, reference_body, spec, layout=Layout())
    report = compare(spec, dynamic, reference)
    report["elapsed_s"] = time.perf_counter() - started
    return report


def _run_under_torchrun(spec) -> Dict[str, Any] | None:
    """Inside an existing torchrun world (NCCL on GPUs): run in-process; rank 0 returns the report."""
    import torch
    import torch.distributed as dist

    from megatron_dynbatch.megatron.cpu_shim import apply_cpu_shim

    apply_cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    p = spec["planner"]
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() != p["dp_size"] * p["pp_size"]:
        raise ValueError(
            f"torchrun started {dist.get_world_size()} processes but --dp-size {p['dp_size']} x "
            f"--pp-size {p['pp_size']} = {p['dp_size'] * p['pp_size']}; make them equal."
        )
    started = time.perf_counter()
    results = []
    for body, pp, vpp in ((dynamic_body, p["pp_size"], p["vpp_size"]), (reference_body, 1, 1)):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        )
        model_parallel_cuda_manual_seed(_SEED)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, body(spec))
        results.append(gathered)
    if dist.get_rank() != 0:
        return None
    report = compare(spec, results[0], results[1][0])
    report["elapsed_s"] = time.perf_counter() - started
    return report


def _format(report: Dict[str, Any]) -> str:
    verdict = "PASS" if report["passed"] else "FAIL"
    return (
        f"{verdict}: dp={report['dp_size']} pp={report['pp_size']} vpp={report['vpp_size']} "
        f"layout={report['layout']} loss={report['loss_mode']}\n"
        f"  samples={report['num_samples']} micro-batches/rank={report['num_microbatches']} "
        f"[{report['micro_batch_size']}x{report['seq_length']}] placeholders="
        f"{report['num_placeholders']}\n"
        f"  max grad rel diff   {report['max_grad_rel_diff']:.3e} (tol {GRAD_REL_TOL:g})\n"
        f"  max grad abs diff   {report['max_grad_abs_diff']:.3e}\n"
        f"  max logprob diff    {report['max_logprob_abs_diff']:.3e} (tol {LOGPROB_ABS_TOL:g})\n"
        f"  loss {report['loss']:.8f} vs reference {report['reference_loss']:.8f}\n"
        f"  wall {report['elapsed_s']:.1f} s"
    )


def run_verify_cli(args, samples=None) -> int:
    """Entry point of ``megatron-dynbatch verify``: exit 0 on PASS, 1 on FAIL.

    ``samples`` is the decoded SAMPLES.json array (``None``: the bundled set).
    """
    spec = build_spec(
        dp_size=args.dp_size,
        pp_size=args.pp_size,
        vpp_size=args.vpp_size,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        layout=args.layout,
        loss=args.loss,
        samples=samples,
    )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        report = _run_under_torchrun(spec)
        if report is None:
            return 0
    else:
        report = run_verify(spec)
    print(json.dumps(report) if args.json else _format(report))
    sys.stdout.flush()
    return 0 if report["passed"] else 1
