"""KVBatchMeta: the only thing a controller holds for a batch in the store — partition, keys and their tags.

The data itself stays in the store; a stage that needs tensors asks the store for them by key
(``store.kv_batch_get(meta.keys, meta.partition_id, select_fields)``). Tags are small dicts
(status, lengths, versions, ``is_padding``) that let the controller balance, filter and clean up
without reading any tensor.

Every operation returns a new ``KVBatchMeta``; tags and ``extra_info`` are copied, so editing the
tags of one batch never edits another's.

Example::

    >>> meta = KVBatchMeta("train", ["a_0_0", "a_1_0", "b_0_0"], [{"seq_len": 5}, {"seq_len": 7}, {"seq_len": 3}])
    >>> [m.keys for m in meta.chunk(2)]
    [['a_0_0', 'a_1_0'], ['b_0_0']]
    >>> meta.reorder([2, 0, 1]).keys
    ['b_0_0', 'a_0_0', 'a_1_0']
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence
from typing import Any

from protocol.checks import DICT, SCALAR, only_types, plain_keys

__all__ = ["KVBatchMeta", "MetaKeyError", "MetaIndexError", "copy_tag", "copy_tags"]


class MetaKeyError(KeyError):
    """Keys asked of a KVBatchMeta that it does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class MetaIndexError(ValueError, IndexError):
    """Positions asked of a KVBatchMeta that are out of range or repeated."""


def copy_tag(value: Any) -> Any:
    """A deep copy of a tag value; JSON-shaped values (the store's tags) are copied without ``copy.deepcopy``'s
    memo bookkeeping, which costs more than the rest of a large batch's construction."""
    kind = type(value)
    if kind is dict:
        out = value.copy()
        if not only_types(out.values(), SCALAR):  # most tags hold only atoms: one C-level pass
            for k, v in out.items():
                if type(v) not in SCALAR:
                    out[k] = copy_tag(v)
        return out
    if kind in SCALAR:
        return value
    if kind is list:
        return [v if type(v) in SCALAR else copy_tag(v) for v in value]
    return copy.deepcopy(value)


def copy_tags(tags: Iterable[Any]) -> list[Any]:
    """:func:`copy_tag` of each of ``tags``: dicts of atoms (nearly every trajectory tag) are copied and checked in
    a few C-level passes over the whole list, the rest one by one."""
    tags = list(tags)
    if only_types(tags, DICT) and only_types(itertools.chain.from_iterable(map(dict.values, tags)), SCALAR):
        return list(map(dict.copy, tags))
    return [copy_tag(t) for t in tags]  # a mixed list: the per-tag copy, which looks inside only where needed


def _preview(items: Sequence[Any], limit: int = 5) -> str:
    """Up to ``limit`` items and the total count, for error messages."""
    shown = ", ".join(repr(x) for x in list(items)[:limit])
    more = f", ... ({len(items)} in total)" if len(items) > limit else f" ({len(items)} in total)"
    return f"[{shown}]{more}"


