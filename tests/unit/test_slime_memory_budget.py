"""slime's ``--max-memory-gib``: the rollout side's schedule under the per-stage memory model of
slime's (Megatron's) arguments.

Checked: on random models, layouts and rollouts every step's predicted peak, recomputed here from
the rows the schedule really runs, is within the budget on every DP rank and pipeline stage, and
so is every log-prob row; the budget binds (the same rollouts without it plan steps over it); a
budget the longest sample cannot fit alone is refused naming slime's flag, its value and the
smallest budget that works (which then works); without the option the schedule, its rank fields
and its pickle are what they were; the trainer side logs predicted against measured (CPU: skipped).
"""

import pickle
import random
import re

import pytest

from megatron_dynbatch.adapters.slime import build_dp_schedule
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import SLIME
from megatron_dynbatch.integrations.slime import dp_schedule as S
from megatron_dynbatch.integrations.slime.backend import data_iterators
from megatron_dynbatch.integrations.slime.memory import slime_memory_model
from megatron_dynbatch.integrations.slime.step_memory import STEP_PEAKS
from megatron_dynbatch.planning.memory import GIB, MemoryLimit, budget_gib, predicted_step_peaks
from megatron_dynbatch.planning.spec import ParallelLayout, round_up
from tests._support import slime_args, slime_tp

pytestmark = pytest.mark.unit

FLAG = "--max-memory-gib"


def _step_peak(schedule, step):
    """The largest predicted peak of ``step`` the schedule reports, over DP ranks and stages."""
    return max(max(rank[step]) for rank in schedule.memory.per_rank)


def _case(rng):
    """Random slime arguments (a small GPT), layout and rollouts."""
    pp = rng.choice([1, 2, 4])
    vpp = rng.choice([1, 2]) if pp > 1 else 1
    tp = rng.choice([1, 2])
    cp = rng.choice([1, 1, 2])
    dp = rng.choice([1, 2, 4])
    heads = rng.choice([2, 4])
    args = slime_args(
        num_layers=pp * vpp * rng.choice([1, 2]),
        hidden_size=heads * 16,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=16,
        ffn_hidden_size=heads * 64,
        vocab_size=rng.choice([128, 1024]),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        max_tokens_per_gpu=rng.choice([2048, 4096, 8192]),
        transformer_impl=rng.choice(["local", "transformer_engine"]),
        recompute_granularity=rng.choice([None, None, "selective", "full"]),
        bf16=rng.random() < 0.5,
        use_distributed_optimizer=rng.random() < 0.5,
        variable_seq_lengths=rng.random() < 0.8,
        data_pad_size_multiplier=rng.choice([16, 128]),
    )
    tp_config = slime_tp(dp, cp, vpp, microbatch_group_size_per_vp_stage=pp if vpp > 1 else 1)
    num_rollouts = rng.randint(2, 24)
    lengths, ids = [], []
    for rollout in range(num_rollouts):
        for _ in range(rng.randint(1, 4)):
            long = rng.random() < 0.2
            lengths.append(rng.randint(1000, 3000) if long else rng.randint(8, 600))
            ids.append(rollout)
    return args, tp_config, lengths, ids, rng.randint(1, num_rollouts)


def _layout(args, tp_config):
    vpp = tp_config["vpp_size"]
    return ParallelLayout(
        dp_size=tp_config["dp_size"],
        pp_size=args.pipeline_model_parallel_size,
        vpp_size=vpp,
        microbatch_group_size_per_vp_stage=(
            tp_config["microbatch_group_size_per_vp_stage"] if vpp > 1 else None
        ),
        tp_size=args.tensor_model_parallel_size,
        cp_size=tp_config["cp_size"],
    )


def _build(args, tp_config, lengths, ids, gbs):
    return build_dp_schedule(args, tp_config, lengths, global_batch_size=gbs, rollout_indices=ids)


def _step_peaks(model, schedule):
    """Per step, the largest predicted peak over DP ranks and stages, of the rows it runs."""
    cp = model.dims.parallel.cp_size
    peaks, start = [], 0
    for count in schedule.num_microbatches:
        shapes = [
            [(1, row * cp) for row in rows[start : start + count]] for rows in schedule.row_lengths
        ]
        peaks.append(max(t.total for t in predicted_step_peaks(model, shapes)))
        start += count
    return peaks


