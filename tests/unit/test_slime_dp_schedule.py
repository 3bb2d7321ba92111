"""``adapters.slime.build_dp_schedule``: slime's signature and return shape, our guarantees.

slime's own invariants (``tests/test_dp_schedule.py`` at the pinned commit): equal micro-batch
counts per rank, every sample once, per-rank index lists tiling the partition, the token cap kept
except by a lone oversize sample, vpp counts a multiple of the group. Ours on top: nothing dropped
(trailing and short steps train), placeholders are empty index lists, every step has one row length.

Against slime's real function and slime's own test module (``SLIME_DIR``):
tests/megatron/test_slime_dp_schedule_vs_slime.py.
"""

import pickle
import random
import re
import types
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch.adapters.slime import DPSchedule, DPScheduleError, build_dp_schedule
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import (
    OversizeSampleWarning,
    ParallelLayout,
    PlannerConfig,
    SampleSet,
    check_plan,
)
from tests._support import slime_args, slime_tp

pytestmark = pytest.mark.unit


def check_slime_invariants(schedule, *, dp_size, expected, total_lengths, cap=None, group=1):
    """slime's ``assert_invariants`` plus the per-step checks slime leaves implicit."""
    partitions, mbi, nmb, gbs = schedule
    assert len(partitions) == len(mbi) == dp_size
    assert len(nmb) == len(gbs)
    seen = []
    for r in range(dp_size):
        # Same number of micro-batches on every rank, every step (pipeline sync).
        assert len(mbi[r]) == sum(nmb), r
        flat = [i for mb in mbi[r] for i in mb]
        assert flat == list(range(len(partitions[r]))), r
        seen.extend(partitions[r])
        for mb in mbi[r]:
            tokens = sum(total_lengths[partitions[r][i]] for i in mb)
            if cap is not None and tokens > cap:
                assert len(mb) == 1, (r, mb, tokens)
    assert sorted(seen) == sorted(expected), "a sample is missing or scheduled twice"
    for n in nmb:
        assert n >= 1 and n % group == 0, nmb


def step_members(schedule, dp_size):
    """Global sample indices of every step (all ranks)."""
    partitions, mbi, nmb, _ = schedule
    steps = [[] for _ in nmb]
    for r in range(dp_size):
        cursor = 0
        for s, n in enumerate(nmb):
            for mb in mbi[r][cursor : cursor + n]:
                steps[s].extend(partitions[r][i] for i in mb)
            cursor += n
    return steps


# -- the seed cases ---------------------------------------------------------------------------


