"""slime's drop-in ``build_dp_schedule`` with per-micro-batch rows, as slime runs it.

slime runs Megatron with ``variable_seq_lengths`` (its ``validate_args`` always sets it), so each
micro-batch may run its own row: ``DPSchedule.row_lengths[r][m]`` is the row the patched
``get_batch`` pads micro-batch ``m`` of DP rank ``r`` to. Checked here: every row holds its samples
as slime's CP slicing lays them out, stays within the budget (only a lone oversize sample may
exceed it), keeps slime's ``tp * data_pad_size_multiplier`` alignment where that fits; placeholders
run the shortest row; ``variable_seq_lengths=False`` keeps one row per step; no DP rank idles
when the step has a sample for each; and, scored with the rows each runtime builds, slime's own
schedule is never more than 0.5% faster in the cost model (``benchmarks/as_run.py``).
"""

import random
import types

import pytest

from benchmarks import as_run
from megatron_dynbatch.adapters.slime import build_dp_schedule
from megatron_dynbatch.planning import PlannerConfig, plan_schedule
from megatron_dynbatch.planning.spec import ParallelLayout, round_up
from megatron_dynbatch.planning.step_search import variable_rows
from tests._support import slime_tp

pytestmark = pytest.mark.unit


def _args(**overrides):
    values = dict(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=4096,
        micro_batch_size=1,
        balance_data=False,
        balance_by_flops=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        data_pad_size_multiplier=128,
        oversize_samples="allow",
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _random_layout(rng):
    dp = rng.choice([1, 2, 3, 4, 8, 16])
    pp = rng.choice([1, 2, 4])
    vpp = rng.choice([1, 2]) if pp > 1 else 1
    tp = rng.choice([1, 2])
    cp = rng.choice([1, 1, 2])
    cap = rng.choice([1000, 1024, 4096, 8192])
    return dp, pp, vpp, tp, cp, cap


def test_every_row_holds_its_samples_within_the_budget():
    rng = random.Random(0)
    for case in range(150):
        dp, pp, vpp, tp, cp, cap = _random_layout(rng)
        n = rng.randint(1, 6 * dp)
        lengths = [rng.randint(2, cap * cp) if rng.random() < 0.3 else rng.randint(2, cap // 4)]
        lengths += [rng.randint(2, cap * cp) for _ in range(n - 1)]
        oversize = rng.random() < 0.1
        if oversize:
            lengths[0] = cap * cp + rng.randint(1, 500)
        args = _args(
            max_tokens_per_gpu=cap, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
        schedule = build_dp_schedule(
            args,
            slime_tp(dp, cp, vpp, pp),
            lengths,
            global_batch_size=n,
            rollout_indices=list(range(n)),
        )
        where = f"case {case}: dp{dp} pp{pp} vpp{vpp} tp{tp} cp{cp} cap{cap} lengths={lengths}"
        pad = tp * 128
        assert [len(r) for r in schedule.row_lengths] == [
            len(m) for m in schedule.micro_batch_indices
        ], where
        assert schedule.seq_lengths == [max(max(rows) for rows in schedule.row_lengths)], where
        for r in range(dp):
            for m, (mb, row) in enumerate(
                zip(schedule.micro_batch_indices[r], schedule.row_lengths[r], strict=True)
            ):
                members = [lengths[schedule.partitions[r][i]] for i in mb]
                # What slime's get_batch puts in the row: every sample padded to 2 * cp, split.
                packed = sum(round_up(x, 2 * cp) if cp > 1 else x for x in members) // cp
                assert packed <= row, f"{where}: rank {r} mb {m} holds {packed} > row {row}"
                lone_oversize = len(members) == 1 and members[0] > cap * cp
                if not lone_oversize:
                    assert row <= cap, f"{where}: rank {r} mb {m} row {row} > budget {cap}"
                if not members:
                    assert row == min(pad, cap) or row <= pad, f"{where}: placeholder row {row}"
                elif round_up(packed, pad) <= cap:
                    assert row % pad == 0, f"{where}: rank {r} mb {m} row {row} not aligned"


def test_rows_vary_by_default_and_stay_uniform_without_shape_exchange():
    lengths = [3000, 200, 150, 2900, 100, 80, 2500, 60]
    config = slime_tp(dp_size=2)
    variable = build_dp_schedule(
        _args(), config, lengths, global_batch_size=8, rollout_indices=list(range(8))
    )
    uniform = build_dp_schedule(
        _args(variable_seq_lengths=False),
        config,
        lengths,
        global_batch_size=8,
        rollout_indices=list(range(8)),
    )
    assert variable.variable_rows and not uniform.variable_rows
    assert {row for rows in uniform.row_lengths for row in rows} == set(uniform.seq_lengths)
    assert sum(map(sum, variable.row_lengths)) < sum(map(sum, uniform.row_lengths))
    # The rows ship to each rank, for the training and the log-prob passes alike.
    for r in range(2):
        fields = variable.rank_fields(r)
        assert fields["dynbatch_row_lengths"] == variable.row_lengths[r]
        assert fields["dynbatch_logprob_row_lengths"] == variable.forward_only.row_lengths[r]
        assert len(fields["dynbatch_logprob_row_lengths"]) == len(
            fields["dynbatch_logprob_micro_batch_indices"]
        )


def test_placeholders_run_the_shortest_row():
    # Interleaving at dp 2 with group 4 needs 8 micro-batches for 3 samples.
    lengths = [3000, 200, 1500]
    schedule = build_dp_schedule(
        _args(pipeline_model_parallel_size=4),
        slime_tp(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=4),
        lengths,
        global_batch_size=3,
        rollout_indices=[0, 1, 2],
    )
    rows = [
        row
        for mbs, rank_rows in zip(schedule.micro_batch_indices, schedule.row_lengths, strict=True)
        for mb, row in zip(mbs, rank_rows, strict=True)
        if not mb
    ]
    assert len(rows) == 5 and set(rows) == {128}


def test_no_dp_rank_idles_when_the_step_has_a_sample_for_each():
    rng = random.Random(1)
    for case in range(300):
        dp, pp, vpp, tp, cp, cap = _random_layout(rng)
        n = rng.randint(dp, 3 * dp)
        lengths = [
            rng.choice([rng.randint(2, cap // 8), rng.randint(cap // 4, cap)]) for _ in range(n)
        ]
        ids = [i // rng.choice([1, 2]) for i in range(n)]
        schedule = build_dp_schedule(
            _args(
                max_tokens_per_gpu=cap,
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
            ),
            slime_tp(dp, cp, vpp, pp),
            lengths,
            global_batch_size=len(dict.fromkeys(ids)),
            rollout_indices=ids,
        )
        idle = [r for r in range(dp) if not schedule.partitions[r]]
        assert not idle, f"case {case}: dp{dp} pp{pp} vpp{vpp} n={n}: ranks {idle} idle"
        assert schedule.plan.stats.idle_ranks == 0


def test_planner_reports_idle_ranks_when_there_are_fewer_samples_than_ranks():
    config = PlannerConfig(max_tokens_per_gpu=1024, parallel=ParallelLayout(dp_size=4))
    plan = plan_schedule([100, 200], None, None, config=config)
    assert plan.steps[0].idle_ranks == 2 and plan.stats.idle_ranks == 2
    assert plan.to_dict()["steps"][0]["idle_ranks"] == 2


def test_variable_rows_never_round_past_the_cap():
    config = PlannerConfig(
        max_tokens_per_gpu=1000,
        variable_row_lengths=True,
        row_multiple=128,
        oversize_samples="allow",
    )
    plan = plan_schedule([990, 950, 10, 20, 1300], None, None, config=config)
    [step] = plan.steps
    for mb, row in zip(step.ranks[0], step.row_lengths[0], strict=True):
        if mb == (4,):
            assert row == 1408  # a lone oversize sample keeps the alignment
        else:
            assert row <= 1000, (mb, row)


def test_a_placeholder_row_is_never_over_the_budget():
    # tp 8 pads rows to 1,024 tokens, over a budget of 1,000; the step's one sample (1,500) is
    # oversize and runs alone in a row of 2,048. The other rank's placeholder ran that row too
    # (twice the budget, for no sample); it runs the budget rounded down to the tp size.
    schedule = build_dp_schedule(
        _args(max_tokens_per_gpu=1000, tensor_model_parallel_size=8),
        slime_tp(dp_size=2),
        [1500],
        global_batch_size=1,
        rollout_indices=[0],
    )
    for rows in (schedule.row_lengths, schedule.forward_only.row_lengths):
        by_rank = {
            bool(mb): row
            for mbs, rank_rows in zip(schedule.micro_batch_indices, rows, strict=True)
            for mb, row in zip(mbs, rank_rows, strict=True)
        }
        assert by_rank == {True: 2048, False: 1000}
    # With a real row within the budget, the placeholder runs the shortest such row.
    assert variable_rows([1500, 600, 0], 1024, 1000, sample_multiple=8) == [2048, 600, 600]
    assert variable_rows([1500, 0], 1024, 1000, sample_multiple=8) == [2048, 1000]
    assert variable_rows([20, 0], 128, 16) == [128, 16]


def test_a_lone_oversize_row_is_not_aligned_past_the_memory_budget():
    class Budget:
        """A memory budget that holds rows of up to 1,350 tokens (MemoryLimit.fits' shape)."""

        def fits(self, shape):
            rows, length = shape
            return rows * length <= 1350

    assert variable_rows([1300, 990, 0], 128, 1000) == [1408, 990, 128]
    assert variable_rows([1300, 990, 0], 128, 1000, Budget()) == [1300, 990, 128]
    # Within the budget the alignment stays.
    assert variable_rows([1200], 128, 1000, Budget()) == [1280]


def test_slime_is_never_faster_in_the_model_as_each_runtime_runs():
    """ours through build_dp_schedule and its rows vs slime's schedule and get_batch's rows."""
    rng = random.Random(7)
    for k in range(24):
        case = as_run.random_case(rng, k)
        result = as_run.run_case(case, [0.0, 0.01, 0.05])
        assert result["ours_over_cap"] == 0, result
        for fraction, ratio in result.get("ratios", {}).items():
            assert ratio <= 1 + as_run.TOLERANCE, (case.label, fraction, ratio)
        for fraction, ratio in result.get("told_ratios", {}).items():
            assert ratio <= 1 + as_run.TOLERANCE, (case.label, "told", fraction, ratio)


def _grpo_case(lengths, pp, vpp, tp, cap):
    samples = as_run.LengthSet(list(lengths), None, None)
    return as_run.SlimeCase("tiny", samples, 1, pp, vpp, tp, 1, cap)


@pytest.mark.parametrize(
    "lengths, pp, vpp, tp, cap, fewer_at",
    [
        # 4 GRPO samples at pp 2 (as_run seed 3 #48): 2 micro-batches are best at 0%, 1 at 5%.
        ([873, 836, 538, 500], 2, 1, 2, 16384, 0.05),
        # 8 at pp 2, vpp 2 (seed 6 #32, heaviest first): 6 micro-batches at every overhead told;
        # not told, 4 before the check against the peers' schedules, 6 now (test_peer_guard.py).
        ([3455, 3244, 2078, 1792, 1652, 1630, 795, 682], 2, 2, 2, 4096, None),
    ],
)
def test_told_the_overhead_the_slime_planner_picks_the_count_for_it(
    lengths, pp, vpp, tp, cap, fewer_at
):
    """--dynamic-batch-cost-microbatch-overhead reaches the planner: on a tiny pipelined step
    whose best count moves with the overhead, told 0 it plans more micro-batches than told 5% of a
    row, and told it is never behind slime's schedule by more than 0.5% (``fewer_at`` None: the
    count holds at every overhead; the ratios are still checked)."""
    case = _grpo_case(lengths, pp, vpp, tp, cap)
    theirs = as_run._slime_schedule(case)
    theirs_rows = as_run.slime_rows(theirs, case.samples.lengths, case)
    counts = {}
    for fraction in (0.0, 0.01, 0.05, None):
        cost = as_run.true_cost(case, fraction or 0.0)
        told = None if fraction is None else cost.microbatch_overhead
        ranks, rows, _ = as_run.ours_as_run(case, told)
        counts[fraction] = len(ranks[0])
        if fraction is not None:
            ours = as_run.step_time(ranks, rows, case.samples.lengths, case, cost)
            slime = as_run.step_time(theirs, theirs_rows, case.samples.lengths, case, cost)
            assert ours <= slime * (1 + as_run.TOLERANCE), (fraction, ours / slime)
    if fewer_at is None:
        assert counts[0.0] == counts[0.05] == counts[None], counts
    else:
        assert counts[0.0] > counts[fewer_at], counts


def test_a_rank_holding_a_sample_that_fills_the_row_holds_little_else():
    """84 long-tailed samples at dp 4, pp 2, one of them 16,384 tokens (the cap): the rank that
    holds it is the step unless it holds little else. The default planner builds clustered
    ranks on a step this small (slime's first fit was 1.3% ahead of ours at every overhead)."""
    _assert_level_with_a_cap_filling_sample(40, 66, "#66 long_tail n=84 dp4 pp2")


def _assert_level_with_a_cap_filling_sample(seed, index, label):
    """``as_run``'s case ``index`` of ``seed`` (checked by ``label``) holds a sample at the cap,
    and ours is never more than 0.5% behind slime's at 0 and 5%, told the overhead or not."""
    rng = random.Random(seed)
    for k in range(index + 1):
        case = as_run.random_case(rng, k)
    assert case.label.startswith(label), case.label
    assert max(case.samples.lengths) == case.max_tokens_per_gpu
    result = as_run.run_case(case, [0.0, 0.05])
    for ratios in (result["ratios"], result["told_ratios"]):
        for fraction, ratio in ratios.items():
            assert ratio <= 1 + as_run.TOLERANCE, (fraction, ratio)


def test_a_large_step_is_refined_around_its_cap_filling_sample():
    """1,408 GRPO samples at dp 64, pp 4 x vpp 2, cap 16,384, one sample at the cap: a step over
    the ramps' limit was not refined, and the rank holding that sample (balanced by work, its
    other samples spread over three micro-batches around it) was the step: slime's first fit was
    0.7% ahead of ours (``benchmarks.as_run --seed 56``, case 64). Refined on a smaller budget,
    the rank's neighbours move and ours is ahead at every overhead, told and not."""
    _assert_level_with_a_cap_filling_sample(56, 64, "#64 grpo n=1408 dp64 pp4 vpp2")
