"""LocalStore: the embedded, in-process KV store (the default); thread- and asyncio-safe.

Values are copied on put and copied again on get, so a caller editing a tensor never edits the store. Each field
of a put is copied once into a column (:mod:`protocol.store.columns`) and every key refers to its row; a column
is freed when its last row is cleared or overwritten, and compacted once half of its bytes are unused, so the
store never holds more than twice the bytes its live keys need (``stats()["bytes"]`` / ``["held_bytes"]``).

Example::

    >>> import torch
    >>> from tensordict import TensorDict
    >>> store = LocalStore()
    >>> resp = torch.nested.as_nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
    >>> meta = store.kv_batch_put(["u_0_0", "u_1_0"], "train", TensorDict({"responses": resp}, [2]),
    ...                           tags=[{"response_len": 3}, {"response_len": 5}])
    >>> store.kv_batch_get(meta.keys, "train", ["responses"])["responses"].is_nested
    True
    >>> store.kv_clear(meta.keys, "train"), store.stats()["keys"]
    (2, 0)
"""
from __future__ import annotations

import itertools
import operator
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from tensordict import TensorDict

from .meta import KVBatchMeta, copy_tag, copy_tags
from .base import (
    DEFAULT_MAX_CLEARED_MARKS,
    ClearedMarks,
    KVStore,
    check_keys,
    check_partition,
    check_select_fields,
    check_tags,
    missing_error,
)
from .batching import batch_of, same_value
from .columns import Column, columns_of_put, gather_field, gather_packed
from .errors import FieldOverwriteError, LateWriteError, StoreClosedError, preview

__all__ = ["LocalStore"]


@dataclass(eq=False)  # compared by identity: ``None in entries`` must not call a Python __eq__ per entry
class _Entry:
    """What one key holds: its tag and, per field, its row of a column."""

    tag: dict = field(default_factory=dict)
    fields: dict[str, tuple[Column, int]] = field(default_factory=dict)


_FIELDS = operator.attrgetter("fields")


