"""The micro-batch schedulers users would otherwise run, re-implemented from their published algorithms.

Each baseline has the planner's shape: sample lengths in, ``ranks[r][m]`` (the sample indices of
micro-batch ``m`` on DP rank ``r``) out, every rank with the same number of micro-batches as
Megatron's pipeline schedules require. An empty list is a placeholder micro-batch (loss-masked padding
the framework runs so the ranks stay in step).

These are written from reading the upstream code, not copied from it; the docstring of each names the
file it follows (snapshots read: Megatron-LM d98e8a6, THUDM/slime 624b824, volcengine/verl b178a3c,
NovaSky-AI/SkyRL a956457, NVIDIA-NeMo/RL 7ea279a). Where an upstream algorithm
raises (a sample longer than the cap, too few samples to align the micro-batch count), the baseline
raises :class:`BaselineFailure` naming the upstream check, instead of silently doing something else.
Where it leaves the ranks with unequal micro-batch counts, or a count Megatron's interleaved schedule
rejects, the harness pads with placeholders and records how many in
:attr:`BaselineSchedule.harness_placeholders`, apart from the placeholders the framework itself adds
(:attr:`BaselineSchedule.upstream_placeholders`).

Pure standard library; the workload formula is verl's and is used only by the baselines that use it.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchRuntimeError, DynBatchValueError
from megatron_dynbatch.planning.karmarkar_karp import karmarkar_karp as _karmarkar_karp
from megatron_dynbatch.planning.registry import Planner, ranks_planner, register_planner
from megatron_dynbatch.planning.spec import ATTENTION_CROSSOVER_7B, ceil_div, round_up

__all__ = [
    "BASELINES",
    "BaselineFailure",
    "BaselineSchedule",
    "VERL_LINEAR_WEIGHT",
    "baseline_planner",
    "fixed_mbs",
    "karmarkar_karp",
    "next_fit",
    "nemo_rl_ffd",
    "nemo_rl_mffd",
    "skyrl_balanced",
    "slime_first_fit",
    "verl_kk",
    "verl_workload",
]

#: verl's ``calculate_workload`` weight of the linear term: FLOPs of a dense block are about
#: ``12*h^2*L + 2*h*L^2``; divided by ``2*h`` that is ``6*h*L + L^2``, and verl fixes ``h = 4096``
#: (a 7B model), so ``6 * 4096``: the planner's :data:`ATTENTION_CROSSOVER_7B`.
VERL_LINEAR_WEIGHT = ATTENTION_CROSSOVER_7B

Ranks = List[List[List[int]]]


class BaselineFailure(DynBatchRuntimeError):
    """The upstream algorithm cannot schedule this input (it raises or asserts at this point).

    Attributes:
        baseline: Name of the baseline function.
        reason: What the upstream check rejects, with the values.
    """

    def __init__(self, baseline: str, reason: str) -> None:
        super().__init__(f"{baseline}: {reason}")
        self.baseline = baseline
        self.reason = reason


class BaselineSchedule(list):
    """``ranks[r][m]`` = sample indices (a plain list of lists), plus how it was made.

    It is a ``list`` so it can be used wherever the planner's ``ranks`` are; the attributes say which
    placeholders the framework needs on its own and which the harness had to add to make a schedule
    Megatron accepts.
    """

    def __init__(
        self,
        ranks: Ranks,
        *,
        baseline: str,
        upstream_placeholders: int = 0,
        harness_placeholders: int = 0,
        micro_batch_size: int = 1,
        notes: Sequence[str] = (),
        dummy_lengths: Sequence[int] = (),
    ) -> None:
        super().__init__(ranks)
        self.baseline = baseline
        """Name of the baseline that produced it."""
        self.upstream_placeholders = upstream_placeholders
        """Empty micro-batches the framework itself runs (e.g. SkyRL's padding micro-batches)."""
        self.harness_placeholders = harness_placeholders
        """Empty micro-batches added here because the framework leaves ranks unequal or the count
        not a multiple of ``microbatch_multiple`` (Megatron would reject or hang without them)."""
        self.micro_batch_size = micro_batch_size
        """Rows per micro-batch: the fixed B of :func:`fixed_mbs`, 1 (one packed row) otherwise."""
        self.notes = tuple(notes)
        """Upstream quirks this input triggered (human-readable)."""
        self.dummy_lengths = tuple(dummy_lengths)
        """Lengths of loss-masked filler samples the framework computes (index ``n + k`` in the
        ranks is filler ``k``; SkyRL pads a mini-batch with copies of sample 0)."""


def _validate(
    baseline: str,
    lengths: Sequence[int],
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int,
    rollout_ids: Optional[Sequence[Hashable]],
) -> None:
    for name, value in (
        ("dp_size", dp_size),
        ("token_cap", token_cap),
        ("microbatch_multiple", microbatch_multiple),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DynBatchValueError(f"{baseline}: {name}={value!r} must be an integer >= 1.")
    if not lengths:
        raise DynBatchValueError(f"{baseline}: no samples to schedule; pass at least one length.")
    for i, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise DynBatchValueError(
                f"{baseline}: lengths[{i}]={length!r} must be an integer >= 1."
            )
    if rollout_ids is not None and len(rollout_ids) != len(lengths):
        raise DynBatchValueError(
            f"{baseline}: rollout_ids has {len(rollout_ids)} entries for {len(lengths)} lengths; "
            f"pass one rollout id per sample or None."
        )


def _equalize(ranks: Ranks, multiple: int) -> int:
    """Pads every rank with placeholders to the same count, a multiple of ``multiple``.

    Returns the number of placeholders added (the harness's, not the framework's).
    """
    target = max(len(rank) for rank in ranks)
    target = max(multiple, round_up(target, multiple))
    added = 0
    for rank in ranks:
        added += target - len(rank)
        rank.extend([] for _ in range(target - len(rank)))
    return added


def verl_workload(length: int) -> int:
    """verl's per-sample workload estimate ``24576 * L + L^2`` (see :data:`VERL_LINEAR_WEIGHT`)."""
    return VERL_LINEAR_WEIGHT * length + length * length


# --------------------------------------------------------------------------------------------------
# Karmarkar-Karp largest differencing, k-way (used by verl and by slime's balance_data option).
# --------------------------------------------------------------------------------------------------


# The implementation lives in the planner (one KK for the planner, slime's static path and these
# baselines); it reproduces verl's ties item for item (``ties="verl"``, its default).
karmarkar_karp = _karmarkar_karp


# --------------------------------------------------------------------------------------------------
# (a) Megatron-Core sequence packing: next fit in arrival order.
# --------------------------------------------------------------------------------------------------


def next_fit(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Hashable]] = None,
    distribution: str = "round_robin",
) -> BaselineSchedule:
    """Megatron-Core's sequence packing: next fit over the global batch in arrival order.

    Follows ``DpBalancedScheduler.get_groups_and_subsamples`` in Megatron-LM
    ``megatron/core/datasets/data_schedule.py``: the sequence lengths of the whole global batch are
    gathered from the DP ranks and packed in their original order, closing the current bin whenever
    the next sample would push it over ``max_seqlen_per_dp_cp_rank * cp`` (next fit: a closed bin is
    never revisited). The bin count is then raised to a multiple of ``dp * group`` (``group`` =
    ``microbatch_group_size_per_vp_stage`` with VPP; here ``microbatch_multiple``) by popping the last
    sample of the last multi-sample bins, walking back from the end, into new single-sample bins
    appended at the end. Micro-batch ``i`` of DP rank ``j`` is bin ``i * dp + j`` (round robin).

    ``distribution="contiguous"`` instead deals bins out the way Megatron-LM's RL loop does
    (``distribute_packed_bins`` in ``megatron/rl/sequence_packing_utils.py``, "fifo"): rank ``r``
    takes a contiguous block of bins, the first ``num_bins % dp`` ranks one more, the others padded
    with empty bins; no splitting. (That path also sorts samples longest first and caps bins at 16
    samples; this baseline keeps arrival order so the two distributions compare like with like.)

    ``rollout_ids`` are ignored: Megatron packs whatever order the sampler delivers.

    Upstream quirks reproduced: a first sample longer than the cap closes an empty first bin, which
    becomes an empty micro-batch (noted); any other oversize sample sits alone in an over-cap bin.

    Raises:
        BaselineFailure: when the alignment walk reaches the first bin before it has moved enough
            samples (upstream ``assert i > 0, "Not enough samples to move"``).
    """
    name = "next_fit"
    _validate(name, lengths, dp_size, token_cap, microbatch_multiple, rollout_ids)
    if distribution not in ("round_robin", "contiguous"):
        raise DynBatchValueError(
            f"{name}: distribution={distribution!r} is not 'round_robin' (megatron/core) or "
            f"'contiguous' (megatron/rl fifo)."
        )
    notes: List[str] = []
    bins: List[List[int]] = []
    current: List[int] = []
    current_tokens = 0
    for i, length in enumerate(lengths):
        if current_tokens + length <= token_cap:
            current.append(i)
            current_tokens += length
        else:
            # Upstream appends the current bin even when it is empty (first sample oversize).
            bins.append(current)
            current = [i]
            current_tokens = length
    if current:
        bins.append(current)
    if bins and not bins[0]:
        notes.append("first sample exceeds the cap: upstream emits an empty first micro-batch")

    if distribution == "contiguous":
        num_bins = len(bins)
        per_rank, extra = divmod(num_bins, dp_size)
        ranks: Ranks = []
        start = 0
        for r in range(dp_size):
            count = per_rank + (1 if r < extra else 0)
            ranks.append([list(b) for b in bins[start : start + count]])
            start += count
        max_bins = ceil_div(num_bins, dp_size)
        upstream = 0
        for rank in ranks:
            upstream += max_bins - len(rank)
            rank.extend([] for _ in range(max_bins - len(rank)))
        harness = _equalize(ranks, microbatch_multiple)
        return BaselineSchedule(
            ranks,
            baseline=name,
            upstream_placeholders=upstream + sum(1 for b in bins if not b),
            harness_placeholders=harness,
            notes=notes,
        )

    multiple = dp_size * microbatch_multiple
    remainder = len(bins) % multiple
    if remainder:
        to_move = multiple - remainder
        i = len(bins) - 1
        while to_move > 0:
            if i <= 0:
                raise BaselineFailure(
                    name,
                    f"cannot raise {len(bins)} bins to a multiple of dp*group={multiple}: the "
                    f"alignment walk reached the first bin with {to_move} samples still to move "
                    f"(upstream asserts 'Not enough samples to move'); {len(lengths)} samples.",
                )
            if len(bins[i]) > 1:
                bins.append([bins[i].pop()])
                to_move -= 1
            else:
                i -= 1
    num_microbatches = len(bins) // dp_size
    ranks = [[bins[m * dp_size + r] for m in range(num_microbatches)] for r in range(dp_size)]
    return BaselineSchedule(
        ranks,
        baseline=name,
        upstream_placeholders=sum(1 for b in bins if not b),
        notes=notes,
    )


