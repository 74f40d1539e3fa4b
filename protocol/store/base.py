"""The KV store contract both stores implement, and the validation they share.

Data model: a *partition* (``"train"``, ``"val"``, any non-empty str) maps *keys* to a *tag* (a small
JSON-able dict) and *fields* (tensors, one value per key; variable-length values are kept per key and
come back jagged, see :mod:`protocol.store.batching`).

Rules every store enforces:

* **Tags merge.** A put's tag entries update the key's tag (``dict.update``); a put without a tag keeps it.
* **No silent overwrite.** Writing a field a key already holds with a *different* value raises
  :class:`FieldOverwriteError` unless ``overwrite=True``; writing the identical value is a no-op.
* **No resurrection.** ``kv_clear`` marks what it clears. A put that would *create* a key is refused with
  :class:`LateWriteError` (and counted in ``stats()["late_writes_refused"]``) when

  - the key itself was cleared in that partition, or
  - its *group* was cleared: the group of a trajectory key ``{uid}_{session}_{index}`` is ``uid`` (the text
    before the first ``_``), a prompt key ``{uid}`` is its own group, and a group counts as cleared once
    its prompt key ``{uid}`` was cleared.

  Puts to keys that are still present are never late (clearing a prompt key does not freeze trajectory
  keys still being scored). The marks are kept in a bounded FIFO (``max_cleared_marks``, oldest forgotten
  first); ``kv_clear(..., mark_cleared=False)`` clears without marking, for partitions that reuse keys.
* **Batch puts are atomic.** A refused put (bad shape, overwrite, late write) changes nothing.
* **Gets are exact.** Missing keys or fields raise :class:`StoreKeyError` naming up to 5 and the count;
  ``select_fields=None`` means every field the keys hold, which must be the same set for all of them.
"""
from __future__ import annotations

import abc
import asyncio
import collections
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from protocol.batch.nested import field_parts
from protocol.checks import DICT, SCALAR, STR, only_types, plain_keys

from .keys import is_prompt_key, uid_of
from .meta import KVBatchMeta
from .batching import normalize_tag, single_key_fields
from .errors import StoreKeyError, preview

__all__ = [
    "KVStore",
    "StepStore",
    "check_partition",
    "check_keys",
    "check_tags",
    "check_select_fields",
    "ClearedMarks",
    "DEFAULT_MAX_CLEARED_MARKS",
]

DEFAULT_MAX_CLEARED_MARKS = 200_000


def check_partition(partition_id: Any) -> str:
    """``partition_id`` as a validated non-empty str."""
    if not isinstance(partition_id, str) or not partition_id:
        raise TypeError(f"partition_id must be a non-empty str (e.g. 'train'), got {partition_id!r}")
    return partition_id


def check_keys(keys: Any, op: str) -> list[str]:
    """``keys`` as a list of unique non-empty str (a single str is one key)."""
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, Iterable):
        raise TypeError(f"{op}: keys must be a list of str, got {type(keys).__name__}")
    keys = list(keys)
    if plain_keys(keys):  # the common case in C-level passes; the loops below name the culprits
        return keys
    bad = [k for k in keys if not isinstance(k, str) or not k]
    if bad:
        raise TypeError(f"{op}: keys must be non-empty str; found {preview(bad)}")
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dups = sorted({k for k in keys if k in seen or seen.add(k)})  # type: ignore[func-returns-value]
        raise ValueError(f"{op}: keys must be unique; duplicated: {preview(dups)}")
    return keys


def check_tags(tags: Any, keys: Sequence[str], op: str) -> list[dict] | None:
    """Validated copies of ``tags`` (one dict per key), or None."""
    if tags is None:
        return None
    if isinstance(tags, Mapping) or not isinstance(tags, Iterable):
        raise TypeError(f"{op}: tags must be a list of dicts (one per key), got {type(tags).__name__}")
    tags = list(tags)
    if len(tags) != len(keys):
        raise ValueError(f"{op}: got {len(tags)} tags for {len(keys)} keys; pass one tag dict per key")
    if only_types(tags, DICT) and only_types(itertools.chain.from_iterable(tags), STR) and \
            only_types(itertools.chain.from_iterable(map(dict.values, tags)), SCALAR):
        return list(map(dict.copy, tags))  # str names and scalar values (nearly every tag): nothing to convert
    return [normalize_tag(t, k) for t, k in zip(tags, keys)]


