"""NeMo-RL's DP shards of one batch from one global plan: which sample goes to which rank and
micro-batch, from lengths alone.

NeMo-RL's driver (``Policy`` in ``nemo_rl/models/policy/lm_policy.py``) holds every sample of a
``train`` / ``get_logprobs`` call and shards it over the DP ranks before any worker runs
(``BatchedDataDict.shard_by_batch_size``), so samples may go to any rank: each global batch
(``train_global_batch_size`` samples; the whole batch for log-probs) is planned over every DP rank
at once by :func:`megatron_dynbatch.planning.plan_schedule`. The result is what NeMo-RL's own
sequence packing hands its workers, so its worker runtime (``get_microbatch_iterator`` ->
``make_microbatch_iterator_for_packable_sequences`` -> THD packing -> ``megatron_forward_backward``)
runs our micro-batches unchanged: per rank its rows in run order, ``micro_batch_indices`` (row
ranges of each micro-batch, per global batch), ``micro_batch_lengths`` (each micro-batch's padded
tokens) and ``elem_counts_per_gb`` (rows per global batch).

What changes against NeMo-RL's packer: one plan over the DP ranks balances the ranks' work (the
packer deals its bins round-robin), every rank runs the same number of micro-batches, a multiple
of the interleaved schedule's group (the packer aligns the total to ``dp`` only), and a rank with
fewer real micro-batches runs loss-masked placeholder rows (one row, ``sample_mask`` and
``token_mask`` 0) as whole micro-batches. Placeholder rows are marked ``None`` in
:attr:`NemoRlShards.rows`.

The budget keeps NeMo-RL's meaning of ``policy.sequence_packing.train_mb_tokens`` /
``logprob_mb_tokens``: the tokens of one packed micro-batch, each sample padded to
``policy.make_sequence_length_divisible_by`` (what ``_pack_sequences_for_megatron`` pads it to), a
hard cap; a sample longer than it is refused, naming the key to raise.

Standard library and :mod:`megatron_dynbatch.planning` / :mod:`megatron_dynbatch.config` only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import (
    NEMO_RL,
    check_host_budget,
    check_host_planner,
    check_overhead,
    host_config,
    host_size,
)
from megatron_dynbatch.integrations.moe_args import refuse_quantile_balancing
from megatron_dynbatch.planning import (
    ParallelLayout,
    PlannerConfig,
    SampleSet,
    round_up,
    run_planner,
)
from megatron_dynbatch.planning.memory import MemoryLimit

__all__ = [
    "NemoRlShards",
    "SECTION_KEYS",
    "dynbatch_enabled",
    "nemo_rl_layout",
    "nemo_rl_planner_config",
    "plan_nemo_rl_shards",
]

_SWITCH = "policy.megatron_cfg.dynbatch.enabled"
#: The keys of ``policy.megatron_cfg.dynbatch`` (a typo is refused, not ignored).
SECTION_KEYS = ("enabled", "planner", "max_memory_gib", "cost_microbatch_overhead")
_PLANNER = NEMO_RL.keys["planner"]
_OVERHEAD = NEMO_RL.keys["cost_microbatch_overhead"]


def _overhead(section: Mapping[str, Any]) -> Optional[float]:
    """``policy.megatron_cfg.dynbatch.cost_microbatch_overhead``: one micro-batch's fixed cost in
    tokens of one GPU's linear work, or ``None`` (not given: the planner assumes one)."""
    value = section.get("cost_microbatch_overhead")
    return check_overhead(value, f"{_OVERHEAD}={value!r}", f"{_OVERHEAD}=330")


