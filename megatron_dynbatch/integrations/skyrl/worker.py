"""What SkyRL's patched Megatron worker calls when ``trainer.use_dynamic_batch_size`` is on.

``patches/skyrl/`` changes a few lines of ``megatron_worker.py`` (see its README for the pinned
commit); the work is in :mod:`.iterator` and :mod:`.plan`. The worker's ``forward_backward``
(training) and ``_forward_logprobs`` (log-prob, ref and value passes) ask :func:`microbatch_iterator`
for their micro-batches instead of SkyRL's ``get_microbatch_iterator``; the rest of SkyRL's code
path (its model wrapper, loss functions, metrics and reordering) runs as stock.
"""

from __future__ import annotations

from typing import Any

from megatron_dynbatch.integrations.skyrl.iterator import (
    PlannedBatchIterator,
    planned_microbatch_iterator,
)
from megatron_dynbatch.planning.spec import layout_flags

__all__ = ["microbatch_iterator"]


def _interleaving_group(worker: Any) -> Any:
    # Megatron keeps the interleaving group on the model's TransformerConfig, not in parallel_state.
    chunks = getattr(worker, "actor_module", None) or []
    config = getattr(chunks[0], "config", None) if chunks else None
    return getattr(config, "microbatch_group_size_per_vp_stage", None)


def microbatch_iterator(
    worker: Any, data: Any, *, what: str = "SkyRL mini-batch"
) -> PlannedBatchIterator:
    """This DP rank's planned micro-batches of ``data`` (its shard of the mini-batch).

    Reads the budget from ``worker.cfg.max_tokens_per_microbatch`` (the planner and the
    per-micro-batch overhead from the keys beside it) and the layout from Megatron's
    ``parallel_state``; the number of model chunks (``len(worker.actor_module)``) is the virtual
    pipeline size. Every DP rank of the worker group must call it for the same mini-batch.

    Raises:
        StepAgreementError: on every DP rank when any rank failed to plan (naming the rank and why,
            e.g. ``max_tokens_per_microbatch`` not set).
    """
    chunks = getattr(worker, "actor_module", None) or [None]
    vpp = len(chunks)
    with layout_flags("SkyRL"):
        return _planned(worker, data, vpp, what)


def _planned(worker: Any, data: Any, vpp: int, what: str) -> PlannedBatchIterator:
    import megatron.core.parallel_state as mpu

    return planned_microbatch_iterator(
        data,
        worker.cfg.max_tokens_per_microbatch,
        dp_group=mpu.get_data_parallel_group(with_context_parallel=False),
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        vpp_size=vpp,
        microbatch_group_size_per_vp_stage=_interleaving_group(worker) if vpp > 1 else None,
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        cp_size=mpu.get_context_parallel_world_size(),
        # trainer.dynamic_batch_planner: the planner registered by this name (default ours).
        planner=getattr(worker.cfg, "dynamic_batch_planner", None),
        # trainer.dynamic_batch_cost_microbatch_overhead: one micro-batch's fixed cost in tokens of
        # linear work, where the user tells it (None: the planner assumes one).
        microbatch_overhead=getattr(worker.cfg, "dynamic_batch_cost_microbatch_overhead", None),
        what=what,
    )
