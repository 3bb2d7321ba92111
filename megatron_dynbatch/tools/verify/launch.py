"""Where verify's ranks run: a reusable gloo worker pool (CPU), or an existing torchrun world."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.mcore.agreement import StepAgreementError
from megatron_dynbatch.tools.verify.bodies import dynamic_body, reference_body
from megatron_dynbatch.tools.verify.compare import compare
from megatron_dynbatch.tools.verify.spec import VerifySpec

__all__ = ["check_torchrun_world_size", "run_verify", "run_under_torchrun", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (torch.distributed.run) world."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ


def check_torchrun_world_size(spec: VerifySpec) -> None:
    """Refuse a torchrun world of another size than the layout asks (before any collective)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != spec.world_size:
        parallel = spec.config.parallel
        raise DynBatchValueError(
            f"torchrun started {world_size} processes but --dp-size {parallel.dp_size} x "
            f"--pp-size {parallel.pp_size} x --tp-size {parallel.tp_size} = {spec.world_size}; "
            "make them equal."
        )


def run_verify(spec: VerifySpec) -> Dict[str, Any]:
    """Launch ``dp*pp*tp`` gloo worker processes (reused across calls) and run the check."""
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim
    from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks

    # Results unpickled here may reference megatron modules, which import only with the shim on CPU.
    apply_cpu_shim()
    parallel = spec.config.parallel
    layout = Layout(
        tp=parallel.tp_size,
        pp=parallel.pp_size,
        vpp=parallel.vpp_size if parallel.vpp_size > 1 else None,
        ep=1 if spec.moe is None else spec.moe.ep_size,
    )
    started = time.perf_counter()
    dynamic = run_on_ranks(spec.world_size, dynamic_body, spec, layout=layout)
    [reference, *_] = run_on_ranks(spec.world_size, reference_body, spec, layout=Layout())
    report = compare(spec, dynamic, reference)
    report["elapsed_s"] = time.perf_counter() - started
    return report


def run_under_torchrun(spec: VerifySpec) -> Optional[Dict[str, Any]]:
    """Inside a torchrun world (NCCL on GPUs): run in-process; rank 0 returns the report."""
    import torch
    import torch.distributed as dist

    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel = spec.config.parallel
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # check_torchrun_world_size read WORLD_SIZE; the initialised world must agree with it.
    assert dist.get_world_size() == spec.world_size, (dist.get_world_size(), spec.world_size)

    def close() -> None:
        """Megatron's groups, then the world if this call initialised it (while every rank is
        alive: left to interpreter exit, gloo's threads can abort a rank that has finished,
        "terminate called without an active exception")."""
        parallel_state.destroy_model_parallel()
        if ours:
            dist.barrier()
            dist.destroy_process_group()

    started = time.perf_counter()
    results = []
    ep_size = 1 if spec.moe is None else spec.moe.ep_size
    layouts = (
        (dynamic_body, parallel.tp_size, parallel.pp_size, parallel.vpp_size, ep_size),
        (reference_body, 1, 1, 1, 1),
    )
    try:
        for body, tp, pp, vpp, ep in layouts:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                expert_model_parallel_size=ep,
            )
            model_parallel_cuda_manual_seed(spec.seed)
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, body(spec))
            results.append(gathered)
    except StepAgreementError:
        # Raised on every rank together (the agreement is a collective over the world): every
        # rank is alive, so the groups close as after a pass, and the failure reaches the CLI.
        close()
        raise
    rank = dist.get_rank()
    close()
    if rank != 0:
        return None
    report = compare(spec, results[0], results[1][0])
    report["elapsed_s"] = time.perf_counter() - started
    return report
