"""Local search on a chosen step, one DP rank at a time: the pipeline's slowest rank gets its
samples moved between its own micro-batches (or, failing that, to a faster rank) and its
micro-batches reordered while its simulated pipeline gets faster (issue 45).

The shape search packs and orders every rank by rules (a profile of loads, light-heavy-light
with the heaviest micro-batch in its best slot); a rank holding a sample that fills a whole row
still idles in the pipeline around it, and which neighbours fill that idle time best depends on
pp, vpp and the interleaving group. So the slowest rank (the step waits for it) is improved by
first improvement, one change at a time, each scored by :func:`.simulate.pipeline_makespan`:

* a sample moved to another micro-batch of the rank that has room under the cap (rows of their
  own length: the two rows change length, the rank's work barely);
* two micro-batches of the rank swapped in its order;
* where neither helps, a sample of the rank moved to a micro-batch with room on a faster rank
  (fastest first), kept when both pipelines then end before the slowest did (ranks of equal work
  idle unequally: balancing their pipelines, not their work, pays). A rank holding a sample that
  fills a row is bound by that micro-batch, so its other samples go to many ranks with a little
  room each: with only the three fastest ranks as takers, and only in the thorough planner,
  slime's first fit was 3.6% ahead of ours on a multi-turn step (523 samples, dp 64, pp 2 x vpp
  2, ``benchmarks.small_steps --cases 300 --seed 10``); now ours is 0.5% ahead.

Then the rank slowest after that, and so on, until the slowest rank has no improving change or
:data:`REPLAYED_STEPS` (``thorough``: :data:`THOROUGH_REPLAYED_STEPS`) are spent. Every row stays under the cap, and a change is kept only when
it makes the slowest rank faster without making another as slow, so the step is never predicted
slower than the shape it starts from. Deterministic: changes are tried in a fixed order (ties by
index), each rank's scan resuming where its last improvement was found (the changes before it
were just tried).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from .simulate import TIE, pipeline_makespan
from .spec import ParallelLayout

__all__ = ["REPLAYED_STEPS", "THOROUGH_REPLAYED_STEPS", "affordable_replays", "refine_ranks"]

#: Work one step may spend at most, in micro-batch steps replayed (a replay of a rank of M
#: micro-batches on pp stages of vpp chunks replays ``M * pp * vpp`` forwards and as many
#: backwards; 10,000 steps are about 1-2 ms of CPU): replays of long ranks cost more. On the
#: GPU-regime steps (``python -m benchmarks.gpu_regime``, seeds 0 and 1) 300,000 gave a mean
#: of 1.136 of the bound, 1,000,000 1.133, 2,000,000 1.130 and 3,000,000 1.129.
#: The default planner spends 300,000: counting planning on the CPU into the step (as a step that
#: does not overlap its planning pays it), 1,000,000 and more made the sixteen steps slower, not
#: faster (docs/benchmarks.md, "What planning costs").
REPLAYED_STEPS = 300_000
#: The thorough planner (``dynbatch-thorough``): the simulated step alone decides.
THOROUGH_REPLAYED_STEPS = 2_000_000


def _replay_steps(per_rank: int, parallel: ParallelLayout) -> int:
    """Micro-batch steps one replay of a rank replays (forwards and backwards)."""
    return 2 * max(1, per_rank) * parallel.pp_size * parallel.vpp_size


def affordable_replays(
    num_ranks: int,
    per_rank: int,
    parallel: ParallelLayout,
    replayed_steps: Optional[int] = None,
    thorough: bool = False,
) -> Optional[int]:
    """Replays :func:`refine_ranks` may spend on changes after replaying every rank once;
    ``None`` where that first replay of every rank would take half the budget or more (a
    step of many ranks and micro-batches): too little is left to search, so none is spent."""
    if replayed_steps is None:
        replayed_steps = THOROUGH_REPLAYED_STEPS if thorough else REPLAYED_STEPS
    replays = replayed_steps // _replay_steps(per_rank, parallel) - num_ranks
    return replays if replays >= num_ranks else None


def refine_ranks(
    bins: List[List[int]],
    orders: List[List[int]],
    loads: List[int],
    costs: List[float],
    sizes: Sequence[int],
    cap: int,
    bin_cost: Callable[[List[int], int], float],
    parallel: ParallelLayout,
    replayed_steps: Optional[int] = None,
    thorough: bool = False,
) -> Optional[List[float]]:
    """Improve the slowest ranks in place (``bins``, ``orders``, ``loads``, ``costs``).

    Args:
        bins: Sample indices per micro-batch (``[]``: a placeholder).
        orders: Per DP rank, its micro-batches in schedule order.
        loads: Padded tokens per micro-batch.
        costs: Forward cost per micro-batch.
        sizes: Every sample's padded size.
        cap: The most padded tokens a micro-batch of two or more samples may hold.
        bin_cost: ``(members, load) -> cost`` of a micro-batch.
        parallel: The pipeline (``pp_size``, ``vpp_size``, the interleaving group).
        replayed_steps: Micro-batch steps to replay at most (default :data:`REPLAYED_STEPS`;
            ``thorough``: :data:`THOROUGH_REPLAYED_STEPS`).
        thorough: The larger default budget.

    Returns:
        Every rank's simulated makespan after the search; ``None`` (nothing changed) where
        replaying every rank once would take half the budget or more.
    """

    pp_size, vpp_size, group = parallel.pp_size, parallel.vpp_size, parallel.group_size

    def span(order: Sequence[int]) -> float:
        return pipeline_makespan([costs[b] for b in order], pp_size, vpp_size, group)

    per_rank = len(orders[0]) if orders else 1
    replays = affordable_replays(len(orders), per_rank, parallel, replayed_steps, thorough)
    if replays is None:
        return None
    per_replay = _replay_steps(per_rank, parallel)
    budget = [replays]
    spans = [span(order) for order in orders]

    cursors = [0] * len(orders)

    def changes(r: int) -> List[Tuple[int, int, int]]:
        """The rank's changes as ``(p, sample, q)``: a sample of the micro-batch at position
        ``p`` moved to position ``q`` (largest samples first), or, with sample ``-1``, the
        micro-batches at ``p`` and ``q`` swapped."""
        order = orders[r]
        m = len(order)
        result = []
        for p in range(m):
            for i in sorted(bins[order[p]], key=lambda i: (-sizes[i], i)):
                result += [(p, i, q) for q in range(m) if q != p]
        result += [(p, -1, q) for p in range(m) for q in range(p + 1, m)]
        return result

    def move(i: int, a: int, b: int, cost_a: float, cost_b: float) -> None:
        """Sample ``i`` from micro-batch ``a`` into ``b``, at the costs just computed."""
        bins[a] = [j for j in bins[a] if j != i]
        bins[b] = bins[b] + [i]
        loads[a] -= sizes[i]
        loads[b] += sizes[i]
        costs[a], costs[b] = cost_a, cost_b

    def improve(r: int) -> bool:
        """The first improving change from where the last one was found (the changes before it
        were just tried), wrapping around once."""
        order = orders[r]
        current = spans[r]
        listed = changes(r)
        # Listing the changes costs about a replayed step each: charged to the budget, so a
        # rank of many samples and micro-batches cannot spend more than it allows.
        budget[0] -= len(listed) // per_replay
        start = cursors[r] % max(1, len(listed))
        for k in range(len(listed)):
            p, i, q = listed[(start + k) % len(listed)]
            a, b = order[p], order[q]
            if i >= 0:
                size = sizes[i]
                if loads[b] + size > cap:
                    continue
            if budget[0] <= 0:
                return False
            budget[0] -= 1
            if i < 0:
                swapped = list(order)
                swapped[p], swapped[q] = b, a
                time = span(swapped)
                if time < current * (1.0 - TIE):
                    orders[r] = swapped
                    spans[r] = time
                    cursors[r] = start + k
                    return True
                continue
            rest = [j for j in bins[a] if j != i]
            cost_a = bin_cost(rest, loads[a] - size)
            cost_b = bin_cost(bins[b] + [i], loads[b] + size)
            rank_costs = [costs[c] for c in order]
            rank_costs[p], rank_costs[q] = cost_a, cost_b
            time = pipeline_makespan(rank_costs, pp_size, vpp_size, group)
            if time < current * (1.0 - TIE):
                move(i, a, b, cost_a, cost_b)
                spans[r] = time
                cursors[r] = start + k
                return True
        return False

    def give(r: int) -> bool:
        """The first sample of rank ``r`` (largest first, in its order) that, moved into a
        micro-batch with room on a faster rank (fastest first), leaves both ranks faster than
        ``r`` is now."""
        order = orders[r]
        if sum(len(bins[b]) for b in order) < 2:
            return False  # its last sample stays: no DP rank idles where each can have one
        current = spans[r]
        takers = sorted((q for q in range(len(orders)) if q != r), key=lambda q: (spans[q], q))
        for p, a in enumerate(order):
            for i in sorted(bins[a], key=lambda i: (-sizes[i], i)):
                if budget[0] <= 0:
                    return False
                budget[0] -= 1
                size = sizes[i]
                rest = [j for j in bins[a] if j != i]
                given = bin_cost(rest, loads[a] - size)
                rank_costs = [costs[c] for c in order]
                rank_costs[p] = given
                time = pipeline_makespan(rank_costs, pp_size, vpp_size, group)
                if time >= current * (1.0 - TIE):
                    continue
                for q in takers:
                    if spans[q] >= current * (1.0 - TIE):
                        break  # the rest are as slow as r: taking a sample cannot end before it
                    taker_costs = [costs[c] for c in orders[q]]
                    for k, b in enumerate(orders[q]):
                        if loads[b] + size > cap or budget[0] <= 0:
                            continue
                        budget[0] -= 1
                        taken = bin_cost(bins[b] + [i], loads[b] + size)
                        taker_costs[k] = taken
                        other = pipeline_makespan(taker_costs, pp_size, vpp_size, group)
                        taker_costs[k] = costs[b]
                        if other < current * (1.0 - TIE):
                            move(i, a, b, given, taken)
                            spans[r], spans[q] = time, other
                            return True
        return False

    while budget[0] > 0:
        slowest = max(range(len(orders)), key=lambda r: (spans[r], -r))
        if not improve(slowest) and not give(slowest):
            break
    return spans