@pytest.mark.parametrize("seed", range(6))
def test_no_planned_step_is_predicted_over_the_budget(seed):
    rng = random.Random(seed)
    bound = 0
    for _ in range(8):
        args, tp_config, lengths, ids, gbs = _case(rng)
        model = slime_memory_model(args, _layout(args, tp_config))
        unbounded = _build(args, tp_config, lengths, ids, gbs)
        unbounded_peak = max(_step_peaks(model, unbounded))
        # From just above what the longest sample needs alone up to what no budget plans.
        multiple = model.dims.parallel.sample_multiple
        floor = budget_gib(model.worst_stage((1, round_up(max(lengths), multiple)))[1])
        gib = floor + rng.random() * max(0.0, unbounded_peak / GIB - floor)
        args.max_memory_gib = gib
        schedule = _build(args, tp_config, lengths, ids, gbs)
        budget = int(gib * GIB)
        peaks = _step_peaks(model, schedule)
        assert max(peaks) <= budget, (gib, peaks)
        # What the schedule reports is what it runs.
        assert [_step_peak(schedule, s) for s in range(len(peaks))] == pytest.approx(peaks)
        assert schedule.memory.budget_bytes == budget
        # Every sample trains exactly once, under the budget too.
        assert sorted(i for p in schedule.partitions for i in p) == list(range(len(lengths)))
        # The log-prob passes keep to the training step's budget.
        fo = schedule.forward_only
        if fo is not None:
            cp = tp_config["cp_size"]
            limit = MemoryLimit(model=model, budget_bytes=budget, row_multiple=1)
            assert all(limit.fits((1, row * cp)) for rows in fo.row_lengths for row in rows)
        bound += unbounded_peak > budget
    assert bound >= 1  # the budget changed some plan: without it a step was over


def test_a_budget_too_small_for_the_longest_sample_names_the_smallest_that_works():
    args = slime_args(max_memory_gib=0.001, pipeline_model_parallel_size=2)
    lengths, ids = [100, 3000, 40, 200], [0, 0, 1, 2]
    with pytest.raises(DynBatchValueError, match=r"--max-memory-gib 0\.001 is too small") as error:
        _build(args, slime_tp(2), lengths, ids, 2)
    message = str(error.value)
    assert "one sample of 3000 tokens" in message and "pipeline stage" in message
    smallest = float(message.split("to at least ")[1].split(",")[0])
    args.max_memory_gib = smallest
    schedule = _build(args, slime_tp(2), lengths, ids, 2)
    assert max(_step_peak(schedule, s) for s in range(len(schedule.num_microbatches))) <= (
        smallest * GIB
    )
    args.max_memory_gib = smallest - 0.002
    with pytest.raises(DynBatchValueError, match=r"--max-memory-gib .* is too small"):
        _build(args, slime_tp(2), lengths, ids, 2)
    assert SLIME.key("max_memory_gib") == FLAG  # errors from the shared checks name slime's flag


def test_under_error_a_token_budget_also_short_of_the_longest_is_named_beside_the_memory():
    """A probe: the memory refusal named --max-memory-gib alone; at that value the token
    budget, also short of the sample, was refused next. Both now, and both together plan."""
    args = slime_args(max_memory_gib=0.001, max_tokens_per_gpu=64, pipeline_model_parallel_size=2)
    args.oversize_samples = "error"
    lengths, ids = [100, 3000, 40, 200], [0, 0, 1, 2]
    with pytest.raises(DynBatchValueError, match=r"are too small for this rollout") as error:
        _build(args, slime_tp(2), lengths, ids, 2)
    message = str(error.value)
    named = dict(re.findall(r"(--[\w-]+) to at least (\d+(?:\.\d+)?)", message))
    assert set(named) == {"--max-memory-gib", "--max-tokens-per-gpu"}, message
    args.max_memory_gib = float(named["--max-memory-gib"])
    args.max_tokens_per_gpu = int(named["--max-tokens-per-gpu"])
    _build(args, slime_tp(2), lengths, ids, 2)
    # Under allow the longer sample runs alone: the token budget is not named.
    args = slime_args(max_memory_gib=0.001, max_tokens_per_gpu=64, pipeline_model_parallel_size=2)
    with pytest.raises(DynBatchValueError) as error:
        _build(args, slime_tp(2), lengths, ids, 2)
    assert "--max-tokens-per-gpu to at least" not in str(error.value), str(error.value)


