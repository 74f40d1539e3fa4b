"""verl's ``verl.utils.seqlen_balancing`` names and signatures, backed by this package's partitioner and packer.

A verl user swaps ``from verl.utils.seqlen_balancing import ...`` for ``from dispatch.seqlen_balancing import ...``
and keeps every call. What changes is what the calls guarantee:

* equal-size partitions are never worse (max part workload) than verl's own Karmarkar–Karp on the same input
  (:func:`dispatch.balance.balance_partitions` starts from exactly that partition);
* dynamic micro-batches never exceed ``max_token_len`` (verl's count is ``ceil(total / max_token_len)`` and its
  unequal-size KK balances workload, not tokens, so its micro-batches can go over); a single sample (or
  ``force_group_size`` group) over the cap is an error naming its index and length, and the count is the fewest
  any of our packings fits, never more than first-fit decreasing needs;
* every DP rank gets the same micro-batch count when a ``dp_group`` is given (an all-reduce MAX of the count,
  as verl does; any count from a rank's own minimum up to its sample count packs, so no second round is needed)
  or, with no collective at all, when every rank's lengths are passed as ``dp_seq_lens``.

Errors subclass both ``ValueError`` and ``AssertionError`` (what verl raises), so ``except AssertionError``
code keeps working. Example::

    >>> get_seqlen_balanced_partitions([9, 1, 8, 2, 7, 3], k_partitions=2, equal_size=True)
    [[0, 3, 5], [1, 2, 4]]
    >>> get_reverse_idx([2, 0, 1])
    [1, 2, 0]
"""
from __future__ import annotations

import copy
import heapq
from itertools import chain
from typing import Any, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from dispatch.balance import balance_partitions, differencing_partitions
from dispatch.microbatch import _rebalance, min_micro_batches, pack_micro_batches

__all__ = [
    "SeqlenBalancingError",
    "TokenCapError",
    "calculate_workload",
    "karmarkar_karp",
    "greedy_partition",
    "get_seqlen_balanced_partitions",
    "log_seqlen_unbalance",
    "ceildiv",
    "roundup_divisible",
    "rearrange_micro_batches",
    "get_reverse_idx",
    "prepare_dynamic_batch",
    "restore_dynamic_batch",
    "get_group_balanced_partitions",
]


class SeqlenBalancingError(ValueError, AssertionError):
    """Inputs the balancing functions cannot honour (verl asserts on the same cases, hence AssertionError)."""


class TokenCapError(SeqlenBalancingError):
    """A sample (or a forced group) longer than ``max_token_len`` on its own."""


