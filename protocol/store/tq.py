"""TransferQueueStore: the KV store contract on top of the Ray-backed ``transfer_queue`` package (multi-node runs).

The package provides the verbs (``kv_batch_put``, ``kv_batch_get``, ``kv_list``, ``kv_clear``) and merges
tags; this adapter adds what the contract needs and the package does not do on its own:

* gets fail on missing keys / fields (the package silently drops them) and follow the dense-or-jagged rule
  of :mod:`protocol.store.batching` (the package hands dense 2-D fields back jagged);
* field overwrites with a different value are refused unless ``overwrite=True`` (existing values are read
  back and compared first);
* re-creating cleared keys / keys of cleared groups is refused. The marks live in TransferQueue itself, in a
  reserved partition ``__cleared__{pid}`` (tag-only keys), so a writer in another process sees a clear made
  by the trainer. Each instance forgets the oldest marks *it* wrote beyond ``max_cleared_marks``. A put that
  races a clear of the same group (check, then clear, then write) is not caught: the check and the write are
  two requests;
* ``kv_list(pid)`` always returns ``{pid: {...}}`` and ``kv_list()`` omits empty and reserved partitions.

Puts are serialised by a per-instance lock, so tag merges of threads in one process never interleave; the
package itself does a read-modify-write of tags, so writers in *different* processes that merge tags of the
same key concurrently can lose an update. ``stats()["fields"]`` and ``["bytes"]`` count what this instance
wrote and has not cleared.

Start-up: on a small machine the package's default (2 storage units) can hang; this adapter starts one
storage unit and, when Ray is not running yet, starts Ray with ``num_cpus=4`` in a private temp folder that
``close()`` removes. ``transfer_queue`` and ``ray`` are imported only when a store is created.
"""
from __future__ import annotations

import collections
import os
import shutil
import tempfile
import threading
from typing import Any, Iterable, Mapping, Sequence

import torch
from tensordict import TensorDict

from .keys import uid_of
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
from .batching import assemble_batch, assemble_field, nbytes, per_key_fields, same_value
from .errors import FieldOverwriteError, LateWriteError, StoreClosedError, preview

__all__ = ["TransferQueueStore", "MARKS_PREFIX"]

MARKS_PREFIX = "__cleared__"


def _rows(value: torch.Tensor) -> list[torch.Tensor]:
    """Per-key values of a field as the package returned it (dense rows or jagged components)."""
    return list(value.unbind(0))


