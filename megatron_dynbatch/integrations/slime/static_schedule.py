"""slime's static path (without ``--use-dynamic-batch-size``), as slime builds it: fixed
``micro_batch_size`` chunks, trailing rollouts trimmed, an error when the count does not align to
``dp_size * group``, and a strided or (``--balance-data``) Karmarkar-Karp assignment of chunks to
ranks by slime's FLOPs estimate. It is the way back when our switch is off; the dynamic path is
in :mod:`.schedule`. Standard library and the pure planner only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from megatron_dynbatch.integrations.slime.config import flag
from megatron_dynbatch.integrations.slime.dp_schedule import DPSchedule, DPScheduleError
from megatron_dynbatch.integrations.slime.flops import balance_flops
from megatron_dynbatch.planning import round_up
from megatron_dynbatch.planning.karmarkar_karp import karmarkar_karp
from megatron_dynbatch.planning.spec import check_int

__all__ = ["balanced_partitions", "static_schedule"]


def balanced_partitions(weights: Sequence[Any], k: int) -> List[List[int]]:
    """Largest differencing (Karmarkar-Karp) into ``k`` parts of equal item counts, each sorted.

    The same tie-breaking as slime's ``get_seqlen_balanced_partitions(..., equal_size=True)``, so
    the static ``balance_data`` path assigns exactly the ranks slime assigns.
    """
    return [sorted(part) for part in karmarkar_karp(weights, k, equal_size=True)]


def static_schedule(
    args: Any,
    sizes: Dict[str, int],
    lengths: List[int],
    rollouts: List[List[int]],
    global_batch_size: int,
    pad_size: int,
) -> DPSchedule:
    """slime's static path: ``micro_batch_size`` chunks, trailing rollouts trimmed, strict."""
    dp = sizes["dp_size"]
    group = sizes["microbatch_group_size_per_vp_stage"] if sizes["vpp_size"] > 1 else 1
    align_to = dp * group
    micro_batch_size = check_int(
        "args.micro_batch_size",
        getattr(args, "micro_batch_size", None),
        1,
        "pass --micro-batch-size (or --use-dynamic-batch-size with --max-tokens-per-gpu).",
    )
    num_steps = len(rollouts) // global_batch_size
    if num_steps < 1:
        raise DPScheduleError(
            f"num_rollouts ({len(rollouts)}) < global_batch_size ({global_batch_size}); the "
            "static path needs at least one full step: lower --global-batch-size or use "
            "--use-dynamic-batch-size (which trains a short step)."
        )
    balance = flag(args, "balance_data")
    partitions: List[List[int]] = [[] for _ in range(dp)]
    micro_batch_indices: List[List[List[int]]] = [[] for _ in range(dp)]
    rollout_counts: List[List[int]] = [[] for _ in range(dp)]
    num_microbatches: List[int] = []
    seq_lengths: List[int] = []
    for step in range(num_steps):
        step_rollouts = rollouts[step * global_batch_size : (step + 1) * global_batch_size]
        samples = [i for members in step_rollouts for i in members]
        heads = {members[0] for members in step_rollouts}
        if len(samples) < dp:
            raise DPScheduleError(
                f"step {step}: {len(samples)} samples < dp_size {dp}; each step needs at least one "
                "sample per rank on the static path (use --use-dynamic-batch-size, which fills "
                "ranks with placeholders)."
            )
        chunks = [
            list(range(i, min(i + micro_batch_size, len(samples))))
            for i in range(0, len(samples), micro_batch_size)
        ]
        if len(chunks) % align_to:
            raise DPScheduleError(
                f"static path: num_mbs ({len(chunks)}) is not a multiple of dp_size * mb_group "
                f"({align_to}); got step_size={len(samples)}, micro_batch_size={micro_batch_size}, "
                f"dp_size={dp}, mb_group={group}. Adjust the config so step_size % (dp_size * "
                "micro_batch_size * mb_group) == 0, or use --use-dynamic-batch-size."
            )
        per_rank = len(chunks) // dp
        num_microbatches.append(per_rank)
        if balance:
            flops = balance_flops(args, [lengths[i] for i in samples])
            weights = [sum(flops[i] for i in chunk) for chunk in chunks]
            rank_chunks = balanced_partitions(weights, dp)
        else:
            rank_chunks = [list(range(r, len(chunks), dp)) for r in range(dp)]
        for r in range(dp):
            for c in rank_chunks[r]:
                start = len(partitions[r])
                members = [samples[i] for i in chunks[c]]
                partitions[r].extend(members)
                micro_batch_indices[r].append(list(range(start, start + len(members))))
                rollout_counts[r].append(sum(1 for i in members if i in heads))
        longest = max(sum(lengths[samples[i]] for i in chunk) for chunk in chunks)
        seq_lengths.append(round_up(longest, pad_size))
    return DPSchedule(
        partitions,
        micro_batch_indices,
        num_microbatches,
        [global_batch_size] * num_steps,
        seq_lengths=seq_lengths,
        rollout_counts=rollout_counts,
    )