def dynbatch_enabled(policy_cfg: Mapping[str, Any]) -> bool:
    """Whether ``policy.megatron_cfg.dynbatch.enabled`` is on, after checking what it needs.

    Raises:
        DynBatchValueError: the switch is not a boolean; it is on without the Megatron backend, or
            without ``policy.sequence_packing.enabled`` (the runtime that runs our micro-batches),
            or together with ``policy.dynamic_batching.enabled`` (ours replaces it), or with a
            ``planner`` no planner is registered as, or a ``cost_microbatch_overhead`` that is
            not a finite number >= 0.
    """
    megatron_cfg = policy_cfg.get("megatron_cfg") or {}
    section = megatron_cfg.get("dynbatch") or {}  # `dynbatch:` with nothing under it: absent
    if not isinstance(section, Mapping):
        raise DynBatchValueError(
            f"policy.megatron_cfg.dynbatch={section!r} must be a mapping, e.g. "
            "{enabled: true}; or leave it out."
        )
    unknown = sorted(set(section) - set(SECTION_KEYS))
    flag = section.get("enabled", False)
    if flag is None:
        flag = False
    if not isinstance(flag, bool):
        raise DynBatchValueError(f"{_SWITCH}={flag!r} is not a boolean; set it to true or false.")
    if not flag:
        # Off runs NeMo-RL as stock, which reads nothing of the section: said, not refused (a
        # misspelt switch, `enable: true`, would otherwise pass unseen).
        if unknown:
            warnings.warn(
                f"policy.megatron_cfg.dynbatch has unknown key(s) {unknown}, ignored while "
                f"{_SWITCH} is off; valid: {list(SECTION_KEYS)}.",
                stacklevel=2,
            )
        return False
    if unknown:
        raise DynBatchValueError(
            f"policy.megatron_cfg.dynbatch has unknown key(s) {unknown}; valid: "
            f"{list(SECTION_KEYS)}."
        )
    planner = section.get("planner")
    if planner is not None:
        check_host_planner(NEMO_RL, planner, NEMO_RL.fixed["layout"])  # at start-up
    _overhead(section)  # at start-up too, not at the first train call
    refuse_quantile_balancing(
        megatron_cfg.get("moe_router_load_balancing_type"),
        "policy.megatron_cfg.moe_router_load_balancing_type",
        f"{_SWITCH}=false",
    )
    if not megatron_cfg.get("enabled", False):
        raise DynBatchValueError(
            f"{_SWITCH}=true plans the Megatron policy's micro-batches, but "
            "policy.megatron_cfg.enabled is false; enable the Megatron backend or set "
            f"{_SWITCH}=false."
        )
    packing_on = (policy_cfg.get("sequence_packing") or {}).get("enabled", False)
    if (policy_cfg.get("dynamic_batching") or {}).get("enabled", False):
        # Both fixes at once where both are needed (a probe: the second came as a second refusal).
        also = (
            ""
            if packing_on
            else " and policy.sequence_packing.enabled=true (with "
            "policy.sequence_packing.train_mb_tokens: its runtime runs our micro-batches)"
        )
        raise DynBatchValueError(
            f"{_SWITCH}=true replaces policy.dynamic_batching (which needs pipeline size 1); set "
            f"policy.dynamic_batching.enabled=false{also}."
        )
    if not packing_on:
        raise DynBatchValueError(
            f"{_SWITCH}=true runs its micro-batches through NeMo-RL's sequence packing; set "
            "policy.sequence_packing.enabled=true with policy.sequence_packing.train_mb_tokens "
            "(and logprob_mb_tokens for log-prob passes)."
        )
    packing = policy_cfg.get("sequence_packing") or {}
    multiple = host_size(
        policy_cfg.get("make_sequence_length_divisible_by"),
        "policy.make_sequence_length_divisible_by",
    )
    for key, forward_only in (("train_mb_tokens", False), ("logprob_mb_tokens", True)):
        if forward_only and packing.get(key) is None:
            continue
        budget = check_host_budget(NEMO_RL, packing.get(key), forward_only=forward_only)
        if budget < multiple:
            # Every sample pads to at least one multiple: each batch would be refused at its
            # first pass, after a rollout (a probe).
            raise DynBatchValueError(
                f"policy.sequence_packing.{key}={budget} holds no sample: NeMo-RL pads each to a "
                f"multiple of policy.make_sequence_length_divisible_by={multiple}; raise "
                f"policy.sequence_packing.{key} to at least {multiple} (a budget of several "
                "samples is usual)."
            )
    # The pipeline layout at start-up too, not at the first train or log-prob call.
    nemo_rl_layout(policy_cfg, 1)
    return True


