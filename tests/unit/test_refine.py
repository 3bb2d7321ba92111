"""Refinement of a chosen step (:mod:`megatron_dynbatch.planning.refine`): the slowest rank gets
faster, rows stay under the cap, and a budget too small to replay every rank twice is not spent."""

import pytest

from megatron_dynbatch.planning.refine import affordable_replays, refine_ranks
from megatron_dynbatch.planning.simulate import pipeline_makespan
from megatron_dynbatch.planning.spec import ParallelLayout

pytestmark = pytest.mark.unit

CAP = 100
LAYOUT = ParallelLayout(dp_size=2, pp_size=2)


def _cost(members, load):
    return 1.0 + load + load * load / CAP


def _step():
    # Rank 0: the full sample first, then three micro-batches of 20; rank 1 light.
    sizes = [100, 10, 10, 10, 10, 10, 10, 5, 5, 5, 5]
    bins = [[0], [1, 2], [3, 4], [5, 6], [7], [8], [9], [10]]
    orders = [[0, 1, 2, 3], [4, 5, 6, 7]]
    loads = [sum(sizes[i] for i in b) for b in bins]
    costs = [_cost(b, load) for b, load in zip(bins, loads, strict=True)]
    return sizes, bins, orders, loads, costs


def _span(order, costs):
    return pipeline_makespan([costs[b] for b in order], LAYOUT.pp_size, LAYOUT.vpp_size, 1)


def test_the_slowest_rank_gets_faster_and_every_row_stays_under_the_cap():
    sizes, bins, orders, loads, costs = _step()
    before = max(_span(order, costs) for order in orders)
    spans = refine_ranks(bins, orders, loads, costs, sizes, CAP, _cost, LAYOUT)
    assert spans is not None
    assert max(spans) < before * (1 - 1e-6), (max(spans), before)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    for members, load in zip(bins, loads, strict=True):
        assert load == sum(sizes[i] for i in members)
        assert len(members) < 2 or load <= CAP
    assert spans == [_span(order, costs) for order in orders]


def test_a_budget_that_replaying_every_rank_would_half_spend_is_not_spent():
    sizes, bins, orders, loads, costs = _step()
    steps = 2 * 4 * LAYOUT.pp_size  # one replay of a rank of four micro-batches
    assert affordable_replays(2, 4, LAYOUT, replayed_steps=4 * steps - 1) is None
    assert affordable_replays(2, 4, LAYOUT, replayed_steps=4 * steps) == 2
    snapshot = ([list(b) for b in bins], [list(o) for o in orders], list(loads), list(costs))
    spans = refine_ranks(
        bins, orders, loads, costs, sizes, CAP, _cost, LAYOUT, replayed_steps=4 * steps - 1
    )
    assert spans is None
    assert (bins, orders, loads, costs) == snapshot