# --------------------------------------------------------------------------------------------------
# (b) slime: first fit in arrival order, aligned by splitting bins, strided over DP.
# --------------------------------------------------------------------------------------------------


def _rollout_order(n: int, rollout_ids: Optional[Sequence[Hashable]]) -> List[int]:
    """Sample indices grouped by rollout id, rollouts in order of first appearance."""
    if rollout_ids is None:
        return list(range(n))
    groups: Dict[Hashable, List[int]] = {}
    for i, rid in enumerate(rollout_ids):
        groups.setdefault(rid, []).append(i)
    return [i for members in groups.values() for i in members]


def _split_in_two(members: List[int], lengths: Sequence[int]) -> Tuple[List[int], List[int]]:
    """Longest-processing-time split of a bin into two halves of similar tokens."""
    halves: Tuple[List[int], List[int]] = ([], [])
    sums = [0, 0]
    for i in sorted(members, key=lambda i: -lengths[i]):
        side = 0 if sums[0] <= sums[1] else 1
        halves[side].append(i)
        sums[side] += lengths[i]
    return halves


def slime_first_fit(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Hashable]] = None,
    balance_data: bool = False,
) -> BaselineSchedule:
    """slime's dynamic batch: pack first (first fit over the step), distribute second.

    Follows ``build_dp_schedule`` in THUDM/slime ``slime/utils/dp_schedule.py`` with the helpers of
    ``slime/utils/seqlen_balancing.py``, for one step holding every rollout:

    1. samples are grouped by rollout id (rollouts in order of first appearance);
    2. first fit in that order into bins of ``max_tokens_per_gpu * cp`` tokens (``first_fit_pack``:
       each sample goes to the first open bin with room; a sample over the cap gets its own bin);
    3. the bin count ``K`` is raised to ``max(ceil(K / A) * A, A)`` with ``A = dp * group``
       (``group`` only with VPP; here ``microbatch_multiple``) by repeatedly splitting the bin with
       the most tokens among those with two or more samples into two token-balanced halves
       (``expand_bins_by_splitting``);
    4. bins are dealt to DP ranks strided (rank ``r`` takes bins ``r, r + dp, ...``), or, with
       ``balance_data``, by Karmarkar-Karp with equal counts on per-bin FLOPs (slime estimates them
       from the model config; this baseline uses verl's ``24576*L + L^2`` as the stand-in).

    Raises:
        BaselineFailure: fewer samples than DP ranks (upstream asserts one per rank), or the bins
            cannot be split to the aligned count (upstream asserts after maximal splitting).
    """
    name = "slime_first_fit"
    _validate(name, lengths, dp_size, token_cap, microbatch_multiple, rollout_ids)
    order = _rollout_order(len(lengths), rollout_ids)
    if len(order) < dp_size:
        raise BaselineFailure(
            name, f"{len(order)} samples < dp_size {dp_size}; each step needs a sample per rank."
        )
    bins: List[List[int]] = []
    bin_tokens: List[int] = []
    for i in order:
        for j, tokens in enumerate(bin_tokens):
            if tokens + lengths[i] <= token_cap:
                bins[j].append(i)
                bin_tokens[j] += lengths[i]
                break
        else:
            bins.append([i])
            bin_tokens.append(lengths[i])

    align = dp_size * microbatch_multiple
    target = max(round_up(len(bins), align), align)
    while len(bins) < target:
        candidates = [(sum(lengths[i] for i in b), j) for j, b in enumerate(bins) if len(b) > 1]
        if not candidates:
            raise BaselineFailure(
                name,
                f"could only produce {len(bins)} micro-batches after maximal splitting; need "
                f"{target} (dp*group={align}) for {len(lengths)} samples.",
            )
        _, j = max(candidates)
        left, right = _split_in_two(bins[j], lengths)
        bins[j] = left
        bins.append(right)

    if balance_data:
        weights = [sum(verl_workload(lengths[i]) for i in b) for b in bins]
        rank_bins = [sorted(part) for part in karmarkar_karp(weights, dp_size, equal_size=True)]
    else:
        rank_bins = [list(range(r, len(bins), dp_size)) for r in range(dp_size)]
    ranks = [[bins[j] for j in rank_bins[r]] for r in range(dp_size)]
    return BaselineSchedule(ranks, baseline=name)


