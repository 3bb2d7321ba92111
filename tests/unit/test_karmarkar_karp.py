"""Differencing over only the sets that hold something (``merge_sparse``) makes exactly the
dense merge's partition, where every value is positive; zero values keep the dense merge."""

import random

import pytest

from megatron_dynbatch.planning.karmarkar_karp import karmarkar_karp, merge_by_differencing
from megatron_dynbatch.planning.packing import kk_pack

pytestmark = pytest.mark.unit


def _dense(values, k, equal_size):
    """Every partial carries all ``k`` sets: the merge as verl and the reference write it."""
    ordered = sorted((value, i) for i, value in enumerate(values))
    step = k if equal_size else 1
    partials = []
    for start in range(0, len(ordered), step):
        sets = [[0, []] for _ in range(k)]
        for j, (value, i) in enumerate(ordered[start : start + step]):
            sets[j][0] += value
            sets[j][1].append(i)
        sets.sort(key=lambda entry: -entry[0])
        partials.append(sets)
    merged = merge_by_differencing(partials, "index")
    return [[] for _ in range(k)] if merged is None else [entry[1] for entry in merged]


def _values(rng, n):
    kind = rng.randrange(3)
    if kind == 0:
        return [rng.randint(1, 5) for _ in range(n)]  # many ties
    if kind == 1:
        return [rng.random() * 100 + 1e-9 for _ in range(n)]
    return [rng.choice([1, 2, 3, 999, 1000]) for _ in range(n)]


def test_the_sparse_merge_makes_the_dense_merges_partition():
    rng = random.Random(0)
    for _ in range(3000):
        k = rng.randint(1, 12)
        equal_size = rng.random() < 0.3
        n = rng.randint(0, 40)
        if equal_size:
            n = max(k, n // k * k)
        values = _values(rng, n)
        assert karmarkar_karp(values, k, equal_size, ties="index") == _dense(
            values, k, equal_size
        ), (values, k, equal_size)


def test_zero_values_take_the_dense_merge():
    values = [0, 3, 0, 5, 2]
    assert karmarkar_karp(values, 3, False, ties="index") == _dense(values, 3, False)


def test_kk_pack_keeps_every_sample_once_and_the_bin_count():
    rng = random.Random(1)
    for _ in range(200):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 60))]
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        bins = rng.randint(1, 20)
        packed, loads = kk_pack(sizes, order, bins)
        assert len(packed) == bins
        assert sorted(i for b in packed for i in b) == list(range(len(sizes)))
        assert loads == [sum(sizes[i] for i in b) for b in packed]
