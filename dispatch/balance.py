"""Equal-count partitioning of per-sample workloads into DP shares with a minimal maximum share.

Every DP rank must receive the same number of samples (so that every rank runs the same number of
steps), and the slowest rank sets the step time, so the goal is: split ``n`` workloads into ``k`` sets of
exactly ``n / k`` items each, minimising the largest set sum.

:func:`balance_partitions` runs two constructions and a repair pass, and keeps the best:

1. *greedy with a cardinality cap*: heaviest item first, each to the currently lightest set that still has
   room for it (a set holds at most ``n / k``);
2. *equal-size Karmarkar–Karp* (largest differencing): start from ``n / k`` partial solutions of ``k``
   singleton sets (consecutive items in sorted order), repeatedly merge the two partial solutions with the
   largest spread by pairing the heaviest set of one with the lightest set of the other;
3. *swap repair* of each: while some 1-for-1 exchange between the heaviest set and a lighter set lowers
   the pair's maximum, apply the best such exchange (for sets of at most 8 items, fall back to the exact
   best equal-count re-split of the pair). Each move strictly lowers the sorted load vector, so it
   terminates and never raises the maximum. The construction that already meets the lower bound stops
   the search early.

The result is never worse than equal-size Karmarkar–Karp (it is one of the candidates and repair only
lowers the maximum). :func:`lower_bound` gives a value no equal-count partition can beat (the mean, the
heaviest item plus the ``n/k - 1`` lightest, and its generalisation to the ``j`` heaviest items).

Example::

    >>> balance_partitions([9, 1, 8, 2, 7, 3], 2)
    [[0, 3, 5], [1, 2, 4]]
"""
from __future__ import annotations

import functools
import heapq
import itertools
import math
from typing import Sequence

import numpy as np

__all__ = [
    "PartitionError",
    "balance_partitions",
    "karmarkar_karp",
    "greedy_partitions",
    "contiguous_partitions",
    "refine_partitions",
    "partition_loads",
    "lower_bound",
    "imbalance",
]


class PartitionError(ValueError):
    """Workloads or a part count that cannot be split into equal-count parts."""