@dataclass
class KVBatchMeta:
    """A batch as the controller sees it: ``partition_id``, ``keys`` (unique) and one tag dict per key.

    ``extra_info`` is batch-level information (e.g. the step, metrics) shared by the whole batch.
    Construction validates types, equal lengths of ``keys`` and ``tags`` and key uniqueness, and
    copies ``tags`` and ``extra_info``.
    """

    partition_id: str
    keys: list[str]
    tags: list[dict] = field(default=None)  # type: ignore[assignment]
    extra_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.partition_id, str) or not self.partition_id:
            raise TypeError(f"KVBatchMeta.partition_id must be a non-empty str, got {self.partition_id!r}")
        if isinstance(self.keys, str) or not isinstance(self.keys, Iterable):
            raise TypeError(f"KVBatchMeta.keys must be a list of str, got {type(self.keys).__name__}")
        self.keys = list(self.keys)
        bad = [k for k in self.keys if not isinstance(k, str) or not k]
        if bad:
            raise TypeError(f"KVBatchMeta.keys must be non-empty str; found {_preview(bad)}")
        if self.tags is None:
            self.tags = [{} for _ in self.keys]
        if isinstance(self.tags, dict) or not isinstance(self.tags, Iterable):
            raise TypeError(f"KVBatchMeta.tags must be a list of dict, got {type(self.tags).__name__}")
        self.tags = list(self.tags)
        if len(self.tags) != len(self.keys):
            raise ValueError(
                f"KVBatchMeta needs one tag per key: got {len(self.keys)} keys and {len(self.tags)} tags"
            )
        bad_tags = [i for i, t in enumerate(self.tags) if not isinstance(t, dict)]
        if bad_tags:
            raise TypeError(f"KVBatchMeta.tags must be dicts; positions {_preview(bad_tags)} are not")
        if len(set(self.keys)) != len(self.keys):
            seen: set[str] = set()
            dups = [k for k in self.keys if k in seen or seen.add(k)]  # type: ignore[func-returns-value]
            raise ValueError(f"KVBatchMeta.keys must be unique; duplicated: {_preview(sorted(set(dups)))}")
        if not isinstance(self.extra_info, dict):
            raise TypeError(f"KVBatchMeta.extra_info must be a dict, got {type(self.extra_info).__name__}")
        self.tags = copy_tags(self.tags)
        self.extra_info = copy_tag(self.extra_info)

    @classmethod
    def adopt(cls, partition_id: str, keys: list[str], tags: list[dict], extra_info: dict | None = None
              ) -> "KVBatchMeta":
        """A batch of keys and tags the caller has just made and hands over (tags no one else holds): checked in
        a few C-level passes and not copied again, where the constructor's copy would be a second one. Anything
        the constructor would refuse goes to it, for its error."""
        if type(keys) is not list or type(tags) is not list or len(keys) != len(tags) or \
                type(partition_id) is not str or not partition_id or not plain_keys(keys) or \
                not only_types(tags, DICT) or (extra_info is not None and type(extra_info) is not dict):
            return cls(partition_id, keys, tags, {} if extra_info is None else extra_info)
        meta = cls.__new__(cls)
        meta.partition_id, meta.keys, meta.tags = partition_id, keys, tags
        meta.extra_info = {} if extra_info is None else extra_info
        return meta

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def size(self) -> int:
        """Number of keys (same as ``len``)."""
        return len(self.keys)

    def tag_values(self, name: str, default: Any = None) -> list[Any]:
        """The value of tag ``name`` for every key, in key order (``default`` where a tag lacks it)."""
        return [t.get(name, default) for t in self.tags]

    def select_keys(self, keys: Sequence[str]) -> "KVBatchMeta":
        """A new batch of just ``keys``, in the order given; unknown keys raise MetaKeyError."""
        keys = list(keys)
        index = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys if k not in index]
        if missing:
            raise MetaKeyError(
                f"select_keys: {len(missing)} key(s) not in this KVBatchMeta (partition {self.partition_id!r}): "
                f"{_preview(missing)}"
            )
        return KVBatchMeta(self.partition_id, keys, [self.tags[index[k]] for k in keys], self.extra_info)

    def select_idxs(self, indices: Sequence[int]) -> "KVBatchMeta":
        """A new batch of the keys at ``indices`` (in that order; no repeats)."""
        idx = self._check_indices(indices, "select_idxs")
        return self._taken(idx)

    def reorder(self, indices: Sequence[int]) -> "KVBatchMeta":
        """A new batch whose position ``j`` holds old position ``indices[j]``; ``indices`` must be a permutation."""
        idx = self._check_indices(indices, "reorder")
        if len(idx) != len(self.keys):
            raise MetaIndexError(f"reorder: indices must be a permutation of 0..{len(self.keys) - 1}; "
                             f"got {len(idx)} indices for {len(self.keys)} keys")
        return self._taken(idx)

    def _taken(self, idx: Sequence[int]) -> "KVBatchMeta":
        # positions checked (in range, no repeats) into a valid batch: only the copies are left to make
        tags = self.tags
        return KVBatchMeta.adopt(self.partition_id, [self.keys[i] for i in idx], copy_tags(tags[i] for i in idx),
                                 copy_tag(self.extra_info))

    def chunk(self, chunks: int) -> list["KVBatchMeta"]:
        """Split into ``chunks`` consecutive pieces whose sizes differ by at most one (larger pieces first).

        ``chunks`` may exceed ``len(self)``; the trailing pieces are then empty.
        """
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunk: chunks must be a positive int, got {chunks!r}")
        base, rem = divmod(len(self.keys), chunks)
        out, start = [], 0
        for c in range(chunks):
            end = start + base + (1 if c < rem else 0)
            out.append(KVBatchMeta(self.partition_id, self.keys[start:end], self.tags[start:end], self.extra_info))
            start = end
        return out

    def split(self, sizes: Sequence[int]) -> list["KVBatchMeta"]:
        """Split into consecutive pieces of the given ``sizes`` (they must sum to ``len(self)``)."""
        sizes = list(sizes)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes) or sum(sizes) != len(self):
            raise ValueError(f"split: sizes must be non-negative ints summing to {len(self)}, got {sizes}")
        out, start = [], 0
        for s in sizes:
            out.append(KVBatchMeta(self.partition_id, self.keys[start:start + s], self.tags[start:start + s],
                                   self.extra_info))
            start += s
        return out

    @staticmethod
    def concat(metas: Sequence["KVBatchMeta"]) -> "KVBatchMeta":
        """Join batches of one partition, keys in order; ``extra_info`` entries must agree where they overlap."""
        metas = list(metas)
        if not metas:
            raise ValueError("concat: needs at least one KVBatchMeta, got an empty list")
        bad = [type(m).__name__ for m in metas if not isinstance(m, KVBatchMeta)]
        if bad:
            raise TypeError(f"concat: expected KVBatchMeta items, found {bad[:5]}")
        pids = sorted({m.partition_id for m in metas})
        if len(pids) != 1:
            raise ValueError(f"concat: all batches must share one partition_id, found {pids}")
        extra: dict = {}
        for m in metas:
            for k, v in m.extra_info.items():
                if k in extra and extra[k] != v:
                    raise ValueError(f"concat: extra_info[{k!r}] disagrees between batches: {extra[k]!r} vs {v!r}")
                extra[k] = v
        keys = [k for m in metas for k in m.keys]
        tags = [t for m in metas for t in m.tags]
        return KVBatchMeta(pids[0], keys, tags, extra)

    def _check_indices(self, indices: Sequence[int], op: str) -> list[int]:
        idx = [int(i) for i in indices]
        n = len(self.keys)
        out_of_range = [i for i in idx if not 0 <= i < n]
        if out_of_range:
            raise MetaIndexError(f"{op}: indices out of range 0..{n - 1}: {_preview(out_of_range)}")
        if len(set(idx)) != len(idx):
            raise MetaIndexError(f"{op}: indices must not repeat, got {_preview(idx)}")
        return idx