# --------------------------------------------------------------------------------------------------
# (c) verl: KK over DP ranks, then per rank a MAX-synchronised micro-batch count and KK again.
# --------------------------------------------------------------------------------------------------


def _checked_partitions(
    name: str, values: Sequence[int], k: int, equal_size: bool
) -> List[List[int]]:
    """verl's ``get_seqlen_balanced_partitions``: KK, every set non-empty, each set sorted."""
    if len(values) < k:
        raise BaselineFailure(name, f"number of items {len(values)} < k_partitions {k}.")
    parts = karmarkar_karp(values, k, equal_size)
    for j, part in enumerate(parts):
        if not part:
            raise BaselineFailure(name, f"Karmarkar-Karp left partition {j} of {k} empty.")
    return [sorted(part) for part in parts]


def verl_kk(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Hashable]] = None,
    keep_cap: bool = False,
) -> BaselineSchedule:
    """verl's dynamic batch size with Megatron: workload-balanced partitions at two levels.

    Follows volcengine/verl ``verl/trainer/ppo/ray_trainer.py`` ``_balance_batch`` and
    ``verl/utils/seqlen_balancing.py`` ``rearrange_micro_batches`` (as called by
    ``verl/workers/actor/megatron_actor.py``), for one mini-batch:

    1. DP: Karmarkar-Karp with equal sample counts on the workload ``24576*L + L^2`` splits the batch
       into ``dp`` partitions; each rank's samples are ordered by workload, then the even positions
       followed by the odd ones reversed (short samples at both ends);
    2. per rank: ``num_micro_batches = min(samples, ceil(tokens / max_token_len))``, all-reduced
       with MAX over the ranks, rounded up to a multiple of ``microbatch_group_size_per_vp_stage``
       with VPP (``microbatch_multiple`` here);
    3. per rank: Karmarkar-Karp (sizes free) on the workload into that many micro-batches, which
       are then sorted heaviest first and re-laid so the lighter ones sit at both ends.

    The token cap only sets the *count*: KK balances workload, not tokens, so micro-batches can
    exceed ``max_token_len`` (the metrics report them as over the cap).

    ``rollout_ids`` are ignored (verl's PrefixGrouper group balancing is a separate mode).
    ``keep_cap``: verl kept within the cap, as a user would make it: the count grows (by the
    multiple) until no micro-batch of several samples exceeds ``max_token_len`` (not verl's code).

    Raises:
        BaselineFailure: the sample count is not a multiple of dp (``DataProto.chunk`` asserts; its
            auto-padding would repeat samples); a sample is longer than the cap (``max_token_len
            must be greater than the sequence length``); the rounded micro-batch count exceeds a
            rank's samples; or a KK partition is empty.
    """
    name = "verl_kk"
    _validate(name, lengths, dp_size, token_cap, microbatch_multiple, rollout_ids)
    n = len(lengths)
    if n % dp_size:
        raise BaselineFailure(
            name, f"{n} samples are not a multiple of dp_size={dp_size} (DataProto.chunk asserts)."
        )
    longest = max(lengths)
    if longest > token_cap:
        raise BaselineFailure(
            name, f"max_token_len={token_cap} must be >= the longest sequence {longest}."
        )
    workloads = [verl_workload(length) for length in lengths]
    rank_samples = _checked_partitions(name, workloads, dp_size, equal_size=True)
    for r, part in enumerate(rank_samples):
        part.sort(key=lambda i: (workloads[i], i))
        rank_samples[r] = part[::2] + part[1::2][::-1]

    counts = [
        min(len(part), ceil_div(sum(lengths[i] for i in part), token_cap)) for part in rank_samples
    ]
    num_microbatches = max(counts)  # the all-reduce MAX over the DP group
    num_microbatches = round_up(num_microbatches, microbatch_multiple)
    while True:
        smallest = min(len(part) for part in rank_samples)
        if num_microbatches > smallest:
            raise BaselineFailure(
                name,
                f"{num_microbatches} micro-batches (after MAX over ranks and rounding to "
                f"{microbatch_multiple}) > {smallest} samples on a rank.",
            )
        ranks = _verl_micro_batches(name, rank_samples, workloads, num_microbatches)
        over = any(
            len(mb) > 1 and sum(lengths[i] for i in mb) > token_cap for rank in ranks for mb in rank
        )
        if not (keep_cap and over):
            return BaselineSchedule(ranks, baseline=name + ("_capped" if keep_cap else ""))
        num_microbatches += microbatch_multiple


