"""A drop-in for slime's ``slime.utils.dp_schedule.build_dp_schedule``, backed by the global planner.

slime (github THUDM/slime, checked against commit 624b824a8) computes, on its rollout side, which
DP rank trains which sample in which micro-batch of which optimizer step::

    partitions, micro_batch_indices, num_microbatches, global_batch_sizes = build_dp_schedule(
        args, train_parallel_config, total_lengths,
        global_batch_size=args.global_batch_size, rollout_indices=data["rollout_ids"])

``partitions[r]`` are the global sample indices rank ``r`` holds (all steps, in training order),
``micro_batch_indices[r]`` its micro-batches as lists of local indices into ``partitions[r]``
(flattened, they are ``range(len(partitions[r]))``), ``num_microbatches[s]`` the per-rank count of
step ``s`` and ``global_batch_sizes[s]`` the rollouts trained in step ``s`` (slime's loss
normaliser and LR-scheduler increment). :func:`build_dp_schedule` takes the same arguments and
returns the same four items, as a :class:`DPSchedule` (a tuple, so slime's unpacking is
unchanged) that also carries each step's uniform row length and a per-micro-batch rollout count.

With ``use_dynamic_batch_size`` the steps come from the config's registered planner
(:func:`megatron_dynbatch.planning.registry.run_planner`: :func:`~megatron_dynbatch.planning.plan_schedule`'s
planner by default; ``rollouts_per_step=global_batch_size``). Deliberate differences from slime, one line each:

* Trailing rollouts that do not fill a step are trained in a last, shorter step, never trimmed.
* Fewer rollouts than ``global_batch_size`` train as one step instead of failing an assert.
* A count no packing can align to ``dp_size * group`` is padded with placeholder micro-batches
  (empty index lists), never by dropping rollouts and never by an assert (slime #2065).
* A step with fewer samples than ``dp_size`` trains too; ranks without samples get placeholders.
* ``global_batch_sizes[s]`` is the number of rollouts step ``s`` really trains.
* DP ranks are always balanced by the step time of linear work plus per-sample attention
  (slime's FLOPs ratio from the model dimensions on ``args``; see ``_cost_model``), and never
  above ``max_tokens_per_gpu * cp_size`` per micro-batch, which ``balance_by_flops`` in slime may
  exceed.
* Each micro-batch runs its own row (``DPSchedule.row_lengths``), as slime's
  ``variable_seq_lengths`` allows; ``args.variable_seq_lengths=False`` keeps one row per step.
* A rank's micro-batches are ordered for the pipeline (light ones at warm-up and cool-down), and
  samples within a micro-batch by global index, not in first-fit order.
* ``--max-memory-gib`` (patch 0005; slime has no byte budget): no step or log-prob pass is planned
  whose predicted per-stage peak exceeds it (:mod:`.memory`; ``DPSchedule.memory``).

Without ``use_dynamic_batch_size`` the static path is slime's: fixed ``micro_batch_size`` chunks,
trailing rollouts trimmed, an error when the count does not align, and a strided or (with
``balance_data``) Karmarkar-Karp assignment by the same FLOPs estimate.

Standard library and the pure planner only: slime's rollout manager imports it without torch work.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_dynbatch.config import DynBatchConfig
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import SLIME, check_host_oversize
from megatron_dynbatch.integrations.slime.config import (
    DATA_PAD_SIZE_MULTIPLIER,
    dynbatch_config_from_slime_args,
    oversize_policy,
    pad_size,
    planner_oversize_reported,
    routing_replay,
    slime_flags,
)
from megatron_dynbatch.integrations.slime.memory import (
    StepPeaks,
    check_longest_sample,
    slime_max_memory_gib,
    slime_memory_limit,
    step_peaks,
)
from megatron_dynbatch.integrations.slime.scheduled import dp_schedule_steps
from megatron_dynbatch.planning import (
    CostModel,
    ParallelLayout,
    Plan,
    SampleSet,
    check_plan,
    round_up,
)
from megatron_dynbatch.planning.forward_only import (
    ForwardOnlyPlan,
    fewest_forward_only_count,
    plan_forward_only,
)
from megatron_dynbatch.planning.karmarkar_karp import karmarkar_karp
from megatron_dynbatch.planning.memory import MIB, MemoryLimit
from megatron_dynbatch.planning.registry import run_planner
from megatron_dynbatch.planning.samples import as_sequence
from megatron_dynbatch.planning.schedule import ScheduledStep
from megatron_dynbatch.planning.spec import (
    ATTENTION_CROSSOVER_7B,
    MAX_TOKENS,
    OWN_PLANNERS,
    check_int,
)
from megatron_dynbatch.planning.step_search import variable_rows as micro_batch_rows

__all__ = [
    "DATA_PAD_SIZE_MULTIPLIER",
    "DPSchedule",
    "DPScheduleError",
    "build_dp_schedule",
    "oversize_policy",
    "uniform_row_lengths",
]


class DPScheduleError(DynBatchValueError, AssertionError):
    """A schedule cannot be built from these arguments.

    A ``ValueError`` (a user error, with the value and the fix in the message) that is also an
    ``AssertionError``, because slime's own ``build_dp_schedule`` asserts in the same cases and
    code written against it catches ``AssertionError``.
    """


def _flag(args: Any, name: str, default: bool = False) -> bool:
    value = getattr(args, name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise DynBatchValueError(
            f"args.{name}={value!r} must be True or False (slime's --{_dash(name)})."
        )
    return value


def _dash(name: str) -> str:
    return name.replace("_", "-")


class DPSchedule(tuple):
    """``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)`` plus row shapes.

    Unpacks into slime's four items. The extra attributes:

    * ``row_lengths[r][m]``: the packed row micro-batch ``m`` of DP rank ``r`` is built with on
      one GPU (per context-parallel rank), placeholders included: what slime's patched
      ``get_batch`` pads it to. With variable rows (slime's default: it runs Megatron with
      ``variable_seq_lengths``) each micro-batch has its own row, its samples rounded up to
      ``tp_size * data_pad_size_multiplier`` where that stays within ``max_tokens_per_gpu``
      (:func:`row_length`); with uniform rows every micro-batch of a step has the step's longest.
      Score a schedule as it runs with these.
    * ``seq_lengths[s]``: the longest row of step ``s`` (with uniform rows, every row's length).
    * ``micro_batch_size``: rows per micro-batch (1: slime packs samples into one THD row).
    * ``rollout_counts[r][m]``: rollouts whose first sample (lowest global index) is in micro-batch
      ``m`` of rank ``r``; over a step they add up to ``global_batch_sizes[s]``, so a trainer that
      normalises per rollout through Megatron's per-token path can count each rollout once.
    * ``plan``: the planner's :class:`~megatron_dynbatch.planning.Plan` (``None`` on the static
      path).
    * ``forward_only``: the log-prob passes' :class:`ForwardOnlySchedule`, planned here from every
      rank's lengths so that every DP rank runs the same number of forward-only micro-batches;
      ``None`` where the log-prob passes run the training micro-batches (the static path, and
      MoE routing replay, which records and replays routing per micro-batch).
    * ``memory``: with ``--max-memory-gib``, every step's predicted peak per DP rank and pipeline
      stage (:class:`~megatron_dynbatch.integrations.slime.memory.StepPeaks`), each within the
      budget; ``None`` without it.
    """

    def __new__(
        cls,
        partitions: List[List[int]],
        micro_batch_indices: List[List[List[int]]],
        num_microbatches: List[int],
        global_batch_sizes: List[int],
        *,
        seq_lengths: Sequence[int],
        rollout_counts: Sequence[Sequence[int]],
        plan: Optional[Plan] = None,
        forward_only: Optional["ForwardOnlySchedule"] = None,
        row_lengths: Optional[Sequence[Sequence[int]]] = None,
        memory: Optional[StepPeaks] = None,
    ) -> "DPSchedule":
        self = super().__new__(
            cls, (partitions, micro_batch_indices, num_microbatches, global_batch_sizes)
        )
        self.seq_lengths = [int(s) for s in seq_lengths]
        if row_lengths is None:
            uniform = uniform_row_lengths(self.seq_lengths, num_microbatches)
            row_lengths = [list(uniform) for _ in partitions]
        self.row_lengths = [list(map(int, rows)) for rows in row_lengths]
        # Internal invariant: one row per micro-batch of every rank.
        assert [len(rows) for rows in self.row_lengths] == [len(mbs) for mbs in micro_batch_indices]
        self.micro_batch_size = 1
        self.rollout_counts = [list(counts) for counts in rollout_counts]
        self.plan = plan
        self.forward_only = forward_only
        self.memory = memory
        return self

    def __reduce__(self):
        fields = (
            tuple(self),
            self.seq_lengths,
            self.rollout_counts,
            self.plan,
            self.forward_only,
            self.row_lengths,
        )
        # Without --max-memory-gib a schedule pickles as it did before the option existed.
        return (_rebuild_schedule, fields if self.memory is None else fields + (self.memory,))

    @property
    def partitions(self) -> List[List[int]]:
        return self[0]

    @property
    def micro_batch_indices(self) -> List[List[List[int]]]:
        return self[1]

    @property
    def num_microbatches(self) -> List[int]:
        return self[2]

    @property
    def global_batch_sizes(self) -> List[int]:
        return self[3]

    @property
    def variable_rows(self) -> bool:
        """Whether micro-batches of one step run rows of different lengths."""
        return any(len(set(rows)) > 1 for rows in self._rows_per_step())

    def _rows_per_step(self) -> List[List[int]]:
        starts = [0]
        for n in self.num_microbatches:
            starts.append(starts[-1] + n)
        return [
            [row for rows in self.row_lengths for row in rows[a:b]]
            for a, b in zip(starts[:-1], starts[1:], strict=True)
        ]

    def scheduled_steps(self) -> Tuple[ScheduledStep, ...]:
        """Every step as the runtime reads it (:class:`~megatron_dynbatch.planning.schedule.
        Schedule`), in global sample indices (:mod:`.scheduled`)."""
        return dp_schedule_steps(self)

    def rank_fields(self, dp_rank: int) -> Dict[str, Any]:
        """What the patched slime ships to DP rank ``dp_rank`` besides slime's own keys.

        The trainer's :func:`~megatron_dynbatch.integrations.slime.backend.data_iterators` takes
        these keys out of the rank's rollout data again (slime would log them as metrics).
        """
        check_int("dp_rank", dp_rank, 0, "pass a data-parallel rank of the schedule.")
        if dp_rank >= len(self.partitions):
            raise DynBatchValueError(
                f"dp_rank={dp_rank} but the schedule has {len(self.partitions)} DP ranks."
            )
        fields: Dict[str, Any] = {
            SEQ_LENGTHS_KEY: list(self.seq_lengths),
            ROW_LENGTHS_KEY: list(self.row_lengths[dp_rank]),
        }
        if self.forward_only is not None:
            fields[LOGPROB_MICRO_BATCHES_KEY] = [
                list(mb) for mb in self.forward_only.micro_batch_indices[dp_rank]
            ]
            fields[LOGPROB_ROW_LENGTHS_KEY] = list(self.forward_only.row_lengths[dp_rank])
        if self.memory is not None:
            fields[PREDICTED_PEAK_KEY] = [
                [peak / MIB for peak in step] for step in self.memory.per_rank[dp_rank]
            ]
            fields[MEMORY_BUDGET_KEY] = self.memory.budget_bytes / MIB
        return fields


def uniform_row_lengths(seq_lengths: Sequence[int], num_microbatches: Sequence[int]) -> List[int]:
    """Uniform rows: every micro-batch of step ``k`` has the step's row ``seq_lengths[k]``."""
    return [int(s) for s, n in zip(seq_lengths, num_microbatches, strict=True) for _ in range(n)]


