"""The slime drop-in's fast host code gives exactly what the per-sample code it replaced gave.

``_reference_schedule`` is a frozen copy of ``build_dp_schedule``'s host code before the speed-up
(per-sample ``check_int`` on every length and rollout id, rollouts grouped in a dict, the
partition loop with a generator per micro-batch, two ``SampleSet`` builds, the host oversize pass
always run); the planner, ``check_plan`` and the log-prob planning it calls are the live ones. On
random inputs (both paths, variable and uniform rows, routing replay, CP, interleaving, oversize
samples, string, mixed and numpy ids, bad values anywhere) the two must return equal 4-tuples and
equal ``DPSchedule`` fields, or raise the same error with the same message.
"""

import random
import warnings

import numpy as np
import pytest

import megatron_dynbatch.integrations.slime.schedule as S
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import SLIME, check_host_oversize
from megatron_dynbatch.integrations.slime.config import (
    dynbatch_config_from_slime_args,
    flag,
    planner_oversize_reported,
    routing_replay,
    slime_flags,
)
from megatron_dynbatch.integrations.slime.dp_schedule import DPSchedule, DPScheduleError
from megatron_dynbatch.integrations.slime.flops import cost_model
from megatron_dynbatch.integrations.slime.static_schedule import static_schedule
from megatron_dynbatch.planning import SampleSet, check_plan
from megatron_dynbatch.planning.registry import run_planner
from megatron_dynbatch.planning.spec import check_int
from tests._support import slime_args, slime_tp

pytestmark = pytest.mark.unit


# -- the frozen reference (the host code as it was) ------------------------------------------------


def _ref_lengths(total_lengths):
    lengths = []
    for i, value in enumerate(total_lengths):
        lengths.append(
            check_int(
                f"total_lengths[{i}]",
                value,
                1,
                "pass every sample's token count (prompt + response) as an integer >= 1.",
            )
        )
    if not lengths:
        raise DPScheduleError("total_lengths is empty; there is no sample to schedule.")
    return lengths


def _ref_keys(rollout_indices, num_samples):
    ids = list(rollout_indices)
    if len(ids) != num_samples:
        raise DynBatchValueError(
            f"got {len(ids)} rollout_indices for {num_samples} total_lengths; pass one rollout id "
            "per sample (samples[i].index)."
        )
    keys = []
    for i, rid in enumerate(ids):
        if isinstance(rid, str):
            keys.append(rid)
        else:
            keys.append(
                check_int(
                    f"rollout_indices[{i}]",
                    rid,
                    -(2**63),
                    "pass integer (or string) rollout ids, one per sample.",
                )
            )
    return keys


def _ref_group(keys):
    members = {}
    for position, key in enumerate(keys):
        members.setdefault(key, []).append(position)
    return list(members.values())


def _ref_dynamic(args, sizes, lengths, keys, global_batch_size, pad_size):
    flag(args, "balance_data")
    flag(args, "balance_by_flops")
    config = dynbatch_config_from_slime_args(
        args, rollouts_per_step=global_batch_size, cost=cost_model(args)
    )
    dp, cp = sizes["dp_size"], sizes["cp_size"]
    variable = S.variable_rows(args)
    planner_config = config.planner_config(
        S._layout(sizes, dp), row_multiple=pad_size * cp if variable else None
    )
    check_host_oversize(SLIME, [lengths], planner_config, forward_only=False)
    with planner_oversize_reported():
        plan = run_planner(SampleSet.build(lengths, keys), planner_config)
    check_plan(plan, SampleSet.build(lengths, keys, None), planner_config)
    heads = {members[0] for members in _ref_group(keys)}
    partitions = [[] for _ in range(dp)]
    micro_batch_indices = [[] for _ in range(dp)]
    rollout_counts = [[] for _ in range(dp)]
    row_lengths = [[] for _ in range(dp)]
    seq_lengths = []
    for step in plan.steps:
        uniform = S.row_length(step.seq_length, cp, pad_size, config.max_tokens_per_gpu)
        seq_lengths.append(
            max(max(S._gpu_rows(rows, cp)) for rows in step.row_lengths) if variable else uniform
        )
        for r, rank in enumerate(step.ranks):
            rows = S._gpu_rows(step.row_lengths[r], cp) if variable else [uniform] * len(rank)
            row_lengths[r].extend(rows)
            for mb in rank:
                start = len(partitions[r])
                partitions[r].extend(mb)
                micro_batch_indices[r].append(list(range(start, start + len(mb))))
                rollout_counts[r].append(sum(1 for i in mb if i in heads))
    if routing_replay(args):
        # The live note of a log-prob budget routing replay cannot bind (as the planner is live).
        forward_only = S._replayed_log_probs(config, lengths, None)
    else:
        check_host_oversize(
            SLIME,
            [lengths],
            config.planner_config(
                S._layout(sizes, 1),
                forward_only=True,
                row_multiple=pad_size * cp if variable else None,
            ),
            forward_only=True,
        )
        forward_only = S._forward_only_schedule(
            config,
            sizes,
            lengths,
            partitions,
            pad_size,
            variable,
            training=(micro_batch_indices, row_lengths),
        )
    return DPSchedule(
        partitions,
        micro_batch_indices,
        [step.num_microbatches for step in plan.steps],
        [step.num_rollouts for step in plan.steps],
        seq_lengths=seq_lengths,
        rollout_counts=rollout_counts,
        plan=plan,
        forward_only=forward_only,
        row_lengths=row_lengths,
    )