@pytest.mark.parametrize(
    "value, match",
    [
        ("auto", r"--max-memory-gib auto: slime plans the steps on its rollout manager"),
        (0.0, r"--max-memory-gib 0\.0 must be a number of GiB > 0"),
        (float("nan"), r"--max-memory-gib nan must be a number of GiB > 0"),
        (True, r"--max-memory-gib True must be a number of GiB > 0"),
        (1e300, r"--max-memory-gib 1e\+300 must be a number of GiB > 0 \(from 1e-09"),
        (1e-10, r"--max-memory-gib 1e-10 must be a number of GiB > 0 \(from 1e-09"),
    ],
)
def test_bad_budgets_are_refused_in_slimes_words(value, match):
    with pytest.raises(DynBatchValueError, match=match):
        _build(slime_args(max_memory_gib=value), slime_tp(1), [10, 20], [0, 1], 1)


def test_a_budget_without_the_models_arguments_is_refused():
    args = slime_args(max_memory_gib=1.0)
    del args.num_layers
    with pytest.raises(DynBatchValueError, match=r"--max-memory-gib needs the model's Megatron"):
        _build(args, slime_tp(1), [10, 20], [0, 1], 1)


@pytest.mark.parametrize("seed", range(3))
def test_without_the_option_the_schedule_is_what_it_was(seed):
    rng = random.Random(100 + seed)
    for _ in range(6):
        args, tp_config, lengths, ids, gbs = _case(rng)
        plain = _build(args, tp_config, lengths, ids, gbs)
        args.max_memory_gib = None
        unset = _build(args, tp_config, lengths, ids, gbs)
        assert plain.memory is None and unset.memory is None
        assert pickle.dumps(plain) == pickle.dumps(unset)
        # Six fields, as before the option existed (a seventh only with a budget).
        assert len(plain.__reduce__()[1]) == 6
        assert not {S.PREDICTED_PEAK_KEY, S.MEMORY_BUDGET_KEY} & set(plain.rank_fields(0))
        # A budget that never binds plans exactly what no budget plans.
        args.max_memory_gib = 1000.0
        roomy = _build(args, tp_config, lengths, ids, gbs)
        assert tuple(roomy) == tuple(plain) and roomy.row_lengths == plain.row_lengths
        assert pickle.loads(pickle.dumps(roomy)).memory == roomy.memory


def test_the_trainer_logs_predicted_and_skips_measuring_on_cpu(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    args = slime_args(max_memory_gib=0.05, pipeline_model_parallel_size=2)
    lengths, ids = [300, 900, 40, 200, 500], [0, 0, 1, 2, 3]
    schedule = _build(args, slime_tp(1), lengths, ids, 2)
    rollout_data = {
        "partition": schedule.partitions[0],
        "micro_batch_indices": schedule.micro_batch_indices[0],
        "num_microbatches": schedule.num_microbatches,
        "total_lengths": [lengths[i] for i in schedule.partitions[0]],
        **schedule.rank_fields(0),
    }
    iterators = data_iterators(rollout_data, vpp_size=1, cp_size=1)
    # The schedule's keys are taken out (slime would log them as metrics).
    assert S.PREDICTED_PEAK_KEY not in rollout_data and S.MEMORY_BUDGET_KEY not in rollout_data
    assert len(iterators[0].predicted_peaks_mib) == len(schedule.num_microbatches)
    STEP_PEAKS.lines.clear()
    for step in range(len(schedule.num_microbatches)):
        # What agree_on_step does at the start of every step (it needs a process group).
        STEP_PEAKS.begin(step, iterators[0].predicted_peaks_mib[step], 0.05 * 1024)
    STEP_PEAKS.close()
    out = capsys.readouterr().out
    assert len(STEP_PEAKS.lines) == len(schedule.num_microbatches)
    predicted = schedule.memory.per_rank[0][0][0] / 2**20
    assert f"slime step 0: peak memory predicted (MiB): {predicted:.0f}, measured: skipped" in out
    assert "memory budget (MiB): 51" in out
