"""Step-time simulation of Megatron-Core's pipeline schedules from per-micro-batch costs.

A discrete-event model of ``forward_backward_pipelining_without_interleaving`` (1F1B) and
``forward_backward_pipelining_with_interleaving`` (virtual pipeline) in
``megatron/core/pipeline_parallel/schedules.py``: every pipeline stage runs its forward (F) and
backward (B) steps in exactly the order Megatron issues them, and a step starts when both its stage is
free and its data dependency is done:

* F of micro-batch ``m`` on virtual stage ``v`` needs F of ``m`` on virtual stage ``v - 1``;
* B of ``m`` on ``v`` needs B of ``m`` on ``v + 1`` (the last virtual stage needs its own F).

Communication is free and sends never block (Megatron's combined send/recv calls can add small extra
waits that this model omits), so the makespan is a lower bound on what the hardware does with these
costs. Costs are per micro-batch for the whole model: a stage runs ``cost / pp`` of it and one
interleaved model chunk ``cost / (pp * vpp)``.

Used by ``megatron-dynbatch plan --plot`` and the benchmarks to turn a schedule into a step time.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "BACKWARD_TO_FORWARD_RATIO",
    "TIE",
    "forward_only_makespan",
    "SimEvent",
    "SimResult",
    "StepSimResult",
    "ideal_time",
    "interleaved_order",
    "one_f_one_b_order",
    "pipeline_makespan",
    "simulate_1f1b",
    "simulate_interleaved",
    "simulate_step",
]

#: Backward cost relative to forward when only forward costs are given: the backward pass computes the
#: gradients with respect to both the activations and the weights, each about one forward's FLOPs.
BACKWARD_TO_FORWARD_RATIO = 2.0

#: Relative difference under which two simulated steps are a tie: float noise is no gain, so a
#: candidate replaces the one kept only when faster by more than this.
TIE = 1e-9

#: An operation in a stage's program: (kind 'F' or 'B', model chunk, micro-batch).
Op = Tuple[str, int, int]


@dataclass(frozen=True)
class SimEvent:
    """One forward or backward step of one model chunk on one pipeline stage."""

    stage: int
    """Pipeline rank, 0 = first stage."""
    chunk: int
    """Model chunk (virtual pipeline index) on this stage; always 0 without interleaving."""
    microbatch: int
    """Micro-batch index within the step."""
    kind: str
    """``'F'`` (forward) or ``'B'`` (backward)."""
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """The simulated timeline of one pipeline (one DP rank) for one optimizer step."""

    makespan: float
    """Time from the first forward to the last backward over all stages."""
    stage_busy: Tuple[float, ...]
    """Compute time of each stage (sum of its step durations)."""
    bubble_fraction: float
    """Idle share of the pipeline: ``1 - sum(stage_busy) / (pp * makespan)``."""
    bubble_overhead: float
    """Megatron's "bubble" ratio: ``makespan / (sum(stage_busy) / pp) - 1``, i.e. the bubble time
    relative to a perfectly balanced pipeline's compute time. ``(pp-1)/M`` for 1F1B with equal costs,
    ``(pp-1)/(vpp*M)`` interleaved."""
    events: Tuple[SimEvent, ...]
    """Every step, sorted by stage then start time (for plotting)."""


@dataclass(frozen=True)
class StepSimResult:
    """A data-parallel step: each DP rank is its own pipeline and the step waits for the slowest."""

    step_time: float
    """Max over DP ranks of the pipeline makespan (the gradient all-reduce waits for all of them)."""
    ideal_time: float
    """Total work / (dp * pp): no pipeline bubble and perfect balance over all GPUs."""
    efficiency: float
    """``ideal_time / step_time`` (1.0 = no bubble, no imbalance)."""
    ranks: Tuple[SimResult, ...]
    """The per-DP-rank pipeline simulations."""


def _check_costs(fwd_costs: Sequence[float], bwd_costs: Sequence[float]) -> int:
    if len(fwd_costs) != len(bwd_costs):
        raise DynBatchValueError(
            f"fwd_costs has {len(fwd_costs)} micro-batches but bwd_costs has {len(bwd_costs)}; pass "
            f"one forward and one backward cost per micro-batch."
        )
    if not fwd_costs:
        raise DynBatchValueError(
            "no micro-batches to simulate; Megatron's schedules need num_microbatches >= 1 (pad the "
            "rank with a placeholder micro-batch)."
        )
    for name, costs in (("fwd_costs", fwd_costs), ("bwd_costs", bwd_costs)):
        for m, cost in enumerate(costs):
            if (
                isinstance(cost, bool)
                or not isinstance(cost, (int, float))
                or not math.isfinite(cost)
            ):
                raise DynBatchValueError(f"{name}[{m}]={cost!r} must be a finite number >= 0.")
            if cost < 0:
                raise DynBatchValueError(
                    f"{name}[{m}]={cost} is negative; costs are durations >= 0."
                )
    return len(fwd_costs)


def _check_pp(pp_size: int) -> None:
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise DynBatchValueError(f"pp_size={pp_size!r} must be an integer >= 1.")


def one_f_one_b_order(num_microbatches: int, pp_size: int, stage: int) -> List[Op]:
    """The order in which one stage of Megatron's non-interleaved 1F1B schedule runs its steps.

    Warm-up: ``min(pp - stage - 1, M)`` forwards; steady state: alternately one forward and one
    backward; cool-down: the remaining backwards. Example, pp=4, M=6, stage 1 (2 warm-up forwards):
    F0 F1 | F2 B0 F3 B1 F4 B2 F5 B3 | B4 B5.
    """
    num_warmup = min(pp_size - stage - 1, num_microbatches)
    return _warmup_steady_cooldown(
        lambda m: ("F", 0, m), lambda m: ("B", 0, m), num_microbatches, num_warmup
    )


def _warmup_steady_cooldown(
    forward: Callable[[int], Op], backward: Callable[[int], Op], total: int, num_warmup: int
) -> List[Op]:
    """Both of Megatron's orders: ``num_warmup`` forwards, then forward ``k + num_warmup`` and
    backward ``k`` in turn, then the remaining backwards (``forward(k)`` / ``backward(k)``: the
    ``k``-th of ``total`` steps)."""
    order = [forward(k) for k in range(num_warmup)]
    for k in range(total - num_warmup):
        order.append(forward(k + num_warmup))
        order.append(backward(k))
    order.extend(backward(k) for k in range(total - num_warmup, total))
    return order


def _schedule_table(num_microbatches: int, vpp_size: int, group: int) -> List[Tuple[int, int]]:
    """Megatron's ``get_schedule_table``: the (micro-batch, chunk) of each virtual micro-batch.

    Micro-batches are walked in groups of ``group``; inside a group every chunk runs all of the group's
    micro-batches before the next chunk starts. The last group takes whatever is left (its size is
    ``M % group`` when that is not 0). Example, M=5, group=3, vpp=2:
    (0,0) (1,0) (2,0) (0,1) (1,1) (2,1) (3,0) (4,0) (3,1) (4,1).
    """
    table: List[Tuple[int, int]] = []
    for first in range(0, num_microbatches, group):
        last = min(first + group, num_microbatches)
        table.extend((m, chunk) for chunk in range(vpp_size) for m in range(first, last))
    return table


def interleaved_order(
    num_microbatches: int, pp_size: int, vpp_size: int, group: int, stage: int
) -> List[Op]:
    """The order in which one stage of Megatron's interleaved schedule runs its steps.

    With ``T = M * vpp`` virtual micro-batches, the warm-up runs
    ``min(2 * (pp - stage - 1) + (vpp - 1) * group, T)`` forwards; the steady state alternates the
    forward of virtual micro-batch ``k + warmup`` and the backward of virtual micro-batch ``k``; the
    cool-down runs the remaining backwards. Forward ``k`` is ``table[k]``; backward ``k`` is the same
    micro-batch on the mirrored chunk ``vpp - 1 - chunk`` (backward walks the chunks last to first).
    """
    table = _schedule_table(num_microbatches, vpp_size, group)
    total = len(table)
    num_warmup = min(2 * (pp_size - stage - 1) + (vpp_size - 1) * group, total)

    def forward(k: int) -> Op:
        m, chunk = table[k]
        return ("F", chunk, m)

    def backward(k: int) -> Op:
        m, chunk = table[k]
        return ("B", vpp_size - 1 - chunk, m)

    return _warmup_steady_cooldown(forward, backward, total, num_warmup)


def _run(
    orders: Sequence[Sequence[Op]],
    fwd_costs: Sequence[float],
    bwd_costs: Sequence[float],
    pp_size: int,
    vpp_size: int,
) -> SimResult:
    """Replays each stage's program in order, starting each step when its dependency is done."""
    # Virtual stage v = chunk * pp + stage: the model's layers in order (Megatron assigns chunk c of
    # stage s the (c*pp + s)-th slice of layers).
    num_virtual = pp_size * vpp_size
    share = float(num_virtual)
    done: Dict[Tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    position = [0] * pp_size
    free_at = [0.0] * pp_size
    busy = [0.0] * pp_size
    events: List[SimEvent] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for stage in range(pp_size):
            order = orders[stage]
            while position[stage] < len(order):
                kind, chunk, m = order[position[stage]]
                virtual = chunk * pp_size + stage
                if kind == "F":
                    dep = ("F", virtual - 1, m) if virtual > 0 else None
                    duration = fwd_costs[m] / share
                elif virtual < num_virtual - 1:
                    dep = ("B", virtual + 1, m)
                    duration = bwd_costs[m] / share
                else:
                    dep = ("F", virtual, m)
                    duration = bwd_costs[m] / share
                if dep is not None and dep not in done:
                    break
                start = max(free_at[stage], done[dep] if dep is not None else 0.0)
                end = start + duration
                done[(kind, virtual, m)] = end
                free_at[stage] = end
                busy[stage] += duration
                events.append(SimEvent(stage, chunk, m, kind, start, end))
                position[stage] += 1
                remaining -= 1
                progressed = True
        # Megatron's orders never deadlock; a stall means an order builder is wrong.
        assert progressed, f"pipeline simulation deadlocked at positions {position}"
    makespan = max(free_at)
    total_busy = sum(busy)
    if makespan > 0:
        bubble_fraction = 1.0 - total_busy / (pp_size * makespan)
        bubble_overhead = makespan / (total_busy / pp_size) - 1.0
    else:
        bubble_fraction = bubble_overhead = 0.0
    events.sort(key=lambda e: (e.stage, e.start, e.end))
    return SimResult(makespan, tuple(busy), bubble_fraction, bubble_overhead, tuple(events))


def simulate_1f1b(
    fwd_costs: Sequence[float], bwd_costs: Sequence[float], pp_size: int
) -> SimResult:
    """Simulates Megatron's non-interleaved 1F1B schedule for one pipeline.

    Args:
        fwd_costs: Forward time of each micro-batch through the whole model, in schedule order.
        bwd_costs: Backward time of each micro-batch through the whole model.
        pp_size: Pipeline stages; each runs ``1/pp`` of every micro-batch.

    Returns:
        The timeline. With equal costs ``f``, ``b`` and ``M`` micro-batches the makespan is
        ``(M + pp - 1) * (f + b) / pp``.
    """
    num_microbatches = _check_costs(fwd_costs, bwd_costs)
    _check_pp(pp_size)
    orders = [one_f_one_b_order(num_microbatches, pp_size, s) for s in range(pp_size)]
    return _run(orders, fwd_costs, bwd_costs, pp_size, 1)


def simulate_interleaved(
    fwd_costs: Sequence[float],
    bwd_costs: Sequence[float],
    pp_size: int,
    vpp_size: int,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
) -> SimResult:
    """Simulates Megatron's interleaved (virtual pipeline) schedule for one pipeline.

    Args:
        fwd_costs: Forward time of each micro-batch through the whole model, in schedule order.
        bwd_costs: Backward time of each micro-batch through the whole model.
        pp_size: Pipeline stages.
        vpp_size: Model chunks per stage; each chunk runs ``1/(pp*vpp)`` of every micro-batch.
            ``vpp_size=1`` runs the 1F1B simulation (Megatron uses the non-interleaved schedule).
        microbatch_group_size_per_vp_stage: Megatron's interleaving group; ``None`` = ``pp_size``.

    Returns:
        The timeline. With equal costs, ``group = pp`` and ``M`` a multiple of ``pp`` the makespan is
        ``(M + (pp - 1) / vpp) * (f + b) / pp`` (bubble ``(pp-1)/(vpp*M)`` of the compute).

    Raises:
        ValueError: for a layout Megatron's schedule itself rejects (group < pp, group > M, or a last
            group of fewer than pp micro-batches).
    """
    num_microbatches = _check_costs(fwd_costs, bwd_costs)
    _check_pp(pp_size)
    if isinstance(vpp_size, bool) or not isinstance(vpp_size, int) or vpp_size < 1:
        raise DynBatchValueError(f"vpp_size={vpp_size!r} must be an integer >= 1.")
    if vpp_size == 1:
        return simulate_1f1b(fwd_costs, bwd_costs, pp_size)
    group = (
        pp_size
        if microbatch_group_size_per_vp_stage is None
        else microbatch_group_size_per_vp_stage
    )
    if not pp_size <= group <= num_microbatches:
        raise DynBatchValueError(
            f"microbatch_group_size_per_vp_stage={group} must lie in [pp_size={pp_size}, "
            f"num_microbatches={num_microbatches}] (Megatron's interleaved schedule raises otherwise); "
            f"use more micro-batches or a group size in that range."
        )
    last_group = num_microbatches % group
    if 0 < last_group < pp_size:
        raise DynBatchValueError(
            f"num_microbatches={num_microbatches} leaves a last group of {last_group} < pp_size="
            f"{pp_size} micro-batches with microbatch_group_size_per_vp_stage={group}; Megatron raises "
            f"here. Pad to a multiple of {group} micro-batches."
        )
    orders = [
        interleaved_order(num_microbatches, pp_size, vpp_size, group, s) for s in range(pp_size)
    ]
    return _run(orders, fwd_costs, bwd_costs, pp_size, vpp_size)


@functools.lru_cache(maxsize=256)
def _programs(
    num_microbatches: int, pp_size: int, vpp_size: int, group: int
) -> Tuple[Tuple[Tuple[int, int, int, bool], ...], ...]:
    """Every stage's program as ``(slot, dependency slot or -1, micro-batch, is_backward)``.

    A slot numbers one (kind, virtual stage, micro-batch) step: ``kind * V * M + v * M + m`` with
    ``V = pp * vpp`` virtual stages, so :func:`pipeline_makespan` keeps finish times in one flat
    list. Cached: a planner scores many ranks and candidates of the same shape.
    """
    num_virtual = pp_size * vpp_size
    span = num_virtual * num_microbatches
    programs = []
    for stage in range(pp_size):
        if vpp_size > 1:
            order = interleaved_order(num_microbatches, pp_size, vpp_size, group, stage)
        else:
            order = one_f_one_b_order(num_microbatches, pp_size, stage)
        program = []
        for kind, chunk, m in order:
            v = chunk * pp_size + stage
            if kind == "F":
                slot = v * num_microbatches + m
                dep = (v - 1) * num_microbatches + m if v > 0 else -1
            else:
                slot = span + v * num_microbatches + m
                if v < num_virtual - 1:
                    dep = span + (v + 1) * num_microbatches + m
                else:
                    dep = v * num_microbatches + m
            program.append((slot, dep, m, kind == "B"))
        programs.append(tuple(program))
    return tuple(programs)


#: The makespans replayed so far in the current :func:`remembered_makespans` (``None``: outside).
_REMEMBERED: contextvars.ContextVar[Optional[Dict[tuple, float]]] = contextvars.ContextVar(
    "remembered_makespans", default=None
)


@contextlib.contextmanager
def remembered_makespans() -> Iterator[None]:
    """Within it, :func:`pipeline_makespan` replays each distinct input once.

    A planner's searches score the same micro-batch costs again and again (a change tried from
    two places, an order whose heaviest slot is where it already was, a rank planned again for
    another count): on SkyRL's as-run mini-batches two of three replays were repeats. The memory
    lives as long as the outermost ``with`` (one step's search, or a sharded host's plan of
    every rank: bounded by their search budgets; at most about 50,000 entries, 20 MB, on
    SkyRL's largest as-run mini-batch) and is per thread / task (a context variable), so two
    planners never share it. The same floats come back, so plans are unchanged.
    """
    if _REMEMBERED.get() is not None:
        yield  # nested: the outermost call's memory serves
        return
    token = _REMEMBERED.set({})
    try:
        yield
    finally:
        _REMEMBERED.reset(token)


def pipeline_makespan(
    fwd_costs: Sequence[float],
    pp_size: int,
    vpp_size: int = 1,
    group: Optional[int] = None,
    bwd_costs: Optional[Sequence[float]] = None,
) -> float:
    """The makespan of :func:`simulate_interleaved` (or 1F1B) without building the timeline.

    The planner scores candidate schedules with it: the same replay of Megatron's order, on flat
    lists, several times faster than the event-recording simulation. Arguments are trusted (the
    planner only builds valid shapes); ``bwd_costs`` defaults to ``BACKWARD_TO_FORWARD_RATIO`` x
    forward. Without pipelining the makespan is the sum of the work.
    """
    if pp_size == 1:
        if bwd_costs is None:
            bwd_costs = [BACKWARD_TO_FORWARD_RATIO * c for c in fwd_costs]
        return float(sum(fwd_costs) + sum(bwd_costs))
    if vpp_size == 1:
        group = 1
    elif group is None:
        group = pp_size
    remembered = _REMEMBERED.get()
    if remembered is None:
        return _replayed(fwd_costs, bwd_costs, pp_size, vpp_size, group)
    key = (
        tuple(fwd_costs),
        None if bwd_costs is None else tuple(bwd_costs),
        pp_size,
        vpp_size,
        group,
    )
    found = remembered.get(key)
    if found is None:
        found = remembered[key] = _replayed(fwd_costs, bwd_costs, pp_size, vpp_size, group)
    return found


def _replayed(
    fwd_costs: Sequence[float],
    bwd_costs: Optional[Sequence[float]],
    pp_size: int,
    vpp_size: int,
    group: int,
) -> float:
    """:func:`pipeline_makespan`'s replay of a pipeline (``pp_size`` > 1)."""
    num_microbatches = len(fwd_costs)
    if bwd_costs is None:
        bwd_costs = [BACKWARD_TO_FORWARD_RATIO * c for c in fwd_costs]
    share = float(pp_size * vpp_size)
    # Forward durations at 0..M-1, backward at M..2M-1 (the same floats as c / share each).
    durations = [c / share for c in fwd_costs] + [c / share for c in bwd_costs]
    shape = (num_microbatches, pp_size, vpp_size, group)
    uses = _REPLAYS_OF_SHAPE.get(shape, 0)
    if uses >= _COMPILE_AFTER:
        compiled = _compiled_replay(*shape)
        if compiled is not None:
            return compiled(durations)
    else:
        _REPLAYS_OF_SHAPE[shape] = uses + 1
    steps, last, size = _flat_replay(num_microbatches, pp_size, vpp_size, group)
    done = [0.0] * size
    # Each step starts when both its stage's previous step and its dependency are done (slot
    # ``size - 1`` stands for "nothing", always 0.0): the floats of a stage-by-stage replay.
    for slot, dep, previous, k in steps:
        t = done[previous]
        ready = done[dep]
        if ready > t:
            t = ready
        done[slot] = t + durations[k]
    return max(done[slot] for slot in last)


#: Replays of a shape ``(M, pp, vpp, group)`` before it gets its own straight-line code
#: (:func:`_compiled_replay`). Compiling costs about as much as 150-300 loop replays of the shape
#: (about 30 us a step on this project's 2-core machines); the compiled replay then takes half the
#: time of the loop. A planner's search replays a few shapes thousands of times a step (a step of
#: 128 samples at pp 4: 36 shapes, four of them over 13,000 times each) and many only a few times.
_COMPILE_AFTER = 128
#: Longer replays stay in the loop: compiling grows with the steps, and a replay this long is
#: rarely repeated often enough to pay for it (the refinement budget, ``refine.REPLAYED_STEPS``,
#: affords about 40 of them).
_COMPILE_MAX_STEPS = 8192
#: Loop replays so far of each shape, until it reaches :data:`_COMPILE_AFTER` (a miscount under
#: threads only moves when a shape is compiled; the floats are the same either way).
_REPLAYS_OF_SHAPE: Dict[Tuple[int, int, int, int], int] = {}


@functools.lru_cache(maxsize=256)
def _compiled_replay(
    num_microbatches: int, pp_size: int, vpp_size: int, group: int
) -> Optional[Callable[[List[float]], float]]:
    """:func:`_replayed`'s loop over :func:`_flat_replay` written out as one function of the
    durations (``None`` past :data:`_COMPILE_MAX_STEPS`).

    Every slot is a local variable and every step one line with the loop's own operations in
    the loop's order (the later of the stage's previous finish and the dependency, ties to the
    stage, plus the duration), so it returns the same floats: plans do not change, they are found
    about twice as fast (no tuple unpacking, list reads or writes per step)."""
    steps, last, size = _flat_replay(num_microbatches, pp_size, vpp_size, group)
    if len(steps) > _COMPILE_MAX_STEPS:
        return None
    sentinel = size - 1

    def name(slot: int) -> str:
        return "z" if slot == sentinel else f"t{slot}"

    durations = ", ".join(f"d{k}" for k in range(2 * num_microbatches))
    lines = ["def replay(durations):", f"    {durations}, = durations", "    z = 0.0"]
    for slot, dep, previous, k in steps:
        stage, ready = name(previous), name(dep)
        if stage == ready:
            lines.append(f"    t{slot} = {stage} + d{k}")
        else:
            lines.append(f"    t{slot} = ({ready} if {ready} > {stage} else {stage}) + d{k}")
    ends = [name(slot) for slot in last]
    lines.append(f"    return max({', '.join(ends)})" if len(ends) > 1 else f"    return {ends[0]}")
    namespace: Dict[str, Callable[[List[float]], float]] = {}
    where = f"<pipeline replay M={num_microbatches} pp={pp_size} vpp={vpp_size} group={group}>"
    exec(compile("\n".join(lines), where, "exec"), namespace)  # noqa: S102 - our own text
    return namespace["replay"]


@functools.lru_cache(maxsize=256)
def _flat_replay(
    num_microbatches: int, pp_size: int, vpp_size: int, group: int
) -> Tuple[Tuple[Tuple[int, int, int, int], ...], Tuple[int, ...], int]:
    """:func:`_replay_order` as :func:`pipeline_makespan` replays it: ``(slot, dependency slot,
    the stage's previous slot, duration index)`` per step, with a sentinel slot (the last, never
    written) for "no dependency" and "first on its stage"; every stage's last slot; the number
    of slots. Reading the stage's previous finish from the same list saves a list and a write a
    step (the planner replays thousands of candidates a step)."""
    order = _replay_order(num_microbatches, pp_size, vpp_size, group)
    sentinel = 2 * pp_size * vpp_size * num_microbatches
    last = [sentinel] * pp_size
    steps = []
    for stage, slot, dep, m, backward in order:
        k = num_microbatches + m if backward else m
        steps.append((slot, dep if dep >= 0 else sentinel, last[stage], k))
        last[stage] = slot
    return tuple(steps), tuple(last), sentinel + 1


@functools.lru_cache(maxsize=256)
def _replay_order(
    num_microbatches: int, pp_size: int, vpp_size: int, group: int
) -> Tuple[Tuple[int, int, int, int, bool], ...]:
    """Every stage's program (:func:`_programs`) merged into one order that respects each
    stage's own order and every dependency: ``(stage, slot, dependency slot or -1,
    micro-batch, is_backward)``. Found by walking the stages in turn, each as far as its
    dependencies are done (Megatron's orders never deadlock; a stall means a builder is wrong).
    Cached: a planner replays many ranks of the same shape."""
    programs = _programs(num_microbatches, pp_size, vpp_size, group)
    done = [False] * (2 * pp_size * vpp_size * num_microbatches)
    position = [0] * pp_size
    merged = []
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = remaining
        for stage in range(pp_size):
            program = programs[stage]
            p = position[stage]
            while p < len(program):
                slot, dep, m, backward = program[p]
                if dep >= 0 and not done[dep]:
                    break
                done[slot] = True
                merged.append((stage, slot, dep, m, backward))
                p += 1
            remaining -= p - position[stage]
            position[stage] = p
        assert remaining < progressed, f"pipeline replay deadlocked at positions {position}"
    return tuple(merged)


def forward_only_makespan(
    costs: Sequence[float], pp_size: int, vpp_size: int = 1, group: Optional[int] = None
) -> float:
    """A forward-only pass (log-probs, no backward) through Megatron's order: every stage runs
    the forwards of the schedule table (:func:`_schedule_table`) in turn, each waiting for the
    same micro-batch on the previous virtual stage. ``costs``: forward cost of every micro-batch
    through the whole model, in schedule order; arguments trusted, as for
    :func:`pipeline_makespan`."""
    if pp_size == 1:
        return float(sum(costs))
    if vpp_size == 1:
        group = 1
    elif group is None:
        group = pp_size
    share = float(pp_size * vpp_size)
    free = [0.0] * pp_size
    done: Dict[Tuple[int, int], float] = {}
    for m, chunk in _schedule_table(len(costs), vpp_size, group):
        duration = costs[m] / share
        ready = done.get((chunk * pp_size - 1, m), 0.0)
        for stage in range(pp_size):
            t = max(free[stage], ready) + duration
            free[stage] = ready = t
        done[(chunk * pp_size + pp_size - 1, m)] = ready
    return max(free)


RankCosts = Union[Sequence[float], Tuple[Sequence[float], Sequence[float]]]


def _split_rank_costs(rank_costs: RankCosts, rank: int) -> Tuple[Sequence[float], Sequence[float]]:
    """Accepts ``(fwd_costs, bwd_costs)`` or forward costs alone (backward = ratio * forward)."""
    if len(rank_costs) == 2 and all(isinstance(c, (list, tuple)) for c in rank_costs):
        fwd, bwd = rank_costs
        return fwd, bwd
    if all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in rank_costs):
        return rank_costs, [BACKWARD_TO_FORWARD_RATIO * c for c in rank_costs]
    raise DynBatchValueError(
        f"ranks_costs[{rank}] must be a (fwd_costs, bwd_costs) pair of lists or a list of forward "
        f"costs, got {rank_costs!r}."
    )