def test_514_samples_at_dp4_with_vpp_all_train_with_equal_counts():
    """slime #2065: 512 rollouts, 2 fan out to 2 samples, each sample about fills a micro-batch.

    slime asserts (cannot split singletons to reach 516) or, with the PR, drops 2 rollouts.
    """
    rollout_ids = []
    for rollout in range(512):
        rollout_ids += [rollout] * (2 if rollout in (100, 300) else 1)
    lengths = [20000] * len(rollout_ids)
    assert len(lengths) == 514
    args = slime_args(max_tokens_per_gpu=32768, pipeline_model_parallel_size=2)
    tp = slime_tp(dp_size=4, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    schedule = build_dp_schedule(
        args, tp, lengths, global_batch_size=512, rollout_indices=rollout_ids
    )
    check_slime_invariants(
        schedule, dp_size=4, expected=range(514), total_lengths=lengths, cap=32768, group=2
    )
    partitions, mbi, nmb, gbs = schedule
    assert gbs == [512]
    assert nmb == [130]  # ceil(514 / 4) = 129 -> 130 for the group of 2
    placeholders = sum(1 for r in range(4) for mb in mbi[r] if not mb)
    assert placeholders == 4 * 130 - 514
    assert schedule.seq_lengths == [20096]  # 20000 padded to a multiple of 128


@pytest.mark.parametrize(
    "sizes", [[3, 2, 3, 1, 2], [1, 1, 4, 1, 3, 1]], ids=["3-2-3-1-2", "1-1-4-1-3-1"]
)
def test_ragged_rollouts_at_dp4_every_sample_trains(sizes):
    """slime #2065's ragged cases: the PR drops rollouts for the first and raises for the second."""
    rollout_ids = [r for r, n in enumerate(sizes) for _ in range(n)]
    lengths = [20000] * len(rollout_ids)
    args = slime_args(max_tokens_per_gpu=32768)
    schedule = build_dp_schedule(
        args,
        slime_tp(dp_size=4),
        lengths,
        global_batch_size=len(sizes),
        rollout_indices=rollout_ids,
    )
    check_slime_invariants(
        schedule, dp_size=4, expected=range(len(lengths)), total_lengths=lengths, cap=32768
    )
    assert schedule.global_batch_sizes == [len(sizes)]
    assert schedule.num_microbatches == [3]  # 11 samples -> 12 micro-batches, 1 placeholder
    assert sum(1 for r in range(4) for mb in schedule.micro_batch_indices[r] if not mb) == 1


def test_fewer_samples_than_ranks_gives_a_rank_only_placeholders():
    """slime #1860: a rank without samples runs placeholders (empty lists), never nothing."""
    schedule = build_dp_schedule(
        slime_args(max_tokens_per_gpu=100),
        slime_tp(dp_size=4),
        [30, 40],
        global_batch_size=2,
        rollout_indices=[0, 1],
    )
    partitions, mbi, nmb, gbs = schedule
    assert nmb == [1] and gbs == [2]
    assert sorted(len(p) for p in partitions) == [0, 0, 1, 1]
    for r in range(4):
        assert len(mbi[r]) == 1
        if not partitions[r]:
            assert mbi[r] == [[]]
    assert schedule.rollout_counts == [[len(p)] for p in partitions]


def test_trailing_rollouts_train_in_a_short_last_step():
    """slime trims rollout 4 (samples 6, 7); we train it in a third step of one rollout."""
    rollout_ids = [0, 0, 1, 2, 2, 3, 4, 4]
    lengths = [3] * 8
    schedule = build_dp_schedule(
        slime_args(max_tokens_per_gpu=12),
        slime_tp(dp_size=1),
        lengths,
        global_batch_size=2,
        rollout_indices=rollout_ids,
    )
    check_slime_invariants(schedule, dp_size=1, expected=range(8), total_lengths=lengths, cap=12)
    assert schedule.global_batch_sizes == [2, 2, 1]
    assert [sorted(s) for s in step_members(schedule, 1)] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_fewer_rollouts_than_global_batch_size_train_as_one_step():
    schedule = build_dp_schedule(
        slime_args(max_tokens_per_gpu=12),
        slime_tp(dp_size=1),
        [3] * 6,
        global_batch_size=4,
        rollout_indices=[0, 0, 1, 1, 2, 2],
    )
    assert schedule.global_batch_sizes == [3]
    check_slime_invariants(schedule, dp_size=1, expected=range(6), total_lengths=[3] * 6, cap=12)


@pytest.mark.parametrize("policy", [None, "allow"])
def test_oversize_sample_runs_alone(policy):
    # What stock slime does with a sample over --max-tokens-per-gpu, and what the patched slime
    # keeps by default (--oversize-samples allow; None: slime's own tests' bare namespace): it
    # trains alone, with one warning naming it and slime's flags (slime has no truncate).
    lengths = [15, 3, 3, 3, 3, 3, 3, 3]
    extra = {} if policy is None else {"oversize_samples": policy}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule = build_dp_schedule(
            slime_args(max_tokens_per_gpu=10, **extra),
            slime_tp(dp_size=2),
            lengths,
            global_batch_size=8,
            rollout_indices=list(range(8)),
        )
    [warning] = [w for w in caught if issubclass(w.category, OversizeSampleWarning)]
    text = str(warning.message)
    assert "sample 0: 15 tokens" in text and "--max-tokens-per-gpu" in text
    assert "--oversize-samples error" in text and "truncate" not in text
    check_slime_invariants(schedule, dp_size=2, expected=range(8), total_lengths=lengths, cap=10)
    partitions, mbi, _, _ = schedule
    [(rank, local)] = [(r, p.index(0)) for r, p in enumerate(partitions) if 0 in p]
    assert [local] in mbi[rank]


def test_the_oversize_warning_says_every_micro_batch_gets_its_row_without_variable_rows():
    """A probe: with variable_seq_lengths off the warning said the sample ran alone over the
    budget; its step's other micro-batches (20-60 real tokens) ran its 71-token rows too."""
    lengths = [71, 30, 30, 30, 30, 20]
    for variable in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            schedule = build_dp_schedule(
                slime_args(max_tokens_per_gpu=64, variable_seq_lengths=variable),
                slime_tp(dp_size=2),
                lengths,
                global_batch_size=6,
                rollout_indices=list(range(6)),
            )
        [warning] = [w for w in caught if issubclass(w.category, OversizeSampleWarning)]
        said = "every micro-batch of its step, placeholders included, gets a row at" in str(
            warning.message
        )
        assert said == (not variable), (variable, str(warning.message))
        if not variable:  # every row is the oversize sample's (slime pads it to 128)
            assert {row for rows in schedule.row_lengths for row in rows} == {128}


def test_oversize_samples_error_stops_before_any_model_work():
    """With --oversize-samples error (opt-in) an oversize sample is refused."""
    lengths = [15, 3, 3, 3]
    with pytest.raises(DynBatchValueError, match=r"15") as caught:
        build_dp_schedule(
            slime_args(max_tokens_per_gpu=10, oversize_samples="error"),
            slime_tp(dp_size=2),
            lengths,
            global_batch_size=4,
            rollout_indices=list(range(4)),
        )
    assert "10" in str(caught.value)  # the budget is named too
    # Only what the patched parser accepts is suggested (it has no truncate).
    assert "--oversize-samples allow" in str(caught.value)
    assert "truncate" not in str(caught.value)
    with pytest.raises(DynBatchValueError, match="--oversize-samples allow \\(default\\) or error"):
        build_dp_schedule(
            slime_args(max_tokens_per_gpu=10, oversize_samples="truncate"),
            slime_tp(dp_size=2),
            lengths,
            global_batch_size=4,
            rollout_indices=list(range(4)),
        )


# -- the return value -------------------------------------------------------------------------


def test_row_alignment_never_breaks_the_token_budget():
    """slime pads a packed row to a multiple of tp * data_pad_size_multiplier (128); under a budget
    that is not such a multiple the padded row must still fit it (1,024 > 1,000 before)."""
    lengths = [990, 400, 500, 300, 999, 20]
    schedule = build_dp_schedule(
        slime_args(max_tokens_per_gpu=1000),
        slime_tp(dp_size=2),
        lengths,
        global_batch_size=6,
        rollout_indices=list(range(6)),
    )
    assert schedule.seq_lengths == [999]
    short = build_dp_schedule(
        slime_args(max_tokens_per_gpu=1000),
        slime_tp(dp_size=2),
        [n // 10 for n in lengths],
        global_batch_size=6,
        rollout_indices=list(range(6)),
    )
    # slime's alignment where it fits the budget.
    [step] = short.plan.steps
    assert short.seq_lengths == [-(-step.seq_length // 128) * 128] and short.seq_lengths[0] < 1000


def test_return_value_unpacks_as_slimes_and_carries_row_shapes():
    lengths = [100, 200, 300, 50, 60, 70, 80, 90]
    schedule = build_dp_schedule(
        slime_args(max_tokens_per_gpu=300, tensor_model_parallel_size=2),
        slime_tp(dp_size=2),
        lengths,
        global_batch_size=4,
        rollout_indices=list(range(8)),
    )
    assert isinstance(schedule, tuple) and isinstance(schedule, DPSchedule) and len(schedule) == 4
    partitions, mbi, nmb, gbs = schedule
    assert schedule.partitions is partitions and schedule.num_microbatches is nmb
    assert len(schedule.seq_lengths) == len(nmb) == 2
    assert schedule.micro_batch_size == 1  # one packed row per micro-batch
    # slime aligns rows to tp 2 x data_pad_size_multiplier 128 = 256; a 300-token budget caps the
    # padded row, so a row over 256 tokens keeps its planned length (a multiple of tp) instead.
    for row, step in zip(schedule.seq_lengths, schedule.plan.steps, strict=True):
        expected = 256 if step.seq_length <= 256 else step.seq_length
        assert row == expected and row % 2 == 0 and row <= 300, (row, step.seq_length)
    for s, step in enumerate(schedule.plan.steps):
        assert schedule.seq_lengths[s] >= step.seq_length
    for r in range(2):
        cursor = 0
        for s, n in enumerate(nmb):
            # Every micro-batch of the step fits the step's row.
            for mb in mbi[r][cursor : cursor + n]:
                assert sum(lengths[partitions[r][i]] for i in mb) <= schedule.seq_lengths[s]
            cursor += n
    # Rollout counts add up to each step's rollouts.
    counts = [0] * len(nmb)
    for r in range(2):
        cursor = 0
        for s, n in enumerate(nmb):
            counts[s] += sum(schedule.rollout_counts[r][cursor : cursor + n])
            cursor += n
    assert counts == gbs
    clone = pickle.loads(pickle.dumps(schedule))
    assert clone == schedule and clone.seq_lengths == schedule.seq_lengths
    assert clone.rollout_counts == schedule.rollout_counts
    assert clone.forward_only == schedule.forward_only
    fields = schedule.rank_fields(1)
    assert fields["dynbatch_seq_lengths"] == schedule.seq_lengths
    assert fields["dynbatch_logprob_micro_batch_indices"] == (
        schedule.forward_only.micro_batch_indices[1]
    )
    assert fields["dynbatch_logprob_row_lengths"] == schedule.forward_only.row_lengths[1]
    assert fields["dynbatch_row_lengths"] == schedule.row_lengths[1]


def test_numpy_integers_are_accepted():
    schedule = build_dp_schedule(
        slime_args(max_tokens_per_gpu=np.int64(64)),
        {k: np.int32(v) for k, v in slime_tp(dp_size=2).items()},
        np.array([10, 20, 30, 40], dtype=np.int64),
        global_batch_size=np.int64(4),
        rollout_indices=np.arange(4),
    )
    check_slime_invariants(schedule, dp_size=2, expected=range(4), total_lengths=[10, 20, 30, 40])


def test_samples_of_a_rollout_stay_in_one_step_non_contiguous_ids():
    rollout_ids = ["a", "b", "a", "c", "b", "c", "d"]
    lengths = [5, 6, 7, 8, 9, 10, 11]
    schedule = build_dp_schedule(
        slime_args(max_tokens_per_gpu=20),
        slime_tp(dp_size=2),
        lengths,
        global_batch_size=2,
        rollout_indices=rollout_ids,
    )
    steps = [sorted(s) for s in step_members(schedule, 2)]
    assert steps == [[0, 1, 2, 4], [3, 5, 6]]
    assert schedule.global_batch_sizes == [2, 2]


# -- properties over random inputs ------------------------------------------------------------


@st.composite
def _cases(draw):
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    vpp = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([2, 3])) if vpp > 1 else 1
    cp = draw(st.sampled_from([1, 2]))
    cap = draw(st.integers(8, 64))
    num_rollouts = draw(st.integers(1, 12))
    ids, lengths = [], []
    for r in range(num_rollouts):
        for _ in range(draw(st.integers(1, 3))):
            ids.append(r)
            lengths.append(draw(st.integers(1, 80)))
    order = draw(st.permutations(range(len(ids))))
    ids = [ids[i] for i in order]
    lengths = [lengths[i] for i in order]
    gbs = draw(st.integers(1, num_rollouts + 2))
    return dp, vpp, group, cp, cap, ids, lengths, gbs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_dynamic_path_keeps_every_guarantee(case):
    dp, vpp, group, cp, cap, ids, lengths, gbs = case
    args = slime_args(max_tokens_per_gpu=cap, pipeline_model_parallel_size=2 if vpp > 1 else 1)
    tp = slime_tp(dp_size=dp, cp_size=cp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        schedule = build_dp_schedule(args, tp, lengths, global_batch_size=gbs, rollout_indices=ids)
    check_slime_invariants(
        schedule,
        dp_size=dp,
        expected=range(len(lengths)),
        total_lengths=lengths,
        cap=cap * cp,
        group=group,
    )
    # The plan behind it passes the planner's own checker.
    config = PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=ParallelLayout(
            dp_size=dp,
            pp_size=2 if vpp > 1 else 1,
            vpp_size=vpp,
            microbatch_group_size_per_vp_stage=group if vpp > 1 else None,
            cp_size=cp,
        ),
        rollouts_per_step=gbs,
    )
    check_plan(schedule.plan, SampleSet.build(lengths, ids), config)
    num_rollouts = len(set(ids))
    assert sum(schedule.global_batch_sizes) == num_rollouts
    assert schedule.global_batch_sizes == [gbs] * (num_rollouts // gbs) + (
        [num_rollouts % gbs] if num_rollouts % gbs else []
    )
    # Rollouts stay whole inside one step.
    step_of = {i: s for s, members in enumerate(step_members(schedule, dp)) for i in members}
    for rid in set(ids):
        assert len({step_of[i] for i, x in enumerate(ids) if x == rid}) == 1


# -- the static path is slime's ---------------------------------------------------------------


def test_static_stride_matches_slime_expectations():
    schedule = build_dp_schedule(
        slime_args(use_dynamic_batch_size=False, micro_batch_size=2),
        slime_tp(dp_size=4),
        [10] * 16,
        global_batch_size=16,
        rollout_indices=list(range(16)),
    )
    partitions, mbi, nmb, gbs = schedule
    assert nmb == [2] and gbs == [16]
    # Strided: rank r takes micro-batches r, r + 4 of [0,1], [2,3], ...
    assert partitions[0] == [0, 1, 8, 9] and partitions[3] == [6, 7, 14, 15]
    assert mbi[0] == [[0, 1], [2, 3]]


def test_static_balance_data_matches_slime_expectations():
    """slime's test_balance_data_distributes_by_flops: the same Karmarkar-Karp assignment."""
    schedule = build_dp_schedule(
        slime_args(use_dynamic_batch_size=False, micro_batch_size=1, balance_data=True),
        slime_tp(dp_size=2),
        [1, 2, 3, 4, 5, 7, 9, 10],
        global_batch_size=8,
        rollout_indices=list(range(8)),
    )
    assert schedule.partitions == [[1, 2, 5, 6], [0, 3, 4, 7]]
    assert schedule.num_microbatches == [4]


def test_static_path_trims_and_asserts_as_slime_does():
    args = slime_args(use_dynamic_batch_size=False, micro_batch_size=1)
    schedule = build_dp_schedule(
        args, slime_tp(dp_size=1), [3] * 5, global_batch_size=2, rollout_indices=list(range(5))
    )
    assert schedule.global_batch_sizes == [2, 2]  # rollout 4 is trimmed, as in slime
    with pytest.raises(AssertionError, match="num_rollouts"):
        build_dp_schedule(
            args, slime_tp(dp_size=1), [3] * 3, global_batch_size=4, rollout_indices=[0, 1, 2]
        )
    with pytest.raises(DPScheduleError, match="not a multiple of dp_size"):
        build_dp_schedule(
            args, slime_tp(dp_size=4), [3] * 5, global_batch_size=5, rollout_indices=list(range(5))
        )


# -- bad input: one ValueError naming the value and the fix -----------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(total_lengths=[None]), r"total_lengths\[0\]=None"),
        (dict(total_lengths=[6.9]), r"total_lengths\[0\]=6.9 \(float\) is not an integer"),
        (dict(total_lengths=["6"]), r"total_lengths\[0\]='6'"),
        (dict(total_lengths=[True]), "bool"),
        (dict(total_lengths=[0]), r"total_lengths\[0\]=0 must be >= 1"),
        # A corrupt length is refused as one, not as over the budget with a budget over the
        # maximum as the fix (both policies).
        (dict(total_lengths=[5, 2**41]), r"total_lengths\[1\]=2199023255552 is above the sup"),
        (
            dict(
                total_lengths=[5, 2**41],
                args=slime_args(max_tokens_per_gpu=64, oversize_samples="error"),
            ),
            "is above the supported maximum 1099511627776",
        ),
        (dict(total_lengths={"a": 1}), "must be a sequence"),
        (dict(global_batch_size=2.0), "global_batch_size=2.0"),
        (dict(global_batch_size=0), "global_batch_size=0 must be >= 1"),
        (dict(rollout_indices=[0, 1]), "2 rollout_indices for 1 total_lengths"),
        (dict(rollout_indices=[0.5]), r"rollout_indices\[0\]=0.5"),
        (dict(tp={"cp_size": 1}), "no 'dp_size'"),
        (dict(tp=dict(slime_tp(), dp_size="2")), "dp_size"),
        (dict(args=slime_args(max_tokens_per_gpu=None)), "--max-tokens-per-gpu"),
        (dict(args=slime_args(max_tokens_per_gpu=1.5)), "max-tokens-per-gpu=1.5"),
        (
            dict(args=slime_args(max_tokens_per_gpu=64, oversize_samples="Allow")),
            "--oversize-samples 'Allow' is not a policy slime runs; use --oversize-samples allow",
        ),
        (dict(args=slime_args(use_dynamic_batch_size="yes")), "use_dynamic_batch_size='yes'"),
    ],
)
def test_bad_arguments_raise_value_errors(change, match):
    kwargs = dict(
        args=slime_args(max_tokens_per_gpu=64),
        tp=slime_tp(dp_size=1),
        total_lengths=[5],
        global_batch_size=1,
        rollout_indices=[0],
    )
    kwargs.update(change)
    if "total_lengths" in change and "rollout_indices" not in change:
        try:
            kwargs["rollout_indices"] = list(range(len(change["total_lengths"])))
        except TypeError:
            pass
    with pytest.raises(DynBatchValueError, match=match):
        build_dp_schedule(
            kwargs["args"],
            kwargs["tp"],
            kwargs["total_lengths"],
            global_batch_size=kwargs["global_batch_size"],
            rollout_indices=kwargs["rollout_indices"],
        )


def test_a_partial_or_attribute_parallel_config_means_the_features_are_off():
    """Only dp_size is required; cp / vpp default to 1, the group to Megatron's default."""
    lengths = [50, 60, 70, 20, 30]
    args = slime_args(max_tokens_per_gpu=100)
    full = build_dp_schedule(args, slime_tp(dp_size=2), lengths, 5, list(range(5)))
    assert tuple(build_dp_schedule(args, {"dp_size": 2}, lengths, 5, list(range(5)))) == tuple(full)
    as_object = types.SimpleNamespace(dp_size=2, vpp_size=2)
    interleaved = build_dp_schedule(args, as_object, lengths, 5, list(range(5)))
    assert all(count % 2 == 0 for count in interleaved[2])  # a multiple of the default group 2
    with pytest.raises(DynBatchValueError, match="dp_size"):
        build_dp_schedule(args, {"cp_size": 1}, lengths, 5, list(range(5)))


def test_both_budgets_under_one_padded_sample_are_named_at_once():
    """A probe: the training budget was named, then, raised, the log-prob budget."""
    for extra, training in (({}, 8), ({"packing_safety_margin": 0.5}, 16)):
        args = slime_args(
            max_tokens_per_gpu=4,
            log_probs_max_tokens_per_gpu=4,
            tensor_model_parallel_size=8,
            **extra,
        )
        build = dict(global_batch_size=2, rollout_indices=[0, 1])
        with pytest.raises(DynBatchValueError) as refused:
            build_dp_schedule(args, slime_tp(dp_size=2), [5, 3], **build)
        message = str(refused.value)
        named = (
            f"raise --max-tokens-per-gpu to at least {training} and "
            "--log-probs-max-tokens-per-gpu to at least 8."
        )
        assert named in message, message
        args.max_tokens_per_gpu, args.log_probs_max_tokens_per_gpu = training, 8
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OversizeSampleWarning)
            build_dp_schedule(args, slime_tp(dp_size=2), [5, 3], **build)


