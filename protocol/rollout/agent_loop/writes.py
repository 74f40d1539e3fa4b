"""The store writes of prompt groups: put at once, or combined with the other groups writing in the same turn.

``run_groups`` runs many groups concurrently and each writes its ``running`` status, its trajectories and its
final status. :class:`GroupWrites` with ``combine=True`` gathers the puts requested during one event-loop turn and
sends them as few batch puts as the requests allow, so thousands of groups cost a handful of puts instead of three
each. A reader observes nothing different: each group still writes in order (it waits for one put before asking
the next), no request waits past the end of its turn, and a request the store refuses (a group cleared meanwhile)
fails alone, with the store's own error, because batch puts are atomic (a refused one wrote nothing) and the
requests of a refused combined put are then sent one by one.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from protocol.store.meta import KVBatchMeta

__all__ = ["GroupWrites"]

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    keys: list[str]
    partition_id: str
    fields: Mapping[str, Any] | None
    tags: list[dict] | None
    future: asyncio.Future


def _kind(value: Any) -> tuple | None:
    """How a field's value joins others of its kind (a list of rows, a dense batch); None: it is sent alone."""
    if type(value) is list:
        return ("list",)
    if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() >= 1:
        return ("dense", value.dtype, value.device, value.shape[1:])
    return None


def _signature(r: _Request) -> tuple | None:
    """Requests with equal signatures can be one put; None: this one cannot join any other."""
    if r.fields is None:
        fields: tuple = ()
    elif type(r.fields) is not dict:  # a TensorDict or other mapping goes as it is
        return None
    else:
        kinds = tuple((name, _kind(v)) for name, v in r.fields.items())
        if any(k is None for _, k in kinds):
            return None
        fields = kinds
    return r.partition_id, r.tags is None, r.fields is None, fields


def _join(values: list[Any]) -> Any:
    if type(values[0]) is list:
        return [row for v in values for row in v]
    return torch.cat(values, 0)


class GroupWrites:
    """Batch puts into ``store`` for running groups: at once, or (``combine``) combined per event-loop turn."""

    def __init__(self, store: Any, combine: bool = False) -> None:
        self.store = store
        self.combine = combine
        self._queue: list[_Request] = []
        self._scheduled = False

    async def put(self, keys: Sequence[str], partition_id: str, fields: Mapping[str, Any] | None = None,
                  tags: Sequence[dict] | None = None) -> KVBatchMeta:
        """One batch put; its meta, or the store's error. A caller cancelled while its combined put waits does not
        withdraw it: it is written all the same, as a put already under way would be."""
        if not self.combine:
            return self.store.kv_batch_put(list(keys), partition_id, fields=fields,
                                           tags=None if tags is None else list(tags))
        future = self.put_nowait(keys, partition_id, fields, tags)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_warn_unread)  # nobody reads its outcome now
            raise

    def put_nowait(self, keys: Sequence[str], partition_id: str, fields: Mapping[str, Any] | None = None,
                   tags: Sequence[dict] | None = None) -> asyncio.Future:
        """The put as a future (done at once without ``combine``), for a write that must happen even while its
        caller is being cancelled; whoever does not await it reads its outcome with a done-callback."""
        future = asyncio.get_running_loop().create_future()
        request = _Request(list(keys), partition_id, fields, None if tags is None else list(tags), future)
        if not self.combine:
            self._send([request])
            return future
        self._queue.append(request)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)
        return future

    def flush(self) -> None:
        """Send every queued request now (the end of the turn does this; so does the end of a run)."""
        self._scheduled = False
        queue, self._queue = self._queue, []
        batch: list[_Request] = []
        sig, seen = None, set()
        for r in queue:  # consecutive requests of one signature and disjoint keys become one put, in order
            s = _signature(r)
            if batch and (s is None or s != sig or not seen.isdisjoint(r.keys)):
                self._send(batch)
                batch, seen = [], set()
            batch.append(r)
            sig = s
            seen.update(r.keys)
        if batch:
            self._send(batch)

    def _send(self, batch: list[_Request]) -> None:
        first = batch[0]
        if len(batch) == 1:
            try:
                meta = self.store.kv_batch_put(first.keys, first.partition_id, fields=first.fields, tags=first.tags)
            except Exception as exc:  # the caller's error, raised where it awaits
                _settle(first.future, exc=exc)
            else:
                _settle(first.future, meta)
            return
        try:  # joining inside too: whatever fails here, every caller still gets an outcome
            keys = [k for r in batch for k in r.keys]
            fields = None if first.fields is None else {name: _join([r.fields[name] for r in batch])
                                                        for name in first.fields}
            tags = None if first.tags is None else [t for r in batch for t in r.tags]
            meta = self.store.kv_batch_put(keys, first.partition_id, fields=fields, tags=tags)
        except Exception:  # some request was refused, and nothing was written: each on its own, in order
            for r in batch:
                self._send([r])
            return
        start = 0
        for r in batch:
            end = start + len(r.keys)
            _settle(r.future, KVBatchMeta.adopt(first.partition_id, meta.keys[start:end], meta.tags[start:end]))
            start = end


def _settle(future: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if future.done():  # cancelled by whoever held it: the write happened, or was refused, all the same
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _warn_unread(future: asyncio.Future) -> None:
    """The outcome of a put whose caller was cancelled while it waited: an error is logged, not lost."""
    if not future.cancelled() and future.exception() is not None:
        exc = future.exception()
        logger.warning("a group write whose caller was cancelled was refused: %s: %s", type(exc).__name__, exc)
