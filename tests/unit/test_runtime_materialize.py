"""materialize_microbatches: round trips, placeholders, label boundaries, THD metadata, errors."""

import dataclasses
import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.runtime import (
    BatchSchema,
    FieldSpec,
    materialize_microbatches,
    microbatch_shapes,
)
from tests._support import make_step_plan

pytestmark = pytest.mark.unit

PAD_TOKEN = 99

SCHEMA = BatchSchema(
    fields=(
        FieldSpec(name="advantages", kind="token", dtype=torch.float32, pad_value=-7.0),
        FieldSpec(name="old_logp", kind="token", dtype=torch.float32, shift_to_labels=True),
        FieldSpec(
            name="group", kind="sample", dtype=torch.int64, pad_value=-1, trailing_shape=(2,)
        ),
    ),
    pad_token_id=PAD_TOKEN,
)


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def make_samples(lengths, rng):
    samples = {}
    for i, length in enumerate(lengths):
        sample = {
            "tokens": torch.tensor(
                [rng.randrange(1, 50) for _ in range(length)], dtype=torch.int64
            ),
            "advantages": torch.randn(length, generator=torch.Generator().manual_seed(i)),
            "old_logp": -torch.arange(1, length + 1, dtype=torch.float32),
            "group": torch.tensor([i, 2 * i], dtype=torch.int64),
        }
        choice = rng.randrange(3)
        if choice == 1:
            sample["prompt_length"] = rng.randrange(0, length + 1)
        elif choice == 2:
            sample["loss_mask"] = torch.tensor([rng.random() < 0.7 for _ in range(length)])
        samples[i] = sample
    return samples


