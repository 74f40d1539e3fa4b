"""Equal-count partitioning: validity, never worse than verl's equal-size Karmarkar–Karp, bounds and quality targets."""
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
    differencing_partitions,
    greedy_partitions,
    imbalance,
    karmarkar_karp,
    lower_bound,
    partition_loads,
    refine_partitions,
)


def _load_reference():
    """tests/dispatch/verl_reference.py: verl's KK written from its definition (tie-breaking included)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("verl_reference.py")
    spec = importlib.util.spec_from_file_location("dispatch_verl_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REF = _load_reference()


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


@st.composite
def kk_inputs(draw):
    k = draw(st.sampled_from([1, 2, 3, 5, 8, 9, 16, 24]))
    equal = draw(st.booleans())
    n = k * draw(st.integers(1, 6)) if equal else draw(st.integers(k, 3 * k + 4))
    if draw(st.booleans()):  # few distinct values: ties everywhere, so the tie-breaking decides
        w = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    else:
        w = draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n))
    return w, k, equal


@settings(max_examples=300, deadline=None)
@given(kk_inputs())
def test_differencing_is_verls_karmarkar_karp_exactly(inst):
    # every internal path (two sets, Python lists, numpy rows) reproduces verl's sets, their order and item order
    w, k, equal = inst
    assert differencing_partitions(w, k, equal) == REF.verl_karmarkar_karp(w, k, equal)
    if equal:
        assert karmarkar_karp(w, k) == [sorted(p) for p in REF.verl_karmarkar_karp(w, k, True)]


@st.composite
def verl_inputs(draw):
    k = draw(st.integers(1, 40))
    m = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["seqlen", "small", "heavy"]))
    if kind == "seqlen":  # verl's own workloads: 24576·s + s² of integer lengths
        s = draw(st.lists(st.integers(1, 32768), min_size=k * m, max_size=k * m))
        w = [REF.verl_workload(x) for x in s]
    elif kind == "small":
        w = draw(st.lists(st.integers(0, 20), min_size=k * m, max_size=k * m))
    else:
        w = draw(st.lists(st.integers(1, 100), min_size=k * m, max_size=k * m))
        w[draw(st.integers(0, k * m - 1))] = 10**6
    return w, k


@settings(max_examples=300, deadline=None)
@given(verl_inputs())
def test_never_worse_than_verls_karmarkar_karp(inst):
    # integer workloads below 2**53 add up exactly in float64, so the comparison needs no tolerance
    w, k = inst
    ours = balance_partitions(w, k)
    _valid(ours, len(w), k)
    assert max(partition_loads(w, ours)) <= max(sum(w[i] for i in p) for p in REF.verl_balanced_partitions(w, k, True))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=2, max_size=16).filter(lambda x: len(x) % 2 == 0))
def test_refine_of_two_parts_of_at_most_eight_is_optimal(w):
    # with k = 2 the exact pair re-split of refine_partitions covers the whole problem: the true optimum
    import itertools

    n = len(w)
    best = min(max(sum(w[i] for i in c), sum(w) - sum(w[i] for i in c))
               for c in itertools.combinations(range(n), n // 2))
    start = contiguous_partitions(n, 2)
    assert max(partition_loads(w, refine_partitions(w, start, tolerance=0.0))) == best
    assert max(partition_loads(w, balance_partitions(w, 2))) >= best
    from dispatch.balance import _half_masks

    assert _half_masks(3).shape == (10, 6) and (_half_masks(3).sum(axis=1) == 3).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.lists(st.integers(0, 50), min_size=1, max_size=12),
       st.integers(0, 120))
def test_exchange_search_is_the_same_with_lists_and_arrays(hv, ov, gap):
    """The Python scan (small parts) and the numpy search (large parts) pick the same exchange, ties included."""
    from dispatch.balance import _best_exchange_arrays, _best_exchange_scan

    m = min(len(hv), len(ov))
    hv, ov = sorted(float(x) for x in hv[:m]), sorted(float(x) for x in ov[:m])
    assert _best_exchange_scan(hv, ov, float(gap), 1e-9) == _best_exchange_arrays(hv, ov, float(gap), 1e-9)