class TransferQueueStore(KVStore):
    """The store contract over ``transfer_queue`` (0.1.x); see the module docstring for what the adapter adds.

    ``tq_config`` is merged into the package's default config (e.g. a different storage backend);
    ``num_storage_units`` sets ``backend.SimpleStorage.num_data_storage_units``. ``ray_init_kwargs`` is used
    only when Ray is not initialised yet. If a TransferQueue controller already runs in the Ray cluster the
    store attaches to it and ``close()`` leaves it running.
    """

    def __init__(self, tq_config: Mapping | None = None, *, num_storage_units: int = 1,
                 ray_init_kwargs: Mapping | None = None, max_cleared_marks: int = DEFAULT_MAX_CLEARED_MARKS) -> None:
        if isinstance(num_storage_units, bool) or not isinstance(num_storage_units, int) or num_storage_units < 1:
            raise ValueError(f"num_storage_units must be an int >= 1, got {num_storage_units!r}")
        os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
        import ray
        import transfer_queue as tq

        self._ray, self._tq = ray, tq
        self._lock = threading.RLock()
        ClearedMarks(max_cleared_marks)  # validates the bound
        self._max_marks = max_cleared_marks
        self._my_marks: collections.deque[tuple[str, str]] = collections.deque()  # marks this instance wrote
        self._bytes: dict[tuple[str, str], dict[str, int]] = {}  # (partition, key) -> field -> bytes
        self._late_refused = 0
        self._overwrites_refused = 0
        self._closed = False
        self._ray_tmp: str | None = None
        self._started_ray = False
        if not ray.is_initialized():
            self._ray_tmp = tempfile.mkdtemp(prefix="rldispatch_ray_")
            kwargs = dict(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                          _temp_dir=self._ray_tmp,
                          runtime_env={"env_vars": {"TQ_LOGGING_LEVEL": os.environ["TQ_LOGGING_LEVEL"]}})
            kwargs.update(ray_init_kwargs or {})
            ray.init(**kwargs)
            self._started_ray = True
        self._owns_tq = not self._controller_exists()
        conf: dict = {"backend": {"SimpleStorage": {"num_data_storage_units": num_storage_units}}}
        from omegaconf import OmegaConf

        merged = OmegaConf.merge(OmegaConf.create(conf), OmegaConf.create(dict(tq_config or {})))
        tq.init(merged)
        self._client = tq.get_client()

    def _controller_exists(self) -> bool:
        try:
            self._ray.get_actor("TransferQueueController", namespace="transfer_queue")
            return True
        except ValueError:
            return False

    @staticmethod
    def _check_partition(partition_id: Any) -> str:
        partition_id = check_partition(partition_id)
        if partition_id.startswith(MARKS_PREFIX):
            raise ValueError(f"partition_id {partition_id!r}: the prefix {MARKS_PREFIX!r} is reserved for the "
                             f"store's cleared-key marks; choose another partition name")
        return partition_id

    # ---- cleared marks (kept in TransferQueue, visible to every process) ----------------------------
    def _late(self, partition_id: str, new_keys: list[str]) -> list[str]:
        """Those of ``new_keys`` that were cleared themselves or whose group (prompt key) was cleared."""
        if not new_keys:
            return []
        candidates = list(dict.fromkeys(list(new_keys) + [uid_of(k) for k in new_keys]))
        _, where, missing = self._lookup(candidates, MARKS_PREFIX + partition_id)
        if not where:
            return []
        return [k for k in new_keys if k in where or uid_of(k) in where]

    def _add_marks(self, partition_id: str, keys: list[str]) -> None:
        if self._max_marks == 0:
            return
        self._tq.kv_batch_put(keys=keys, partition_id=MARKS_PREFIX + partition_id, tags=[{}] * len(keys))
        self._my_marks.extend((partition_id, k) for k in keys)
        expired: dict[str, list[str]] = {}
        while len(self._my_marks) > self._max_marks:
            pid, k = self._my_marks.popleft()
            expired.setdefault(pid, []).append(k)
        for pid, ks in expired.items():
            self._tq.kv_clear(keys=list(dict.fromkeys(ks)), partition_id=MARKS_PREFIX + pid)

    # ---- lookups ------------------------------------------------------------------------------------
    def _lookup(self, keys: list[str], partition_id: str):
        """(BatchMeta of the present keys, {key: position in that BatchMeta}, missing keys)."""
        meta = self._client.kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
        if meta.size == len(keys):
            return meta, {k: i for i, k in enumerate(keys)}, []
        if meta.size == 0:
            return meta, {}, list(keys)
        present = self._client.kv_retrieve_keys(global_indexes=list(meta.global_indexes), partition_id=partition_id)
        where = {k: i for i, k in enumerate(present)}
        return meta, where, [k for k in keys if k not in where]

    def _has_field(self, partition_id: str, name: str, gidx: Sequence[int]) -> list[bool]:
        """For each global index, whether it holds field ``name`` (one controller request per field)."""
        index, status = self._client.get_production_status(data_fields=[name], partition_id=partition_id)
        if index is None or status is None:
            return [False] * len(gidx)
        pos = torch.searchsorted(index, torch.as_tensor(list(gidx), dtype=index.dtype))
        pos = pos.clamp(max=max(len(index) - 1, 0))
        ok = index[pos] == torch.as_tensor(list(gidx), dtype=index.dtype)
        return (ok & (status.reshape(len(index), -1)[pos, 0] == 1)).tolist()

    def _partition_fields(self, partition_id: str) -> list[str]:
        meta = self._client._run_coroutine(self._client._get_partition_meta(partition_id))
        return list(meta.field_names) if meta is not None else []

    # ---- writes -------------------------------------------------------------------------------------
    def kv_batch_put(self, keys: Sequence[str], partition_id: str, fields: TensorDict | Mapping | None = None,
                     tags: Sequence[dict] | None = None, overwrite: bool = False) -> KVBatchMeta:
        op = "kv_batch_put"
        self._check_open(op)
        partition_id = self._check_partition(partition_id)
        keys = check_keys(keys, op)
        tags = check_tags(tags, keys, op)
        if fields is None and tags is None:
            raise ValueError(f"{op}: give fields, tags, or both (partition {partition_id!r}, {len(keys)} keys)")
        columns = per_key_fields(fields, len(keys))
        if not keys:
            return KVBatchMeta(partition_id, [], [])
        with self._lock:
            self._check_open(op)
            meta, where, missing = self._lookup(keys, partition_id)
            late = self._late(partition_id, missing)
            if late:
                self._late_refused += len(late)
                raise LateWriteError(
                    f"{op}: refused to re-create {len(late)} cleared key(s) in partition {partition_id!r} "
                    f"(the key or its group was cleared by kv_clear): {preview(late)}; nothing was written")
            conflicts = self._conflicts(partition_id, keys, columns, meta, where) if not overwrite else []
            if conflicts:
                self._overwrites_refused += len(conflicts)
                raise FieldOverwriteError(
                    f"{op}: {len(conflicts)} (key, field) pair(s) in partition {partition_id!r} already hold a "
                    f"different value: {preview(conflicts)}; pass overwrite=True to replace them; nothing was written")
            batch = None
            if columns:
                batch = TensorDict({name: assemble_field(name, parts) for name, parts in columns.items()},
                                   batch_size=[len(keys)])
            out = self._tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=batch, tags=tags)
            for name, parts in columns.items():
                for key, value in zip(keys, parts):
                    self._bytes.setdefault((partition_id, key), {})[name] = nbytes(value)
            return KVBatchMeta(partition_id, keys, out.tags)  # the meta copies the tags

    def _conflicts(self, partition_id: str, keys: list[str], columns: Mapping[str, list[torch.Tensor]],
                   meta: Any, where: Mapping[str, int]) -> list[tuple[str, str]]:
        """(key, field) pairs whose stored value differs from the one being written."""
        present = [k for k in keys if k in where]
        if not present or not columns:
            return []
        gidx = [meta.global_indexes[where[k]] for k in present]
        conflicts = []
        for name, parts in columns.items():
            holds = [k for k, h in zip(present, self._has_field(partition_id, name, gidx)) if h]
            if not holds:
                continue
            stored = self._tq.kv_batch_get(keys=holds, partition_id=partition_id, select_fields=[name])[name]
            new = dict(zip(keys, parts))
            for key, old in zip(holds, _rows(stored)):
                if not same_value(old, new[key]):
                    conflicts.append((key, name))
        return conflicts

    # ---- reads --------------------------------------------------------------------------------------
    def kv_batch_get(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str] | None = None,
                     *, jagged: Iterable[str] = ()) -> TensorDict:
        op = "kv_batch_get"
        self._check_open(op)
        partition_id = self._check_partition(partition_id)
        keys = check_keys(keys, op)
        select = check_select_fields(select_fields, op)
        if not keys:
            return TensorDict({}, batch_size=[0])
        meta, where, missing = self._lookup(keys, partition_id)
        if missing:
            raise missing_error(op, partition_id, missing)
        common = list(meta.field_names)
        if select is None:
            extra = [f for f in self._partition_fields(partition_id) if f not in common]
            select = common + [f for f in extra if any(self._has_field(partition_id, f, meta.global_indexes))]
        absent_fields = [f for f in select if f not in common]
        if absent_fields:
            absent = []
            for f in absent_fields:
                absent += [(k, f) for k, h in zip(keys, self._has_field(partition_id, f, meta.global_indexes))
                           if not h]
            raise missing_error(op, partition_id, absent, "(key, field) pair(s)")
        if not select:
            return TensorDict({}, batch_size=[len(keys)])
        data = self._tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=select)
        if data.batch_size[0] != len(keys):
            raise missing_error(op, partition_id, keys, "key(s) (store returned a partial batch)")
        columns = {f: _rows(data[f]) for f in select}
        return assemble_batch(len(keys), columns, jagged)

    def kv_batch_get_tags(self, keys: Sequence[str], partition_id: str) -> list[dict]:
        op = "kv_batch_get_tags"
        self._check_open(op)
        partition_id = self._check_partition(partition_id)
        keys = check_keys(keys, op)
        if not keys:
            return []
        meta, where, missing = self._lookup(keys, partition_id)
        if missing:
            raise missing_error(op, partition_id, missing)
        return copy_tags(meta.custom_meta[where[k]] for k in keys)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        self._check_open("kv_list")
        if partition_id is not None:
            partition_id = self._check_partition(partition_id)
            listed = self._tq.kv_list(partition_id)
            return {partition_id: {k: copy_tag(t) for k, t in listed.get(partition_id, {}).items()}}
        listed = self._tq.kv_list()
        return {pid: {k: copy_tag(t) for k, t in part.items()} for pid, part in listed.items()
                if part and not pid.startswith(MARKS_PREFIX)}

    # ---- clean-up -----------------------------------------------------------------------------------
    def kv_clear(self, keys: Sequence[str], partition_id: str, *, mark_cleared: bool = True) -> int:
        op = "kv_clear"
        self._check_open(op)
        partition_id = self._check_partition(partition_id)
        keys = check_keys(keys, op)
        if not keys:
            return 0
        with self._lock:
            meta = self._client.kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
            if meta.size:
                self._tq.kv_clear(keys=keys, partition_id=partition_id)
            for k in keys:
                self._bytes.pop((partition_id, k), None)
            if mark_cleared:
                self._add_marks(partition_id, keys)
            return meta.size

    def stats(self) -> dict[str, int]:
        marks = self._tq.kv_list() if not self._closed else {}
        listed = {pid: p for pid, p in marks.items() if not pid.startswith(MARKS_PREFIX)}
        with self._lock:
            return {
                "partitions": sum(1 for p in listed.values() if p),
                "keys": sum(len(p) for p in listed.values()),
                "fields": sum(len(f) for f in self._bytes.values()),
                "bytes": sum(sum(f.values()) for f in self._bytes.values()),
                "cleared_marks": sum(len(p) for pid, p in marks.items() if pid.startswith(MARKS_PREFIX)),
                "late_writes_refused": self._late_refused,
                "overwrites_refused": self._overwrites_refused,
            }

    def close(self) -> None:
        """Close the client; stop the TransferQueue it started and Ray if it started it; remove its temp folder."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._my_marks.clear()
            self._bytes.clear()
            try:
                if self._owns_tq:
                    self._tq.close()
            finally:
                if self._started_ray:
                    self._ray.shutdown()
                if self._ray_tmp:
                    shutil.rmtree(self._ray_tmp, ignore_errors=True)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise StoreClosedError(f"{op}: this TransferQueueStore was closed; create a new one")