def _verl_micro_batches(
    name: str, rank_samples: List[List[int]], workloads: Sequence[int], num_microbatches: int
) -> Ranks:
    """verl's per-rank step: Karmarkar-Karp into ``num_microbatches``, re-laid light-heavy-light."""
    ranks: Ranks = []
    for part in rank_samples:
        local_workloads = [workloads[i] for i in part]
        local = _checked_partitions(name, local_workloads, num_microbatches, equal_size=False)
        local.sort(key=lambda mb: (sum(local_workloads[i] for i in mb), mb[0]), reverse=True)
        local = local[::2][::-1] + local[1::2]
        ranks.append([[part[i] for i in mb] for mb in local])
    return ranks


# --------------------------------------------------------------------------------------------------
# (d) SkyRL: contiguous DP chunks, balanced (least-loaded) packing per rank, MAX + padding.
# --------------------------------------------------------------------------------------------------


def skyrl_balanced(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Hashable]] = None,
) -> BaselineSchedule:
    """SkyRL's token-based micro-batching (``max_tokens_per_microbatch``).

    Follows NovaSky-AI/SkyRL ``skyrl/backends/skyrl_train/distributed/dispatch.py``
    (``MeshDispatch.stage_chunks``: a mini-batch whose size does not divide by dp is padded with
    ``(-n) % dp`` loss-masked copies of its sample 0, ``pad_training_input_batch`` in
    ``training_batch.py``, then cut into ``dp`` contiguous chunks of equal sample count) and
    ``skyrl/backends/skyrl_train/workers/worker_utils.py`` ``TokenBasedBatchIterator`` with the
    ``Balanced`` packer of ``skyrl/train/dataset/bin_packing.py``: per rank, samples sorted longest
    first (stable) each go to the least-loaded open bin if they fit there, else open a new bin (a
    sample over the cap gets its own bin: the cap is soft). The ranks' bin counts are all-reduced
    with MAX and shorter ranks append padding micro-batches (counted as upstream placeholders).

    The copies of sample 0 are computed like real samples; they appear in the ranks as indices
    ``n, n+1, ...`` with :attr:`BaselineSchedule.dummy_lengths`. SkyRL does not align the count to
    the interleaving group: the harness pads to ``microbatch_multiple``. ``rollout_ids`` are ignored.
    """
    name = "skyrl_balanced"
    _validate(name, lengths, dp_size, token_cap, microbatch_multiple, rollout_ids)
    n = len(lengths)
    dummies = [lengths[0]] * ((-n) % dp_size)
    every_length = list(lengths) + dummies
    chunk = len(every_length) // dp_size
    ranks: Ranks = []
    for r in range(dp_size):
        members = list(range(r * chunk, (r + 1) * chunk))
        members.sort(key=lambda i: -every_length[i])  # stable: equal lengths keep arrival order
        bins: List[List[int]] = []
        heap: List[Tuple[int, int]] = []  # (tokens, bin index); the root is the least loaded bin
        for i in members:
            # Only the least-loaded bin can be the one a sample fits in, if any bin fits it.
            if heap and heap[0][0] + every_length[i] <= token_cap:
                tokens, j = heap[0]
                bins[j].append(i)
                heapq.heapreplace(heap, (tokens + every_length[i], j))
            else:
                bins.append([i])
                heapq.heappush(heap, (every_length[i], len(bins) - 1))
        ranks.append(bins)
    target = max(len(rank) for rank in ranks)
    upstream = 0
    for rank in ranks:
        upstream += target - len(rank)
        rank.extend([] for _ in range(target - len(rank)))
    harness = _equalize(ranks, microbatch_multiple)
    notes = (
        [f"{len(dummies)} copies of sample 0 pad the batch to a multiple of dp"] if dummies else []
    )
    return BaselineSchedule(
        ranks,
        baseline=name,
        upstream_placeholders=upstream,
        harness_placeholders=harness,
        notes=notes,
        dummy_lengths=dummies,
    )