def check_select_fields(select_fields: Any, op: str) -> list[str] | None:
    """``select_fields`` as a list of unique field names (a single str is one field), or None for all."""
    if select_fields is None:
        return None
    if isinstance(select_fields, str):
        select_fields = [select_fields]
    select_fields = list(select_fields)
    bad = [f for f in select_fields if not isinstance(f, str) or not f]
    if bad:
        raise TypeError(f"{op}: select_fields must be field names (str); found {preview(bad)}")
    if len(set(select_fields)) != len(select_fields):
        raise ValueError(f"{op}: select_fields must not repeat a field, got {select_fields}")
    return select_fields


class ClearedMarks:
    """A bounded FIFO set of (partition, key-or-group) marks left by ``kv_clear`` (not thread-safe alone)."""

    def __init__(self, max_marks: int = DEFAULT_MAX_CLEARED_MARKS) -> None:
        if isinstance(max_marks, bool) or not isinstance(max_marks, int) or max_marks < 0:
            raise ValueError(f"max_cleared_marks must be an int >= 0, got {max_marks!r}")
        self.max_marks = max_marks
        self._marks: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._marks)

    def add(self, partition_id: str, keys: Iterable[str]) -> None:
        """Mark ``keys`` cleared in ``partition_id`` (a prompt key marks its whole group)."""
        if self.max_marks == 0:
            return
        for k in keys:
            self._marks[(partition_id, k)] = None
            self._marks.move_to_end((partition_id, k))
        while len(self._marks) > self.max_marks:
            self._marks.popitem(last=False)

    def late(self, partition_id: str, new_keys: Iterable[str]) -> list[str]:
        """Those of ``new_keys`` (keys a put would create) that were cleared themselves or by their group."""
        marks = self._marks
        return [k for k in new_keys if (partition_id, k) in marks or (partition_id, uid_of(k)) in marks]

    def clear(self) -> None:
        self._marks.clear()


@runtime_checkable
class StepStore(Protocol):
    """The verbs a training step needs from its store, whether one process's or a view across ranks.

    :class:`KVStore` implements them for one process (every value is local, :meth:`sync` has nothing to do); the
    trainer's cross-rank view implements them with replicated tags and point-to-point :meth:`fetch`.
    """

    def kv_batch_put(self, keys: Sequence[str], partition_id: str, fields: TensorDict | None = None,
                     tags: Sequence[dict] | None = None, overwrite: bool = False) -> Any: ...

    def kv_batch_get_tags(self, keys: Sequence[str], partition_id: str) -> list[dict]: ...

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]: ...

    def kv_clear(self, keys: Sequence[str], partition_id: str) -> int: ...

    def local_keys(self, keys: Sequence[str], partition_id: str, field: str) -> list[str]:
        """Those of ``keys`` whose ``field`` this process holds, in order."""

    def read_local(self, keys: Sequence[str], partition_id: str, fields: Sequence[str]) -> TensorDict:
        """``fields`` of keys this process holds (per-token fields jagged), without communication."""

    def fetch(self, keys: Sequence[str], partition_id: str, fields: Sequence[str]) -> TensorDict:
        """``fields`` of ``keys`` wherever they are held (a collective for a cross-rank store)."""

    def sync(self) -> None:
        """Make tags and value locations written since the last call visible everywhere."""

    def num_keys(self) -> int:
        """Keys this process still knows of (tags or values): 0 after a step's clean-up."""