#: The keys :meth:`DPSchedule.rank_fields` ships (the patched ``get_data_iterator`` recognises
#: the schedule by the first).
SEQ_LENGTHS_KEY = "dynbatch_seq_lengths"
ROW_LENGTHS_KEY = "dynbatch_row_lengths"
LOGPROB_MICRO_BATCHES_KEY = "dynbatch_logprob_micro_batch_indices"
LOGPROB_ROW_LENGTHS_KEY = "dynbatch_logprob_row_lengths"
#: With --max-memory-gib: per step, per pipeline stage, the rank's predicted peak (MiB), and the
#: budget (MiB); the trainer logs them beside the measured peak (backend.StepPeakLog).
PREDICTED_PEAK_KEY = "dynbatch_predicted_peak_mib"
MEMORY_BUDGET_KEY = "dynbatch_memory_budget_mib"


@dataclass(frozen=True, kw_only=True)
class ForwardOnlySchedule:
    """The log-prob passes of one rollout, for every DP rank.

    Each rank's micro-batches hold only its own (training) samples, as local indices into its
    partition; ranks with fewer micro-batches are topped up with placeholders (empty lists) so every
    rank runs the same count: with expert parallelism the MoE all-to-all spans DP ranks, and unequal
    counts would leave a rank waiting in it. Every micro-batch is one packed row of
    ``row_lengths[r][m]`` tokens per GPU (one length on every rank where rows are uniform).
    """

    micro_batch_indices: List[List[List[int]]]
    """Per DP rank, per micro-batch, local sample indices (``[]``: a placeholder)."""
    row_lengths: List[List[int]]
    """Per DP rank, per micro-batch, the packed row on one GPU (per CP rank)."""

    def __post_init__(self) -> None:
        counts = {len(rank) for rank in self.micro_batch_indices}
        assert len(counts) == 1, f"forward-only micro-batch counts differ across DP ranks: {counts}"
        assert [len(r) for r in self.row_lengths] == [len(r) for r in self.micro_batch_indices]

    @property
    def row_length(self) -> int:
        """The longest forward-only row (every row's length when rows are uniform)."""
        return max(max(rows) for rows in self.row_lengths)

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batch_indices[0])