class LocalStore(KVStore):
    """In-process store; ``max_cleared_marks`` bounds the memory of cleared keys/groups (oldest forgotten)."""

    def __init__(self, max_cleared_marks: int = DEFAULT_MAX_CLEARED_MARKS) -> None:
        self._lock = threading.RLock()
        self._parts: dict[str, dict[str, _Entry]] = {}
        self._marks = ClearedMarks(max_cleared_marks)
        self._bytes = 0  # bytes of the rows live keys refer to
        self._held = 0  # bytes of the column buffers held
        self._late_refused = 0
        self._overwrites_refused = 0
        self._closed = False

    # ---- writes -------------------------------------------------------------------------------------
    def kv_batch_put(self, keys: Sequence[str], partition_id: str, fields: TensorDict | Mapping | None = None,
                     tags: Sequence[dict] | None = None, overwrite: bool = False) -> KVBatchMeta:
        op = "kv_batch_put"
        self._check_open(op)
        partition_id = check_partition(partition_id)
        keys = check_keys(keys, op)
        tags = check_tags(tags, keys, op)
        if fields is None and tags is None:
            raise ValueError(f"{op}: give fields, tags, or both (partition {partition_id!r}, {len(keys)} keys)")
        columns = columns_of_put(fields, keys)  # the copies are made outside the lock
        if not keys:
            return KVBatchMeta(partition_id, [], [])
        with self._lock:
            self._check_open(op)
            part = self._parts.get(partition_id, {})
            new_keys = [k for k in keys if k not in part]
            late = self._marks.late(partition_id, new_keys)
            if late:
                self._late_refused += len(late)
                raise LateWriteError(
                    f"{op}: refused to re-create {len(late)} cleared key(s) in partition {partition_id!r} "
                    f"(the key or its group was cleared by kv_clear): {preview(late)}; nothing was written")
            conflicts, skips, holds = self._plan_field_writes(part, keys, columns, overwrite)
            if conflicts:
                self._overwrites_refused += len(conflicts)
                raise FieldOverwriteError(
                    f"{op}: {len(conflicts)} (key, field) pair(s) in partition {partition_id!r} already hold a "
                    f"different value: {preview(conflicts)}; pass overwrite=True to replace them; nothing was written")
            part = self._parts.setdefault(partition_id, part)
            entries, out_tags = [], []
            for i, key in enumerate(keys):
                entry = part.get(key)
                if entry is None:
                    entry = part[key] = _Entry()
                if tags is not None:
                    entry.tag.update(tags[i])
                entries.append(entry)
                out_tags.append(entry.tag)
            unused: list[tuple[Column, int]] = []
            fresh = not holds  # no key holds a field of this put yet: plain assignment
            for name, (cols, refs) in columns.items():
                for col in cols:
                    self._held += col.nbytes
                    self._bytes += col.nbytes
                if fresh:
                    for entry, ref in zip(entries, refs):
                        entry.fields[name] = ref
                    continue
                for i, (entry, ref) in enumerate(zip(entries, refs)):
                    if (i, name) in skips:  # the same value is already there: the new row is not used
                        unused.append(ref)
                        continue
                    old = entry.fields.get(name)
                    if old is not None:
                        unused.append(old)
                    entry.fields[name] = ref
            if unused:
                self._release(unused, part)
            return KVBatchMeta.adopt(partition_id, keys, copy_tags(out_tags))  # keys checked above

    def _plan_field_writes(self, part: dict[str, _Entry], keys: list[str],
                           columns: Mapping[str, tuple[list[Column], list[tuple[Column, int]]]], overwrite: bool):
        """The (key, field) pairs a put may not overwrite, the (position, field) pairs it leaves as they are (the
        key already holds that very value), and whether any key already holds a field of the put."""
        conflicts: list[tuple[str, str]] = []
        skips: set[tuple[int, str]] = set()
        entries = [part.get(k) for k in keys]
        holds = False
        if not any(e is not None and e.fields for e in entries):
            return conflicts, skips, holds
        for name, (_, refs) in columns.items():
            olds = [e.fields.get(name) if e is not None else None for e in entries]
            if olds.count(None) == len(olds):  # a field new to every key (the common put): nothing to compare
                continue
            for i, (key, old) in enumerate(zip(keys, olds)):
                if old is None:
                    continue
                holds = True
                new_col, new_i = refs[i]
                if same_value(old[0].row(old[1]), new_col.row(new_i)):
                    skips.add((i, name))
                elif not overwrite:
                    conflicts.append((key, name))
        return conflicts, skips, holds

    def _release(self, refs: Iterable[tuple[Column, int]], part: dict[str, _Entry]) -> None:
        """Rows no key refers to any more leave the byte count, one call per column; then a column without live
        rows is freed and one at most half used has its live rows copied into a smaller one."""
        by_col: defaultdict[Column, list[int]] = defaultdict(list)  # a column hashes by identity
        for col, i in refs:
            by_col[col].append(i)
        for col, rows in by_col.items():
            self._bytes -= col.drop(rows)
            if col.live == 0:
                self._held -= col.nbytes
            elif 2 * col.live_bytes <= col.nbytes and col.nbytes:
                self._compact(col, part)

    def _compact(self, col: Column, part: dict[str, _Entry]) -> None:
        """Copy the rows of ``col`` that keys still refer to into a new column and point those keys at it."""
        rows, owners = [], []
        for i, key in enumerate(col.keys):
            entry = part.get(key)
            ref = entry.fields.get(col.field) if entry is not None else None
            if ref is not None and ref[0] is col and ref[1] == i:
                rows.append(i)
                owners.append(entry)
        new = col.take(rows)
        for j, entry in enumerate(owners):
            entry.fields[col.field] = (new, j)
        self._held += new.nbytes - col.nbytes

    # ---- reads --------------------------------------------------------------------------------------
    def kv_batch_get(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str] | None = None,
                     *, jagged: Iterable[str] = ()) -> TensorDict:
        keys, columns = self._rows_asked("kv_batch_get", keys, partition_id, select_fields)
        # stored buffers are never mutated in place, so joining rows outside the lock is safe
        jagged = set(jagged)
        return batch_of({f: gather_field(f, refs, f in jagged) for f, refs in columns.items()}, len(keys))

    def kv_batch_get_packed(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]
                            ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`kv_batch_get` of ``select_fields`` as each field's ``(values, offsets)`` (``offsets`` None when
        dense): what a transfer sends, read without building jagged tensors."""
        _, columns = self._rows_asked("kv_batch_get_packed", keys, partition_id, select_fields)
        return {f: gather_packed(f, refs) for f, refs in columns.items()}

    def _rows_asked(self, op: str, keys: Sequence[str], partition_id: str, select_fields: Sequence[str] | None
                    ) -> tuple[list[str], dict[str, list[tuple[Column, int]]]]:
        """The checked keys and, per field asked (all fields when None), each key's ``(column, row)``."""
        self._check_open(op)
        partition_id = check_partition(partition_id)
        keys = check_keys(keys, op)
        select = check_select_fields(select_fields, op)
        with self._lock:
            part = self._parts.get(partition_id, {})
            entries = list(map(part.get, keys))  # C-level passes here: a get may ask for every key of a step
            if None in entries:
                raise missing_error(op, partition_id, [k for k, e in zip(keys, entries) if e is None])
            held = list(map(_FIELDS, entries))
            if select is None:
                select = list(held[0]) if held else []
                union = set().union(*held) if held else set()
                extra = sorted(union - set(select))
                select += extra
            try:
                return keys, {f: list(map(operator.itemgetter(f), held)) for f in select}
            except KeyError:
                absent = [(k, f) for f in select for k, e in zip(keys, entries) if f not in e.fields]
                raise missing_error(op, partition_id, absent, "(key, field) pair(s)") from None

    def kv_batch_get_tags(self, keys: Sequence[str], partition_id: str) -> list[dict]:
        op = "kv_batch_get_tags"
        self._check_open(op)
        partition_id = check_partition(partition_id)
        keys = check_keys(keys, op)
        with self._lock:
            part = self._parts.get(partition_id, {})
            missing = [k for k in keys if k not in part]
            if missing:
                raise missing_error(op, partition_id, missing)
            return copy_tags(part[k].tag for k in keys)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        self._check_open("kv_list")
        with self._lock:
            if partition_id is not None:
                partition_id = check_partition(partition_id)
                part = self._parts.get(partition_id, {})
                return {partition_id: {k: copy_tag(e.tag) for k, e in part.items()}}
            return {pid: {k: copy_tag(e.tag) for k, e in part.items()} for pid, part in self._parts.items() if part}

    # ---- clean-up -----------------------------------------------------------------------------------
    def kv_clear(self, keys: Sequence[str], partition_id: str, *, mark_cleared: bool = True) -> int:
        op = "kv_clear"
        self._check_open(op)
        partition_id = check_partition(partition_id)
        keys = check_keys(keys, op)
        with self._lock:
            part = self._parts.get(partition_id, {})
            entries = [e for e in map(part.pop, keys, itertools.repeat(None)) if e is not None]
            dropped = len(entries)
            self._release([ref for e in entries for ref in e.fields.values()], part)
            if not part:
                self._parts.pop(partition_id, None)
            if mark_cleared:
                self._marks.add(partition_id, keys)
            return dropped

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "partitions": sum(1 for p in self._parts.values() if p),
                "keys": sum(len(p) for p in self._parts.values()),
                "fields": sum(len(e.fields) for p in self._parts.values() for e in p.values()),
                "bytes": self._bytes,
                "held_bytes": self._held,
                "cleared_marks": len(self._marks),
                "late_writes_refused": self._late_refused,
                "overwrites_refused": self._overwrites_refused,
            }

    def close(self) -> None:
        with self._lock:
            self._parts.clear()
            self._marks.clear()
            self._bytes = self._held = 0
            self._closed = True

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise StoreClosedError(f"{op}: this LocalStore was closed; create a new one")
