"""Micro-batches of one DP rank's mini-batch: by a fixed sample count or by a hard token budget.

Every DP rank of a mini-batch gets the same number of micro-batches (the engines step through them in
lock-step: pipeline schedules and gradient all-reduce need equal counts). The count is computed from the
tags of all ranks, deterministically, so any rank arrives at the same plan without a collective.

* Token budget: no micro-batch holds more than ``token_cap`` tokens (sum of seq_len); a single sample
  longer than the cap is an error naming its key. The count is the smallest for which every rank packs
  under the cap (never more than first-fit decreasing needs), rounded up to ``multiple_of`` (the
  virtual-pipeline group); any larger count up to the rank's sample count packs too, so the rounded count
  always fits.
* Fixed size: ``ceil(m / micro_batch_size)`` micro-batches (rounded up likewise), sizes differing by at
  most one and never above ``micro_batch_size``.

Within those limits samples are packed heaviest first into the currently lightest micro-batch, which
evens out the micro-batches' workloads; where that greedy does not fit the count, a dense packing is split
instead. Under a token budget the bins are then rebalanced by moves and exchanges that keep the cap. ``small_ends`` then orders them lightest at both ends.

Example::

    >>> split_micro_batches([[0, 1, 2, 3]], workloads=[4, 3, 2, 1], tokens=[4, 3, 2, 1], token_cap=5)
    [[[0, 3], [1, 2]]]
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

__all__ = ["MicroBatchError", "pack_micro_batches", "min_micro_batches", "split_micro_batches", "small_ends_order"]


class MicroBatchError(ValueError):
    """A sample over the token budget, or a micro-batch count a rank cannot fill."""


def pack_micro_batches(workloads: Sequence[float] | np.ndarray, tokens: Sequence[int] | np.ndarray, count: int, *,
                       token_cap: int | None = None, size_caps: Sequence[int] | None = None) -> list[list[int]] | None:
    """Pack positions ``0..m-1`` into exactly ``count`` non-empty bins of at most ``token_cap`` tokens (and
    ``size_caps[b]`` samples); ``None`` when no packing tried fits.

    First heaviest-first into the lightest bin that still fits (balanced by construction). If that fails under a
    token cap, the densest packings known — first-fit and best-fit decreasing by tokens — are tried: one that
    needs at most ``count`` bins is split up to ``count`` (halving the heaviest splittable bin) and then
    rebalanced by moves and exchanges that keep every bin under the cap. So a count succeeds whenever any of
    these packings fits in it, and every count between the smallest such and ``m`` succeeds.
    """
    w = np.asarray(workloads, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.int64)
    m = w.size
    if count < 1 or count > m:
        return None
    loads = np.zeros(count)
    used = np.zeros(count, dtype=np.int64)
    sizes = np.zeros(count, dtype=np.int64)
    caps = np.full(count, m, dtype=np.int64) if size_caps is None else np.asarray(size_caps, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(count)]
    # Heaviest first; ties by tokens then position, so the result is deterministic.
    order = np.lexsort((np.arange(m), -t, -w))
    if token_cap is None:
        return _pack_by_count(order.tolist(), w.tolist(), count, caps.tolist())
    for i in order.tolist():
        ok = sizes < caps
        if token_cap is not None:
            ok &= used + t[i] <= token_cap
        if not ok.any():
            return _dense_pack(w, t, count, token_cap) if token_cap is not None and size_caps is None else None
        # Lightest feasible bin; empty bins first so that no bin stays empty.
        score = np.where(ok, loads, np.inf)
        score = np.where(ok & (sizes == 0), -1.0, score)
        b = int(np.argmin(score))
        bins[b].append(i)
        loads[b] += w[i]
        used[b] += t[i]
        sizes[b] += 1
    if any(not b for b in bins):
        return _dense_pack(w, t, count, token_cap) if token_cap is not None and size_caps is None else None
    return [sorted(b) for b in bins]


def _pack_by_count(order: list[int], w: list[float], count: int, caps: list[int]) -> list[list[int]] | None:
    """:func:`pack_micro_batches` without a token cap, in O(m log count): the same choices (empty bins first in
    index order, then the lightest bin under its size cap, ties to the lower index) kept in a heap."""
    bins: list[list[int]] = [[] for _ in range(count)]
    heap: list[tuple[float, int]] = []
    loads = [0.0] * count
    empty = 0  # bins below ``empty`` are non-empty
    for i in order:
        if empty < count and caps[empty] > 0:
            b = empty
            empty += 1
        elif empty < count:  # a bin whose size cap is 0 can never be filled
            return None
        elif heap:
            b = heapq.heappop(heap)[1]
        else:
            return None
        bins[b].append(i)
        loads[b] += w[i]
        if len(bins[b]) < caps[b]:
            heapq.heappush(heap, (loads[b], b))
    if empty < count:
        return None
    return [sorted(b) for b in bins]


def _dense_pack(w: np.ndarray, t: np.ndarray, count: int, cap: int) -> list[list[int]] | None:
    """The fewest-bin packing of first-fit / best-fit decreasing, split up to ``count`` bins and rebalanced."""
    order = np.lexsort((np.arange(t.size), -w, -t)).tolist()  # most tokens first; ties heavier, then position
    tl, wl = t.tolist(), w.tolist()
    for packer in (_first_fit, _best_fit):
        bins = packer(order, tl, cap)
        if len(bins) <= count:
            bins = _split_to(bins, count, wl)
            return [sorted(b) for b in _rebalance(bins, wl, tl, cap)]
    return None


def _first_fit(order: list[int], t: list[int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, r in enumerate(room):
            if t[i] <= r:
                bins[b].append(i)
                room[b] -= t[i]
                break
        else:
            bins.append([i])
            room.append(cap - t[i])
    return bins


def _best_fit(order: list[int], t: list[int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        fits = [b for b, r in enumerate(room) if t[i] <= r]
        if fits:
            b = min(fits, key=lambda x: (room[x], x))
            bins[b].append(i)
            room[b] -= t[i]
        else:
            bins.append([i])
            room.append(cap - t[i])
    return bins


def _split_to(bins: list[list[int]], count: int, w: list[float]) -> list[list[int]]:
    """Halve the heaviest bin of two or more samples (heaviest first into the lighter half) until ``count`` bins;
    parts of a bin under the cap stay under it."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        b = max(splittable, key=lambda x: (sum(w[i] for i in bins[x]), -x))  # count <= m: one always exists
        halves: list[list[int]] = [[], []]
        loads = [0.0, 0.0]
        for i in sorted(bins[b], key=lambda i: (-w[i], i)):
            h = 0 if (loads[0], len(halves[0])) <= (loads[1], len(halves[1])) else 1
            halves[h].append(i)
            loads[h] += w[i]
        bins[b] = halves[0]
        bins.append(halves[1])
    return bins