# ------------------------------------------------------------------------------------------------ arithmetic
def calculate_workload(seqlen_list: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """verl's relative cost of a sequence of ``s`` tokens: ``24576·s + s²`` (12·h²·s + 2·h·s² for h = 4096, / 2h)."""
    s = seqlen_list if isinstance(seqlen_list, torch.Tensor) else torch.as_tensor(list(seqlen_list))
    return 24576 * s + s ** 2


def ceildiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers."""
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    """The smallest multiple of ``b`` that is ``>= a``."""
    return ((a + b - 1) // b) * b


# ------------------------------------------------------------------------------------------------ partitions
def _values(seqlen_list: Any, name: str = "seqlen_list") -> list[float]:
    if isinstance(seqlen_list, torch.Tensor):
        seqlen_list = seqlen_list.tolist()
    vals = list(seqlen_list)
    bad = [i for i, v in enumerate(vals) if isinstance(v, bool) or not isinstance(v, (int, float, np.integer,
                                                                                     np.floating)) or v < 0]
    if bad:
        raise SeqlenBalancingError(f"{name} must hold non-negative numbers; position {bad[0]} holds {vals[bad[0]]!r}")
    return vals


def _check_parts(n: int, k_partitions: int, equal_size: bool) -> None:
    if isinstance(k_partitions, bool) or not isinstance(k_partitions, (int, np.integer)) or k_partitions < 1:
        raise SeqlenBalancingError(f"k_partitions must be a positive int, got {k_partitions!r}")
    if equal_size and n % k_partitions:
        raise SeqlenBalancingError(f"equal_size needs len(seqlen_list) divisible by k_partitions; got {n} items "
                                   f"for {k_partitions} partitions")


def karmarkar_karp(seqlen_list: Sequence[float], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's Karmarkar–Karp partition exactly (sets in descending order, indices in the order they joined)."""
    vals = _values(seqlen_list)
    _check_parts(len(vals), k_partitions, equal_size)
    return differencing_partitions(vals, int(k_partitions), bool(equal_size))


def greedy_partition(seqlen_list: Sequence[float], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's greedy: items in input order, each to the partition with the smallest sum (first on ties); with
    ``equal_size`` every item also weighs ``sum + 1`` extra, which deals the items out in equal counts."""
    vals = _values(seqlen_list)
    _check_parts(len(vals), k_partitions, equal_size)
    bias = sum(vals) + 1 if equal_size else 0
    parts: list[list[int]] = [[] for _ in range(k_partitions)]
    heap = [(0, j) for j in range(k_partitions)]
    for i, v in enumerate(vals):
        total, j = heapq.heappop(heap)
        parts[j].append(i)
        heapq.heappush(heap, (total + v + bias, j))
    return parts


def get_seqlen_balanced_partitions(seqlen_list: Sequence[float], k_partitions: int,
                                   equal_size: bool) -> list[list[int]]:
    """``k_partitions`` non-empty partitions of ``range(len(seqlen_list))`` with balanced sums, indices sorted.

    ``equal_size``: exactly ``n / k`` items each (:func:`dispatch.balance.balance_partitions`, never worse than
    verl's KK). Otherwise verl's unequal-size KK, then moves and exchanges that lower the largest sum.
    """
    vals = _values(seqlen_list)
    n = len(vals)
    _check_parts(n, k_partitions, equal_size)
    if n < k_partitions:
        raise SeqlenBalancingError(f"number of items [{n}] < k_partitions [{k_partitions}]; every partition must "
                                   f"hold at least one item")
    if equal_size:
        parts = balance_partitions(vals, k_partitions)
    else:
        parts = differencing_partitions(vals, k_partitions, False)
        parts = _rebalance([list(p) for p in parts], vals, [0] * n, 0)
    return [sorted(p) for p in parts]


def log_seqlen_unbalance(seqlen_list: Sequence[float], partitions: list[list[int]], prefix: str) -> dict:
    """verl's metrics: min/max/spread of the sums of contiguous chunks of ``n / k`` items (before balancing),
    min/max of the partition sums (after), and the mean partition sum."""
    vals = _values(seqlen_list)
    k = len(partitions)
    if k == 0 or len(vals) < k:
        raise SeqlenBalancingError(f"log_seqlen_unbalance needs 1..{len(vals)} partitions, got {k}")
    size = len(vals) // k
    chunks = [sum(vals[o:o + size]) for o in range(0, len(vals), size)]
    balanced = [sum(vals[i] for i in p) for p in partitions]
    return {
        f"{prefix}/min": min(chunks),
        f"{prefix}/max": max(chunks),
        f"{prefix}/minmax_diff": max(chunks) - min(chunks),
        f"{prefix}/balanced_min": min(balanced),
        f"{prefix}/balanced_max": max(balanced),
        f"{prefix}/mean": sum(chunks) / k,
    }


def get_group_balanced_partitions(seqlen_list: Sequence[int], uid_list: Sequence[Any],
                                  k_partitions: int) -> list[list[int]]:
    """Partitions of the samples that keep each run of equal consecutive uids whole, an equal number of runs per
    partition, balanced by the runs' summed :func:`calculate_workload`; indices sorted."""
    vals = _values(seqlen_list)
    if len(vals) != len(uid_list):
        raise SeqlenBalancingError(f"seqlen_list ({len(vals)}) and uid_list ({len(uid_list)}) must have the same "
                                   f"length")
    groups: list[list[int]] = []
    for i, uid in enumerate(uid_list):
        if groups and uid_list[groups[-1][0]] == uid:
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) < k_partitions:
        raise SeqlenBalancingError(f"number of uid groups ({len(groups)}) must be >= k_partitions ({k_partitions}); "
                                   f"lower the world size or raise the batch size")
    _check_parts(len(groups), k_partitions, True)
    work = [sum(int(v) * 24576 + int(v) * int(v) for v in (vals[i] for i in g)) for g in groups]
    parts = balance_partitions(work, k_partitions)
    return [sorted(i for gi in p for i in groups[gi]) for p in parts]


# ------------------------------------------------------------------------------------------------ micro-batches
def _batch_of(data: Any) -> TensorDict:
    batch = getattr(data, "batch", data)
    if not isinstance(batch, TensorDict):
        raise SeqlenBalancingError(f"expected a TensorDict or a DataProto with one, got {type(data).__name__}")
    return batch


def _effective_lengths(batch: TensorDict) -> list[int]:
    """Tokens per sample: the rows of a jagged ``input_ids``, else the sum of ``attention_mask``."""
    keys = set(batch.keys())
    if "input_ids" in keys and isinstance(batch["input_ids"], torch.Tensor) and batch["input_ids"].is_nested:
        return batch["input_ids"].offsets().diff().tolist()
    if "attention_mask" in keys:
        return batch["attention_mask"].sum(dim=-1).long().tolist()
    raise SeqlenBalancingError(f"the batch needs a jagged 'input_ids' or an 'attention_mask' to count tokens; it "
                               f"holds {sorted(keys)}")


def _dp_max(count: int, dp_group: Any) -> int:
    """All-reduce MAX of ``count`` over ``dp_group`` (on the GPU for NCCL, as verl does; on the CPU otherwise)."""
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(dp_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([count], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
    return int(t.item())


def _unit_count(lengths: list[int], group: int, cap: int, *, what: str) -> tuple[list[float], list[int]]:
    n = len(lengths)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or n % group:
        raise SeqlenBalancingError(f"{what}: batch size {n} must be divisible by force_group_size {group!r}")
    tokens = [sum(lengths[u:u + group]) for u in range(0, n, group)]
    work = [float(sum(24576 * s + s * s for s in lengths[u:u + group])) for u in range(0, n, group)]
    for u, tok in enumerate(tokens):
        if tok > cap:
            where = f"sample {u}" if group == 1 else f"group {u} (samples {u * group}..{u * group + group - 1})"
            raise TokenCapError(f"{what}: {where} has {tok} tokens > max_token_len {cap}; raise max_token_len "
                                f"(max_token_len_per_gpu x sp size) or drop the sample")
    return work, tokens


def rearrange_micro_batches(batch: Any, max_token_len: int, dp_group: Any = None, num_batches_divided_by: int | None = None,
                            same_micro_num_in_dp: bool = True, min_num_micro_batch: int | None = None,
                            use_dynamic_bsz_balance: bool = True, force_group_size: int = 1, *,
                            dp_seq_lens: Sequence[Sequence[int]] | None = None) -> tuple[list[TensorDict], list[list[int]]]:
    """Cut ``batch`` into micro-batches of at most ``max_token_len`` tokens; returns them and their index lists.

    The count is the fewest our packing fits (at least ``min_num_micro_batch``), the maximum over the DP ranks
    (all-reduced over ``dp_group`` when ``same_micro_num_in_dp``; or the maximum over ``dp_seq_lens``, every
    rank's sample lengths, with no collective), rounded up to ``num_batches_divided_by`` (virtual pipeline).
    ``force_group_size`` consecutive samples stay in one micro-batch. ``use_dynamic_bsz_balance`` orders the
    micro-batches by workload with the lightest at both ends (verl's pipeline-bubble order); otherwise by their
    first index. Index lists are sorted; tokens are counted as verl does (jagged ``input_ids`` rows, else
    ``attention_mask`` sums), so padding never counts against the cap.
    """
    td = _batch_of(batch)
    if isinstance(max_token_len, bool) or not isinstance(max_token_len, (int, np.integer)) or max_token_len < 1:
        raise SeqlenBalancingError(f"max_token_len must be a positive int, got {max_token_len!r}")
    cap = int(max_token_len)
    lengths = _effective_lengths(td)
    if not lengths:
        raise SeqlenBalancingError("rearrange_micro_batches got an empty batch")
    work, tokens = _unit_count(lengths, force_group_size, cap, what="rearrange_micro_batches")
    count = min_micro_batches(work, tokens, cap)
    if dp_seq_lens is not None:
        for r, other in enumerate(dp_seq_lens):
            ow, ot = _unit_count([int(x) for x in other], force_group_size, cap, what=f"dp_seq_lens[{r}]")
            count = max(count, min_micro_batches(ow, ot, cap))
    if min_num_micro_batch is not None:
        count = max(count, int(min_num_micro_batch))
    if same_micro_num_in_dp and dp_group is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            count = _dp_max(count, dp_group)
    if num_batches_divided_by is not None:
        count = roundup_divisible(count, int(num_batches_divided_by))
    if count > len(tokens):
        raise SeqlenBalancingError(
            f"{count} micro-batches are needed (min_num_micro_batch={min_num_micro_batch}, num_batches_divided_by="
            f"{num_batches_divided_by}, DP maximum) but this rank holds only {len(tokens)} "
            f"{'samples' if force_group_size == 1 else 'groups'}; raise the batch size or lower those settings")
    bins = pack_micro_batches(work, tokens, count, token_cap=cap)
    if bins is None:  # cannot happen for min count <= count <= units; kept as a loud guard
        raise SeqlenBalancingError(f"no packing of {len(tokens)} units into {count} micro-batches under {cap} tokens")
    g = force_group_size
    parts = [sorted(i for u in b for i in range(u * g, u * g + g)) for b in bins]
    if use_dynamic_bsz_balance:
        loads = [sum(work[u] for u in b) for b in bins]
        parts = [parts[j] for j in sorted(range(len(parts)), key=lambda j: (loads[j], parts[j][0]), reverse=True)]
        parts = parts[::2][::-1] + parts[1::2]  # lightest at both ends, heaviest in the middle
    else:
        parts.sort(key=lambda p: p[0])
    return [td[torch.as_tensor(p, dtype=torch.long)] for p in parts], parts


def get_reverse_idx(idx_map: Sequence[int]) -> list[int]:
    """The inverse permutation: ``out[idx_map[i]] = i``."""
    idx = [int(i) for i in idx_map]
    if sorted(idx) != list(range(len(idx))):
        raise SeqlenBalancingError(f"idx_map must be a permutation of 0..{len(idx) - 1}")
    out = [0] * len(idx)
    for i, j in enumerate(idx):
        out[j] = i
    return out


def prepare_dynamic_batch(data: Any, max_token_len: int, dp_group: Any = None, num_batches_divided_by: int | None = None,
                          same_micro_num_in_dp: bool = True, min_num_micro_batch: int | None = None,
                          use_dynamic_bsz_balance: bool = True, force_group_size: int = 1, *,
                          dp_seq_lens: Sequence[Sequence[int]] | None = None) -> tuple[list[Any], list[list[int]]]:
    """:func:`rearrange_micro_batches` of a DataProto (ours or any with ``batch``/``non_tensor_batch``/``meta_info``)
    or a TensorDict; returns micro-batches of the same type (meta_info deep-copied) and their index lists."""
    micro, idx = rearrange_micro_batches(_batch_of(data), max_token_len, dp_group, num_batches_divided_by,
                                         same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance,
                                         force_group_size, dp_seq_lens=dp_seq_lens)
    if isinstance(data, TensorDict):
        return micro, idx
    out = []
    for td, ids in zip(micro, idx):
        non_tensors = {k: v[ids] for k, v in data.non_tensor_batch.items()}
        out.append(type(data)(batch=td, non_tensor_batch=non_tensors, meta_info=copy.deepcopy(data.meta_info)))
    return out, idx


def restore_dynamic_batch(data: Any, batch_idx_list: list[list[int]]) -> Any:
    """Undo the reordering of :func:`prepare_dynamic_batch`: ``data`` (outputs concatenated micro-batch by
    micro-batch: a dense or jagged tensor, or a TensorDict) back in input order."""
    indices = list(chain.from_iterable(batch_idx_list))
    n = data.batch_size[0] if isinstance(data, TensorDict) else data.shape[0]
    if len(indices) != n:
        raise SeqlenBalancingError(f"batch_idx_list covers {len(indices)} samples but data holds {n}")
    rev = get_reverse_idx(indices)
    if isinstance(data, torch.Tensor) and data.is_nested:
        rows = data.unbind()
        return torch.nested.as_nested_tensor([rows[i] for i in rev], layout=torch.jagged)
    return data[torch.tensor(rev, dtype=torch.long)]