def ideal_time(ranks_costs: Sequence[RankCosts], pp_size: int) -> float:
    """Total forward + backward work over all DP ranks divided by ``dp * pp`` GPUs.

    The step time of a schedule with no pipeline bubble and a perfectly even split of the work over
    every GPU: the bound that schedule quality is measured against.
    """
    _check_pp(pp_size)
    if not ranks_costs:
        raise DynBatchValueError("ranks_costs is empty; pass one entry per DP rank.")
    total = 0.0
    for r, rank_costs in enumerate(ranks_costs):
        fwd, bwd = _split_rank_costs(rank_costs, r)
        total += sum(fwd) + sum(bwd)
    return total / (len(ranks_costs) * pp_size)


def simulate_step(
    ranks_costs: Sequence[RankCosts],
    pp_size: int,
    vpp_size: int = 1,
    group: Optional[int] = None,
) -> StepSimResult:
    """Simulates one optimizer step over several DP ranks, each its own pipeline.

    Args:
        ranks_costs: One entry per DP rank: ``(fwd_costs, bwd_costs)`` per micro-batch, or the forward
            costs alone (backward = ``BACKWARD_TO_FORWARD_RATIO`` x forward). A placeholder
            micro-batch should carry the cost of the padding it computes, not 0.
        pp_size: Pipeline stages.
        vpp_size: Model chunks per stage (> 1 = interleaved schedule).
        group: ``microbatch_group_size_per_vp_stage``; ``None`` = ``pp_size``.

    Returns:
        The step time (slowest DP rank), the ideal time and each rank's timeline.
    """
    if not ranks_costs:
        raise DynBatchValueError("ranks_costs is empty; pass one entry per DP rank.")
    results = []
    for r, rank_costs in enumerate(ranks_costs):
        fwd, bwd = _split_rank_costs(rank_costs, r)
        results.append(simulate_interleaved(fwd, bwd, pp_size, vpp_size, group))
    step_time = max(result.makespan for result in results)
    ideal = ideal_time(ranks_costs, pp_size)
    efficiency = ideal / step_time if step_time > 0 else 1.0
    return StepSimResult(step_time, ideal, efficiency, tuple(results))
