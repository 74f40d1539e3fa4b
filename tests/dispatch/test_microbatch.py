"""Micro-batches: hard token cap, equal counts across ranks, VPP rounding, fixed sizes, pipeline order."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dispatch import (
    MicroBatchError,
    WorkloadModel,
    min_micro_batches,
    pack_micro_batches,
    small_ends_order,
    split_micro_batches,
)

MODEL = WorkloadModel.from_hidden_size(64)


@st.composite
def rank_batches(draw):
    dp = draw(st.integers(1, 4))
    m = draw(st.integers(1, 10))
    seq = draw(st.lists(st.integers(1, 300), min_size=dp * m, max_size=dp * m))
    perm = draw(st.permutations(range(dp * m)))
    ranks = [sorted(perm[d * m:(d + 1) * m]) for d in range(dp)]
    return np.array(seq), ranks


def _check_cover(ranks, out):
    for r, mbs in zip(ranks, out):
        assert sorted(i for mb in mbs for i in mb) == sorted(r)
        assert all(len(mb) > 0 for mb in mbs)


@settings(max_examples=120, deadline=None)
@given(rank_batches(), st.integers(300, 1200), st.sampled_from([1, 2, 4]), st.booleans())
def test_token_cap_is_never_exceeded_and_counts_are_equal(batch, cap, group, small_ends):
    seq, ranks = batch
    m = len(ranks[0])
    w = MODEL(seq)
    try:
        out = split_micro_batches(ranks, w, seq, token_cap=cap, multiple_of=group, small_ends=small_ends)
    except MicroBatchError as exc:  # only legal when VPP rounding asks for more micro-batches than samples
        assert "micro-batches" in str(exc) and group > 1
        return
    counts = {len(mbs) for mbs in out}
    assert len(counts) == 1  # same count on every rank
    count = counts.pop()
    assert count % group == 0 and count <= m
    assert count >= max(math.ceil(seq[r].sum() / cap) for r in ranks)  # no fewer than the volume bound
    for mbs in out:
        assert all(seq[mb].sum() <= cap for mb in mbs)  # hard cap
    _check_cover(ranks, out)
    # as few as possible: the most any single rank needs, rounded up to the group, unless that count fails to pack
    need = max(min_micro_batches(w[r], seq[r], cap) for r in ranks)
    base = math.ceil(need / group) * group
    assert count >= base
    if count > base:
        assert any(pack_micro_batches(w[r], seq[r], count - group, token_cap=cap) is None for r in ranks)


@settings(max_examples=80, deadline=None)
@given(rank_batches(), st.integers(1, 6))
def test_fixed_micro_batch_size(batch, mbs):
    seq, ranks = batch
    m = len(ranks[0])
    out = split_micro_batches(ranks, MODEL(seq), seq, micro_batch_size=mbs)
    assert {len(x) for x in out} == {math.ceil(m / mbs)}
    for x in out:
        sizes = [len(mb) for mb in x]
        assert max(sizes) <= mbs and max(sizes) - min(sizes) <= 1
    _check_cover(ranks, out)


def _greedy_by_count(w, count, caps):
    """The documented rule, one scan per sample: heaviest first (ties by position); an empty bin first, in
    index order; else the lightest bin under its size cap, ties to the lower index."""
    bins, loads = [[] for _ in range(count)], [0.0] * count
    for i in sorted(range(len(w)), key=lambda j: (-w[j], j)):
        open_ = [b for b in range(count) if len(bins[b]) < caps[b]]
        if not open_:
            return None
        empty = [b for b in open_ if not bins[b]]
        b = empty[0] if empty else min(open_, key=lambda x: (loads[x], x))
        bins[b].append(i)
        loads[b] += w[i]
    return None if any(not b for b in bins) else [sorted(b) for b in bins]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, 2.5, 3.0, 7.0]) | st.floats(0, 100), min_size=1, max_size=40),
       st.data())
def test_size_capped_packing_follows_the_greedy_rule(w, data):
    """Without a token cap the heap-based packing makes exactly the choices of the per-sample scan."""
    count = data.draw(st.integers(1, len(w)))
    caps = data.draw(st.lists(st.integers(0, len(w)), min_size=count, max_size=count))
    tokens = [1] * len(w)
    assert pack_micro_batches(w, tokens, count, size_caps=caps) == _greedy_by_count(w, count, caps)


def test_over_cap_sample_is_an_error_naming_the_key():
    seq = np.array([10, 500, 20, 30])
    with pytest.raises(MicroBatchError, match="sample 'u1_0_0' has seq_len 500 > the micro-batch token cap 100"):
        split_micro_batches([[0, 1], [2, 3]], MODEL(seq), seq, token_cap=100,
                            keys=["u0_0_0", "u1_0_0", "u2_0_0", "u3_0_0"])
    with pytest.raises(MicroBatchError, match="exceeds the micro-batch token cap"):
        min_micro_batches([1.0], [7], 5)


def test_vpp_rounding_and_its_limit():
    seq = np.array([10] * 8)
    out = split_micro_batches([list(range(4)), list(range(4, 8))], MODEL(seq), seq, token_cap=1000, multiple_of=2)
    assert [len(x) for x in out] == [2, 2]
    with pytest.raises(MicroBatchError, match="4 micro-batches \\(a multiple of 4\\) .* only 2 samples"):
        split_micro_batches([[0, 1], [2, 3]], MODEL(seq[:4]), seq[:4], token_cap=15, multiple_of=4)
    with pytest.raises(MicroBatchError, match="same number of samples"):
        split_micro_batches([[0, 1], [2]], MODEL(seq[:3]), seq[:3])
    with pytest.raises(MicroBatchError, match="not both"):
        split_micro_batches([[0]], [1.0], [1], micro_batch_size=1, token_cap=5)


def test_packing_balances_workloads():
    seq = np.array([100, 90, 80, 70, 60, 50, 40, 30])
    bins = pack_micro_batches(MODEL(seq), seq, 2, token_cap=400)
    loads = [seq[b].sum() for b in bins]
    assert sorted(loads) == [260, 260]
    assert pack_micro_batches(MODEL(seq), seq, 1, token_cap=400) is None  # 520 tokens do not fit one
    assert pack_micro_batches([1.0], [1], 2) is None  # more bins than samples
    assert min_micro_batches(MODEL(seq), seq, 400) == 2
    assert min_micro_batches([], [], 5) == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=1, max_size=12))
def test_small_ends_order(loads):
    order = small_ends_order(loads)
    assert sorted(order) == list(range(len(loads)))
    got = [loads[i] for i in order]
    peak = int(np.argmax(got))
    assert all(got[i] <= got[i + 1] for i in range(peak))  # rises to the heaviest ...
    assert all(got[i] >= got[i + 1] for i in range(peak, len(got) - 1))  # ... then falls
    assert got[0] == min(loads) or got[-1] == min(loads)


def test_small_ends_in_split():
    seq = np.array([5, 50, 10, 40, 20, 30])
    out = split_micro_batches([list(range(6))], MODEL(seq), seq, micro_batch_size=1, small_ends=True)
    assert [int(seq[mb].sum()) for mb in out[0]] == [5, 20, 40, 50, 30, 10]


def _ffd_count(tokens, cap):
    """First-fit decreasing, written independently: bins it opens for ``tokens`` under ``cap``."""
    rooms = []
    for x in sorted(tokens, reverse=True):
        for j, r in enumerate(rooms):
            if x <= r:
                rooms[j] -= x
                break
        else:
            rooms.append(cap - x)
    return len(rooms)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=40), st.integers(100, 260), st.booleans())
def test_micro_batch_count_is_never_above_first_fit_decreasing(seq, cap, same_workload):
    seq = np.array(seq)
    w = np.ones(seq.size) if same_workload else MODEL(seq)
    count = min_micro_batches(w, seq, cap)
    assert math.ceil(seq.sum() / cap) <= count <= _ffd_count(seq.tolist(), cap)
    # every count from the minimum up to one sample per micro-batch packs under the cap, covering each sample once
    for c in range(count, min(seq.size, count + 3) + 1):
        bins = pack_micro_batches(w, seq, c, token_cap=cap)
        assert bins is not None and len(bins) == c and all(len(b) > 0 for b in bins)
        assert all(seq[b].sum() <= cap for b in bins)
        assert sorted(i for b in bins for i in b) == list(range(seq.size))


def test_dense_packing_beats_the_balanced_greedy_where_it_fails():
    # heaviest-first into the lightest bin spreads 60, 50 over two bins and then cannot place 40 + 40 + 10;
    # first-fit decreasing fits {60, 40}, {50, 40, 10} into two
    seq = np.array([60, 50, 40, 40, 10])
    assert min_micro_batches(MODEL(seq), seq, 100) == 2
    bins = pack_micro_batches(MODEL(seq), seq, 2, token_cap=100)
    assert sorted(int(seq[b].sum()) for b in bins) == [100, 100]