def nemo_rl_layout(policy_cfg: Mapping[str, Any], dp_size: int) -> ParallelLayout:
    """The parallel layout of ``policy.megatron_cfg`` at ``dp_size`` DP ranks (tensor and context
    parallel sizes too: the memory model divides by them; planning pads samples itself)."""
    megatron_cfg = policy_cfg.get("megatron_cfg") or {}
    pp, vpp = (
        host_size(megatron_cfg.get(name), f"policy.megatron_cfg.{name}")
        for name in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
    )
    group = megatron_cfg.get("microbatch_group_size_per_vp_stage") if vpp > 1 else None
    with NEMO_RL.flags():
        return ParallelLayout(
            dp_size=dp_size, pp_size=pp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group
        )


def nemo_rl_planner_config(
    policy_cfg: Mapping[str, Any],
    *,
    dp_size: int,
    forward_only: bool,
    memory: Optional[MemoryLimit] = None,
) -> PlannerConfig:
    """The planner config of one NeMo-RL pass from its policy config (one table, one function).

    The parallel layout is read from ``policy.megatron_cfg``: pipeline size, virtual pipeline
    size and Megatron's interleaving group. Samples are planned at the length NeMo-RL pads them to
    (:func:`padded_lengths`), so tensor and context parallelism add nothing here. ``memory``:
    ``policy.megatron_cfg.dynbatch.max_memory_gib`` as a limit (:mod:`.memory`), or ``None``;
    ``policy.megatron_cfg.dynbatch.cost_microbatch_overhead``, where given, is the cost model's
    per-micro-batch overhead (else assumed: 2% of a full micro-batch).
    """
    packing = policy_cfg.get("sequence_packing") or {}
    megatron_cfg = policy_cfg.get("megatron_cfg") or {}
    section = megatron_cfg.get("dynbatch") or {}
    values = {
        "train_mb_tokens": packing.get("train_mb_tokens"),
        "logprob_mb_tokens": packing.get("logprob_mb_tokens"),
        "planner": section.get("planner"),
    }
    if forward_only and values["logprob_mb_tokens"] is None:
        raise DynBatchValueError(
            "a log-prob pass with policy.megatron_cfg.dynbatch.enabled=true needs "
            "policy.sequence_packing.logprob_mb_tokens; set it (e.g. to train_mb_tokens x 2)."
        )
    if forward_only:
        check_host_budget(NEMO_RL, values["logprob_mb_tokens"], forward_only=True)
    overhead = _overhead(section)
    layout = nemo_rl_layout(policy_cfg, dp_size)
    return host_config(
        NEMO_RL,
        values,
        layout,
        forward_only=forward_only,
        memory=memory,
        fixed={"cost_microbatch_overhead": overhead} if overhead is not None else None,
        # At PP 1 NeMo-RL's runtime runs each packed row at its own length (samples are planned
        # at their padded lengths already, so no further multiple); at PP > 1 it pads a rank's
        # rows to its largest pack, which one row length for the step bounds from above.
        row_multiple=1 if layout.pp_size == 1 else None,
    )


@dataclass(frozen=True, kw_only=True)
class NemoRlShards:
    """Every DP rank's rows of one NeMo-RL pass, in NeMo-RL's sharding attributes."""

    rows: Tuple[Tuple[Optional[int], ...], ...]
    """``rows[r]``: the global sample index of each row of DP rank ``r``'s shard, in run order;
    ``None`` is a placeholder row (a whole placeholder micro-batch)."""
    micro_batch_indices: Tuple[Tuple[Tuple[Tuple[int, int], ...], ...], ...]
    """``micro_batch_indices[r][g]``: ``(start, end)`` rows of each micro-batch of global batch
    ``g`` on rank ``r``, relative to the global batch (NeMo-RL's attribute of that name)."""
    micro_batch_lengths: Tuple[Tuple[Tuple[int, ...], ...], ...]
    """``micro_batch_lengths[r][g][m]``: padded tokens of that micro-batch (its packed row)."""
    num_microbatches: Tuple[int, ...]
    """Micro-batches every rank runs in global batch ``g`` (equal on every rank)."""

    def elem_counts_per_gb(self, dp_rank: int) -> List[int]:
        """Rows of each global batch on ``dp_rank`` (NeMo-RL's ``elem_counts_per_gb``)."""
        return [mbs[-1][1] for mbs in self.micro_batch_indices[dp_rank]]

    def sample_order(self) -> List[int]:
        """Global sample index of every real row, rank by rank: NeMo-RL's
        ``unsorted_data_indices`` once each rank has dropped its placeholder rows."""
        return [i for rank in self.rows for i in rank if i is not None]


