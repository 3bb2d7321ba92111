"""NeMo-RL's DP shards built from :mod:`.plan`, and what its workers do with their placeholders.

The patched ``Policy._shard_for_train`` / ``_shard_for_logprob`` call :func:`shard_for_train` /
:func:`shard_for_logprob` instead of ``BatchedDataDict.shard_by_batch_size`` when
``policy.megatron_cfg.dynbatch.enabled`` is on. Each shard is a ``BatchedDataDict`` of the batch's
own type with NeMo-RL's packing attributes (``micro_batch_indices``, ``micro_batch_lengths``,
``elem_counts_per_gb``), so the worker's stock ``get_microbatch_iterator`` runs it, and the
placeholder marker: the key ``dynbatch_sample_index``
(:data:`~megatron_dynbatch.runtime.placeholders.MARKER_KEY`), every row's sample index, the marker
:data:`~megatron_dynbatch.runtime.placeholders.PLACEHOLDER_INDEX` on placeholder rows.

A placeholder row is a shape, not data: every key of the batch with its dtype and per-row shape,
all zeros (``sample_mask``, ``token_mask``, advantages, log-probs: no loss weight, counted in
neither ``global_valid_seqs`` nor ``global_valid_toks``), except ``input_lengths``
(:data:`~megatron_dynbatch.runtime.placeholders.PLACEHOLDER_ATTENDED_TOKENS`, one token), so
NeMo-RL's packing gives it a segment. The worker drops placeholder rows from its outputs
(:func:`drop_placeholder_rows`) and counts only real rows (:func:`num_real_rows`), both by the
marker (:func:`placeholder_rows`), never by the rows' content; the driver then
restores sample order with NeMo-RL's own ``reorder_data`` and the order returned here.

NeMo-RL is never imported here: batches are built with the batch's own methods.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import host_size
from megatron_dynbatch.integrations.nemo_rl.memory import (
    check_memory_budget,
    nemo_rl_max_memory_gib,
    nemo_rl_memory_limit,
)
from megatron_dynbatch.integrations.nemo_rl.plan import (
    NemoRlShards,
    dynbatch_enabled,
    nemo_rl_layout,
    nemo_rl_planner_config,
    plan_nemo_rl_shards,
)
from megatron_dynbatch.planning import ParallelLayout
from megatron_dynbatch.planning.memory import MemoryLimit
from megatron_dynbatch.runtime import placeholders, restore_order
from megatron_dynbatch.runtime.placeholders import (
    MARKER_KEY,
    PLACEHOLDER_INDEX,
    is_placeholder,
    placeholder_tensor,
)

#: The attribute holding a shard's placeholder row positions, derived from the marker by
#: :func:`placeholder_rows` (the worker's patch 0003 reads it; an attribute survives Ray's pickling).
PLACEHOLDER_ROWS = "dynbatch_placeholder_rows"

__all__ = [
    "INPUT_LENGTHS_KEY",
    "NemoRlPlanner",
    "PLACEHOLDER_ROWS",
    "chunk_iterators",
    "drop_placeholder_rows",
    "num_real_rows",
    "placeholder_rows",
    "planner",
    "restore_rows",
    "shard_for_logprob",
    "shard_for_train",
]

#: NeMo-RL's key of each sample's token count (``SequencePackingArgs.input_lengths_key``).
INPUT_LENGTHS_KEY = "input_lengths"


def _lengths(data: Any) -> List[int]:
    if INPUT_LENGTHS_KEY not in data:
        raise DynBatchValueError(
            f"the batch has no {INPUT_LENGTHS_KEY!r}; policy.megatron_cfg.dynbatch plans by "
            "each sample's token count, as NeMo-RL's sequence packing does."
        )
    value = data[INPUT_LENGTHS_KEY]
    return [int(n) for n in (value.tolist() if torch.is_tensor(value) else value)]


def _with_placeholder_row(data: Any) -> Any:
    """``data`` with one placeholder row appended (row ``data.size``)."""
    out = type(data)()
    for key, value in data.items():
        if torch.is_tensor(value):
            row = placeholder_tensor(value, rows=1)
            if key == INPUT_LENGTHS_KEY:
                # A (masked) segment in NeMo-RL's packing: the contract's attended tokens.
                row += placeholders.PLACEHOLDER_ATTENDED_TOKENS
            out[key] = torch.cat([value, row])
        elif isinstance(value, list):
            out[key] = [*value, None]
        else:
            raise DynBatchValueError(
                f"key {key!r} is a {type(value).__name__}; policy.megatron_cfg.dynbatch builds "
                "placeholder rows for tensors and lists only (no multimodal PackedTensor); set "
                "policy.megatron_cfg.dynbatch.enabled=false for this batch."
            )
    return out


def _shards(data: Any, plan: NemoRlShards) -> List[Any]:
    source = _with_placeholder_row(data)
    placeholder = data.size
    shards = []
    for rank, rows in enumerate(plan.rows):
        shard = source.select_indices([placeholder if i is None else i for i in rows])
        shard.micro_batch_indices = [
            [list(span) for span in gb] for gb in plan.micro_batch_indices[rank]
        ]
        shard.micro_batch_lengths = [list(gb) for gb in plan.micro_batch_lengths[rank]]
        shard.elem_counts_per_gb = plan.elem_counts_per_gb(rank)
        # The marker, every row's sample index, as a key: Ray's pickling and NeMo-RL's
        # micro-batch slicing keep keys (the slicing drops attributes), so the worker's MoE
        # forward still finds it in each micro-batch (patch 0005, .moe).
        marker = [PLACEHOLDER_INDEX if i is None else i for i in rows]
        shard[MARKER_KEY] = torch.tensor(marker, dtype=torch.int64)
        # Derived from the marker, for the worker's patched lines, which read it without
        # importing this package (NeMo-RL with the switch off never does).
        setattr(shard, PLACEHOLDER_ROWS, placeholder_rows(shard))
        shards.append(shard)
    return shards


def _plan(policy_cfg, data, dp_size, batch_size, forward_only, memory=None) -> NemoRlShards:
    config = nemo_rl_planner_config(
        policy_cfg, dp_size=dp_size, forward_only=forward_only, memory=memory
    )
    return plan_nemo_rl_shards(
        _lengths(data),
        config,
        batch_size=batch_size,
        pad_multiple=int(policy_cfg.get("make_sequence_length_divisible_by", 1) or 1),
        placeholder_length=placeholders.PLACEHOLDER_ATTENDED_TOKENS,
        forward_only=forward_only,
    )


def shard_for_train(
    policy_cfg: Mapping[str, Any],
    data: Any,
    dp_size: int,
    batch_size: int,
    *,
    memory: Optional[MemoryLimit] = None,
) -> List[Any]:
    """``Policy._shard_for_train`` with the switch on: one shard per DP rank, every global batch
    of ``batch_size`` samples planned over every rank under ``train_mb_tokens`` (and ``memory``,
    ``max_memory_gib``'s limit, where given)."""
    return _shards(data, _plan(policy_cfg, data, dp_size, batch_size, False, memory))


def shard_for_logprob(
    policy_cfg: Mapping[str, Any], data: Any, dp_size: int, *, memory: Optional[MemoryLimit] = None
) -> Tuple[List[Any], List[int]]:
    """``Policy._shard_for_logprob`` with the switch on: the shards and the
    ``unsorted_data_indices`` NeMo-RL's ``reorder_data`` puts the gathered outputs back with."""
    plan = _plan(policy_cfg, data, dp_size, None, True, memory)
    return _shards(data, plan), plan.sample_order()


class NemoRlPlanner:
    """What the patched ``Policy`` holds while ``policy.megatron_cfg.dynbatch.enabled`` is on:
    its two shard calls, with the memory limit built once at config time."""

    def __init__(self, memory: Optional[MemoryLimit] = None) -> None:
        self.memory = memory

    def shard_for_train(self, policy_cfg, data, dp_size, batch_size) -> List[Any]:
        return shard_for_train(policy_cfg, data, dp_size, batch_size, memory=self.memory)

    def shard_for_logprob(self, policy_cfg, data, dp_size) -> Tuple[List[Any], List[int]]:
        return shard_for_logprob(policy_cfg, data, dp_size, memory=self.memory)


def planner(
    policy_cfg: Mapping[str, Any], world_size: int, *, hf_config: Any = None
) -> Optional[NemoRlPlanner]:
    """The patched ``Policy.__init__``'s one call, before any worker starts: the whole
    ``policy.megatron_cfg.dynbatch`` section checked in NeMo-RL's key names, and the planner the
    policy shards with (``None`` while the switch is off: NeMo-RL's own batching runs).

    Args:
        policy_cfg: NeMo-RL's ``policy`` config.
        world_size: The cluster's GPUs (``cluster.world_size()``): the DP size of the memory model.
        hf_config: The model's Hugging Face config; ``None``: NeMo-RL's own
            ``get_default_hf_config(policy.model_name)``, read only with ``max_memory_gib``.

    Raises:
        DynBatchValueError: any bad value of the section, a bad budget, or a memory budget under
            which the longest sample cannot train, naming the key and the smallest that works.
    """
    if not dynbatch_enabled(policy_cfg):
        return None
    if nemo_rl_max_memory_gib(policy_cfg) is None:
        return NemoRlPlanner()
    if hf_config is None:
        from nemo_rl.utils.flops_tracker import get_default_hf_config  # NeMo-RL's own reading

        hf_config = get_default_hf_config(policy_cfg["model_name"])
    megatron_cfg = policy_cfg.get("megatron_cfg") or {}
    tp, cp = (
        host_size(megatron_cfg.get(name), f"policy.megatron_cfg.{name}")
        for name in ("tensor_model_parallel_size", "context_parallel_size")
    )
    layout = nemo_rl_layout(policy_cfg, 1)
    dp = max(1, int(world_size) // (tp * cp * layout.pp_size))
    parallel = ParallelLayout(
        dp_size=dp,
        pp_size=layout.pp_size,
        vpp_size=layout.vpp_size,
        microbatch_group_size_per_vp_stage=layout.microbatch_group_size_per_vp_stage,
        tp_size=tp,
        cp_size=cp,
    )
    memory = nemo_rl_memory_limit(policy_cfg, hf_config, parallel)
    check_memory_budget(policy_cfg, memory)
    return NemoRlPlanner(memory)


def placeholder_rows(data: Any) -> Tuple[int, ...]:
    """The positions of a shard's placeholder rows, by the marker (none without one)."""
    marker = data.get(MARKER_KEY) if hasattr(data, "get") else None
    if marker is None:
        return ()
    return tuple(p for p, i in enumerate(marker.tolist()) if is_placeholder(i))


def num_real_rows(data: Any) -> int:
    """Rows of a shard that are samples (what ``train`` counts its global batches from)."""
    return data.size - len(placeholder_rows(data))


def drop_placeholder_rows(data: Any, output: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A worker's per-row ``output`` (``[rows, ...]`` in shard order) without placeholder rows.

    Raises:
        DynBatchValueError: when ``output`` does not have one row per row of the shard.
    """
    marked = placeholder_rows(data)
    if output is None or not marked:
        return output
    if output.shape[0] != data.size:
        raise DynBatchValueError(
            f"{output.shape[0]} output rows for a shard of {data.size} rows; every row of the "
            "shard (placeholders included) must give one."
        )
    drop = set(marked)
    keep = torch.tensor([p for p in range(data.size) if p not in drop], dtype=torch.long)
    return output.index_select(0, keep.to(output.device))


def restore_rows(outputs: Sequence[torch.Tensor], plan: NemoRlShards) -> torch.Tensor:
    """Every rank's outputs (one ``[rows, ...]`` tensor per rank, placeholder rows included)
    stacked in sample order, strictly (:func:`megatron_dynbatch.runtime.restore_order`)."""
    per_sample = {}
    for rank, (rows, output) in enumerate(zip(plan.rows, outputs, strict=True)):
        if output.shape[0] != len(rows):
            raise DynBatchValueError(
                f"DP rank {rank} returned {output.shape[0]} rows, its shard has {len(rows)}."
            )
        per_sample.update({i: output[p] for p, i in enumerate(rows) if i is not None})
    return torch.stack(restore_order(per_sample, len(per_sample)))


def chunk_iterators(iterator: Iterator[Any], num_chunks: int) -> List[Iterator[Any]]:
    """One iterator per model chunk over the same micro-batches, for Megatron's interleaved
    schedule (it reads micro-batch ``k`` of chunk ``c`` from ``data_iterator[c]``).

    Each micro-batch is taken from ``iterator`` once (NeMo-RL processes it: packing, device
    copy) and served to every chunk in order.
    """
    cache: List[Any] = []

    def chunk() -> Iterator[Any]:
        k = 0
        while True:
            if k == len(cache):
                try:
                    cache.append(next(iterator))
                except StopIteration:
                    return
            yield cache[k]
            k += 1

    return [chunk() for _ in range(num_chunks)]
