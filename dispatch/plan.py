"""The dispatch plan of one step: which samples each DP rank computes on, in which mini- and micro-batches.

:func:`build_plan` is a pure function of the step's trajectory tags, the :class:`~dispatch.topology.Topology`
and the :class:`~dispatch.settings.BatchSettings`; every rank can compute it and reach the same plan.

Per epoch the batch is (optionally) shuffled, cut into mini-batches of M·G trajectories (one optimizer step
each), and every mini-batch is partitioned over the DP ranks with equal sample counts and a near-equal
workload (:func:`~dispatch.balance.balance_partitions`); groups stay whole with ``group_partition``. Each
rank's share of a mini-batch is then cut into micro-batches, the same number on every rank.

``plan.ranks[d].mini_batches[k]`` (k over (epoch, index) in order) is a :class:`MiniBatchPlan` whose
``indices`` are positions into the input tag list in the order rank ``d`` receives them and whose
``micro_batches`` are positions into ``indices`` — exactly ``backends.base.Share(data, micro_batches)``.

Example::

    >>> from dispatch.topology import Topology
    >>> from dispatch.settings import BatchSettings
    >>> tags = [{"seq_len": s, "is_padding": False} for s in (8, 1, 7, 2)]
    >>> plan = build_plan(tags, Topology.from_config({"backend": "fsdp"}, 2), BatchSettings())
    >>> [r.mini_batches[0].indices for r in plan.ranks], plan.reverse_index()
    ([[0, 1], [2, 3]], [0, 1, 2, 3])
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dispatch.balance import balance_partitions, contiguous_partitions, imbalance, lower_bound
from dispatch.microbatch import split_micro_batches
from dispatch.settings import BatchSettings
from dispatch.topology import Topology
from protocol.checks import DICT, INT, STR, only_types
from protocol.store.keys import KeyFormatError, group_of

__all__ = [
    "PlanError",
    "MiniBatchPlan",
    "RankPlan",
    "DispatchPlan",
    "MiniBatchWork",
    "PlanJob",
    "build_plan",
    "reverse_index",
    "restore_order",
]


class PlanError(ValueError):
    """Tags that cannot be planned (missing/bad lengths, unpadded batch, uneven groups)."""


@dataclass(frozen=True)
class MiniBatchPlan:
    """One rank's share of one optimizer step: ``indices`` (global positions, in receive order) and micro-batches.

    ``micro_batches`` lists positions into ``indices``; together they cover ``range(len(indices))`` once.
    ``tokens`` / ``workload`` / ``padding`` are sums over the share.
    """

    epoch: int
    index: int
    indices: list[int]
    micro_batches: list[list[int]]
    tokens: int
    workload: float
    padding: int

    @property
    def micro_batch_indices(self) -> list[list[int]]:
        """Micro-batches as global positions."""
        return [[self.indices[p] for p in mb] for mb in self.micro_batches]


@dataclass(frozen=True)
class RankPlan:
    """Everything DP rank ``dp_rank`` computes on in this step, mini-batch by mini-batch."""

    dp_rank: int
    mini_batches: list[MiniBatchPlan]

    @property
    def num_samples(self) -> int:
        return sum(len(mb.indices) for mb in self.mini_batches)

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.mini_batches)

    @property
    def workload(self) -> float:
        return float(sum(mb.workload for mb in self.mini_batches))

    @property
    def padding(self) -> int:
        return sum(mb.padding for mb in self.mini_batches)

    @property
    def num_micro_batches(self) -> list[int]:
        """Micro-batch count of each mini-batch."""
        return [len(mb.micro_batches) for mb in self.mini_batches]


@dataclass(frozen=True)
class DispatchPlan:
    """Per-DP-rank shares of one step plus the metrics of how well they are balanced. Build with :func:`build_plan`."""

    topology: Topology
    settings: BatchSettings
    num_samples: int
    num_padding: int
    ranks: list[RankPlan]
    metrics: dict[str, float]
    baseline_workload: list[float] = field(default_factory=list)  # per rank, contiguous split of each mini-batch

    @classmethod
    def build(cls, tags: Sequence[Mapping[str, Any]], topology: Topology, settings: BatchSettings | None = None, *,
              keys: Sequence[str] | None = None) -> "DispatchPlan":
        """Same as :func:`build_plan`."""
        return build_plan(tags, topology, settings, keys=keys)

    @property
    def num_mini_batches(self) -> int:
        """Mini-batches per rank over all epochs (the same on every rank)."""
        return len(self.ranks[0].mini_batches) if self.ranks else 0

    def for_rank(self, global_rank: int) -> RankPlan:
        """The plan of the DP share that ``global_rank`` computes on."""
        return self.ranks[self.topology.dp_rank(global_rank)]

    def _check_mb(self, mini_batch: int) -> None:
        if isinstance(mini_batch, bool) or not isinstance(mini_batch, int) or not 0 <= mini_batch < self.num_mini_batches:
            raise PlanError(f"mini_batch must be an int in [0, {self.num_mini_batches}), got {mini_batch!r}")

    def gather_order(self, mini_batch: int = 0) -> list[int]:
        """Global positions in the order rank outputs arrive when concatenated DP rank 0, 1, ..."""
        self._check_mb(mini_batch)
        return [i for r in self.ranks for i in r.mini_batches[mini_batch].indices]

    def reverse_index(self, mini_batch: int = 0) -> list[int]:
        """``concatenated_outputs[reverse_index]`` lists the outputs in input order (see :func:`reverse_index`).

        Covers the samples of ``mini_batch`` only; with one mini-batch (inference) that is the whole batch.
        """
        return reverse_index(self.gather_order(mini_batch), check_complete=self.num_mini_batches == 1
                             and self.settings.ppo_epochs == 1)

    def restore_order(self, outputs_by_dp_rank: Sequence[Any], mini_batch: int = 0) -> Any:
        """Concatenate per-DP-rank outputs (tensors, jagged tensors, TensorDicts, lists) and put them in input order."""
        return restore_order(outputs_by_dp_rank, self.gather_order(mini_batch))

    def select(self, items: Sequence[Any], dp_rank: int, mini_batch: int = 0) -> list[Any]:
        """``items`` (one per input sample: keys, tags, ...) picked in the order ``dp_rank`` receives them."""
        self._check_mb(mini_batch)
        if len(items) != self.num_samples:
            raise PlanError(f"select needs one item per planned sample ({self.num_samples}), got {len(items)}")
        return [items[i] for i in self.ranks[dp_rank].mini_batches[mini_batch].indices]

    def table(self) -> str:
        """Per-DP-rank samples, padding, tokens, workload (after and before balancing) and micro-batch counts."""
        wl = [r.workload for r in self.ranks]
        mean = float(np.mean(wl)) if wl and np.mean(wl) > 0 else 1.0
        header = ["dp", "samples", "padding", "tokens", "workload", "before", "micro_batches"]
        rows = []
        for r, before in zip(self.ranks, self.baseline_workload or [0.0] * len(self.ranks)):
            counts = r.num_micro_batches
            mbs = ",".join(map(str, counts[:6])) + (",..." if len(counts) > 6 else "")
            rows.append([str(r.dp_rank), str(r.num_samples), str(r.padding), str(r.tokens),
                         f"{r.workload / mean:.4f}", f"{before / mean:.4f}", mbs])
        widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in rows]
        m = self.metrics
        lines.append(f"workload max/mean per step: before {m['dispatch/balance_before']:.4f} "
                     f"(worst {m['dispatch/balance_before_max']:.4f}), after {m['dispatch/balance_after']:.4f} "
                     f"(worst {m['dispatch/balance_after_max']:.4f}), bound {m['dispatch/balance_bound']:.4f}; "
                     f"padding {self.num_padding}; workload columns are relative to the mean rank")
        return "\n".join(lines)


def reverse_index(order: Sequence[int], check_complete: bool = False) -> list[int]:
    """``rev`` with ``[x[o] for o in order][rev[j]] == x[j]``: the inverse permutation of ``order`` (ranked when partial)."""
    o = np.asarray(list(order), dtype=np.int64)
    if o.size and (len(np.unique(o)) != o.size or o.min() < 0):
        raise PlanError("order must hold distinct non-negative positions")
    if check_complete and o.size and o.max() != o.size - 1:
        raise PlanError(f"order must be a permutation of 0..{o.size - 1}")
    return np.argsort(o, kind="stable").tolist()


def restore_order(outputs_by_dp_rank: Sequence[Any], order: Sequence[int]) -> Any:
    """Concatenate per-rank outputs (rank order) and reorder them by :func:`reverse_index` of ``order``.

    Works on lists/tuples, numpy arrays, dense tensors, bare jagged (nested) tensors and TensorDicts (with dense or
    jagged fields); every rank's output must be of the same kind.
    """
    parts = list(outputs_by_dp_rank)
    if not parts:
        raise PlanError("restore_order needs at least one rank's outputs")
    first = parts[0]
    jagged = isinstance(first, torch.Tensor) and first.is_nested
    if isinstance(first, (list, tuple)):
        flat = [x for p in parts for x in p]
    elif isinstance(first, np.ndarray):
        flat = np.concatenate(parts)
    elif jagged:  # torch.cat cannot join jagged tensors along the batch dim: go through their rows
        if not all(isinstance(p, torch.Tensor) and p.is_nested for p in parts):
            raise PlanError("restore_order got a jagged tensor for the first rank but not for every rank; pass "
                            "the same kind of output from every DP rank")
        flat = [row for p in parts for row in p.unbind()]
    else:  # dense torch tensors and TensorDicts
        flat = torch.cat(list(parts), 0)
    n = len(flat) if not hasattr(flat, "batch_size") else flat.batch_size[0]
    if n != len(order):
        raise PlanError(f"outputs hold {n} samples but the plan gathers {len(order)}; pass every DP rank's "
                        f"outputs in DP-rank order")
    rev = reverse_index(order)
    if jagged:
        return torch.nested.as_nested_tensor([flat[i] for i in rev], layout=torch.jagged)
    if isinstance(flat, list):
        return [flat[i] for i in rev]
    if isinstance(flat, np.ndarray):
        return flat[rev]
    return flat[torch.as_tensor(rev, dtype=torch.int64)]


# ---------------------------------------------------------------------------------------------- building
def _int_field(tag: Mapping[str, Any], name: str, where: str, required: bool = True) -> int | None:
    if name not in tag:
        if required:
            raise PlanError(f"tag of {where} lacks {name!r}; expected a trajectory tag with seq_len, prompt_len, "
                            f"response_len, is_padding")
        return None
    v = tag[name]
    if type(v) is int and v >= 0:  # the common case, without the isinstance chain
        return v
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise PlanError(f"tag of {where}: {name} must be a non-negative int, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class PlanTags:
    """What planning reads from the trajectory tags, validated once (several plans of one step share it)."""

    seq: np.ndarray  # int64 seq_len per sample
    pad: np.ndarray  # bool is_padding per sample
    names: list[str]  # the key of each sample (or '#i'), for errors
    groups: list[str | None]  # the uid of each real sample, when it can be told
    need_groups: bool
    #: per sample, the patch counts of its images' vision-attention spans (tag ``vision_spans``; empty: none)
    vision_spans: list[list[int]] | None = None


def read_plan_tags(tags: Sequence[Mapping[str, Any]], keys: Sequence[str] | None = None, *,
                   need_groups: bool = True) -> PlanTags:
    """Validate and read the tags :func:`build_plan` plans from (``need_groups``: every real sample's group must
    be known, as ``group_partition`` needs)."""
    tags = list(tags)
    seq, pad, names, groups = _read_tags(tags, keys, need_groups)
    return PlanTags(seq, pad, names, groups, need_groups, _vision_spans(tags, pad, names))


def _vision_spans(tags: list, pad: np.ndarray, names: list[str]) -> list[list[int]] | None:
    """Each sample's ``vision_spans`` tag (None when no sample has one); a padding sample carries no images."""
    spans = [t.get("vision_spans") for t in tags]  # _read_tags checked each tag is a mapping
    if all(s is None for s in spans):
        return None
    out = []
    for i, s in enumerate(spans):
        s = [] if s is None else s
        if not isinstance(s, (list, tuple)) or any(isinstance(p, bool) or not isinstance(p, (int, np.integer))
                                                   or p < 1 for p in s):
            raise PlanError(f"tag of {names[i]!r}: vision_spans must be a list of positive patch counts, got {s!r}")
        if pad[i] and s:
            raise PlanError(f"tag of {names[i]!r}: a padding sample carries no images (vision_spans {list(s)})")
        out.append([int(p) for p in s])
    return out