def _rebuild_schedule(
    items, seq_lengths, rollout_counts, plan, forward_only=None, row_lengths=None, memory=None
) -> DPSchedule:
    return DPSchedule(
        *items,
        seq_lengths=seq_lengths,
        rollout_counts=rollout_counts,
        plan=plan,
        forward_only=forward_only,
        row_lengths=row_lengths,
        memory=memory,
    )


# -- inputs ---------------------------------------------------------------------------------------


def _parallel_sizes(args: Any, train_parallel_config: Any) -> Dict[str, int]:
    """The layout sizes, from slime's dict (or an object with the same attributes).

    ``dp_size`` is required; ``cp_size`` and ``vpp_size`` default to 1 and the interleaving group
    to 1 (slime's actor always reports all four; a partial config from another caller means the
    feature is off).
    """
    if isinstance(train_parallel_config, Mapping):
        lookup = train_parallel_config.get
    elif hasattr(train_parallel_config, "dp_size"):
        lookup = lambda key: getattr(train_parallel_config, key, None)  # noqa: E731
    else:
        raise DynBatchValueError(
            f"train_parallel_config={train_parallel_config!r} must be a dict with dp_size (and "
            "cp_size, vpp_size, microbatch_group_size_per_vp_stage: what slime's actor reports)."
        )
    if lookup("dp_size") is None:
        raise DynBatchValueError(
            "train_parallel_config has no 'dp_size'; pass the data-parallel size (and cp_size, "
            "vpp_size, microbatch_group_size_per_vp_stage when used)."
        )
    sizes = {}
    for key in ("dp_size", "cp_size", "vpp_size", "microbatch_group_size_per_vp_stage"):
        value = lookup(key)
        if value is None:
            continue  # filled below
        sizes[key] = check_int(
            f"train_parallel_config[{key!r}]",
            value,
            1,
            "pass the Megatron layout's size (1 when unused).",
        )
    sizes.setdefault("cp_size", 1)
    sizes.setdefault("vpp_size", 1)
    # Megatron's own argument names; slime's args carry them, test doubles may not.
    for key, arg in (
        ("tp_size", "tensor_model_parallel_size"),
        ("pp_size", "pipeline_model_parallel_size"),
    ):
        value = getattr(args, arg, None)
        sizes[key] = (
            1
            if value is None
            else check_int(f"args.{arg}", value, 1, f"pass --{_dash(arg)} 1 or more.")
        )
    if "microbatch_group_size_per_vp_stage" not in sizes:
        # Megatron's default group is pp_size (it only matters when interleaving).
        pp = max(sizes["pp_size"], 2) if sizes["vpp_size"] > 1 else 1
        sizes["microbatch_group_size_per_vp_stage"] = pp
    if getattr(args, "pipeline_model_parallel_size", None) is None and sizes["vpp_size"] > 1:
        # Interleaving needs pp >= 2; the group size is what constrains the counts.
        sizes["pp_size"] = min(2, sizes["microbatch_group_size_per_vp_stage"])
    return sizes


