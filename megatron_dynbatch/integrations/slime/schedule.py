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
returns the same four items, as a :class:`~.dp_schedule.DPSchedule` (a tuple, so slime's
unpacking is unchanged) that also carries each step's uniform row length and a per-micro-batch
rollout count.

With ``use_dynamic_batch_size`` the steps come from the config's registered planner
(:func:`megatron_dynbatch.planning.registry.run_planner`: :func:`~megatron_dynbatch.planning.plan_schedule`'s
planner by default; ``rollouts_per_step=global_batch_size``). Deliberate differences from slime, one line each:

* Trailing rollouts that do not fill a step are trained in a last, shorter step, never trimmed.
* Fewer rollouts than ``global_batch_size`` train as one step instead of failing an assert.
* A count no packing can align to ``dp_size * group`` is padded with placeholder micro-batches
  (empty index lists), never by dropping rollouts and never by an assert (slime #2065); a rank
  also runs placeholders where the simulated step is faster with it running fewer, fuller
  micro-batches than the step's count, though the step has a sample for every slot.
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
* Newer slime's options (after 624b824a8): ``packing_safety_margin`` caps every micro-batch at
  that share of the budget, as slime's; ``global_batch_tokens`` and ``multimodal_aware_packing``
  ``separate`` / ``separate_raw`` (with a multimodal sample) are refused by name, not ignored.
* ``--max-memory-gib`` (patch 0005; slime has no byte budget): no step or log-prob pass is planned
  whose predicted per-stage peak exceeds it (:mod:`.memory`; ``DPSchedule.memory``).

Without ``use_dynamic_batch_size`` the static path is slime's: fixed ``micro_batch_size`` chunks,
trailing rollouts trimmed, an error when the count does not align, and a strided or (with
``balance_data``) Karmarkar-Karp assignment by the same FLOPs estimate (:mod:`.static_schedule`,
:mod:`.flops`).

Standard library and the pure planner only: slime's rollout manager imports it without torch work.
"""

from __future__ import annotations

import gc
import numbers
import warnings
from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_dynbatch.config import DynBatchConfig
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import SLIME, check_host_budget, check_host_oversize
from megatron_dynbatch.integrations.slime.config import (
    DATA_PAD_SIZE_MULTIPLIER,
    budget_for_packed,
    dash,
    dynbatch_config_from_slime_args,
    flag,
    oversize_policy,
    pad_size,
    planner_oversize_reported,
    routing_replay,
    safety_margin_named,
    slime_flags,
)
from megatron_dynbatch.integrations.slime.dp_schedule import (
    DPSchedule,
    DPScheduleError,
    ForwardOnlySchedule,
)
from megatron_dynbatch.integrations.slime.flops import cost_model
from megatron_dynbatch.integrations.slime.memory import (
    check_longest_sample,
    slime_max_memory_gib,
    slime_memory_limit,
    step_peaks,
)
from megatron_dynbatch.integrations.slime.static_schedule import static_schedule
from megatron_dynbatch.planning import (
    OversizeSampleWarning,
    ParallelLayout,
    SampleSet,
    check_plan,
    round_up,
)
from megatron_dynbatch.planning.forward_only import (
    ForwardOnlyPlan,
    plan_forward_only,
)
from megatron_dynbatch.planning.memory import MemoryLimit
from megatron_dynbatch.planning.registry import run_planner
from megatron_dynbatch.planning.samples import as_sequence
from megatron_dynbatch.planning.spec import (
    MAX_TOKENS,
    OWN_PLANNERS,
    ceil_div,
    check_int,
)
from megatron_dynbatch.planning.step_search import variable_rows as micro_batch_rows

__all__ = [
    "DATA_PAD_SIZE_MULTIPLIER",
    "DPSchedule",
    "DPScheduleError",
    "build_dp_schedule",
    "check_validated_layout",
    "oversize_policy",
]


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
            else check_int(f"args.{arg}", value, 1, f"pass --{dash(arg)} 1 or more.")
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
        raise DPScheduleError(
            "total_lengths is empty: the rollout batch holds no sample to schedule. Check that "
            "--rollout-batch-size is at least 1 and that no filter (--dynamic-sampling-filter-"
            "path) drops every sample of the batch."
        )
    return lengths


def _is_flag(value: Any) -> bool:
    """A bool, numpy's or torch's one-element bool, or the integers 0 and 1."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):  # numpy 1, 2
        return True
    if isinstance(value, numbers.Integral):
        return value in (0, 1)
    dtype = getattr(value, "dtype", None)
    return str(dtype) == "torch.bool" and getattr(value, "numel", lambda: 0)() == 1


def _check_newer_slime(
    args: Any, sample_is_multimodal: Any, num_samples: int, use_dynamic: bool
) -> None:
    """Newer slime's options that this drop-in does not plan by, refused by name rather than
    ignored (a schedule that silently differs from the one asked for)."""
    if sample_is_multimodal is not None:
        flags = as_sequence("sample_is_multimodal", sample_is_multimodal, "one bool per sample")
        if len(flags) != num_samples:
            raise DPScheduleError(
                f"sample_is_multimodal has {len(flags)} entries for {num_samples} samples; pass "
                "one bool per sample of total_lengths."
            )
        # Read by truth value, "no" was multimodal and None text-only (a probe): bools only.
        for i, flag in enumerate(flags):
            if not _is_flag(flag):
                raise DPScheduleError(
                    f"sample_is_multimodal[{i}]={flag!r} is not a bool; pass one True or False "
                    "per sample of total_lengths."
                )
        mode = getattr(args, "multimodal_aware_packing", "off")
        if use_dynamic and mode in ("separate", "separate_raw") and any(flags):
            raise DynBatchValueError(
                f"--multimodal-aware-packing {mode} keeps multimodal and text-only samples in "
                "separate micro-batches, which megatron_dynbatch's planner does not (it packs "
                "every sample by its cost); pass --multimodal-aware-packing off, or train this "
                "run without megatron_dynbatch's patches."
            )
    tokens = getattr(args, "global_batch_tokens", None)
    if tokens is not None:
        raise DynBatchValueError(
            f"--global-batch-tokens {tokens}: megatron_dynbatch's schedule makes each step of "
            "--global-batch-size rollouts (every rollout trained, none trimmed) and does not "
            "form steps by tokens; drop --global-batch-tokens, or train this run without "
            "megatron_dynbatch's patches."
        )


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


# -- rows and the dynamic path ------------------------------------------------------------------


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
    return True if value is None else flag(args, "variable_seq_lengths")


def _gpu_rows(rows: Sequence[int], cp: int) -> List[int]:
    """Planned rows (every CP rank's tokens) as one GPU's rows."""
    # Internal invariant: rows are multiples of the sample multiple, itself one of 2 * cp.
    assert all(row % cp == 0 for row in rows), (rows, cp)
    return [row // cp for row in rows]


def _replayed_log_probs(config: DynBatchConfig, lengths: List[int], budget: Optional[int]) -> None:
    """Routing replay runs the log-prob pass on the training micro-batches (``None``: no schedule
    of its own); a smaller ``--log-probs-max-tokens-per-gpu`` then cannot bind, which is said
    once, naming the samples over it (a probe: it was ignored without a word)."""
    forward = config.forward_only_max_tokens_per_gpu
    training = budget or config.max_tokens_per_gpu
    over = [i for i, n in enumerate(lengths) if n > forward]
    if forward < training and over:
        warnings.warn(
            f"--log-probs-max-tokens-per-gpu {forward} is below --max-tokens-per-gpu {training}, "
            "but routing replay (--use-routing-replay / --use-rollout-routing-replay) runs the "
            "log-prob pass on the training micro-batches: samples over it (e.g. sample "
            f"{over[0]}, {lengths[over[0]]} tokens) run in the training rows. Drop "
            "--log-probs-max-tokens-per-gpu or raise it to --max-tokens-per-gpu.",
            OversizeSampleWarning,
            stacklevel=4,
        )
    return None


def _unshared_budget(args: Any) -> Optional[int]:
    """``--max-tokens-per-gpu`` in full where ``--packing-safety-margin`` plans to a share of it
    (the config checked the margin), else ``None``."""
    margin = getattr(args, "packing_safety_margin", None)
    if margin is None or margin >= 1:
        return None
    return check_host_budget(SLIME, getattr(args, "max_tokens_per_gpu", None))


def _within_budget(
    rows: List[int],
    rank: Sequence[Sequence[int]],
    lengths: Sequence[int],
    planner_config: Any,
    budget: int,
) -> List[int]:
    """One GPU's rows, none rounded past the full budget where its samples fit it: a sample over
    the packing share runs alone in a row rounded up to slime's alignment, which the share does
    not bound (a probe: a 90-token sample ran a 128-token row under a budget of 100)."""
    cp = planner_config.parallel.cp_size
    multiple = planner_config.parallel.sample_multiple
    out = []
    for row, samples in zip(rows, rank, strict=True):
        if row > budget:
            load = -(-sum(round_up(lengths[i], multiple) for i in samples) // cp)
            row = load if load <= budget else row
        out.append(row)
    return out


def _check_oversize(
    lengths: List[int], planner_config: Any, *, forward_only: bool, report: bool = False
) -> None:
    """slime's oversize rule over the global lengths (:func:`check_host_oversize`), skipped where
    no sample is over the cap rounded down to the sample multiple: then none is over however the
    host counts its budget (two passes over 1M samples saved). ``report``: a forward-only pass
    warns too (its budget is smaller than training's)."""
    if max(lengths) > planner_config.longest_fitting:
        check_host_oversize(
            SLIME,
            [lengths],
            planner_config,
            forward_only=forward_only,
            report_forward_only=report,
        )


def _forward_only_schedule(
    config: DynBatchConfig,
    sizes: Dict[str, int],
    lengths: List[int],
    partitions: List[List[int]],
    pad_size: int,
    variable: bool,
    training: Optional[Tuple[List[List[List[int]]], List[List[int]]]] = None,
    memory: Optional[MemoryLimit] = None,
    training_budget: Optional[int] = None,
) -> ForwardOnlySchedule:
    """The log-prob passes, planned here from every rank's lengths (see :class:`ForwardOnlySchedule`).

    Each rank packs its own samples under ``--log-probs-max-tokens-per-gpu`` (no gradient is reduced
    over DP, so a rank needs no other rank's samples), all ranks into one count, chosen once for
    all of them (:func:`megatron_dynbatch.planning.forward_only.plan_forward_only`): a multiple of
    the interleaving group, and every rank spreads its samples over all of it. Under the
    training budget (no larger ``--log-probs-max-tokens-per-gpu``) with rows of their own, the
    training micro-batches (``training``: every rank's local micro-batches and rows, all steps)
    are the log-prob passes' instead, as in stock slime: each sample's old log-probs come from
    the packing its first training forward runs.

    ``memory``: the training step's budget (``--max-memory-gib``) bounds the log-prob rows too;
    a forward pass keeps no activations for a backward, so this is safe, not tight.
    ``training_budget``: ``--max-tokens-per-gpu`` in full where ``packing_safety_margin`` packs
    training to a share of it (slime then sets the log-prob budget to the full one: the same
    budget, given once).
    """
    cp = sizes["cp_size"]
    planner_config = config.planner_config(
        _layout(sizes, 1),
        forward_only=True,
        row_multiple=pad_size * cp if variable else None,
        memory=memory,
    )
    budget = config.forward_only_max_tokens_per_gpu
    one_budget = budget in (config.max_tokens_per_gpu, training_budget)
    if training is not None and variable and one_budget:
        # One budget for both passes (slime's default): the log-probs are computed on the
        # training micro-batches, as stock slime computes them. A sample's logits depend on what
        # it is packed with (the kernels' shapes), so old log-probs packed otherwise differ from
        # the first training forward's in the last bits, and the PPO ratio starts off 1 (a
        # probe, after SkyRL's PR #1477). A larger --log-probs-max-tokens-per-gpu packs anew.
        return ForwardOnlySchedule(
            micro_batch_indices=[list(map(list, rank)) for rank in training[0]],
            row_lengths=[list(rows) for rows in training[1]],
        )
    # Once over the global lengths, so an error names the samples by their rollout position; a
    # log-prob budget under the training one is warned about in its own key (a probe: samples
    # over it ran alone in rows of 128 against 16, unreported).
    _check_oversize(
        lengths,
        planner_config,
        forward_only=True,
        report=budget < (training_budget or config.max_tokens_per_gpu),
    )
    rank_lengths = [list(map(lengths.__getitem__, partition)) for partition in partitions]
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


def _check_budgets_at_once(
    args: Any,
    config: DynBatchConfig,
    layout: ParallelLayout,
    lengths: Sequence[int],
    memory: Optional[MemoryLimit],
) -> None:
    """Every budget short of what this rollout needs, named at once: the token budgets under
    one padded sample (and, under ``--oversize-samples error``, short of the longest sample,
    which must fit them), the memory budget short of the longest sample alone in a row (which
    it must hold under any policy). The checks after this name one budget each, one at a time
    (probes: four such chains, each fix refused next for another budget); they still name a
    budget that is short alone, where that is all that is wrong.
    """
    multiple, cp = layout.sample_multiple, layout.cp_size
    least = ceil_div(multiple, cp)
    error = config.oversize_samples == "error"
    longest = max(lengths)
    padded = round_up(longest, multiple)
    fits_longest = ceil_div(padded, cp)
    # Checked by dynbatch_config_from_slime_args, which built ``config``: in (0, 1] or None.
    margin = getattr(args, "packing_safety_margin", None)
    full = getattr(args, "max_tokens_per_gpu", None)
    needs: List[Tuple[str, Any, str]] = []  # (flag, given, least value that works)
    under_one = False
    # The training budget: its margin's share holds one padded sample; in full (the oversize
    # rule's budget under a margin) the longest sample, under error.
    training = []
    if config.max_tokens_per_gpu < least:
        under_one = True
        training.append(least if margin is None else budget_for_packed(least, margin))
    if error and full * cp < padded:
        training.append(fits_longest)
    if training:
        needs.append((SLIME.key("max_tokens_per_gpu"), full, str(max(training))))
    # Only as given: without it, the log-prob budget follows --max-tokens-per-gpu.
    log_probs = getattr(args, "log_probs_max_tokens_per_gpu", None)
    if log_probs is not None:
        log_probs = config.log_probs_max_tokens_per_gpu
        wanted = []
        if log_probs < least:
            under_one = True
            wanted.append(least)
        if error and log_probs * cp < padded:
            wanted.append(fits_longest)
        if wanted:
            needs.append(
                (SLIME.key("max_tokens_per_gpu", forward_only=True), log_probs, str(max(wanted)))
            )
    if memory is not None and not memory.fits((1, round_up(longest, memory.row_multiple))):
        needs.append(
            (
                SLIME.key("max_memory_gib"),
                slime_max_memory_gib(args),
                f"{memory.least_gib(longest):.3f}",
            )
        )
    if len(needs) < 2 and not (needs and under_one and error):
        return
    given = " and ".join(f"{flag} {value}" for flag, value, _ in needs)
    wanted_all = " and ".join(f"{flag} to at least {value}" for flag, _, value in needs)
    reason = (
        f"under --oversize-samples error every sample must fit them, and the longest has "
        f"{longest} tokens ({padded} padded to a multiple of {multiple})"
        if error
        else f"every sample is padded to a multiple of {multiple}, and the longest ({longest} "
        "tokens) must fit the memory budget alone"
    )
    refusal = DynBatchValueError(
        f"{given} {'are' if len(needs) > 1 else 'is'} too small for this rollout: {reason} "
        f"(--tensor-model-parallel-size {layout.tp_size}, --context-parallel-size {cp}); raise "
        f"{wanted_all}."
    )
    refusal.names_full_budget = True  # safety_margin_named: the values are in full
    raise refusal


def check_validated_layout(args: Any) -> None:
    """At slime's argument validation (before any Ray actor or rollout), what the first
    :func:`build_dp_schedule` would refuse of the layout and the token budgets alone: a budget
    under one padded sample (training, and the log-prob passes' where given), both named at once,
    and an interleaving group under the pipeline size. A probe: each passed validation and was
    refused on the rollout side, after the first rollout. Megatron's own validation runs after
    slime's, so the virtual pipeline size is read from its flags (as the Megatron-LM entry does).
    """
    from megatron_dynbatch.integrations.model_args import virtual_pipeline_size

    reported = {
        "dp_size": 1,  # the checks below do not depend on it
        "cp_size": getattr(args, "context_parallel_size", None) or 1,
        "vpp_size": virtual_pipeline_size(args) or 1,
    }
    with slime_flags(), safety_margin_named(args):
        sizes = _parallel_sizes(args, reported)
        config = dynbatch_config_from_slime_args(args)
        # The group as slime's flag gives it, checked by the layout itself (only interleaving
        # reads it): not through train_parallel_config's check, whose words name the actor's
        # report.
        group = getattr(args, "microbatch_group_size_per_vp_stage", None)
        layout = replace(
            _layout(sizes, 1),
            microbatch_group_size_per_vp_stage=group if sizes["vpp_size"] > 1 else None,
        )
        passes = [False]
        if getattr(args, "log_probs_max_tokens_per_gpu", None) is not None:
            passes.append(True)
        refused = []
        for forward_only in passes:
            try:
                config.planner_config(layout, forward_only=forward_only)
            except DynBatchValueError as error:
                if not forward_only and "padded sample" not in str(error):
                    raise  # not a budget short of one padded sample: one refusal, as raised
                refused.append(str(error))
        if len(refused) == 1:
            raise DynBatchValueError(refused[0])
        if refused:  # both budgets short of one padded sample: named at once
            raise DynBatchValueError(" ".join(refused))


def _dynamic_schedule(
    args: Any,
    sizes: Dict[str, int],
    lengths: List[int],
    keys: List[Any],
    global_batch_size: int,
    pad_size: int,
) -> DPSchedule:
    # Read (and so checked) as on slime's static path; ours always balances by the cost model.
    flag(args, "balance_data")
    flag(args, "balance_by_flops")
    config = dynbatch_config_from_slime_args(
        args, rollouts_per_step=global_batch_size, cost=cost_model(args)
    )
    dp = sizes["dp_size"]
    cp = sizes["cp_size"]
    variable = variable_rows(args)
    layout = _layout(sizes, dp)
    # --max-memory-gib: no shape is planned whose predicted peak breaks it, on any stage.
    memory = slime_memory_limit(args, layout)
    _check_budgets_at_once(args, config, layout, lengths, memory)
    if memory is not None:
        check_longest_sample(memory, lengths, slime_max_memory_gib(args))
    # Variable rows: a row of every CP rank's tokens is a multiple of pad_size per CP rank.
    planner_config = config.planner_config(
        layout, row_multiple=pad_size * cp if variable else None, memory=memory
    )
    budget = _unshared_budget(args)
    if budget is None:
        _check_oversize(lengths, planner_config, forward_only=False)
    else:
        # --packing-safety-margin packs to a share of the budget: a sample over the share but
        # within the budget runs alone, within it, and is no oversize sample (a probe: it was
        # warned about with the share as the budget, and a fix that changed nothing).
        try:
            _check_oversize(
                lengths, replace(planner_config, max_tokens_per_gpu=budget), forward_only=False
            )
        except DynBatchValueError as error:
            error.names_full_budget = True  # safety_margin_named: not the share, leave it
            raise
        planner_config = replace(planner_config, oversize_samples="allow")
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
    # Uniform rows are rounded up within the full budget, not the margin's share (a probe: a
    # 90-token sample's step ran rows of 128 against a budget of 100).
    max_tokens = budget or config.max_tokens_per_gpu
    for step in plan.steps:
        uniform = _uniform_row(step.seq_length, cp, pad_size, max_tokens, memory)
        first = len(row_lengths[0])
        for r, rank in enumerate(step.ranks):
            rows = _gpu_rows(step.row_lengths[r], cp) if variable else [uniform] * len(rank)
            if budget is not None and variable:
                rows = _within_budget(rows, rank, lengths, planner_config, budget)
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
        seq_lengths.append(max(max(rows[first:]) for rows in row_lengths) if variable else uniform)
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
            _replayed_log_probs(config, lengths, budget)
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
                training_budget=budget,
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
    sample_is_multimodal: Optional[Sequence[bool]] = None,
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
        sample_is_multimodal: Newer slime's flag per sample (``--multimodal-aware-packing``).
            Accepted and checked; ours plans every sample by its cost alike, so where slime would
            keep multimodal and text-only samples apart (``separate``, ``separate_raw``) the call
            is refused rather than mixing them silently. Newer slime's ``args.global_batch_tokens``
            (steps by tokens) is refused too; its ``args.packing_safety_margin`` (a fraction of
            the token budget per micro-batch) is kept.

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
        use_dynamic = flag(args, "use_dynamic_batch_size")
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
        _check_newer_slime(args, sample_is_multimodal, len(lengths), use_dynamic)
        # A schedule of 1M samples builds millions of small lists and no reference cycles; the
        # cyclic collector would re-scan them at every threshold (a fifth of the time), so it is
        # paused for the call and restored as it was (as the planner does).
        collecting = gc.isenabled()
        gc.disable()
        try:
            if use_dynamic:
                with safety_margin_named(args):
                    return _dynamic_schedule(args, sizes, lengths, keys, global_batch_size, pad)
            return static_schedule(
                args, sizes, lengths, _group_rollouts(keys), global_batch_size, pad
            )
        finally:
            if collecting:
                gc.enable()