def _rebalance(bins: list[list[int]], w: list[float], t: list[int], cap: int,
               max_moves: int | None = None) -> list[list[int]]:
    """Lower the heaviest bin's workload by moving one of its samples to, or exchanging one with, a lighter bin,
    every bin staying under ``cap`` tokens and non-empty; stops when no such step lowers the maximum."""
    loads = [sum(w[i] for i in b) for b in bins]
    used = [sum(t[i] for i in b) for b in bins]
    limit = max_moves if max_moves is not None else 4 * sum(len(b) for b in bins)
    for _ in range(limit):
        h = max(range(len(bins)), key=lambda x: (loads[x], -x))
        top = loads[h]
        step = None
        for o in sorted(range(len(bins)), key=lambda x: (loads[x], x)):
            if o == h or loads[o] >= top:
                break
            for a in bins[h]:
                if len(bins[h]) > 1 and used[o] + t[a] <= cap and loads[o] + w[a] < top:
                    step = (o, a, None)
                    break
                for b in bins[o]:
                    d = w[a] - w[b]
                    if (d > 0 and loads[o] + d < top and used[o] + t[a] - t[b] <= cap
                            and used[h] - t[a] + t[b] <= cap):
                        step = (o, a, b)
                        break
                if step:
                    break
            if step:
                break
        if step is None:
            break
        o, a, b = step
        _move(a, h, o, bins, loads, used, w, t)
        if b is not None:
            _move(b, o, h, bins, loads, used, w, t)
    return bins