def _lengths(total_lengths: Any) -> List[int]:
    lengths = as_sequence("total_lengths", total_lengths, "per-sample token counts")
    # Plain ints >= 1 (what slime passes) need no per-sample check: 1M samples in milliseconds.
    # Anything else goes through check_int one by one, which names the first bad value.
    # The maximum first too: a corrupt length is refused as one, before any budget check offers
    # a budget above the maximum as its fix.
    if (
        lengths
        and set(map(type, lengths)) == {int}
        and 1 <= min(lengths) <= max(lengths) <= MAX_TOKENS
    ):
        return lengths
    for i, value in enumerate(lengths):
        lengths[i] = check_int(
            f"total_lengths[{i}]",
            value,
            1,
            "pass every sample's token count (prompt + response) as an integer >= 1.",
            maximum=MAX_TOKENS,
        )
    if not lengths:
        raise DPScheduleError("total_lengths is empty; there is no sample to schedule.")
    return lengths


def _rollout_keys(rollout_indices: Any, num_samples: int) -> List[Any]:
    ids = as_sequence("rollout_indices", rollout_indices, "rollout ids, one per sample")
    if len(ids) != num_samples:
        raise DynBatchValueError(
            f"got {len(ids)} rollout_indices for {num_samples} total_lengths; pass one rollout id "
            "per sample (samples[i].index)."
        )
    # One type of id (slime's ints) needs no per-sample check; mixed ids go one by one, which
    # converts numpy integers and names the first bad id.
    types = set(map(type, ids))
    if types == {str} or (types == {int} and (not ids or min(ids) >= _MIN_ROLLOUT_ID)):
        return ids
    keys = []
    for i, rid in enumerate(ids):
        if isinstance(rid, str):
            keys.append(rid)
        else:
            keys.append(
                check_int(
                    f"rollout_indices[{i}]",
                    rid,
                    _MIN_ROLLOUT_ID,
                    "pass integer (or string) rollout ids, one per sample.",
                )
            )
    return keys


#: The smallest integer rollout id (an int64, as slime's ``samples[i].index``).
_MIN_ROLLOUT_ID = -(2**63)


def _group_rollouts(keys: Sequence[Any]) -> List[List[int]]:
    """Samples of each rollout, rollouts in order of first appearance (as slime groups them)."""
    members: Dict[Any, List[int]] = {}
    for position, key in enumerate(keys):
        members.setdefault(key, []).append(position)
    return list(members.values())


def _rollout_heads(keys: Sequence[Any]) -> set:
    """The first sample (lowest global index) of every rollout."""
    # Built from the end, a key's last write is its lowest index (a C loop, not a Python one).
    n = len(keys)
    return set(dict(zip(reversed(keys), range(n - 1, -1, -1), strict=True)).values())


# -- FLOPs and Karmarkar-Karp (slime's static balance_data) ---------------------------------------