# --------------------------------------------------------------------------------------------------
# (e) NeMo-RL: first fit decreasing, bin count a multiple of dp, round robin.
# --------------------------------------------------------------------------------------------------


def _nemo_shard_check(name: str, n: int, dp_size: int, token_cap: int, longest: int) -> None:
    """The checks NeMo-RL makes before packing (``shard_by_batch_size`` and the packers)."""
    if n % dp_size:
        raise BaselineFailure(
            name,
            f"batch size {n} is not a multiple of shards={dp_size} (shard_by_batch_size asserts).",
        )
    if longest > token_cap:
        raise BaselineFailure(name, f"sequence length {longest} exceeds bin capacity {token_cap}.")


def _nemo_adjust_and_shard(
    name: str, bins: List[List[int]], n: int, dp_size: int, microbatch_multiple: int
) -> BaselineSchedule:
    """``SequencePacker._adjust_bin_count`` (min_bin_count=dp, bin_count_multiple=dp), then the
    round-robin shard ``bins[r::dp]`` of ``shard_by_batch_size``, in packer order."""
    multiple = dp_size * microbatch_multiple
    target = max(len(bins), dp_size)
    target = ceil_div(target, multiple) * multiple
    if target > n:
        raise BaselineFailure(
            name,
            f"cannot create {target} bins with only {n} sequences (min_bin_count={dp_size}, "
            f"bin_count_multiple={multiple}).",
        )
    original = len(bins)
    sources = sorted(((len(b), j) for j, b in enumerate(bins)), reverse=True)
    source = 0
    for _ in range(target - original):
        while len(bins[sources[source][1]]) <= 1:
            source += 1  # the earlier check guarantees a bin with two or more samples remains
        bins.append([bins[sources[source][1]].pop()])
    ranks = [[bins[j] for j in range(r, len(bins), dp_size)] for r in range(dp_size)]
    return BaselineSchedule(ranks, baseline=name)


