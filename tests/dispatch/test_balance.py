"""Equal-count partitioning: validity, never worse than equal-size Karmarkar–Karp, bounds and quality targets."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dispatch import (
    PartitionError,
    WorkloadModel,
    balance_partitions,
    contiguous_partitions,
    greedy_partitions,
    imbalance,
    karmarkar_karp,
    lower_bound,
    partition_loads,
    refine_partitions,
)


@st.composite
def instances(draw, max_parts=8, max_per_part=12):
    k = draw(st.integers(1, max_parts))
    m = draw(st.integers(1, max_per_part))
    kind = draw(st.sampled_from(["int", "float", "equal", "heavy"]))
    if kind == "int":
        w = draw(st.lists(st.integers(0, 50), min_size=k * m, max_size=k * m))
    elif kind == "float":
        w = draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=k * m, max_size=k * m))
    elif kind == "equal":
        w = [draw(st.integers(1, 9))] * (k * m)
    else:
        w = draw(st.lists(st.integers(1, 10), min_size=k * m, max_size=k * m))
        w[draw(st.integers(0, k * m - 1))] = 10_000
    return [float(x) for x in w], k


def _valid(parts, n, k):
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(n))  # every index exactly once
    assert {len(p) for p in parts} == {n // k}  # equal counts
    assert all(p == sorted(p) for p in parts)


@settings(max_examples=150, deadline=None)
@given(instances())
def test_partitions_are_valid_and_never_worse_than_karmarkar_karp(inst):
    w, k = inst
    n = len(w)
    ours, kk, greedy = balance_partitions(w, k), karmarkar_karp(w, k), greedy_partitions(w, k)
    for parts in (ours, kk, greedy, contiguous_partitions(n, k)):
        _valid(parts, n, k)
    best = max(partition_loads(w, ours))
    tol = 1e-9 * max(1.0, best)
    assert best <= max(partition_loads(w, kk)) + tol
    assert best <= max(partition_loads(w, greedy)) + tol
    assert best >= lower_bound(w, k) - tol
    assert balance_partitions(w, k) == ours  # deterministic


@settings(max_examples=80, deadline=None)
@given(instances(), st.randoms(use_true_random=False))
def test_refine_never_raises_the_maximum_and_keeps_sizes(inst, rnd):
    w, k = inst
    n = len(w)
    perm = list(range(n))
    rnd.shuffle(perm)
    start = [sorted(perm[p * (n // k):(p + 1) * (n // k)]) for p in range(k)]
    out = refine_partitions(w, start)
    _valid(out, n, k)
    assert max(partition_loads(w, out)) <= max(partition_loads(w, start)) + 1e-9 * max(1.0, sum(w))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=40), st.integers(1, 6))
def test_lower_bound_contains_the_classic_terms(w, k):
    w = w[: len(w) - len(w) % k] or [0] * k
    m = len(w) // k
    s = sorted(w)
    assert lower_bound(w, k) >= max(sum(w) / k, s[-1] + sum(s[: m - 1])) - 1e-9


def _optimum(w, k):
    """Exact minimum of the maximum load over all equal-count partitions (tiny inputs only)."""
    import itertools

    m = len(w) // k
    best = math.inf

    def rec(rest, worst):
        nonlocal best
        if worst >= best:
            return
        if not rest:
            best = worst
            return
        first, others = rest[0], rest[1:]
        for c in itertools.combinations(range(len(others)), m - 1):
            part = [first, *(others[i] for i in c)]
            left = [x for i, x in enumerate(others) if i not in c]
            rec(left, max(worst, sum(w[i] for i in part)))

    rec(list(range(len(w))), 0.0)
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda k: st.tuples(st.just(k), st.integers(1, 3).flatmap(
    lambda m: st.lists(st.integers(0, 50), min_size=k * m, max_size=k * m)))))
def test_lower_bound_is_valid_and_balance_meets_optimum_on_tiny_inputs(inst):
    k, w = inst
    opt = _optimum(w, k)
    assert lower_bound(w, k) <= opt + 1e-9  # a bound, never above the true optimum
    assert max(partition_loads(w, balance_partitions(w, k))) >= opt - 1e-9  # cross-checks the exhaustive solver


def _lengths(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "lognormal":
        return np.clip(rng.lognormal(6.5, 0.8, n), 16, 16384).astype(int)
    # agentic: many short single-turn answers, a tail of long multi-turn trajectories
    short = rng.integers(100, 1200, n)
    long = rng.integers(6000, 14000, n)
    return np.where(rng.random(n) < 0.75, short, long)


@pytest.mark.parametrize("kind", ["lognormal", "bimodal"])
@pytest.mark.parametrize("dp", [8, 16, 32])
def test_quality_target_512_samples(kind, dp):
    model = WorkloadModel.from_hidden_size(4096)
    for seed in range(3):
        w = model(_lengths(kind, 512, np.random.default_rng(seed)))
        ours = imbalance(partition_loads(w, balance_partitions(w, dp)))
        kk = imbalance(partition_loads(w, karmarkar_karp(w, dp)))
        bound = lower_bound(w, dp) / (w.sum() / dp)
        assert ours <= max(1.01, bound * 1.01), (seed, ours, kk, bound)
        assert ours <= kk + 1e-12


def test_bad_inputs_name_the_problem():
    with pytest.raises(PartitionError, match="5 workloads cannot be split into 2 equal-count parts"):
        balance_partitions([1, 2, 3, 4, 5], 2)
    with pytest.raises(PartitionError, match="num_parts must be a positive int"):
        balance_partitions([1, 2], 0)
    with pytest.raises(PartitionError, match="position 1 holds nan"):
        balance_partitions([1.0, float("nan")], 1)
    with pytest.raises(PartitionError, match="position 0 holds -1.0"):
        karmarkar_karp([-1, 2], 2)
    with pytest.raises(PartitionError, match="1-D"):
        balance_partitions([[1, 2]], 1)
    with pytest.raises(PartitionError, match="equal-sized"):
        refine_partitions([1, 2, 3], [[0], [1, 2]])
    with pytest.raises(PartitionError, match="exactly once"):
        refine_partitions([1, 2], [[0], [0]])


def test_edges_and_examples():
    assert balance_partitions([], 3) == [[], [], []]
    assert balance_partitions([5, 1, 2], 1) == [[0, 1, 2]]
    assert contiguous_partitions(6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert imbalance([2, 2]) == 1.0 and imbalance([3, 1]) == 1.5 and imbalance([]) == 1.0
    parts = balance_partitions([9, 1, 8, 2, 7, 3], 2)
    assert sorted(partition_loads([9, 1, 8, 2, 7, 3], parts)) == [14.0, 16.0]  # optimum (15 is unreachable)
    assert balance_partitions(np.array([3.0, 3.0, 1.0, 1.0]), 2) in ([[0, 2], [1, 3]], [[0, 3], [1, 2]])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 24), st.integers(1, 9), st.integers(0, 10_000))
def test_both_karmarkar_karp_implementations_agree(k, m, seed):
    from dispatch.balance import _kk_arrays, _kk_small

    w = WorkloadModel.from_hidden_size(64)(np.random.default_rng(seed).integers(1, 500, k * m))
    order = np.argsort(w, kind="stable")
    a, b = _kk_small(w.tolist(), order.tolist(), k), _kk_arrays(w, order, k)
    assert sorted(map(sorted, a)) == sorted(map(sorted, b))
    assert sorted(i for p in a for i in p) == list(range(k * m))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=2, max_size=16).filter(lambda x: len(x) % 2 == 0))
def test_two_parts_of_at_most_eight_are_optimal(w):
    # with k = 2 the exact pair re-split covers the whole problem, so the result is the true optimum
    import itertools

    n = len(w)
    best = min(max(sum(w[i] for i in c), sum(w) - sum(w[i] for i in c))
               for c in itertools.combinations(range(n), n // 2))
    assert max(partition_loads(w, balance_partitions(w, 2))) == best
    from dispatch.balance import _half_masks

    assert _half_masks(3).shape == (10, 6) and (_half_masks(3).sum(axis=1) == 3).all()