def _layer_flops(args: Any, s: int, ffn: int) -> float:
    """Forward FLOPs of one transformer layer on a sequence of ``s`` tokens (slime's estimate).

    The expressions keep slime's operation order so the floating-point sums, and with them the
    balancing decisions, are identical.
    """
    h = args.hidden_size
    heads = args.num_attention_heads
    mla = bool(getattr(args, "multi_latent_attention", False))
    if mla and args.q_lora_rank is not None:
        q = 2 * s * args.q_lora_rank * (h + heads * (args.qk_head_dim + args.qk_pos_emb_head_dim))
    else:
        q_head_dim = args.qk_head_dim + args.qk_pos_emb_head_dim if mla else args.kv_channels
        q = 2 * s * h * heads * q_head_dim
    if mla and args.kv_lora_rank is not None:
        kv = (
            2
            * s
            * (
                args.kv_lora_rank * (h + heads * (args.qk_head_dim + args.v_head_dim))
                + h * args.qk_pos_emb_head_dim
            )
        )
    else:
        kv = 2 * 2 * s * h * args.num_query_groups * args.kv_channels
    if mla:
        attention = 2 * heads * s * s * (args.qk_head_dim + args.qk_pos_emb_head_dim) / 2
        attention += heads * s * s * args.v_head_dim
    else:
        attention = 2 * heads * s * s * args.kv_channels / 2
        attention += heads * s * s * args.kv_channels
    return (q + kv) + attention + 2 * s * h * h + 2 * s * h * ffn * 3


def _forward_flops(args: Any, s: int) -> float:
    """slime's ``calculate_fwd_flops([s], args)``: every layer plus the output projection."""
    if args.num_experts is None:
        num_dense, num_moe, moe_ffn = args.num_layers, 0, 0
    else:
        shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
        moe_ffn = args.moe_ffn_hidden_size * args.moe_router_topk + shared
        if hasattr(args, "moe_layer_freq"):
            freq = args.moe_layer_freq
            if isinstance(freq, list):
                num_dense = sum(1 for f in freq if f == 0)
                num_moe = sum(1 for f in freq if f > 0)
            else:
                num_dense = sum(1 for i in range(args.num_layers) if i % freq != 0)
                num_moe = sum(1 for i in range(args.num_layers) if i % freq == 0)
        else:
            num_dense, num_moe = 0, args.num_layers
    total = 0
    if num_dense > 0:
        total += _layer_flops(args, s, args.ffn_hidden_size) * num_dense
    if num_moe > 0:
        total += _layer_flops(args, s, moe_ffn) * num_moe
    return total + 2 * s * args.hidden_size * args.vocab_size


#: The model arguments slime's FLOPs estimate reads for a dense model (Megatron's names).
_FLOPS_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "vocab_size",
)


def _balance_flops(args: Any, lengths: Sequence[int]) -> List[float]:
    """``--balance-data``'s weights: slime's FLOPs estimate of every sample, or a
    ``DynBatchValueError`` naming the model arguments it needs where ``args`` lacks them (slime's
    own estimate would stop on an ``AttributeError``)."""
    try:
        return [_forward_flops(args, n) for n in lengths]
    except (AttributeError, TypeError):
        missing = [name for name in _FLOPS_ARGS if getattr(args, name, None) is None]
        if not hasattr(args, "num_experts"):
            missing.append("num_experts")
        raise DPScheduleError(
            "--balance-data balances ranks by slime's FLOPs estimate, which needs the model's "
            f"Megatron arguments on args; missing or None: {', '.join(missing) or 'a MoE/MLA size'}"
            ". Pass slime's parsed arguments, or drop --balance-data (strided assignment)."
        ) from None


def _balanced_partitions(weights: Sequence[Any], k: int) -> List[List[int]]:
    """Largest differencing (Karmarkar-Karp) into ``k`` parts of equal item counts, each sorted.

    The same tie-breaking as slime's ``get_seqlen_balanced_partitions(..., equal_size=True)``, so
    the static ``balance_data`` path assigns exactly the ranks slime assigns.
    """
    return [sorted(part) for part in karmarkar_karp(weights, k, equal_size=True)]


# -- the two paths --------------------------------------------------------------------------------