def _move(i: int, src: int, dst: int, bins: list[list[int]], loads: list[float], used: list[int],
          w: list[float], t: list[int]) -> None:
    """Sample ``i`` from bin ``src`` to bin ``dst``, keeping the bins' workload and token sums current."""
    bins[src].remove(i)
    bins[dst].append(i)
    loads[src] -= w[i]
    loads[dst] += w[i]
    used[src] -= t[i]
    used[dst] += t[i]


def min_micro_batches(workloads: Sequence[float] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                      token_cap: int) -> int:
    """The fewest micro-batches :func:`pack_micro_batches` fills under ``token_cap``: never more than
    first-fit decreasing needs, never fewer than ``ceil(total tokens / token_cap)``."""
    t = np.asarray(tokens, dtype=np.int64)
    if t.size == 0:
        return 0
    if int(t.max()) > token_cap:
        raise MicroBatchError(f"a sample of {int(t.max())} tokens exceeds the micro-batch token cap {token_cap}")
    count = max(1, math.ceil(int(t.sum()) / token_cap))
    while pack_micro_batches(workloads, t, count, token_cap=token_cap) is None:
        count += 1  # terminates by the count first-fit decreasing needs (at most m)
    return count


def small_ends_order(loads: Sequence[float]) -> list[int]:
    """Order of bins with the lightest at both ends and the heaviest in the middle (pipeline-friendly)."""
    asc = sorted(range(len(loads)), key=lambda b: (loads[b], b))
    front, back = asc[0::2], asc[1::2]
    return front + back[::-1]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def split_micro_batches(ranks: Sequence[Sequence[int]], workloads: Sequence[float] | np.ndarray,
                        tokens: Sequence[int] | np.ndarray, *, micro_batch_size: int | None = None,
                        token_cap: int | None = None, multiple_of: int = 1, small_ends: bool = False,
                        keys: Sequence[str] | None = None) -> list[list[list[int]]]:
    """Cut each rank's samples (global indices into ``workloads``/``tokens``) into the same number of micro-batches.

    Returns, per rank, its micro-batches as lists of global indices (ascending within a micro-batch).
    """
    if micro_batch_size is not None and token_cap is not None:
        raise MicroBatchError("give micro_batch_size or token_cap, not both")
    w = np.asarray(workloads, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.int64)
    members = [np.asarray(list(r), dtype=np.int64) for r in ranks]
    sizes = {len(r) for r in members}
    if len(sizes) > 1:
        raise MicroBatchError(f"every DP rank must hold the same number of samples, got sizes {sorted(sizes)}")
    m = sizes.pop() if sizes else 0
    if m == 0:
        return [[] for _ in members]
    if token_cap is not None:
        over = np.flatnonzero(t > token_cap)
        if over.size:
            i = int(over[0])
            name = f"{keys[i]!r}" if keys is not None else f"#{i}"
            raise MicroBatchError(f"sample {name} has seq_len {int(t[i])} > the micro-batch token cap {token_cap} "
                                  f"(max_token_len_per_gpu x seq_shards); raise max_token_len_per_gpu or drop it")
        count = max(min_micro_batches(w[r], t[r], token_cap) for r in members)
    elif micro_batch_size is not None:
        count = -(-m // micro_batch_size)
    else:
        count = 1
    count = _round_up(count, multiple_of)
    while True:
        if count > m:
            raise MicroBatchError(
                f"{count} micro-batches (a multiple of {multiple_of}) are needed but each rank holds only {m} "
                f"samples; raise the mini-batch size or the token budget, or lower pp/vpp")
        caps = None
        if token_cap is None:
            q, rem = divmod(m, count)
            caps = [q + 1] * rem + [q] * (count - rem)
        packed = [pack_micro_batches(w[r], t[r], count, token_cap=token_cap, size_caps=caps) for r in members]
        if all(p is not None for p in packed):
            break
        count += multiple_of  # greedy packing is not monotone in the count; try the next admissible one
    out = []
    for r, bins in zip(members, packed):
        if token_cap is not None:  # even out workloads further by moves/exchanges that keep the cap
            bins = _rebalance([list(b) for b in bins], w[r].tolist(), t[r].tolist(), token_cap)
        glob = [[int(r[i]) for i in b] for b in bins]
        glob.sort(key=lambda b: b[0])
        if small_ends:
            loads = [float(w[b].sum()) for b in glob]
            glob = [glob[j] for j in small_ends_order(loads)]
        out.append([sorted(b) for b in glob])
    return out