def _reference_schedule(args, tp, total_lengths, *, global_batch_size, rollout_indices):
    # build_dp_schedule names slime's flags in its errors (the adapter did before issue 46).
    with slime_flags():
        use_dynamic = flag(args, "use_dynamic_batch_size")
        sizes = S._parallel_sizes(args, tp)
        lengths = _ref_lengths(total_lengths)
        keys = _ref_keys(rollout_indices, len(lengths))
        global_batch_size = check_int(
            "global_batch_size",
            global_batch_size,
            1,
            "pass --global-batch-size as the number of rollouts per optimizer step.",
        )
        pad = S.pad_size(args)
        if use_dynamic:
            return _ref_dynamic(args, sizes, lengths, keys, global_batch_size, pad)
        return static_schedule(args, sizes, lengths, _ref_group(keys), global_batch_size, pad)


# -- random inputs ---------------------------------------------------------------------------------


def _case(rng):
    n = rng.randint(1, 160)
    cap = rng.choice([256, 512, 1000, 4096])
    lengths = [max(1, int(rng.lognormvariate(5, 1))) for _ in range(n)]
    if rng.random() < 0.15:
        lengths[rng.randrange(n)] = cap * 2 + 3  # an oversize sample (slime's default: allowed)
    group = rng.choice([1, 2, 4, 8])
    ids = [i // group for i in range(n)]
    if rng.random() < 0.3:
        rng.shuffle(ids)  # a rollout's samples apart
    if rng.random() < 0.2:
        ids = [f"r{i}" for i in ids]
    elif rng.random() < 0.1:
        ids = [i if i % 2 else f"s{i}" for i in ids]
    elif rng.random() < 0.1:
        ids = [np.int32(i) for i in ids]
    if rng.random() < 0.1:
        lengths = [np.int64(x) for x in lengths]
    if rng.random() < 0.08:
        lengths[rng.randrange(n)] = rng.choice([0, True, 3.0, -2, "7"])
    if rng.random() < 0.08:
        ids[rng.randrange(n)] = rng.choice([1.5, None, True, -(2**63) - 1])
    if rng.random() < 0.03:
        ids = ids[:-1]
    rollouts = len({str(i) for i in ids})
    dp = rng.choice([1, 2, 3, 4, 8])
    vpp = rng.choice([1, 1, 2])
    pp = rng.choice([1, 2, 4]) if vpp == 1 else rng.choice([2, 4])
    overrides = dict(
        max_tokens_per_gpu=cap,
        tensor_model_parallel_size=rng.choice([1, 2]),
        pipeline_model_parallel_size=pp,
        data_pad_size_multiplier=rng.choice([1, 8, 128]),
    )
    if rng.random() < 0.25:
        overrides.update(
            use_dynamic_batch_size=False,
            micro_batch_size=rng.choice([1, 2, 4]),
            balance_data=rng.random() < 0.5,
        )
    if rng.random() < 0.2:
        overrides["variable_seq_lengths"] = False
    if rng.random() < 0.15:
        overrides["use_routing_replay"] = True
    if rng.random() < 0.2:
        overrides["log_probs_max_tokens_per_gpu"] = rng.choice([cap // 2, cap * 2])
    tp = slime_tp(dp, rng.choice([1, 1, 2]), vpp, pp if vpp > 1 else 1)
    gbs = rng.choice([1, max(1, rollouts // 3), rollouts, rollouts + 5])
    return slime_args(**overrides), tp, lengths, gbs, ids


def _outcome(build, case):
    args, tp, lengths, gbs, ids = case
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            s = build(args, tp, lengths, global_batch_size=gbs, rollout_indices=ids)
        except DynBatchValueError as error:
            return ("raised", type(error), str(error), [str(w.message) for w in caught])
    fo = s.forward_only
    return (
        tuple(s),
        s.seq_lengths,
        s.row_lengths,
        s.micro_batch_size,
        s.rollout_counts,
        None if fo is None else (fo.micro_batch_indices, fo.row_lengths),
        s.plan,
        [str(w.message) for w in caught],
    )


@pytest.mark.parametrize("seed", range(4))
def test_build_dp_schedule_returns_what_the_per_sample_host_code_returned(seed):
    rng = random.Random(seed)
    built = raised = 0
    for _ in range(40):
        case = _case(rng)
        want = _outcome(_reference_schedule, case)
        got = _outcome(S.build_dp_schedule, case)
        assert got == want, case
        raised += want[0] == "raised"
        built += want[0] != "raised"
    assert built >= 20 and raised >= 1  # both kinds of outcome were compared


def test_a_bad_value_late_in_a_long_list_is_named_as_before():
    lengths = [100] * 5000 + [0] + [100] * 10
    ids = list(range(len(lengths)))
    with pytest.raises(DynBatchValueError, match=r"total_lengths\[5000\]=0 must be >= 1"):
        S.build_dp_schedule(
            slime_args(), slime_tp(2), lengths, global_batch_size=8, rollout_indices=ids
        )
    ids[4321] = 2.0
    with pytest.raises(DynBatchValueError, match=r"rollout_indices\[4321\]=2.0 \(float\)"):
        S.build_dp_schedule(
            slime_args(), slime_tp(2), [100] * 5011, global_batch_size=8, rollout_indices=ids
        )


@pytest.mark.parametrize("seed", range(3))
def test_rollouts_group_by_first_appearance_whether_or_not_contiguous(seed):
    rng = random.Random(seed)
    keys = [i // rng.choice([1, 3, 8]) for i in range(200)]
    for shuffled in (False, True):
        if shuffled:
            rng.shuffle(keys)
        samples = SampleSet.build([10] * len(keys), keys)
        expected = {}
        for i, key in enumerate(keys):
            expected.setdefault(key, []).append(i)
        assert samples.rollouts() == [(key, members) for key, members in expected.items()]