def nemo_rl_ffd(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Hashable]] = None,
) -> BaselineSchedule:
    """NeMo-RL's sequence packing with the first-fit-decreasing packer.

    Follows NVIDIA-NeMo/RL ``nemo_rl/data/packing/algorithms.py`` (``FirstFitDecreasingPacker``,
    ``SequencePacker._adjust_bin_count``) as driven by ``BatchedDataDict.shard_by_batch_size`` in
    ``nemo_rl/distributed/batched_data_dict.py``: the batch size must divide by dp (an assert:
    multi-turn mixes of any sample count cannot run); the whole batch is sorted by (length, index)
    descending and packed first fit; the bin count is raised to at least ``dp`` and to a multiple of
    ``dp`` by moving the last sample of the bins holding the most samples into new bins; bin ``b``
    goes to rank ``b % dp`` (round robin), in packer order. NeMo-RL's shipped configs use the MFFD
    packer instead (:func:`nemo_rl_mffd`).

    Upstream sets ``bin_count_multiple = dp``; with ``microbatch_multiple > 1`` this baseline passes
    ``dp * microbatch_multiple`` to the same knob (how one would configure it for VPP).
    ``rollout_ids`` are ignored.

    Raises:
        BaselineFailure: a batch size that is not a multiple of dp, a sample longer than the cap
            (upstream ``ValueError``), or fewer samples than the required bin count.
    """
    name = "nemo_rl_ffd"
    _validate(name, lengths, dp_size, token_cap, microbatch_multiple, rollout_ids)
    _nemo_shard_check(name, len(lengths), dp_size, token_cap, max(lengths))
    items = sorted(((length, i) for i, length in enumerate(lengths)), reverse=True)
    bins: List[List[int]] = []
    room: List[int] = []
    for length, i in items:
        for j, free in enumerate(room):
            if free >= length:
                bins[j].append(i)
                room[j] -= length
                break
        else:
            bins.append([i])
            room.append(token_cap - length)
    return _nemo_adjust_and_shard(name, bins, len(lengths), dp_size, microbatch_multiple)