def _sums(values: np.ndarray, parts: Sequence[Sequence[int]]) -> np.ndarray:
    """``[values[p].sum() for p in parts]`` (float64; an empty part sums to 0) in one pass instead of one per part."""
    flat = np.array(list(itertools.chain.from_iterable(parts)), dtype=np.int64)  # C-level passes, no Python step
    part_of = np.repeat(np.arange(len(parts)), list(map(len, parts)))
    return np.bincount(part_of, weights=values[flat].astype(np.float64), minlength=len(parts))


_BOOL = frozenset({bool})


def _read_tags_fast(tags: list, keys: Sequence[str] | None, need_groups: bool):
    """:func:`_read_tags` for well-formed tags (plain dicts, int lengths that add up, bool ``is_padding``, str keys)
    by columns, in a few C-level passes; None where anything looks off, so the per-tag reader names the problem."""
    if keys is None or len(keys) != len(tags) or not only_types(tags, DICT):
        return None
    columns = [[t.get(name) for t in tags] for name in ("seq_len", "prompt_len", "response_len")]
    flags = [t.get("is_padding", False) for t in tags]
    if not all(only_types(c, INT) for c in columns) or not only_types(flags, _BOOL):
        return None
    try:
        seq, prompt, response = (np.array(c, dtype=np.int64) for c in columns)
    except OverflowError:
        return None
    if n := len(tags):
        if seq.min() < 1 or prompt.min() < 0 or response.min() < 0 or not np.array_equal(prompt + response, seq):
            return None
    pad = np.array(flags, dtype=bool).reshape(n)
    names = list(keys)
    if not only_types(names, STR):
        return None
    groups = [t.get("uid") for t in tags]
    if need_groups:
        for i in np.flatnonzero(~pad).tolist():
            if groups[i] is None:
                try:
                    groups[i] = group_of(names[i])
                except KeyFormatError:
                    return None
    return seq, pad, names, groups


