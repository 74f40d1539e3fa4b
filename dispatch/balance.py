"""Equal-count partitioning of per-sample workloads into DP shares with a minimal maximum share.

Every DP rank must receive the same number of samples (so that every rank runs the same number of
steps), and the slowest rank sets the step time, so the goal is: split ``n`` workloads into ``k`` sets of
exactly ``n / k`` items each, minimising the largest set sum.

:func:`balance_partitions` runs two constructions and a repair pass, and keeps the best:

1. *round-robin greedy*: sort descending, hand out ``k`` items per round, the heaviest item of the round
   to the currently lightest set;
2. *equal-size Karmarkar–Karp* (largest differencing): start from ``n / k`` partial solutions of ``k``
   singleton sets (consecutive items in sorted order), repeatedly merge the two partial solutions with the
   largest spread by pairing the heaviest set of one with the lightest set of the other;
3. *swap repair* on the better of the two: while some 1-for-1 exchange between the heaviest set and
   another set lowers the pair's maximum, apply the exchange whose weight difference is closest to half
   the gap. Each exchange strictly lowers the sorted load vector, so it terminates and never worsens
   the maximum.

The result is never worse than equal-size Karmarkar–Karp (it is one of the candidates and repair only
lowers the maximum). :func:`lower_bound` gives ``max(mean, w_max + sum of the n/k - 1 smallest others)``,
which no equal-count partition can beat.

Example::

    >>> balance_partitions([9, 1, 8, 2, 7, 3], 2)
    [[0, 3, 5], [1, 2, 4]]
"""
from __future__ import annotations

import heapq
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
    """A bound no equal-count partition's maximum load can beat: max(mean, largest + (n/k - 1) smallest others)."""
    w = _as_weights(workloads, num_parts)
    if w.size == 0:
        return 0.0
    m = w.size // num_parts
    s = np.sort(w)
    return float(max(s.sum() / num_parts, s[-1] + s[: m - 1].sum()))


def contiguous_partitions(n: int, num_parts: int) -> list[list[int]]:
    """Consecutive equal chunks ``[0..n/k), [n/k..2n/k), ...``: what a plain split does."""
    _as_weights(np.zeros(n), num_parts)
    m = n // num_parts
    return [list(range(p * m, (p + 1) * m)) for p in range(num_parts)]


def greedy_partitions(workloads: Sequence[float] | np.ndarray, num_parts: int) -> list[list[int]]:
    """Round-robin greedy: per round of ``k`` items (descending), heaviest item to the lightest part."""
    w = _as_weights(workloads, num_parts)
    k = num_parts
    order = np.argsort(-w, kind="stable")
    loads = np.zeros(k)
    assign = np.empty(w.size, dtype=np.int64)
    for start in range(0, w.size, k):
        items = order[start:start + k]
        parts = np.argsort(loads, kind="stable")
        assign[items] = parts
        loads[parts] += w[items]
    return _parts_from_assign(assign, k)


def karmarkar_karp(workloads: Sequence[float] | np.ndarray, num_parts: int) -> list[list[int]]:
    """Equal-size Karmarkar–Karp (largest differencing method), written from its definition."""
    w = _as_weights(workloads, num_parts)
    k = num_parts
    if w.size == 0:
        return [[] for _ in range(k)]
    order = np.argsort(w, kind="stable")
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


def refine_partitions(workloads: Sequence[float] | np.ndarray, parts: Sequence[Sequence[int]],
                      max_swaps: int | None = None) -> list[list[int]]:
    """Swap repair: exchange items between the heaviest part and lighter parts while that lowers the maximum.

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
    order = np.argsort(wt, axis=1, kind="stable")  # each row sorted by weight for binary search
    idx = np.take_along_axis(idx, order, axis=1)
    wt = np.take_along_axis(wt, order, axis=1)
    m = wt.shape[1]
    loads = wt.sum(axis=1)
    limit = max_swaps if max_swaps is not None else 8 * w.size + 16
    eps = 1e-12 * max(float(loads.max()), 1.0)
    for _ in range(limit):
        h = int(np.argmax(loads))
        wh = wt[h]
        best = None
        for o in np.argsort(loads, kind="stable").tolist():
            gap = loads[h] - loads[o]
            if o == h or gap <= eps:
                break  # parts are visited lightest first; the rest are at least as heavy
            wo = wt[o]
            pos = np.searchsorted(wo, wh - gap / 2.0)
            best_val = math.inf
            for cand in (np.maximum(pos - 1, 0), np.minimum(pos, m - 1)):
                delta = wh - wo[cand]
                score = np.abs(delta - gap / 2.0)
                score[(delta <= eps) | (delta >= gap - eps)] = math.inf
                a = int(np.argmin(score))
                if score[a] < best_val:
                    best_val, best = float(score[a]), (o, a, int(cand[a]), float(delta[a]))
            if best is not None:
                break
        if best is None:
            break
        o, a, b, delta = best
        ia, ib = idx[h, a], idx[o, b]
        wa, wb = wt[h, a], wt[o, b]
        idx[h, a], wt[h, a] = ib, wb
        idx[o, b], wt[o, b] = ia, wa
        for row in (h, o):
            r = np.argsort(wt[row], kind="stable")
            wt[row], idx[row] = wt[row][r], idx[row][r]
        loads[h] -= delta
        loads[o] += delta
    return [sorted(row) for row in idx.tolist()]


def balance_partitions(workloads: Sequence[float] | np.ndarray, num_parts: int) -> list[list[int]]:
    """Split ``range(n)`` into ``num_parts`` parts of exactly ``n / num_parts`` indices with a small maximum load.

    Requires ``n`` divisible by ``num_parts``. Deterministic; each part is sorted ascending. Never worse than
    :func:`karmarkar_karp` (equal-size) on the same input.
    """
    w = _as_weights(workloads, num_parts)
    if num_parts == 1:
        return [list(range(w.size))]
    if w.size == 0:
        return [[] for _ in range(num_parts)]
    candidates = [greedy_partitions(w, num_parts), karmarkar_karp(w, num_parts)]
    maxes = [max(partition_loads(w, c)) for c in candidates]
    start = candidates[int(np.argmin(maxes))]
    refined = refine_partitions(w, start)
    if max(partition_loads(w, refined)) <= min(maxes):
        return refined
    return start  # unreachable in exact arithmetic; guards against float round-off


def _parts_from_assign(assign: np.ndarray, k: int) -> list[list[int]]:
    order = np.argsort(assign, kind="stable")
    counts = np.bincount(assign, minlength=k)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [order[bounds[p]:bounds[p + 1]].tolist() for p in range(k)]