def _mffd_bins(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """``ModifiedFirstFitDecreasingPacker._pack_implementation`` (Johnson & Garey's MFFD).

    Items are classed large (> C/2), medium (> C/3), small (> C/6) and tiny. One bin per large item
    (largest first); a forward pass adds to each the first medium item that fits; a backward pass
    adds to bins without a medium item the smallest small item plus the largest small item that fits
    with it; a forward pass then fills each bin with the largest remaining items that fit; leftovers
    go, largest first, to the least-loaded extra bin if they fit there, else to a new one.
    """
    half, third, sixth = capacity / 2, capacity / 3, capacity / 6
    large = [(i, s) for i, s in enumerate(lengths) if s > half]
    medium = [(i, s) for i, s in enumerate(lengths) if third < s <= half]
    small = [(i, s) for i, s in enumerate(lengths) if sixth < s <= third]
    tiny = [(i, s) for i, s in enumerate(lengths) if s <= sixth]
    large.sort(key=lambda item: item[1], reverse=True)
    medium.sort(key=lambda item: item[1], reverse=True)
    small.sort(key=lambda item: item[1])
    tiny.sort(key=lambda item: item[1])

    bins: List[List[Tuple[int, int]]] = [[item] for item in large]
    for b in bins:
        room = capacity - sum(s for _, s in b)
        for k, (_, s) in enumerate(medium):
            if s <= room:
                b.append(medium.pop(k))
                break
    for b in reversed(bins):
        if any(third < s <= half for _, s in b) or len(small) < 2:
            continue
        room = capacity - sum(s for _, s in b)
        if small[0][1] + small[1][1] > room:
            continue
        first = small.pop(0)
        second = next(
            (k for k in range(len(small) - 1, -1, -1) if small[k][1] <= room - first[1]), None
        )
        if second is not None:
            b.extend([first, small.pop(second)])
    remaining = sorted(medium + small + tiny, key=lambda item: item[1], reverse=True)
    for b in bins:
        while remaining:
            room = capacity - sum(s for _, s in b)
            if room < remaining[-1][1]:
                break
            chosen = next((k for k, (_, s) in enumerate(remaining) if s <= room), None)
            if chosen is None:
                break
            b.append(remaining.pop(chosen))
    extra: List[List[Tuple[int, int]]] = [[]]
    loads: List[int] = [0]  # ascending; extra[0] is the least loaded bin
    for i, s in sorted(remaining, key=lambda item: item[1], reverse=True):
        if s <= capacity - loads[0]:
            target, load = extra.pop(0), loads.pop(0)
        else:
            target, load = [], 0
        target.append((i, s))
        load += s
        position = bisect.bisect(loads, load)
        extra.insert(position, target)
        loads.insert(position, load)
    bins.extend(extra)
    return [[i for i, _ in b] for b in bins if b]


def nemo_rl_mffd(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Hashable]] = None,
) -> BaselineSchedule:
    """NeMo-RL's sequence packing with the packer its shipped configs select: MFFD.

    ``modified_first_fit_decreasing`` in every ``examples/configs`` recipe that packs sequences:
    :func:`_mffd_bins` (``ModifiedFirstFitDecreasingPacker``), then the same bin-count adjustment
    and round-robin shard as :func:`nemo_rl_ffd`, with the same checks.

    Raises:
        BaselineFailure: as :func:`nemo_rl_ffd`.
    """
    name = "nemo_rl_mffd"
    _validate(name, lengths, dp_size, token_cap, microbatch_multiple, rollout_ids)
    _nemo_shard_check(name, len(lengths), dp_size, token_cap, max(lengths))
    bins = _mffd_bins(lengths, token_cap)
    return _nemo_adjust_and_shard(name, bins, len(lengths), dp_size, microbatch_multiple)