def random_plan(lengths, *, layout, sample_multiple, dp_size, rng, max_rows=3):
    """First-fit bins of the samples, spread unevenly over ranks, padded with placeholders."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    padded = [_round_up(n, sample_multiple) for n in lengths]
    seq_length = max(padded) + sample_multiple * rng.randrange(3)
    if layout == "packed":
        bins, loads = [], []
        for i in order:
            for b, load in enumerate(loads):
                if load + padded[i] <= seq_length:
                    bins[b].append(i)
                    loads[b] += padded[i]
                    break
            else:
                bins.append([i])
                loads.append(padded[i])
        micro_batch_size = 1
    else:
        micro_batch_size = rng.randrange(1, max_rows + 1)
        bins = []
        while order:
            take = rng.randrange(1, micro_batch_size + 1)
            bins.append(order[:take])
            order = order[take:]
    ranks = [[] for _ in range(dp_size)]
    for b in bins:
        ranks[rng.randrange(dp_size)].append(tuple(b))
    num_microbatches = max(len(r) for r in ranks) + rng.randrange(2)
    for rank in ranks:
        while len(rank) < num_microbatches:
            rank.insert(rng.randrange(len(rank) + 1), ())
    return make_step_plan(ranks, seq_length=seq_length, micro_batch_size=micro_batch_size)


def check_rank(microbatches, plan, dp_rank, samples, *, layout, sample_multiple):
    """Every contract of the micro-batch dicts, checked against the samples they came from."""
    b, s = plan.micro_batch_size, plan.seq_length
    shapes = microbatch_shapes(SCHEMA, micro_batch_size=b, seq_length=s)
    rank_mbs = plan.rank_microbatches(dp_rank)
    assert len(microbatches) == plan.num_microbatches == len(rank_mbs)
    for m, (mb_plan, batch) in enumerate(zip(rank_mbs, microbatches, strict=True)):
        assert set(batch) == set(shapes) | {"cu_seqlens"}
        for key, (shape, dtype) in shapes.items():
            assert tuple(batch[key].shape) == shape and batch[key].dtype == dtype, key
        assert batch["cu_seqlens"].dtype == torch.int32

        # THD segments: row boundaries are segment boundaries, every segment a multiple long.
        cu = batch["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == b * s
        assert all(hi > lo for lo, hi in itertools.pairwise(cu))
        assert {r * s for r in range(b + 1)} <= set(cu)
        flat = {key: batch[key].reshape(b * s, *batch[key].shape[2:]) for key in shapes}
        segment_in_row = 0
        row_samples = {r: [] for r in range(b)}
        for lo, hi in itertools.pairwise(cu):
            row = lo // s
            if lo % s == 0:
                segment_in_row = 0
            assert (hi - lo) % sample_multiple == 0
            assert flat["segment_ids"][lo:hi].tolist() == [segment_in_row] * (hi - lo)
            assert flat["position_ids"][lo:hi].tolist() == list(range(hi - lo))
            segment_in_row += 1
            index = int(flat["sample_index"][lo])
            if index < 0:  # the row's padding tail: pure padding
                assert flat["sample_index"][lo:hi].eq(-1).all()
                continue
            row_samples[row].append(index)
            sample = samples[index]
            n = sample["tokens"].shape[0]
            assert hi - lo == _round_up(n, sample_multiple)
            assert flat["sample_index"][lo : lo + n].eq(index).all()
            assert flat["sample_index"][lo + n : hi].eq(-1).all()
            tokens = sample["tokens"]
            mask = SCHEMA.check_sample(index, sample).loss_mask
            assert torch.equal(flat["tokens"][lo : lo + n], tokens)
            assert flat["labels"][lo : lo + n].tolist() == tokens[1:].tolist() + [0]
            assert flat["loss_mask"][lo : lo + n].tolist() == mask[1:].tolist() + [0.0]
            assert torch.equal(flat["advantages"][lo : lo + n], sample["advantages"])
            old = sample["old_logp"]
            assert flat["old_logp"][lo : lo + n].tolist() == old[1:].tolist() + [0.0]
            assert torch.equal(flat["group"][lo : lo + n], sample["group"].expand(n, 2))

        # The plan's samples, in plan order (packed: one row, or the rows packed_rows counts;
        # padded: one sample per row).
        if layout == "packed":
            counts = plan.packed_rows[dp_rank][m] if plan.packed_rows else (len(mb_plan),)
            starts = list(itertools.accumulate(counts, initial=0))
            rows = [list(mb_plan[lo:hi]) for lo, hi in itertools.pairwise(starts)]
            assert [row_samples[r] for r in range(b)] == rows + [[]] * (b - len(rows))
        else:
            assert [row_samples[r] for r in range(b)] == [[i] for i in mb_plan] + [[]] * (
                b - len(mb_plan)
            )

        # Padding carries pad values and is never a loss target.
        pad = flat["sample_index"] < 0
        assert flat["tokens"][pad].eq(PAD_TOKEN).all()
        assert flat["labels"][pad].eq(0).all()
        assert flat["loss_mask"][pad].eq(0).all()
        assert flat["advantages"][pad].eq(-7.0).all()
        assert flat["group"][pad].eq(-1).all()

        # Labels never cross a sample boundary: a loss target's next token is in the same sample.
        for t in torch.nonzero(flat["loss_mask"]).reshape(-1).tolist():
            assert t % s != s - 1
            assert int(flat["sample_index"][t + 1]) == int(flat["sample_index"][t]) >= 0
            assert int(flat["labels"][t]) == int(flat["tokens"][t + 1])

        if not mb_plan:
            assert flat["loss_mask"].eq(0).all() and flat["sample_index"].eq(-1).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=12),
    layout=st.sampled_from(["packed", "padded"]),
    sample_multiple=st.sampled_from([1, 2, 4, 8]),
    dp_size=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_round_trip_random_plans(lengths, layout, sample_multiple, dp_size, seed):
    rng = random.Random(seed)
    samples = make_samples(lengths, rng)
    plan = random_plan(
        lengths, layout=layout, sample_multiple=sample_multiple, dp_size=dp_size, rng=rng
    )
    for rank in range(dp_size):
        # A rank is given only its own samples.
        own = {i: samples[i] for mb in plan.rank_microbatches(rank) for i in mb}
        mbs = materialize_microbatches(
            plan, rank, own, SCHEMA, layout=layout, sample_multiple=sample_multiple
        )
        check_rank(mbs, plan, rank, samples, layout=layout, sample_multiple=sample_multiple)


def test_packed_worked_example_from_docstring():
    samples = {
        7: {"tokens": torch.tensor([11, 12, 13]), "prompt_length": 1},
        2: {"tokens": torch.tensor([21, 22, 23, 24, 25, 26])},
    }
    plan = make_step_plan([[(7, 2)]], seq_length=16, micro_batch_size=1)
    (batch,) = materialize_microbatches(
        plan, 0, samples, BatchSchema(), layout="packed", sample_multiple=4
    )
    assert batch["segment_ids"].tolist() == [[0] * 4 + [1] * 8 + [2] * 4]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert batch["sample_index"].tolist() == [[7, 7, 7, -1] + [2] * 6 + [-1] * 6]
    assert batch["cu_seqlens"].tolist() == [0, 4, 12, 16]
    assert batch["labels"].tolist() == [[12, 13, 0, 0, 22, 23, 24, 25, 26] + [0] * 7]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0, 1, 1, 1, 1, 1] + [0] * 7]


@pytest.mark.parametrize("layout, b", [("packed", 1), ("padded", 3)])
def test_placeholders_match_real_microbatches_exactly(layout, b):
    samples = make_samples([5, 3, 8], random.Random(0))
    real = (0, 1) if layout == "packed" else (0, 1, 2)
    plan = make_step_plan([[(), real, ()]], seq_length=16, micro_batch_size=b)
    mbs = materialize_microbatches(plan, 0, samples, SCHEMA, layout=layout, sample_multiple=2)
    for placeholder in (mbs[0], mbs[2]):
        assert set(placeholder) == set(mbs[1])
        for key, value in mbs[1].items():
            if key != "cu_seqlens":
                assert (
                    placeholder[key].shape == value.shape and placeholder[key].dtype == value.dtype
                )
        assert placeholder["tokens"].eq(PAD_TOKEN).all()
        assert placeholder["loss_mask"].eq(0).all()
        assert placeholder["labels"].eq(0).all()
        assert placeholder["sample_index"].eq(-1).all()
        # One full-length padding segment per row: never a 1- or 2-token stub.
        assert placeholder["cu_seqlens"].tolist() == [16 * r for r in range(b + 1)]
        assert placeholder["cu_seqlens"].dtype == mbs[1]["cu_seqlens"].dtype


def test_all_placeholder_rank_gets_schema_shapes_without_any_sample():
    plan = make_step_plan([[(0,), (1,)], [(), ()]], seq_length=8, micro_batch_size=1)
    samples = make_samples([6, 8], random.Random(1))
    mbs = materialize_microbatches(plan, 1, {}, SCHEMA, layout="packed", sample_multiple=4)
    peer = materialize_microbatches(plan, 0, samples, SCHEMA, layout="packed", sample_multiple=4)
    assert len(mbs) == 2
    for batch in mbs:
        for key, value in peer[0].items():
            if key != "cu_seqlens":
                assert batch[key].shape == value.shape and batch[key].dtype == value.dtype, key
        assert batch["group"].shape == (1, 8, 2) and batch["group"].dtype == torch.int64
        assert batch["loss_mask"].sum() == 0
    check_rank(mbs, plan, 1, {}, layout="packed", sample_multiple=4)


def test_exact_fit_row_has_no_padding_segment():
    samples = {0: {"tokens": torch.arange(1, 5)}, 1: {"tokens": torch.arange(1, 5)}}
    plan = make_step_plan([[(0, 1)]], seq_length=8, micro_batch_size=1)
    (batch,) = materialize_microbatches(
        plan, 0, samples, BatchSchema(), layout="packed", sample_multiple=4
    )
    assert batch["cu_seqlens"].tolist() == [0, 4, 8]
    assert batch["segment_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]


def test_matches_the_real_planner():
    from megatron_dynbatch.planning import CostModel, ParallelLayout, PlannerConfig, plan_schedule

    rng = random.Random(3)
    lengths = [rng.randrange(1, 16) for _ in range(20)]
    samples = make_samples(lengths, rng)
    # Dense attention (the local implementation) gives packed micro-batches of B > 1 rows.
    dense = CostModel(attention_weight=0.01, attention="dense")
    for layout, cost in (("packed", CostModel()), ("padded", CostModel()), ("packed", dense)):
        config = PlannerConfig(
            max_tokens_per_gpu=64,
            layout=layout,
            parallel=ParallelLayout(dp_size=2, tp_size=4),
            cost=cost,
        )
        plan = plan_schedule(lengths, config=config)
        if layout == "packed":
            assert (plan.steps[0].micro_batch_size > 1) == (cost is dense)
        for step in plan.steps:
            for rank in range(plan.dp_size):
                mbs = materialize_microbatches(
                    step,
                    rank,
                    samples,
                    SCHEMA,
                    layout=plan.layout,
                    sample_multiple=plan.sample_multiple,
                )
                check_rank(
                    mbs,
                    step,
                    rank,
                    samples,
                    layout=plan.layout,
                    sample_multiple=plan.sample_multiple,
                )


def test_a_sample_of_another_length_than_planned_is_refused():
    """A global plan keeps the lengths it planned: a sample shorter than planned (most likely
    another sample than the one planned) is refused like a longer one, in every plan kind that
    plans from lengths; a hand-built plan without them checks nothing."""
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, plan_schedule
    from megatron_dynbatch.planning.fixed import plan_fixed_microbatches
    from megatron_dynbatch.planning.registry import ranks_planner
    from megatron_dynbatch.planning.samples import SampleSet

    lengths = [9, 3, 12, 5, 7, 2]
    config = PlannerConfig(max_tokens_per_gpu=32, parallel=ParallelLayout(dp_size=2))

    def round_robin(step_lengths, keys, config):  # another scheduler, through the adapter
        return [[(i,) for i in range(r, len(step_lengths), 2)] for r in range(2)]

    plans = {
        "dynbatch": plan_schedule(lengths, config=config),
        "fixed": plan_fixed_microbatches(lengths, dp_size=2, micro_batch_size=1, seq_length=16),
        "adapted": ranks_planner(round_robin)(SampleSet.build(lengths), config),
    }
    for name, plan in plans.items():
        step = plan.steps[0]
        assert dict(step.sample_lengths) == dict(enumerate(lengths)), name
        (sample,) = step.rank_microbatches(1)[0][:1]
        for tokens in (lengths[sample] - 1, lengths[sample] + 1):
            samples = {
                i: {"tokens": torch.ones(n, dtype=torch.int64)} for i, n in enumerate(lengths)
            }
            samples[sample] = {"tokens": torch.ones(tokens, dtype=torch.int64)}
            for scheduled in (step, plan.scheduled_steps()[0]):
                with pytest.raises(
                    DynBatchValueError,
                    match=f"dp_rank=1: sample {sample} has {tokens} tokens but was planned with "
                    f"{lengths[sample]}",
                ):
                    materialize_microbatches(
                        scheduled,
                        1,
                        samples,
                        BatchSchema(),
                        layout=plan.layout,
                        sample_multiple=plan.sample_multiple,
                    )
            # The other rank holds only its own samples, which match: it builds its rows.
            materialize_microbatches(
                step,
                0,
                samples,
                BatchSchema(),
                layout=plan.layout,
                sample_multiple=plan.sample_multiple,
            )


def _materialize(ranks, lengths, *, layout="packed", s=8, b=1, m=1, **kwargs):
    plan = make_step_plan(ranks, seq_length=s, micro_batch_size=b)
    samples = {i: {"tokens": torch.ones(n, dtype=torch.int64)} for i, n in enumerate(lengths)}
    samples.update(kwargs.pop("samples", {}))
    return materialize_microbatches(
        plan, 0, samples, BatchSchema(), layout=layout, sample_multiple=m
    )


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (([[(0, 5)]], [3]), {}, "names sample 5, which this rank was not given"),
        (([[(0, 1)]], [5, 4]), {}, "need 9 tokens .* more than seq_length=8"),
        (([[(0,)]], [7]), dict(s=4, m=4), "L=7 -> 8"),
        (([[(0,)]], [7]), dict(s=12, m=8), "seq_length=12 is not a multiple of sample_multiple=8"),
        (([[(0,)]], [3]), dict(b=2), "micro_batch_size=2 needs the step plan's packed_rows"),
        (([[(0, 1, 2)]], [1, 1, 1]), dict(layout="padded", b=2), "do not fit micro_batch_size=2"),
        (([[(0,), (0,)]], [2]), {}, "sample 0 appears in micro-batch 0 and again in micro-batch 1"),
        (([[(0,)]], [2]), dict(layout="thd"), "layout='thd' is not one of"),
        (([[(0,)]], [2]), dict(m=0), "sample_multiple=0"),
        (([[(0,)]], [0]), {}, "sample 0: 'tokens' is empty"),
    ],
)
def test_errors(args, kwargs, message):
    with pytest.raises(DynBatchValueError, match=message):
        _materialize(*args, **kwargs)


def test_padded_length_equal_to_seq_length_fits():
    (batch,) = _materialize([[(0,)]], [7], s=8, m=4)
    assert batch["cu_seqlens"].tolist() == [0, 8]


def test_rank_out_of_range_and_inconsistent_plan():
    plan = make_step_plan([[(0,)]], seq_length=4, micro_batch_size=1)
    samples = {0: {"tokens": torch.ones(2, dtype=torch.int64)}}
    with pytest.raises(DynBatchValueError, match="dp_rank=1 is outside"):
        materialize_microbatches(
            plan, 1, samples, BatchSchema(), layout="packed", sample_multiple=1
        )
    bad = dataclasses.replace(plan, num_microbatches=2)
    with pytest.raises(DynBatchValueError, match="num_microbatches=2"):
        materialize_microbatches(bad, 0, samples, BatchSchema(), layout="packed", sample_multiple=1)


@pytest.mark.parametrize("sample_multiple", [1, 8, 6])
def test_a_long_padding_tail_is_cut_into_short_segments_the_cost_model_prices(sample_multiple):
    """A placeholder row of one S-token segment cost S**2 of attention on flash kernels for
    nothing (small_steps seed 19: SkyRL's copied dummy sample was 1.9% faster). A THD row's tail
    is cut into segments of TAIL_SEGMENT_TOKENS (rounded up to the sample multiple), positions
    restarting in each, and the cost model prices those segments."""
    from megatron_dynbatch.planning.cost import TAIL_SEGMENT_TOKENS, tail_units

    s = 120 * sample_multiple  # 120, 960, 720 tokens
    samples = make_samples([37, 5, 11], random.Random(3))
    plan = make_step_plan([[(0,), (), (1, 2)]], seq_length=s, micro_batch_size=1)
    mbs = materialize_microbatches(
        plan, 0, samples, SCHEMA, layout="packed", sample_multiple=sample_multiple
    )
    check_rank(mbs, plan, 0, samples, layout="packed", sample_multiple=sample_multiple)
    chunk = _round_up(TAIL_SEGMENT_TOKENS, sample_multiple)
    for batch, mb in zip(mbs, plan.rank_microbatches(0), strict=True):
        used = sum(_round_up(samples[i]["tokens"].shape[0], sample_multiple) for i in mb)
        cu = batch["cu_seqlens"].tolist()
        tail = [hi - lo for lo, hi in itertools.pairwise(cu) if lo >= used]
        assert sum(tail) == s - used and all(0 < t <= max(chunk, 1) for t in tail), tail
        assert len(tail) == -(-(s - used) // chunk)
        if chunk == TAIL_SEGMENT_TOKENS:  # the multiple divides the segment: priced exactly
            assert tail_units(s - used) == sum(t * t for t in tail)
    # The tail costs about chunk * T, not T**2: a placeholder row of 960 tokens, under 1/7 of it.
    if sample_multiple == 8:
        assert tail_units(960) == 7 * 128 * 128 + 64 * 64 < 960 * 960 / 7


def test_rows_whose_attention_runs_over_the_whole_row_keep_one_tail_segment():
    """Padded rows (one sample, a causal row) keep the tail as one segment: forward's THD-less
    path reads segment ids 0 (the sample) and 1 (the tail)."""
    samples = make_samples([37, 5], random.Random(3))
    plan = make_step_plan([[(0, 1)]], seq_length=480, micro_batch_size=2)
    (batch,) = materialize_microbatches(
        plan, 0, samples, SCHEMA, layout="padded", sample_multiple=8
    )
    assert batch["cu_seqlens"].tolist() == [0, 40, 480, 488, 960]
    assert int(batch["segment_ids"].max()) == 1