def _build_quietly(values, cp, lengths):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        return build_dp_schedule(
            slime_args(**values), slime_tp(dp_size=1, cp_size=cp), lengths,
            global_batch_size=1, rollout_indices=[0] * len(lengths),
        )  # fmt: skip


def test_every_short_budget_is_named_in_one_refusal_whose_values_plan():
    """A re-probe: four chains (a training budget under one padded sample under error, then the
    longest sample; both token budgets, one then the other; memory and both token budgets;
    memory and a token budget under one padded sample at the default policy), each named fix
    refused next for another budget. Random cases now plan after one refusal's values."""
    fields = {
        "--max-tokens-per-gpu": "max_tokens_per_gpu",
        "--log-probs-max-tokens-per-gpu": "log_probs_max_tokens_per_gpu",
        "--max-memory-gib": "max_memory_gib",
    }
    model = dict(num_attention_heads=8, num_query_groups=8, hidden_size=128, kv_channels=16)
    refused = 0
    for seed in range(120):
        rng = random.Random(seed)
        values = dict(model, pipeline_model_parallel_size=rng.choice([1, 2]))
        values["tensor_model_parallel_size"] = rng.choice([1, 2, 8])
        values["max_tokens_per_gpu"] = rng.choice([1, 4, 8, 64, 600, 4096])
        if rng.random() < 0.5:
            values["oversize_samples"] = "error"
        if rng.random() < 0.5:
            values["log_probs_max_tokens_per_gpu"] = rng.choice([1, 4, 8, 64, 600])
        if rng.random() < 0.5:
            values["max_memory_gib"] = rng.choice([0.0001, 0.002, 0.05])
        if rng.random() < 0.3:
            values["packing_safety_margin"] = rng.choice([0.5, 0.9])
        cp = rng.choice([1, 1, 2])
        lengths = [rng.randint(5, 600) for _ in range(rng.randint(1, 6))]

        try:
            _build_quietly(values, cp, lengths)
            continue
        except DynBatchValueError as error:
            message = str(error)
        refused += 1
        named = re.findall(r"(--[\w-]+) to at least (\d+(?:\.\d+)?)", message.split(", or ")[0])
        assert named, (seed, message)
        for flag, value in named:
            values[fields[flag]] = float(value) if "." in value else int(value)
        _build_quietly(values, cp, lengths)  # one refusal's values plan (else: the next one)
    assert refused > 30, refused