def _static_schedule(
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
    balance = _flag(args, "balance_data")
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
            flops = _balance_flops(args, [lengths[i] for i in samples])
            weights = [sum(flops[i] for i in chunk) for chunk in chunks]
            rank_chunks = _balanced_partitions(weights, dp)
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


def _cost_model(args: Any) -> CostModel:
    """What one micro-batch costs on one GPU: linear work per position plus attention per sample.

    slime's THD rows attend per sample (``cu_seqlens``), so a micro-batch of long samples costs
    more than one of as many tokens in short samples; the planner balances and orders by that.
    The ratio is slime's own FLOPs estimate (``calculate_fwd_flops``, what ``--balance-data``
    and ``--balance-by-flops`` balance) from the model dimensions on ``args``, or, without them
    (a bare namespace), a 7B-class model's (:data:`ATTENTION_CROSSOVER_7B`).
    """
    default = CostModel(token_weight=1.0, attention_weight=1.0 / ATTENTION_CROSSOVER_7B)
    try:
        # FLOPs(L) = a * L + b * L**2: b from the second difference, a from FLOPs(1).
        quadratic = (_forward_flops(args, 2) - 2 * _forward_flops(args, 1)) / 2
        linear = _forward_flops(args, 1) - quadratic
    except (AttributeError, TypeError):
        return default
    if linear <= 0 or quadratic < 0:
        return default
    return CostModel(token_weight=1.0, attention_weight=quadratic / linear)


def row_length(seq_length: int, cp: int, pad_size: int, max_tokens: int) -> int:
    """One GPU's packed row of a step whose planned row is ``seq_length`` tokens.

    A row of S tokens is S / cp per CP rank (every sample is padded to 2 * cp chunks, and to a
    multiple of tp, which sequence parallelism needs). slime aligns it further to ``pad_size``
    (``tp * data_pad_size_multiplier``); that alignment is kept only while the row stays within
    ``--max-tokens-per-gpu``: the budget is a hard cap on the padded row (a cap of 1,000 with the
    default multiple of 128 would otherwise give rows of 1,024). A step holding an oversize sample
    is over the budget anyway and keeps slime's alignment.
    """
    per_rank = -(-seq_length // cp)
    aligned = round_up(per_rank, pad_size)
    return aligned if aligned <= max_tokens or per_rank > max_tokens else per_rank


def _uniform_row(
    seq_length: int, cp: int, pad_size: int, max_tokens: int, memory: Optional[MemoryLimit]
) -> int:
    """:func:`row_length`, not aligned past what ``--max-memory-gib`` allows: the planned row
    (``seq_length``, within the memory budget) is kept unaligned where the aligned one breaks it."""
    row = row_length(seq_length, cp, pad_size, max_tokens)
    if memory is not None and not memory.fits((1, row * cp)):
        return -(-seq_length // cp)
    return row


def _layout(sizes: Dict[str, int], dp_size: int) -> ParallelLayout:
    vpp = sizes["vpp_size"]
    return ParallelLayout(
        dp_size=dp_size,
        pp_size=sizes["pp_size"],
        vpp_size=vpp,
        microbatch_group_size_per_vp_stage=(
            sizes["microbatch_group_size_per_vp_stage"] if vpp > 1 else None
        ),
        tp_size=sizes["tp_size"],
        cp_size=sizes["cp_size"],
    )


def variable_rows(args: Any) -> bool:
    """Whether each micro-batch runs its own row: slime runs Megatron with
    ``variable_seq_lengths`` (its ``validate_args`` always sets it), so Megatron exchanges every
    micro-batch's shape before its pipeline send and a row need not be the step's longest. Only
    an explicit ``args.variable_seq_lengths=False`` keeps one row per step."""
    value = getattr(args, "variable_seq_lengths", None)
    return True if value is None else _flag(args, "variable_seq_lengths")


def _gpu_rows(rows: Sequence[int], cp: int) -> List[int]:
    """Planned rows (every CP rank's tokens) as one GPU's rows."""
    # Internal invariant: rows are multiples of the sample multiple, itself one of 2 * cp.
    assert all(row % cp == 0 for row in rows), (rows, cp)
    return [row // cp for row in rows]


def _check_oversize(lengths: List[int], planner_config: Any, *, forward_only: bool) -> None:
    """slime's oversize rule over the global lengths (:func:`check_host_oversize`), skipped where
    no sample is over the cap rounded down to the sample multiple: then none is over however the
    host counts its budget (two passes over 1M samples saved)."""
    multiple, cap = planner_config.parallel.sample_multiple, planner_config.token_cap
    if max(lengths) > (cap // multiple) * multiple:
        check_host_oversize(SLIME, [lengths], planner_config, forward_only=forward_only)


def _forward_only_schedule(
    config: DynBatchConfig,
    sizes: Dict[str, int],
    lengths: List[int],
    partitions: List[List[int]],
    pad_size: int,
    variable: bool,
    training: Optional[Tuple[List[List[List[int]]], List[List[int]]]] = None,
    memory: Optional[MemoryLimit] = None,
) -> ForwardOnlySchedule:
    """The log-prob passes, planned here from every rank's lengths (see :class:`ForwardOnlySchedule`).

    Each rank packs its own samples under ``--log-probs-max-tokens-per-gpu`` (no gradient is reduced
    over DP, so a rank needs no other rank's samples), all ranks into one count, chosen once for
    all of them (:func:`megatron_dynbatch.planning.forward_only.plan_forward_only`): a multiple of
    the interleaving group, and every rank spreads its samples over all of it. Where the training
    micro-batches (``training``: every rank's local micro-batches and rows, all steps) already
    are that few under the same budget, with rows of their own, they are the log-prob passes'
    too: no packing can do with fewer, and the rollout side packs nothing twice.

    ``memory``: the training step's budget (``--max-memory-gib``) bounds the log-prob rows too;
    a forward pass keeps no activations for a backward, so this is safe, not tight.
    """
    cp = sizes["cp_size"]
    planner_config = config.planner_config(
        _layout(sizes, 1),
        forward_only=True,
        row_multiple=pad_size * cp if variable else None,
        memory=memory,
    )
    budget = config.forward_only_max_tokens_per_gpu
    # Once over the global lengths, so an error names the samples by their rollout position.
    _check_oversize(lengths, planner_config, forward_only=True)
    rank_lengths = [list(map(lengths.__getitem__, partition)) for partition in partitions]
    if (
        training is not None
        and planner_config.planner in OWN_PLANNERS
        and variable
        and budget == config.max_tokens_per_gpu
        and len(training[0][0]) == fewest_forward_only_count(rank_lengths, planner_config)
    ):
        return ForwardOnlySchedule(
            micro_batch_indices=[list(map(list, rank)) for rank in training[0]],
            row_lengths=[list(rows) for rows in training[1]],
        )
    if planner_config.planner in OWN_PLANNERS:
        plan = plan_forward_only(rank_lengths, planner_config)
    else:
        plan = _registered_forward_only(rank_lengths, planner_config)
    if variable:
        # The planner's rows: within --max-memory-gib (step_search.variable_rows) where it is given.
        rows = [_gpu_rows(rank_rows, cp) for rank_rows in plan.row_lengths]
    else:
        # Uniform rows: one row length on every rank, the same shapes everywhere.
        longest = max(rank_rows[0] for rank_rows in plan.row_lengths)
        row = _uniform_row(longest, cp, pad_size, budget, memory)
        rows = [[row] * len(rank_rows) for rank_rows in plan.row_lengths]
    return ForwardOnlySchedule(micro_batch_indices=plan.micro_batches, row_lengths=rows)


def _registered_forward_only(rank_lengths: List[List[int]], planner_config: Any) -> ForwardOnlyPlan:
    """The log-prob pass of a registered planner other than ours (``--dynamic-batch-planner``).

    A forward-only pass reduces nothing over DP, so each rank's own samples are planned alone by
    the planner the config names (dp 1, one step); every rank then runs the same count, a
    multiple of the interleaving group, the shorter ranks topped up with placeholders (``[]``).
    Rows as :func:`~megatron_dynbatch.planning.forward_only.plan_forward_only` gives them.
    """
    one = replace(
        planner_config,
        parallel=replace(planner_config.parallel, dp_size=1),
        rollouts_per_step=None,
    )
    multiple, cap = one.parallel.sample_multiple, one.token_cap
    members: List[List[List[int]]] = []
    for lengths in rank_lengths:
        if not lengths:  # a rank without samples (its phantom arrives later): placeholders
            members.append([])
            continue
        plan = run_planner(SampleSet.build(lengths), one)
        members.append([list(mb) for step in plan.steps for mb in step.ranks[0]])
    count = round_up(max(1, *map(len, members)), one.parallel.microbatch_multiple)
    members = [rank + [[] for _ in range(count - len(rank))] for rank in members]
    loads = [
        [sum(round_up(lengths[i], multiple) for i in mb) for mb in rank]
        for rank, lengths in zip(members, rank_lengths, strict=True)
    ]
    if one.variable_row_lengths:
        rows = [micro_batch_rows(r, one.variable_row_multiple, cap, one.memory) for r in loads]
    else:
        longest = max([1] + [load for rank in loads for load in rank])
        rows = [[longest] * count for _ in loads]
    return ForwardOnlyPlan(micro_batches=members, row_lengths=rows)


def _dynamic_schedule(
    args: Any,
    sizes: Dict[str, int],
    lengths: List[int],
    keys: List[Any],
    global_batch_size: int,
    pad_size: int,
) -> DPSchedule:
    # Read (and so checked) as on slime's static path; ours always balances by the cost model.
    _flag(args, "balance_data")
    _flag(args, "balance_by_flops")
    config = dynbatch_config_from_slime_args(
        args, rollouts_per_step=global_batch_size, cost=_cost_model(args)
    )
    dp = sizes["dp_size"]
    cp = sizes["cp_size"]
    variable = variable_rows(args)
    layout = _layout(sizes, dp)
    # --max-memory-gib: no shape is planned whose predicted peak breaks it, on any stage.
    memory = slime_memory_limit(args, layout)
    if memory is not None:
        check_longest_sample(memory, lengths, slime_max_memory_gib(args))
    # Variable rows: a row of every CP rank's tokens is a multiple of pad_size per CP rank.
    planner_config = config.planner_config(
        layout, row_multiple=pad_size * cp if variable else None, memory=memory
    )
    _check_oversize(lengths, planner_config, forward_only=False)
    samples = SampleSet.build(lengths, keys)
    with planner_oversize_reported():
        plan = run_planner(samples, planner_config)
    check_plan(plan, samples, planner_config)

    heads = _rollout_heads(keys)
    partitions: List[List[int]] = [[] for _ in range(dp)]
    micro_batch_indices: List[List[List[int]]] = [[] for _ in range(dp)]
    rollout_counts: List[List[int]] = [[] for _ in range(dp)]
    row_lengths: List[List[int]] = [[] for _ in range(dp)]
    seq_lengths: List[int] = []
    max_tokens = config.max_tokens_per_gpu
    for step in plan.steps:
        uniform = _uniform_row(step.seq_length, cp, pad_size, max_tokens, memory)
        seq_lengths.append(
            max(max(_gpu_rows(rows, cp)) for rows in step.row_lengths) if variable else uniform
        )
        for r, rank in enumerate(step.ranks):
            rows = _gpu_rows(step.row_lengths[r], cp) if variable else [uniform] * len(rank)
            row_lengths[r].extend(rows)
            partition, local, counts = partitions[r], micro_batch_indices[r], rollout_counts[r]
            start = len(partition)
            for mb in rank:
                partition.extend(mb)
                end = start + len(mb)
                local.append(list(range(start, end)))
                # A sample is in one micro-batch only (check_plan), so the overlap counts heads.
                counts.append(len(heads.intersection(mb)))
                start = end
    num_microbatches = [step.num_microbatches for step in plan.steps]
    return DPSchedule(
        partitions,
        micro_batch_indices,
        num_microbatches,
        [step.num_rollouts for step in plan.steps],
        seq_lengths=seq_lengths,
        rollout_counts=rollout_counts,
        plan=plan,
        # Routing replay records routing per micro-batch in the log-prob pass and replays it, in
        # order, in training: both passes must run the same micro-batches.
        forward_only=(
            None
            if routing_replay(args)
            else _forward_only_schedule(
                config,
                sizes,
                lengths,
                partitions,
                pad_size,
                variable,
                training=(micro_batch_indices, row_lengths),
                memory=memory,
            )
        ),
        row_lengths=row_lengths,
        memory=(
            None
            if memory is None
            else step_peaks(memory.model, memory.budget_bytes, row_lengths, num_microbatches)
        ),
    )


def build_dp_schedule(
    args: Any,
    train_parallel_config: Any,
    total_lengths: Sequence[int],
    global_batch_size: int = None,  # type: ignore[assignment]
    rollout_indices: Sequence[Any] = None,  # type: ignore[assignment]
) -> DPSchedule:
    """slime's ``build_dp_schedule``, same arguments and return value (see the module docstring).

    Args:
        args: slime's namespace. Read: ``use_dynamic_batch_size``, ``max_tokens_per_gpu``,
            ``micro_batch_size`` (static path), ``balance_data``, ``balance_by_flops``, the model
            dimensions for the FLOPs estimate (``balance_data``), and when present
            ``tensor_model_parallel_size``, ``pipeline_model_parallel_size`` and
            ``data_pad_size_multiplier``.
        train_parallel_config: ``{"dp_size", "cp_size", "vpp_size",
            "microbatch_group_size_per_vp_stage"}`` as slime's actor reports it.
        total_lengths: Token count of every sample (global index order).
        global_batch_size: Rollouts per optimizer step (slime passes it by keyword).
        rollout_indices: One rollout id per sample; a rollout's samples stay in one step.

    Returns:
        A :class:`DPSchedule`: ``(partitions, micro_batch_indices, num_microbatches,
        global_batch_sizes)``; a placeholder micro-batch is an empty index list.

    Raises:
        ValueError: a bad argument, naming the value and the fix (``DPScheduleError``, also an
            ``AssertionError``, where slime asserts).
    """
    if args is None or isinstance(args, Mapping):
        raise DynBatchValueError(
            f"args={type(args).__name__} must be slime's argument namespace (read as attributes: "
            "args.use_dynamic_batch_size, args.max_tokens_per_gpu, ...); pass the parsed "
            "arguments, or argparse.Namespace(**settings) for a dict."
        )
    if global_batch_size is None or rollout_indices is None:
        raise DynBatchValueError(
            "build_dp_schedule needs global_batch_size= and rollout_indices= (slime passes both "
            "by keyword)."
        )
    # Errors about the parallel layout name slime's (Megatron-LM's) flags.
    with slime_flags():
        use_dynamic = _flag(args, "use_dynamic_batch_size")
        sizes = _parallel_sizes(args, train_parallel_config)
        lengths = _lengths(total_lengths)
        keys = _rollout_keys(rollout_indices, len(lengths))
        global_batch_size = check_int(
            "global_batch_size",
            global_batch_size,
            1,
            "pass --global-batch-size as the number of rollouts per optimizer step.",
        )
        pad = pad_size(args)
        # A schedule of 1M samples builds millions of small lists and no reference cycles; the
        # cyclic collector would re-scan them at every threshold (a fifth of the time), so it is
        # paused for the call and restored as it was (as the planner does).
        collecting = gc.isenabled()
        gc.disable()
        try:
            if use_dynamic:
                return _dynamic_schedule(args, sizes, lengths, keys, global_batch_size, pad)
            return _static_schedule(
                args, sizes, lengths, _group_rollouts(keys), global_batch_size, pad
            )
        finally:
            if collecting:
                gc.enable()