def _as_weights(workloads: Sequence[float] | np.ndarray, num_parts: int) -> np.ndarray:
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)) or num_parts < 1:
        raise PartitionError(f"num_parts must be a positive int, got {num_parts!r}")
    try:
        w = np.asarray(workloads, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PartitionError(f"workloads must be a sequence of numbers: {exc}") from None
    if w.ndim != 1:
        raise PartitionError(f"workloads must be 1-D, got shape {tuple(w.shape)}")
    if w.size % num_parts:
        raise PartitionError(f"{w.size} workloads cannot be split into {num_parts} equal-count parts; pad the batch "
                             f"to a multiple of {num_parts} (e.g. with dispatch.make_padding) first")
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        raise PartitionError(f"workloads must be finite and >= 0; position {int(bad[0])} holds {float(w[bad[0]])}")
    return w


def partition_loads(workloads: Sequence[float] | np.ndarray, parts: Sequence[Sequence[int]]) -> list[float]:
    """Sum of the workloads in each part."""
    w = np.asarray(workloads, dtype=np.float64)
    return [float(w[list(p)].sum()) if len(p) else 0.0 for p in parts]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of part loads (1.0 = perfect; 1.0 for an all-zero or empty list)."""
    if not len(loads):
        return 1.0
    mean = float(np.mean(loads))
    return float(np.max(loads)) / mean if mean > 0 else 1.0


def lower_bound(workloads: Sequence[float] | np.ndarray, num_parts: int) -> float:
    """A value no equal-count partition's maximum load can be below (``m = n / k`` items per part).

    ``max(mean, max_j B_j)`` over ``j = 1..k`` with the items sorted (``w_1 >= w_2 >= ...``), where
    ``B_j = min(A_j, P_j)``: either the ``j`` heaviest items sit in ``j`` different parts, which then also
    hold ``(m-1)·j`` other items, so the heaviest of them carries at least
    ``A_j = (w_1 + ... + w_j + the (m-1)·j smallest) / j``; or two of them share a part, which then carries at
    least ``P_j = w_{j-1} + w_j + the (m-2) smallest`` (impossible when ``m = 1``). ``B_1 = w_1 + the m-1
    smallest`` is the familiar single-item bound.
    """
    w = _as_weights(workloads, num_parts)
    if w.size == 0:
        return 0.0
    k = num_parts
    m = w.size // k
    asc = np.sort(w)
    desc = asc[::-1]
    small = np.concatenate([[0.0], np.cumsum(asc)])  # small[i] = sum of the i smallest
    top = np.cumsum(desc[:k])  # top[j-1] = sum of the j heaviest
    j = np.arange(1, k + 1)
    spread = (top + small[(m - 1) * j]) / j
    if m >= 2:
        pair = np.full(k, np.inf)
        pair[1:] = desc[:k - 1] + desc[1:k] + small[m - 2]
        spread = np.minimum(spread, pair)
    return float(max(asc.sum() / k, spread.max()))


def contiguous_partitions(n: int, num_parts: int) -> list[list[int]]:
    """Consecutive equal chunks ``[0..n/k), [n/k..2n/k), ...``: what a plain split does."""
    _as_weights(np.zeros(n), num_parts)
    m = n // num_parts
    return [list(range(p * m, (p + 1) * m)) for p in range(num_parts)]


def greedy_partitions(workloads: Sequence[float] | np.ndarray, num_parts: int) -> list[list[int]]:
    """Greedy with a cardinality cap: heaviest first, each item to the lightest part that still has room.

    With many parts (>= 32) holding many items (>= 64) each, it hands out whole rounds of ``k`` items at once (the round's heaviest
    item to the lightest part), which is the same rule applied round by round and much faster.
    """
    w = _as_weights(workloads, num_parts)
    k = num_parts
    m = w.size // k
    if m == 0:
        return [[] for _ in range(k)]
    order = np.argsort(-w, kind="stable")
    if m >= 64 and k >= 32:
        loads = np.zeros(k)
        assign = np.empty(w.size, dtype=np.int64)
        for start in range(0, w.size, k):
            items = order[start:start + k]
            parts_by_load = np.argsort(loads, kind="stable")
            assign[items] = parts_by_load
            loads[parts_by_load] += w[items]
        return _parts_from_assign(assign, k)
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, p) for p in range(k)]
    wl = w.tolist()
    for i in order.tolist():
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        if len(parts[p]) < m:
            heapq.heappush(heap, (load + wl[i], p))
    return [sorted(p) for p in parts]


def karmarkar_karp(workloads: Sequence[float] | np.ndarray, num_parts: int) -> list[list[int]]:
    """Equal-size Karmarkar–Karp (largest differencing method), written from its definition.

    Sort the items; every run of ``k`` consecutive items is a partial solution of ``k`` singleton sets.
    Repeatedly take the two partial solutions with the largest spread (max set sum - min set sum) and
    merge them, joining the heaviest set of one with the lightest set of the other, and so on.
    """
    w = _as_weights(workloads, num_parts)
    k = num_parts
    if w.size == 0:
        return [[] for _ in range(k)]
    order = np.argsort(w, kind="stable")
    if k <= 16:
        return _kk_small(w.tolist(), order.tolist(), k)
    return _kk_arrays(w, order, k)


def _kk_arrays(w: np.ndarray, order: np.ndarray, k: int) -> list[list[int]]:
    """Karmarkar–Karp on numpy arrays: faster when each partial solution has many sets."""
    heap: list[tuple[float, int, np.ndarray, np.ndarray]] = []
    for c, start in enumerate(range(0, w.size, k)):
        chunk = order[start:start + k]
        sums = w[chunk]
        heapq.heappush(heap, (-(float(sums.max() - sums.min())), c, sums, chunk[:, None]))
    tick = len(heap)
    while len(heap) > 1:
        _, _, s1, m1 = heapq.heappop(heap)
        _, _, s2, m2 = heapq.heappop(heap)
        o1 = np.argsort(-s1, kind="stable")  # heaviest set of one solution ...
        o2 = np.argsort(s2, kind="stable")  # ... joins the lightest set of the other
        sums = s1[o1] + s2[o2]
        members = np.concatenate([m1[o1], m2[o2]], axis=1)
        heapq.heappush(heap, (-(float(sums.max() - sums.min())), tick, sums, members))
        tick += 1
    return [sorted(row) for row in heap[0][3].tolist()]


def _kk_small(w: list[float], order: list[int], k: int) -> list[list[int]]:
    """The same method on plain lists: faster when each partial solution has only a few sets."""
    heap: list[tuple[float, int, list[float], list]] = []
    for c, start in enumerate(range(0, len(order), k)):
        chunk = order[start:start + k]  # ascending weights
        heapq.heappush(heap, (-(w[chunk[-1]] - w[chunk[0]]), c, [w[i] for i in chunk], [[i] for i in chunk]))
    tick = len(heap)
    while len(heap) > 1:
        _, _, s1, m1 = heapq.heappop(heap)
        _, _, s2, m2 = heapq.heappop(heap)
        o1 = sorted(range(k), key=lambda j: -s1[j])  # heaviest set of one solution ...
        o2 = sorted(range(k), key=lambda j: s2[j])  # ... joins the lightest set of the other
        sums = [s1[x] + s2[y] for x, y in zip(o1, o2)]
        members = [(m1[x], m2[y]) for x, y in zip(o1, o2)]  # a tree of joins, flattened once at the end
        heapq.heappush(heap, (-(max(sums) - min(sums)), tick, sums, members))
        tick += 1
    return [sorted(_flatten(m)) for m in heap[0][3]]


def _flatten(tree) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.extend(node)
    return out


_BRUTE_ELEMS = 1 << 16  # (parts x m x m) exchange candidates evaluated at once for small parts
_PAIR_EXACT_M = 8  # parts of up to this many items get an exact two-part re-split when swaps are stuck


def _best_swap(wt: np.ndarray, loads: np.ndarray, h: int, eps: float):
    """The 1-for-1 exchange (o, a, b, delta) between part h and the lightest possible part that lowers their max."""
    k, m = wt.shape
    wh = wt[h]
    order = np.argsort(loads, kind="stable")
    order = order[(order != h) & (loads[h] - loads[order] > eps)].tolist()
    if m >= 32:  # many items: binary search per partner part (rows are sorted)
        for o in order:
            gap = loads[h] - loads[o]
            wo = wt[o]
            pos = np.searchsorted(wo, wh - gap / 2.0)
            best_val, best = math.inf, None
            for cand in (np.maximum(pos - 1, 0), np.minimum(pos, m - 1)):
                delta = wh - wo[cand]
                score = np.abs(delta - gap / 2.0)
                score[(delta <= eps) | (delta >= gap - eps)] = math.inf
                a = int(np.argmin(score))
                if score[a] < best_val:
                    best_val, best = float(score[a]), (o, a, int(cand[a]), float(delta[a]))
            if best is not None:
                return best
        return None
    chunk = max(1, _BRUTE_ELEMS // (m * m))
    for start in range(0, len(order), chunk):
        cand = np.asarray(order[start:start + chunk])
        delta = wh[None, :, None] - wt[cand][:, None, :]  # (c, a, b)
        new_max = np.maximum(loads[h] - delta, loads[cand][:, None, None] + delta)
        new_max[(delta <= eps) | (new_max >= loads[h] - eps)] = math.inf
        flat = int(np.argmin(new_max))
        if np.isfinite(new_max.flat[flat]):
            c, a, b = np.unravel_index(flat, new_max.shape)
            return int(cand[c]), int(a), int(b), float(delta[c, a, b])
    return None


@functools.lru_cache(maxsize=16)
def _half_masks(m: int) -> np.ndarray:
    """All ways to pick m of 2m positions (as a 0/1 matrix), each split counted once."""
    rows = [c for c in itertools.combinations(range(2 * m), m) if 0 in c]
    mask = np.zeros((len(rows), 2 * m))
    for r, c in enumerate(rows):
        mask[r, list(c)] = 1.0
    return mask


def _best_pair_split(wt: np.ndarray, idx: np.ndarray, loads: np.ndarray, h: int, eps: float):
    """Exact best equal-count re-split of part h with the lightest part for which it lowers their maximum."""
    k, m = wt.shape
    mask = _half_masks(m)  # (splits, 2m)
    order = np.argsort(loads, kind="stable")
    order = order[(order != h) & (loads[h] - loads[order] > eps)]
    chunk = max(1, (1 << 20) // mask.size)
    for start in range(0, order.size, chunk):
        cand = order[start:start + chunk]
        both = np.concatenate([np.broadcast_to(wt[h], (cand.size, m)), wt[cand]], axis=1)  # (c, 2m)
        first = both @ mask.T  # (c, splits)
        pair_max = np.maximum(first, both.sum(axis=1, keepdims=True) - first)
        best = pair_max.argmin(axis=1)
        ok = np.flatnonzero(pair_max[np.arange(cand.size), best] < loads[h] - eps)
        if ok.size:
            c = int(ok[0])  # the lightest partner that helps
            o = int(cand[c])
            sel = mask[best[c]].astype(bool)
            ids = np.concatenate([idx[h], idx[o]])
            return o, ids[sel], ids[~sel]
    return None


def refine_partitions(workloads: Sequence[float] | np.ndarray, parts: Sequence[Sequence[int]],
                      max_swaps: int | None = None, tolerance: float = 1e-4) -> list[list[int]]:
    """Local search: lower the heaviest part by 1-for-1 exchanges (or, for parts of <= 8 items, an exact two-part
    re-split) with lighter parts, until nothing lowers it or it is within ``tolerance`` (relative) of
    :func:`lower_bound`.

    ``parts`` must be equal-sized and cover ``range(n)``; sizes never change and the maximum load never rises.
    """
    k = len(parts)
    sizes = {len(p) for p in parts}
    if len(sizes) > 1:
        raise PartitionError(f"refine_partitions needs equal-sized parts, got sizes {sorted(sizes)}")
    w = _as_weights(workloads, max(k, 1))
    if k <= 1 or w.size == 0:
        return [sorted(int(i) for i in p) for p in parts]
    idx = np.asarray([list(p) for p in parts], dtype=np.int64)  # (k, m)
    if idx.size != w.size or not np.array_equal(np.sort(idx.ravel()), np.arange(w.size)):
        raise PartitionError(f"parts must cover positions 0..{w.size - 1} exactly once")
    wt = w[idx]
    order = np.argsort(wt, axis=1, kind="stable")  # each row sorted by weight
    idx = np.take_along_axis(idx, order, axis=1)
    wt = np.take_along_axis(wt, order, axis=1)
    m = wt.shape[1]
    loads = wt.sum(axis=1)
    limit = max_swaps if max_swaps is not None else 8 * w.size + 16
    eps = 1e-12 * max(float(loads.max()), 1.0)
    floor = lower_bound(w, k) * (1.0 + tolerance) + eps
    for _ in range(limit):
        h = int(np.argmax(loads))
        if loads[h] <= floor:
            break  # optimal: nothing can beat the bound
        move = _best_swap(wt, loads, h, eps)
        if move is not None:
            o, a, b, delta = move
            idx[h, a], idx[o, b] = idx[o, b], idx[h, a]
            wt[h, a], wt[o, b] = wt[o, b], wt[h, a]
            rows = (h, o)
        elif 1 < m <= _PAIR_EXACT_M and (split := _best_pair_split(wt, idx, loads, h, eps)) is not None:
            o, ids_h, ids_o = split
            idx[h], idx[o] = ids_h, ids_o
            wt[h], wt[o] = w[ids_h], w[ids_o]
            rows = (h, o)
        else:
            break
        for row in rows:
            r = np.argsort(wt[row], kind="stable")
            wt[row], idx[row] = wt[row][r], idx[row][r]
            loads[row] = wt[row].sum()
    return [sorted(row) for row in idx.tolist()]


def balance_partitions(workloads: Sequence[float] | np.ndarray, num_parts: int) -> list[list[int]]:
    """Split ``range(n)`` into ``num_parts`` parts of exactly ``n / num_parts`` indices with a small maximum load.

    Requires ``n`` divisible by ``num_parts``. Deterministic; each part is sorted ascending. Never worse than
    :func:`karmarkar_karp` (equal-size) on the same input: Karmarkar–Karp runs as a second candidate unless
    the first already meets :func:`lower_bound`, which no partition can beat.
    """
    w = _as_weights(workloads, num_parts)
    if num_parts == 1:
        return [list(range(w.size))]
    if w.size == 0:
        return [[] for _ in range(num_parts)]
    best = refine_partitions(w, greedy_partitions(w, num_parts))
    best_max = max(partition_loads(w, best))
    bound = lower_bound(w, num_parts)
    if best_max <= bound * (1 + 1e-12):
        return best
    kk = karmarkar_karp(w, num_parts)
    for cand in (kk, refine_partitions(w, kk)):
        cand_max = max(partition_loads(w, cand))
        if cand_max < best_max:
            best, best_max = cand, cand_max
    return best


def _parts_from_assign(assign: np.ndarray, k: int) -> list[list[int]]:
    order = np.argsort(assign, kind="stable")
    counts = np.bincount(assign, minlength=k)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [order[bounds[p]:bounds[p + 1]].tolist() for p in range(k)]
