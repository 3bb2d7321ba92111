"""Tests of the pipeline step-time simulator against Megatron's orders and the closed forms.

Closed forms (equal costs: forward ``f`` and backward ``b`` per micro-batch for the whole model, so
``f/pp``, ``b/pp`` per stage and ``f/(pp*vpp)``, ``b/(pp*vpp)`` per model chunk):

* 1F1B: the last stage starts after the first micro-batch's forward crossed the ``pp - 1`` stages
  before it, then is never idle for ``M`` forwards and backwards, and the step ends when the last
  backward has crossed back ``pp - 1`` stages: ``(pp-1)*f/pp + M*(f+b)/pp + (pp-1)*b/pp``
  = ``(M + pp - 1) * (f + b) / pp``.
* Interleaved: the same ramp-up and drain now cross ``pp - 1`` *chunks* of ``1/(pp*vpp)`` of the
  model, while each stage still has ``M*vpp`` chunk steps of work: ``(M*vpp + pp - 1) * (f+b) /
  (pp*vpp)`` = ``(M + (pp-1)/vpp) * (f + b) / pp``, i.e. Megatron's bubble ``(pp-1)/(vpp*M)`` of the
  compute time ``M*(f+b)/pp``. It holds whenever Megatron accepts the layout (group in [pp, M] and a
  last group of 0 or >= pp micro-batches), for any f, b; the tests sweep that space.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import subprocess
import sys

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import simulate
from megatron_dynbatch.planning.simulate import (
    BACKWARD_TO_FORWARD_RATIO,
    _schedule_table,
    ideal_time,
    interleaved_order,
    one_f_one_b_order,
    simulate_1f1b,
    simulate_interleaved,
    simulate_step,
)

pytestmark = pytest.mark.unit

TOL = 1e-9


def test_1f1b_closed_form():
    # One formula over a grid: a loop (the case is in each message), not 150 tests.
    grid = itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 7, 16], [1.0, 2.5], [1.0, 2.0, 3.5])
    for pp, num_mb, f, b in grid:
        case = dict(pp=pp, num_mb=num_mb, f=f, b=b)
        result = simulate_1f1b([f] * num_mb, [b] * num_mb, pp)
        expected = (num_mb + pp - 1) * (f + b) / pp
        assert result.makespan == pytest.approx(expected, abs=TOL), case
        assert result.bubble_overhead == pytest.approx((pp - 1) / num_mb, abs=TOL), case
        for busy in result.stage_busy:
            assert busy == pytest.approx(num_mb * (f + b) / pp, abs=TOL), case


def _valid_interleaved_layouts():
    for pp, vpp in itertools.product([2, 3, 4], [2, 3, 4]):
        for group in (pp, pp + 1, 2 * pp):
            for num_mb in range(group, 4 * group + 1):
                last = num_mb % group
                if 0 < last < pp:
                    continue  # Megatron rejects a short last group
                yield pp, vpp, group, num_mb


def test_interleaved_closed_form():
    layouts = list(_valid_interleaved_layouts())
    assert len(layouts) == 216  # the grid is what it was when each layout was its own test
    for (pp, vpp, group, num_mb), (f, b) in itertools.product(
        layouts, ((1.0, 1.0), (1.0, 2.0), (3.0, 1.0))
    ):
        case = dict(pp=pp, vpp=vpp, group=group, num_mb=num_mb, f=f, b=b)
        result = simulate_interleaved([f] * num_mb, [b] * num_mb, pp, vpp, group)
        expected = (num_mb + (pp - 1) / vpp) * (f + b) / pp
        assert result.makespan == pytest.approx(expected, abs=TOL), case
        expected_overhead = (pp - 1) / (vpp * num_mb)
        assert result.bubble_overhead == pytest.approx(expected_overhead, abs=TOL), case
        # Idle share of pp * makespan: bubble / (compute + bubble).
        expected_fraction = (pp - 1) / (vpp * num_mb + pp - 1)
        assert result.bubble_fraction == pytest.approx(expected_fraction, abs=TOL), case


def test_interleaved_default_group_is_pp():
    costs = [1.0] * 8
    assert (
        simulate_interleaved(costs, costs, 4, 2).makespan
        == simulate_interleaved(costs, costs, 4, 2, 4).makespan
    )


def test_vpp_one_is_1f1b():
    fwd, bwd = [1.0, 3.0, 2.0, 5.0], [2.0, 6.0, 4.0, 9.0]
    assert simulate_interleaved(fwd, bwd, 3, 1).makespan == simulate_1f1b(fwd, bwd, 3).makespan


def test_pp1_is_serial():
    fwd, bwd = [1.0, 3.0, 2.0], [2.0, 6.0, 4.0]
    result = simulate_1f1b(fwd, bwd, 1)
    assert result.makespan == pytest.approx(sum(fwd) + sum(bwd))
    assert result.bubble_fraction == pytest.approx(0.0)


def test_1f1b_order_matches_megatron():
    order = one_f_one_b_order(6, 4, 1)
    names = [f"{kind}{m}" for kind, _, m in order]
    assert names == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5".split()
    # Fewer micro-batches than warm-up slots: all forwards first.
    assert [k for k, _, _ in one_f_one_b_order(2, 8, 0)] == ["F", "F", "B", "B"]


def test_schedule_table_matches_megatron_example():
    # The example in Megatron's schedules.py: PP2, group 3, M5, VP2.
    table = _schedule_table(5, 2, 3)
    assert [m for m, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_interleaved_order_warmup_and_backward_chunks():
    pp, vpp, group, num_mb = 2, 2, 2, 4
    order = interleaved_order(num_mb, pp, vpp, group, stage=0)
    warmup = 2 * (pp - 0 - 1) + (vpp - 1) * group
    assert all(kind == "F" for kind, _, _ in order[:warmup])
    assert order[warmup + 1] == ("B", vpp - 1, 0)  # backward starts on the last chunk
    assert len(order) == 2 * num_mb * vpp


def _check_timeline(result, pp, vpp, num_mb):
    seen = {}
    for e in result.events:
        key = (e.kind, e.chunk * pp + e.stage, e.microbatch)
        assert key not in seen
        seen[key] = e
    assert len(seen) == 2 * pp * vpp * num_mb
    last = pp * vpp - 1
    for (kind, v, m), e in seen.items():
        if kind == "F" and v > 0:
            assert e.start >= seen[("F", v - 1, m)].end - TOL
        if kind == "B":
            dep = seen[("B", v + 1, m)] if v < last else seen[("F", v, m)]
            assert e.start >= dep.end - TOL
    for stage in range(pp):
        events = [e for e in result.events if e.stage == stage]
        for a, b in itertools.pairwise(events):
            assert b.start >= a.end - TOL  # one step at a time on a stage


@pytest.mark.parametrize("seed", range(6))
def test_random_costs_respect_dependencies_and_bounds(seed):
    rng = random.Random(seed)
    pp = rng.choice([2, 3, 4])
    vpp = rng.choice([1, 2, 3])
    num_mb = pp * rng.randint(1, 4)
    fwd = [rng.uniform(0.1, 5.0) for _ in range(num_mb)]
    bwd = [2 * c for c in fwd]
    result = simulate_interleaved(fwd, bwd, pp, vpp)
    _check_timeline(result, pp, vpp, num_mb)
    assert result.makespan >= max(result.stage_busy) - TOL
    # One micro-batch alone must cross the whole model forward and back.
    assert result.makespan >= max(f + b for f, b in zip(fwd, bwd, strict=True)) - TOL
    assert 0.0 <= result.bubble_fraction < 1.0


def test_heavy_microbatch_costs_more_at_the_edges_than_in_the_middle():
    # A known effect the planner exploits: a heavy micro-batch in warm-up/cool-down is exposed.
    base = [1.0] * 8
    heavy_first = [4.0] + base[1:]
    heavy_middle = base[:4] + [4.0] + base[5:]
    first = simulate_1f1b(heavy_first, [2 * c for c in heavy_first], 4).makespan
    middle = simulate_1f1b(heavy_middle, [2 * c for c in heavy_middle], 4).makespan
    assert first > middle


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fwd=[1.0] * 4, bwd=[1.0] * 4, pp=4, vpp=2, group=3), "microbatch_group_size"),
        (dict(fwd=[1.0] * 4, bwd=[1.0] * 4, pp=2, vpp=2, group=5), "microbatch_group_size"),
        (dict(fwd=[1.0] * 7, bwd=[1.0] * 7, pp=4, vpp=2, group=4), "last group"),
        (dict(fwd=[1.0] * 3, bwd=[1.0] * 2, pp=2, vpp=1, group=None), "bwd_costs"),
        (dict(fwd=[], bwd=[], pp=2, vpp=1, group=None), "at least|>= 1"),
        (dict(fwd=[1.0, -1.0], bwd=[1.0, 1.0], pp=2, vpp=1, group=None), "negative"),
        (dict(fwd=[1.0], bwd=[1.0], pp=0, vpp=1, group=None), "pp_size"),
    ],
)
def test_rejects_what_megatron_rejects(kwargs, match):
    with pytest.raises(DynBatchValueError, match=match):
        simulate_interleaved(
            kwargs["fwd"], kwargs["bwd"], kwargs["pp"], kwargs["vpp"], kwargs["group"]
        )


def test_simulate_step_takes_the_slowest_rank_and_ideal_time():
    fast = ([1.0] * 4, [2.0] * 4)
    slow = ([2.0] * 4, [4.0] * 4)
    step = simulate_step([fast, slow], pp_size=2)
    assert step.step_time == pytest.approx(simulate_1f1b(*slow, 2).makespan)
    assert step.ideal_time == pytest.approx((12 + 24) / (2 * 2))
    assert step.efficiency == pytest.approx(step.ideal_time / step.step_time)
    assert len(step.ranks) == 2


def test_simulate_step_forward_costs_only():
    step = simulate_step([[1.0, 1.0], [1.0, 1.0]], pp_size=2)
    expected = simulate_1f1b([1.0, 1.0], [BACKWARD_TO_FORWARD_RATIO] * 2, 2).makespan
    assert step.step_time == pytest.approx(expected)
    assert ideal_time([[1.0, 1.0]], 2) == pytest.approx(2 * (1 + BACKWARD_TO_FORWARD_RATIO) / 2)


def test_simulate_step_interleaved():
    costs = ([1.0] * 8, [2.0] * 8)
    step = simulate_step([costs], pp_size=4, vpp_size=2, group=4)
    assert step.step_time == pytest.approx((8 + 3 / 2) * 3.0 / 4)


def test_simulator_imports_only_the_standard_library():
    code = (
        "import sys; import megatron_dynbatch.planning.simulate; "
        "bad = [m for m in ('torch', 'numpy', 'megatron') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_pipeline_makespan_replays_the_same_schedule():
    """The planner's flat replay gives exactly the event simulation's makespan (40 seeds)."""
    for seed in range(40):
        _check_replay(seed)


def _check_replay(seed):
    from megatron_dynbatch.planning.simulate import pipeline_makespan

    rng = random.Random(seed)
    pp = rng.choice([1, 2, 3, 4, 8])
    vpp = rng.choice([1, 2, 3]) if pp > 1 else 1
    group = pp + rng.randint(0, 2) if vpp > 1 else None
    m = rng.randint(1, 12)
    if vpp > 1:
        m = max(group, m - m % group)  # Megatron needs whole groups of at least pp
    fwd = [rng.random() * 10 for _ in range(m)]
    bwd = [rng.random() * 20 for _ in range(m)]
    case = dict(seed=seed, pp=pp, vpp=vpp, group=group, m=m)
    expected = simulate_interleaved(fwd, bwd, pp, vpp, group).makespan
    assert pipeline_makespan(fwd, pp, vpp, group, bwd) == pytest.approx(expected), case
    default = simulate_interleaved(fwd, [2.0 * c for c in fwd], pp, vpp, group).makespan
    assert pipeline_makespan(fwd, pp, vpp, group) == pytest.approx(default), case


def test_a_shape_replayed_often_is_compiled_and_gives_the_loops_floats():
    """Past ``_COMPILE_AFTER`` replays a shape runs its straight-line code: exactly the loop's
    floats (``==``, plans must not change) for 1F1B and interleaved shapes, ties and zeros
    included, and shapes past ``_COMPILE_MAX_STEPS`` stay in the loop."""
    rng = random.Random(3)
    compiled = 0
    for m, pp, vpp, group in [(1, 2, 1, 1), (5, 3, 1, 1), (12, 4, 1, 1), (8, 4, 2, 4)] + [
        (12, 4, 2, 6),
        (9, 3, 3, 3),
        (40, 8, 2, 8),
    ]:
        shape = (m, pp, vpp, group)
        simulate._REPLAYS_OF_SHAPE.pop(shape, None)
        with _calls_to("_compiled_replay") as calls:
            for k in range(simulate._COMPILE_AFTER + 20):
                fwd = [rng.choice([0.0, 1.0, 2.5, rng.random() * 9]) for _ in range(m)]
                bwd = None if k % 2 else [rng.choice([0.0, 2.0, rng.random() * 20]) for _ in fwd]
                share = float(pp * vpp)
                durations = [c / share for c in fwd] + [
                    c / share for c in (bwd or [2.0 * c for c in fwd])
                ]
                steps, last, _ = simulate._flat_replay(*shape)
                done = {}
                for slot, dep, previous, d in steps:
                    done[slot] = max(done.get(previous, 0.0), done.get(dep, 0.0)) + durations[d]
                got = simulate._replayed(fwd, bwd, pp, vpp, group)
                assert got == max(done[s] for s in last), (shape, k)
        assert len(calls) == 20, (shape, len(calls))  # the loop until then, compiled after
        compiled += simulate._compiled_replay(*shape) is not None
    assert compiled == 7
    steps = simulate._COMPILE_MAX_STEPS // (2 * 8) + 1
    assert simulate._compiled_replay(steps, 8, 1, 1) is None  # too long: the loop


def test_remembered_makespans_give_the_same_floats_and_end_with_the_outermost_scope():
    """Inside :func:`remembered_makespans` a repeated input is not replayed again, the floats are
    those of a fresh replay (so plans are unchanged), and the memory ends with the outermost
    ``with``: a nested one shares it, and a later scope starts empty."""
    rng = random.Random(7)
    inputs = []
    for _ in range(30):
        pp = rng.choice([2, 4])
        vpp = rng.choice([1, 2])
        m = rng.choice([4, 8])
        fwd = [rng.choice([1.0, 2.5, 3.0]) for _ in range(m)]
        bwd = None if rng.random() < 0.5 else [2.2 * c for c in fwd]
        inputs.append((fwd, pp, vpp, None, bwd))
    inputs += [(list(f), p, v, g, b) for f, p, v, g, b in inputs[::3]]  # equal, not the same lists
    fresh = [simulate.pipeline_makespan(*args) for args in inputs]
    with _calls_to("_replayed") as replays:
        with simulate.remembered_makespans():
            first = [simulate.pipeline_makespan(*args) for args in inputs]
            with simulate.remembered_makespans():  # nested: the same memory
                again = [simulate.pipeline_makespan(*args) for args in inputs]
            distinct = len(replays)
        assert first == fresh and again == fresh  # exactly, not approximately
        assert distinct == len({(tuple(f), p, v, g, b and tuple(b)) for f, p, v, g, b in inputs})
        with simulate.remembered_makespans():  # a new scope replays again
            simulate.pipeline_makespan(*inputs[0])
        assert len(replays) == distinct + 1
        simulate.pipeline_makespan(*inputs[0])  # outside any scope: always replayed
        assert len(replays) == distinct + 2


@contextlib.contextmanager
def _calls_to(name):
    """Every call of ``simulate.<name>`` within, by its arguments (the function still runs)."""
    real = getattr(simulate, name)
    calls = []

    def counted(*args):
        calls.append(args)
        return real(*args)

    setattr(simulate, name, counted)
    try:
        yield calls
    finally:
        setattr(simulate, name, real)