# --------------------------------------------------------------------------------------------------
# (f) Fixed micro_batch_size: no dynamic batching.
# --------------------------------------------------------------------------------------------------


def fixed_mbs(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Hashable]] = None,
) -> BaselineSchedule:
    """A fixed ``micro_batch_size`` in arrival order: Megatron's default, padded ``[B, S]`` layout.

    ``B`` is the largest micro-batch size with ``B * max(lengths) <= token_cap`` (every row padded to
    the longest sample). Micro-batch ``m`` of DP rank ``r`` holds samples
    ``[(m * dp + r) * B, (m * dp + r + 1) * B)``, as ``MegatronPretrainingSampler`` hands each rank
    its slice of every ``B * dp`` samples. Megatron requires the global batch to be a multiple of
    ``B * dp`` (and its sampler drops an incomplete last batch); here the samples of an incomplete
    last round fill partial micro-batches and ranks left without one get placeholders (harness
    placeholders), so nothing is dropped. ``rollout_ids`` are ignored.

    Raises:
        BaselineFailure: the longest sample alone exceeds the cap (no ``B >= 1`` fits).
    """
    name = "fixed_mbs"
    _validate(name, lengths, dp_size, token_cap, microbatch_multiple, rollout_ids)
    longest = max(lengths)
    micro_batch_size = token_cap // longest
    if micro_batch_size < 1:
        raise BaselineFailure(
            name, f"the longest sample ({longest} tokens) exceeds token_cap={token_cap}."
        )
    n = len(lengths)
    per_round = micro_batch_size * dp_size
    num_microbatches = ceil_div(n, per_round)
    ranks: Ranks = [[] for _ in range(dp_size)]
    for m in range(num_microbatches):
        for r in range(dp_size):
            start = (m * dp_size + r) * micro_batch_size
            ranks[r].append(
                list(range(start, min(start + micro_batch_size, n))) if start < n else []
            )
    harness = sum(1 for rank in ranks for mb in rank if not mb)
    harness += _equalize(ranks, microbatch_multiple)
    notes = []
    if n % per_round:
        notes.append(
            f"{n} samples are not a multiple of micro_batch_size*dp={per_round}: Megatron would "
            f"reject this global batch size"
        )
    return BaselineSchedule(
        ranks,
        baseline=name,
        harness_placeholders=harness,
        micro_batch_size=micro_batch_size,
        notes=notes,
    )


#: Every baseline by name, for the benchmark drivers.
BASELINES: Dict[str, Callable[..., BaselineSchedule]] = {
    "next_fit": next_fit,
    "slime_first_fit": slime_first_fit,
    "verl_kk": verl_kk,
    "skyrl_balanced": skyrl_balanced,
    "nemo_rl_ffd": nemo_rl_ffd,
    "nemo_rl_mffd": nemo_rl_mffd,
    "fixed_mbs": fixed_mbs,
}


def baseline_planner(baseline: Callable[..., BaselineSchedule]) -> Planner:
    """The baseline as a registered planner (:mod:`megatron_dynbatch.planning.registry`).

    Per step of the config, the baseline schedules the step's samples at the config's budget and
    layout, and its ranks are described as a :class:`~megatron_dynbatch.planning.Plan`
    (``fixed_mbs`` as padded rows). SkyRL's filler copies of sample 0 are no samples of the plan: a
    micro-batch of only fillers becomes a placeholder. The upstream metadata
    (:class:`BaselineSchedule` attributes) is for the benchmark drivers, which call the baseline
    itself.
    """

    def schedule(lengths: List[int], keys: List[Hashable], config) -> Ranks:
        parallel = config.parallel
        ranks = baseline(
            lengths,
            dp_size=parallel.dp_size,
            token_cap=config.token_cap,
            microbatch_multiple=parallel.microbatch_multiple,
            rollout_ids=keys,
        )
        n = len(lengths)
        return [[[i for i in mb if i < n] for mb in rank] for rank in ranks]

    schedule.__name__ = baseline.__name__
    schedule.__doc__ = baseline.__doc__
    return ranks_planner(schedule, layout="padded" if baseline is fixed_mbs else None)


# Every baseline is a planner under its name: `megatron-dynbatch plan --dynamic-batch-planner
# benchmarks.baselines:NAME`, and any benchmark or host config that names it. replace=True: this
# module run a second time (``python -m``, a reload) registers its own names again.
for _name, _baseline in BASELINES.items():
    register_planner(_name, baseline_planner(_baseline), replace=True)