class KVStore(abc.ABC):
    """Abstract KV store with TransferQueue verbs; see the module docstring for the rules.

    It is also a :class:`StepStore` for a single process: every value is local and :meth:`sync` is a no-op.
    """

    # ---- writes -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def kv_batch_put(self, keys: Sequence[str], partition_id: str, fields: TensorDict | Mapping | None = None,
                     tags: Sequence[dict] | None = None, overwrite: bool = False) -> KVBatchMeta:
        """Write fields (dim 0 = keys; jagged split per key, dense per row) and merge tags; return the batch."""

    def kv_put(self, key: str, partition_id: str, fields: Mapping[str, torch.Tensor] | TensorDict | None = None,
               tag: dict | None = None, overwrite: bool = False) -> KVBatchMeta:
        """Write one key: ``fields`` maps names to that key's tensors (no batch dim); ``tag`` merges."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"kv_put: key must be a non-empty str, got {key!r}")
        if fields is None and tag is None:
            raise ValueError(f"kv_put: key {key!r}: give fields, a tag, or both")
        per_key = single_key_fields(fields) if fields is not None else None
        batch = None
        if per_key is not None:
            batch = {name: [value] for name, value in per_key.items()}
        return self.kv_batch_put([key], partition_id, batch, None if tag is None else [tag], overwrite)

    # ---- reads --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def kv_batch_get(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str] | None = None,
                     *, jagged: Iterable[str] = ()) -> TensorDict:
        """Fields of ``keys`` as a TensorDict of batch [len(keys)] in key order (dense or jagged per field)."""

    def kv_batch_get_packed(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]
                            ) -> dict[str, tuple[Any, Any]]:
        """:meth:`kv_batch_get` of ``select_fields`` as each field's ``(values, offsets)`` (``offsets`` None when
        dense): what a transfer sends. A store that can read it without building jagged tensors overrides this."""
        td = self.kv_batch_get(keys, partition_id, select_fields=list(select_fields))
        return {f: field_parts(td.get(f)) for f in select_fields}

    def kv_batch_get_by_meta(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None,
                             *, jagged: Iterable[str] = ()) -> TensorDict:
        """:meth:`kv_batch_get` of a KVBatchMeta's keys and partition."""
        if not isinstance(meta, KVBatchMeta):
            raise TypeError(f"kv_batch_get_by_meta: expected a KVBatchMeta, got {type(meta).__name__}")
        return self.kv_batch_get(meta.keys, meta.partition_id, select_fields, jagged=jagged)

    @abc.abstractmethod
    def kv_batch_get_tags(self, keys: Sequence[str], partition_id: str) -> list[dict]:
        """Copies of the tags of ``keys`` in key order; missing keys raise StoreKeyError."""

    def kv_batch_get_meta(self, keys: Sequence[str], partition_id: str) -> KVBatchMeta:
        """A KVBatchMeta of ``keys`` carrying their current tags."""
        keys = check_keys(keys, "kv_batch_get_meta")
        return KVBatchMeta(partition_id, keys, self.kv_batch_get_tags(keys, partition_id))

    @abc.abstractmethod
    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        """partition -> key -> tag (copies), for one partition (``{pid: {}}`` if empty) or all non-empty ones."""

    # ---- clean-up -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def kv_clear(self, keys: Sequence[str], partition_id: str, *, mark_cleared: bool = True) -> int:
        """Drop tags and fields of ``keys`` (absent keys are fine) and mark them cleared; return how many existed."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: partitions, keys, fields, bytes held, cleared_marks, late_writes_refused, overwrites_refused."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything the store holds; later calls raise StoreClosedError."""

    # ---- the StepStore verbs of a single process ----------------------------------------------------
    def local_keys(self, keys: Sequence[str], partition_id: str, field: str) -> list[str]:
        """Those of ``keys`` present in ``partition_id``: in one process every value is local."""
        held = self.kv_list(partition_id).get(partition_id, {})
        return [k for k in keys if k in held]

    def read_local(self, keys: Sequence[str], partition_id: str, fields: Sequence[str]) -> TensorDict:
        """:meth:`kv_batch_get` of ``fields``, each per-token field jagged."""
        return self.kv_batch_get(keys, partition_id, select_fields=list(fields), jagged=list(fields))

    def fetch(self, keys: Sequence[str], partition_id: str, fields: Sequence[str]) -> TensorDict:
        """In one process every value is local: :meth:`read_local`."""
        return self.read_local(keys, partition_id, fields)

    def sync(self) -> None:
        """Nothing to replicate in one process."""

    def num_keys(self) -> int:
        return int(self.stats().get("keys", 0))

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- asyncio ------------------------------------------------------------------------------------
    async def async_kv_put(self, *args: Any, **kwargs: Any) -> KVBatchMeta:
        """:meth:`kv_put` off the event loop."""
        return await asyncio.to_thread(self.kv_put, *args, **kwargs)

    async def async_kv_batch_put(self, *args: Any, **kwargs: Any) -> KVBatchMeta:
        """:meth:`kv_batch_put` off the event loop."""
        return await asyncio.to_thread(self.kv_batch_put, *args, **kwargs)

    async def async_kv_batch_get(self, *args: Any, **kwargs: Any) -> TensorDict:
        """:meth:`kv_batch_get` off the event loop."""
        return await asyncio.to_thread(self.kv_batch_get, *args, **kwargs)

    async def async_kv_list(self, *args: Any, **kwargs: Any) -> dict[str, dict[str, dict]]:
        """:meth:`kv_list` off the event loop."""
        return await asyncio.to_thread(self.kv_list, *args, **kwargs)

    async def async_kv_clear(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`kv_clear` off the event loop."""
        return await asyncio.to_thread(self.kv_clear, *args, **kwargs)


def missing_error(op: str, partition_id: str, missing: Sequence[Any], what: str = "key(s)") -> StoreKeyError:
    """The StoreKeyError for ``missing`` keys or (key, field) pairs."""
    return StoreKeyError(f"{op}: {len(missing)} {what} not in partition {partition_id!r}: {preview(missing)}")