def _read_tags(tags: Sequence[Mapping[str, Any]], keys: Sequence[str] | None, need_groups: bool):
    tags = tags if type(tags) is list else list(tags)
    fast = _read_tags_fast(tags, keys, need_groups)
    return fast if fast is not None else _read_tags_each(tags, keys, need_groups)


def _read_tags_each(tags: Sequence[Mapping[str, Any]], keys: Sequence[str] | None, need_groups: bool):
    """Tag by tag: the reader that names the first bad tag (and reads the rare forms the fast path leaves)."""
    if keys is not None and len(keys) != len(tags):
        raise PlanError(f"build_plan got {len(keys)} keys for {len(tags)} tags; pass one key per tag")
    n = len(tags)
    seq = np.empty(n, dtype=np.int64)
    pad = np.zeros(n, dtype=bool)
    names: list[str] = []
    groups: list[str | None] = []
    for i, tag in enumerate(tags):
        if type(tag) is not dict and not isinstance(tag, Mapping):
            raise PlanError(f"tags[{i}] must be a mapping, got {type(tag).__name__}")
        key = keys[i] if keys is not None else tag.get("key")
        where = repr(key) if key is not None else f"sample {i}"
        names.append(str(key) if key is not None else f"#{i}")
        s = _int_field(tag, "seq_len", where)
        if s < 1:
            raise PlanError(f"tag of {where}: seq_len must be >= 1, got {s}")
        p = _int_field(tag, "prompt_len", where, required=False)
        r = _int_field(tag, "response_len", where, required=False)
        if p is not None and r is not None and p + r != s:
            raise PlanError(f"tag of {where}: seq_len {s} != prompt_len {p} + response_len {r}")
        seq[i] = s
        ip = tag.get("is_padding", False)
        if not isinstance(ip, (bool, np.bool_)):
            raise PlanError(f"tag of {where}: is_padding must be a bool, got {ip!r}")
        pad[i] = bool(ip)
        uid = tag.get("uid")
        if uid is None and need_groups and key is not None and not pad[i]:
            try:
                uid = group_of(str(key))
            except KeyFormatError as exc:
                raise PlanError(f"cannot tell the group of {where}: {exc}") from None
        if need_groups and uid is None and not pad[i]:
            raise PlanError(f"group_partition needs the group of {where}: give a 'uid' in its tag or its key")
        groups.append(uid)
    return seq, pad, names, groups


