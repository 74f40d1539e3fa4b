"""Reference implementations of verl's seqlen-balancing rules, written from their definitions, for comparison only.

Used by the property tests (``never worse than verl's KK``) and by ``scripts/bench_balance.py``; not part of the
package. They follow verl's ``verl.utils.seqlen_balancing`` semantics exactly, tie-breaking included:

* Karmarkar–Karp (largest differencing): items sorted ascending by ``(value, index)``; with ``equal_size`` each run
  of ``k`` consecutive items is one partial solution of ``k`` singleton sets, otherwise every item is a solution of
  one singleton and ``k - 1`` empty sets. A set orders by ``(sum, item count, item list)``, the item list being
  ``(index, value)`` pairs in insertion order; a solution keeps its sets in descending order. The solution with the
  largest spread (top sum - bottom sum) is taken first, ties going to the larger top set; the first solution taken
  absorbs the second, its ``i``-th set joining the other's ``(k-1-i)``-th, the joined items appended after its own.
  The result lists the final sets in descending order, each set's indices in insertion order.
* Dynamic micro-batch count: ``min(n, ceil(total_tokens / max_token_len))``, then at least ``min_num_micro_batch``,
  then the DP maximum, then rounded up to ``num_batches_divided_by``; the micro-batches are the KK partition of the
  workloads ``24576·s + s²`` with ``equal_size=False`` (so nothing bounds a micro-batch's tokens).

The data structure mirrors the definition (objects compared by Python methods), so its timings are representative
of the original.
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

__all__ = ["verl_karmarkar_karp", "verl_balanced_partitions", "verl_workload", "verl_micro_batches"]


class _Set:
    """One set of a partial solution: its sum and its ``(index, value)`` items in insertion order."""

    __slots__ = ("total", "items")

    def __init__(self) -> None:
        self.total = 0
        self.items: list[tuple[int, float]] = []

    def absorb(self, other: "_Set") -> None:
        for idx, val in other.items:
            self.items.append((idx, val))
            self.total += val

    def __lt__(self, other: "_Set") -> bool:
        if self.total != other.total:
            return self.total < other.total
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    """A partial solution: ``k`` sets kept in descending order."""

    __slots__ = ("k", "sets")

    def __init__(self, items: list[tuple[int, float]], k: int) -> None:
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for s, (idx, val) in zip(self.sets, items):
            s.items.append((idx, val))
            s.total += val
        self.sets = sorted(self.sets, reverse=True)

    @property
    def spread(self):
        return self.sets[0].total - self.sets[-1].total

    def absorb(self, other: "_State") -> None:
        for i in range(self.k):
            self.sets[i].absorb(other.sets[self.k - 1 - i])
        self.sets = sorted(self.sets, reverse=True)

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread  # the largest spread is taken first
        return other.sets[0] < self.sets[0]  # then the larger top set


def verl_karmarkar_karp(values: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    """verl's ``karmarkar_karp``: partitions (descending sets, indices in insertion order)."""
    ranked = sorted((v, i) for i, v in enumerate(values))
    heap: list[_State] = []
    if equal_size:
        if len(values) % k:
            raise ValueError(f"{len(values)} values cannot form {k} equal-size partitions")
        for start in range(0, len(ranked), k):
            heapq.heappush(heap, _State([(i, v) for v, i in ranked[start:start + k]], k))
    else:
        for v, i in ranked:
            heapq.heappush(heap, _State([(i, v)], k))
    while len(heap) > 1:
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    return [[idx for idx, _ in s.items] for s in heap[0].sets]


def verl_balanced_partitions(values: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions``: the KK partitions with each one's indices sorted."""
    if len(values) < k:
        raise ValueError(f"{len(values)} values < {k} partitions")
    parts = [sorted(p) for p in verl_karmarkar_karp(values, k, equal_size)]
    if any(not p for p in parts):
        raise ValueError("a partition is empty")
    return parts


def verl_workload(seq_len: int) -> int:
    """verl's ``calculate_workload`` of one sequence length."""
    return 24576 * seq_len + seq_len * seq_len


def verl_micro_batches(seq_lens: Sequence[int], max_token_len: int, *, dp_max_count: int | None = None,
                       num_batches_divided_by: int | None = None,
                       min_num_micro_batch: int | None = None) -> list[list[int]]:
    """verl's ``rearrange_micro_batches`` partition of one rank (``dp_max_count``: the DP all-reduced count)."""
    n = len(seq_lens)
    count = min(n, math.ceil(sum(seq_lens) / max_token_len))
    if min_num_micro_batch is not None:
        count = max(count, min_num_micro_batch)
    if dp_max_count is not None:
        count = max(count, dp_max_count)
    if num_batches_divided_by is not None:
        count = -(-count // num_batches_divided_by) * num_batches_divided_by
    return verl_balanced_partitions([verl_workload(s) for s in seq_lens], count, equal_size=False)