def padded_lengths(lengths: Sequence[int], pad_multiple: int) -> List[int]:
    """Each sample's length as NeMo-RL's packing pads it (``make_sequence_length_divisible_by``)."""
    return [round_up(int(n), pad_multiple) for n in lengths]


def _check_lengths(lengths: Sequence[int], batch_size: int) -> None:
    if not lengths:
        raise DynBatchValueError("the batch has no sample; pass at least one.")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or int(n) != n or int(n) < 1:
            raise DynBatchValueError(
                f"sample {i} has input_lengths={n!r}; every sample needs at least one token."
            )
    if len(lengths) % batch_size:
        raise DynBatchValueError(
            f"{len(lengths)} samples are not a multiple of the global batch size {batch_size} "
            "(policy.train_global_batch_size); pass whole global batches."
        )


def _check_budget(padded: Sequence[int], config: PlannerConfig, key: str) -> None:
    # Before planning, so the message names NeMo-RL's key (the planner's names Megatron's flags).
    over = [i for i, n in enumerate(padded) if n > config.token_cap]
    if over:
        worst = max(over, key=lambda i: padded[i])
        raise DynBatchValueError(
            f"{len(over)} sample(s) over policy.sequence_packing.{key}={config.token_cap}: "
            f"sample {worst} is {padded[worst]} tokens after padding to "
            "policy.make_sequence_length_divisible_by; raise "
            f"policy.sequence_packing.{key} to at least {padded[worst]} or drop the sample."
        )


def plan_nemo_rl_shards(
    lengths: Sequence[int],
    config: PlannerConfig,
    *,
    batch_size: Optional[int] = None,
    pad_multiple: int = 1,
    placeholder_length: int = 1,
    forward_only: bool = False,
) -> NemoRlShards:
    """Plan every global batch of ``lengths`` over the DP ranks of ``config.parallel``.

    Args:
        lengths: ``input_lengths`` of every sample of the call.
        config: From :func:`nemo_rl_planner_config`.
        batch_size: Samples per global batch (``train``); ``None``: one batch (log-probs).
        pad_multiple: ``policy.make_sequence_length_divisible_by``.
        placeholder_length: ``input_lengths`` of a placeholder row.
        forward_only: Names ``logprob_mb_tokens`` (not ``train_mb_tokens``) in errors.

    Raises:
        DynBatchValueError: no sample, a sample without tokens, a sample count that is not a
            multiple of ``batch_size``, or a sample over the budget.
    """
    batch_size = batch_size or len(lengths)
    _check_lengths(lengths, batch_size)
    key = "logprob_mb_tokens" if forward_only else "train_mb_tokens"
    padded = padded_lengths(lengths, pad_multiple)
    placeholder = round_up(placeholder_length, pad_multiple)
    _check_budget(padded, config, key)
    dp = config.parallel.dp_size
    rows: List[List[Optional[int]]] = [[] for _ in range(dp)]
    indices: List[List[Tuple[Tuple[int, int], ...]]] = [[] for _ in range(dp)]
    mb_lengths: List[List[Tuple[int, ...]]] = [[] for _ in range(dp)]
    counts: List[int] = []
    for start in range(0, len(padded), batch_size):
        chunk = padded[start : start + batch_size]
        # The planner policy.megatron_cfg.dynbatch.planner names (``dynbatch`` by default).
        [step] = run_planner(SampleSet.build(chunk), config).steps
        counts.append(step.num_microbatches)
        for r, microbatches in enumerate(step.ranks):
            assert len(microbatches) == step.num_microbatches, "equal counts by construction"
            spans, tokens, first = [], [], 0
            for mb in microbatches:
                # () is a placeholder micro-batch: one loss-masked row.
                members = [start + i for i in mb] if mb else [None]
                rows[r].extend(members)
                spans.append((first, first + len(members)))
                tokens.append(sum(chunk[i] for i in mb) if mb else placeholder)
                first += len(members)
            indices[r].append(tuple(spans))
            mb_lengths[r].append(tuple(tokens))
    return NemoRlShards(
        rows=tuple(tuple(r) for r in rows),
        micro_batch_indices=tuple(tuple(r) for r in indices),
        micro_batch_lengths=tuple(tuple(r) for r in mb_lengths),
        num_microbatches=tuple(counts),
    )