def _units(pad: np.ndarray, groups: list[str | None], settings: BatchSettings) -> list[list[int]]:
    """Partition units: single samples, or whole groups (padding chunked into groups of rollout_n)."""
    n = len(groups)
    if not settings.group_partition:
        return [[i] for i in range(n)]
    g = settings.rollout_n
    by_uid: dict[str, list[int]] = {}
    pads = []
    for i, uid in enumerate(groups):
        if pad[i]:
            pads.append(i)
        else:
            by_uid.setdefault(uid, []).append(i)
    bad = [(u, len(m)) for u, m in by_uid.items() if len(m) != g]
    if bad:
        raise PlanError(f"group_partition needs every group to hold rollout_n={g} trajectories; group {bad[0][0]!r} "
                        f"holds {bad[0][1]} ({len(bad)} groups differ)")
    if len(pads) % g:
        raise PlanError(f"group_partition needs the padding count to be a multiple of rollout_n={g}, got {len(pads)}")
    return list(by_uid.values()) + [pads[j:j + g] for j in range(0, len(pads), g)]


@dataclass(frozen=True)
class MiniBatchWork:
    """One mini-batch planned over the DP ranks (a :class:`PlanJob` piece): each rank's share and its balance figures."""

    shares: list[MiniBatchPlan]  # one per DP rank
    baseline_loads: list[float]  # per rank, the contiguous split of the mini-batch
    before: float
    after: float
    bound: float
    micro_balance: list[float]  # per rank
    max_micro_tokens: int


class PlanJob:
    """:func:`build_plan` in pieces: the tags are read and checked once, then each mini-batch is planned on its own.

    A piece is a pure function of the job, so any rank may compute any of them (ranks split the work and gather the
    results, ``rldispatch.plan``); :meth:`assemble` joins the pieces, in order, into the plan.
    """

    def __init__(self, tags: Sequence[Mapping[str, Any]] | PlanTags, topology: Topology,
                 settings: BatchSettings | None = None, *, keys: Sequence[str] | None = None) -> None:
        settings = settings or BatchSettings()
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a dispatch.Topology, got {type(topology).__name__}")
        if not isinstance(settings, BatchSettings):
            raise TypeError(f"settings must be a dispatch.BatchSettings, got {type(settings).__name__}")
        settings.check(topology)
        if not isinstance(tags, PlanTags):
            tags = read_plan_tags(tags, keys, need_groups=settings.group_partition)
        elif settings.group_partition and not tags.need_groups:
            raise PlanError("group_partition needs tags read with need_groups=True (read_plan_tags)")
        seq, pad, names = tags.seq, tags.pad, tags.names
        n = seq.size
        dp = topology.dp_size
        multiple = settings.padding_multiple(topology)
        if n == 0:
            raise PlanError("build_plan got an empty batch")
        if n % multiple:
            raise PlanError(f"the batch holds {n} samples, not a multiple of {multiple} (lcm of DP={dp} and the "
                            f"mini-batch of {settings.mini_batch_samples} trajectories); add "
                            f"{-n % multiple} padding samples (dispatch.make_padding) first")
        self.topology, self.settings, self.seq, self.pad, self.names = topology, settings, seq, pad, names
        self.work = settings.workload(seq)
        if tags.vision_spans is not None:  # the vision tower's cost of each sample's images
            self.work = self.work + settings.workload.vision(tags.vision_spans)
        self.units = _units(pad, tags.groups, settings)
        self.unit_w = _sums(self.work, self.units)
        per_mini = len(self.units) if settings.mini_batch_samples is None else (
            settings.ppo_mini_batch_size if settings.group_partition else settings.mini_batch_samples)
        self.token_cap = settings.token_cap(topology)
        if self.token_cap is not None and int(seq.max()) > self.token_cap:
            i = int(np.argmax(seq > self.token_cap))
            raise PlanError(f"sample {names[i]!r} has seq_len {int(seq[i])} > the micro-batch token cap "
                            f"{self.token_cap} (max_token_len_per_gpu {settings.max_token_len_per_gpu} x seq_shards "
                            f"{topology.seq_shards}); raise max_token_len_per_gpu or filter longer trajectories")
        #: (epoch, index in the epoch, the mini-batch's units) of every piece, in plan order
        self.minis: list[tuple[int, int, np.ndarray]] = []
        for epoch in range(settings.ppo_epochs):
            if settings.shuffle:
                perm = np.random.default_rng([settings.seed, epoch]).permutation(len(self.units))
            else:
                perm = np.arange(len(self.units))
            for index, start in enumerate(range(0, len(self.units), per_mini)):
                self.minis.append((epoch, index, perm[start:start + per_mini]))

    def __len__(self) -> int:
        return len(self.minis)

    def cost(self, piece: int) -> int:
        """Samples in mini-batch ``piece``: what planning it costs, roughly."""
        return sum(len(self.units[u]) for u in self.minis[piece][2].tolist())

    def run(self, piece: int) -> MiniBatchWork:
        """Partition mini-batch ``piece`` over the DP ranks and cut each share into micro-batches."""
        epoch, index, chosen = self.minis[piece]
        s, units, work, seq, dp = self.settings, self.units, self.work, self.seq, self.topology.dp_size
        if s.balance:
            parts = balance_partitions(self.unit_w[chosen], dp)
        else:
            parts = contiguous_partitions(len(chosen), dp)
        shares = [[i for p in part for i in units[chosen[p]]] for part in parts]
        samples = [i for u in chosen for i in units[u]]
        contiguous = [samples[j:j + len(samples) // dp] for j in range(0, len(samples), len(samples) // dp)]
        base_loads = [float(work[c].sum()) for c in contiguous]
        loads = [float(work[x].sum()) for x in shares]
        micro = split_micro_batches(shares, work, seq, micro_batch_size=s.micro_batch_size_per_gpu,
                                    token_cap=self.token_cap, multiple_of=self.topology.microbatch_group,
                                    small_ends=s.small_ends, keys=self.names)
        plans, micro_bal, max_micro_tokens = [], [], 0
        for mbs in micro:
            indices = [i for mb in mbs for i in mb]
            positions, pos = [], 0
            for mb in mbs:
                positions.append(list(range(pos, pos + len(mb))))
                pos += len(mb)
            if mbs:
                max_micro_tokens = max(max_micro_tokens, int(_sums(seq, mbs).max()))
            micro_bal.append(imbalance(_sums(work, mbs).tolist() if mbs else []))
            plans.append(MiniBatchPlan(epoch=epoch, index=index, indices=indices, micro_batches=positions,
                                       tokens=int(seq[indices].sum()), workload=float(work[indices].sum()),
                                       padding=int(self.pad[indices].sum())))
        return MiniBatchWork(plans, base_loads, imbalance(base_loads), imbalance(loads),
                             lower_bound(self.unit_w[chosen], dp) / max(float(np.mean(loads)), 1e-300), micro_bal,
                             max_micro_tokens)

    def assemble(self, pieces: Sequence[MiniBatchWork]) -> DispatchPlan:
        """The plan of the planned mini-batches ``pieces`` (one per piece, in order)."""
        if len(pieces) != len(self.minis):
            raise PlanError(f"assemble needs {len(self.minis)} planned mini-batches, got {len(pieces)}")
        dp, seq, pad = self.topology.dp_size, self.seq, self.pad
        ranks = [RankPlan(dp_rank=d, mini_batches=[w.shares[d] for w in pieces]) for d in range(dp)]
        baseline = np.zeros(dp)
        for w in pieces:
            baseline += w.baseline_loads
        before, after = [w.before for w in pieces], [w.after for w in pieces]
        micro_counts = [len(mb.micro_batches) for r in ranks for mb in r.mini_batches]
        rank_tokens = [r.tokens for r in ranks]
        metrics = {
            "dispatch/dp_size": float(dp),
            "dispatch/num_samples": float(seq.size),
            "dispatch/padding": float(pad.sum()),
            "dispatch/num_mini_batches": float(len(ranks[0].mini_batches)),
            "dispatch/micro_batches_per_mini_batch": float(np.mean(micro_counts)),
            "dispatch/max_micro_batch_tokens": float(max(w.max_micro_tokens for w in pieces)),
            "dispatch/balance_before": float(np.mean(before)),
            "dispatch/balance_before_max": float(np.max(before)),
            "dispatch/balance_after": float(np.mean(after)),
            "dispatch/balance_after_max": float(np.max(after)),
            "dispatch/balance_bound": float(np.mean([w.bound for w in pieces])),
            "dispatch/tokens_max_over_mean": imbalance(rank_tokens),
            "dispatch/micro_batch_balance": float(np.mean([b for w in pieces for b in w.micro_balance])),
        }
        return DispatchPlan(topology=self.topology, settings=self.settings, num_samples=int(seq.size),
                            num_padding=int(pad.sum()), ranks=ranks, metrics=metrics,
                            baseline_workload=baseline.tolist())


def build_plan(tags: Sequence[Mapping[str, Any]] | PlanTags, topology: Topology,
               settings: BatchSettings | None = None, *, keys: Sequence[str] | None = None) -> DispatchPlan:
    """Plan one step: per DP rank, mini-batches (epoch by epoch) and their micro-batches.

    ``tags`` are trajectory tags (``seq_len`` required; ``prompt_len``/``response_len`` checked when present;
    ``is_padding``; ``uid`` or a key for ``group_partition``). ``keys`` (optional, one per tag) name samples in
    errors and give groups; tags already read by :func:`read_plan_tags` are taken as they are (``keys`` unused).
    The batch must already be padded to ``settings.padding_multiple(topology)``.
    """
    job = PlanJob(tags, topology, settings, keys=keys)
    return job.assemble([job.run(i) for i in range(len(job))])
