"""The cross-rank data plane: keys and tags replicated on every rank, values moved point to point.

Every rank keeps the values it produced in its own local store. Tags and the location of every (key, field)
are replicated by :meth:`ShardedStore.sync` (metadata only). :meth:`ShardedStore.fetch` is a collective in which
each rank asks for the values it needs; each value travels once, from the rank that holds it straight to the
rank that asked — never through one central rank. Under gloo the values follow the requests in one round trip
when they are short (:meth:`ShardedStore._exchange_framed`); otherwise the ranks first tell each other the sizes.
When every rank already knows every rank's request (a replicated plan), :meth:`ShardedStore.fetch_planned`
sends no request, and nothing at all when every rank holds what it asks for; :meth:`ShardedStore.sync_planned`
records such a plan's writes on every rank without a collective. Every value carries the digest of the keys it
belongs to, and the receiver checks it against the keys it asked for.
"""
from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from protocol.batch.nested import is_jagged, nested_from_lengths, nested_from_values
from protocol.store import KVStore, StepStore
from protocol.store.columns import Column, gather_field, row_ranges
from protocol.store.batching import batch_of
from protocol.store.meta import copy_tag, copy_tags
from rldispatch.collectives import exchange_frames, frame, gather_objects, global_rank, key_digest

__all__ = ["ShardedStore", "DataPlaneError"]


class DataPlaneError(KeyError):
    """A key or field asked of the data plane that no rank holds."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


def _check_rows(field: str, keys: list[str], flat: torch.Tensor, offsets: torch.Tensor | None) -> None:
    rows = flat.shape[0] if offsets is None else offsets.numel() - 1
    if rows != len(keys):
        raise DataPlaneError(f"field {field!r}: a peer sent {rows} values for {len(keys)} keys")


def _as_joined(value: torch.Tensor) -> torch.Tensor:
    """A field read whole from one store, by the rule of :func:`_join`: rows with a length come back jagged even
    when they happen to share it (a dense ``[n, L, ...]`` read), 0-d rows dense."""
    if is_jagged(value) or value.dim() < 2:
        return value
    n, width = value.shape[:2]
    return nested_from_lengths(value.reshape(-1, *value.shape[2:]), np.full(n, width, dtype=np.int64))


def _positions(keys: Sequence[str], lists: Sequence[Sequence[str]]) -> np.ndarray:
    """Where each of ``keys`` sits in ``lists`` laid end to end (every key in exactly one list): the permutation a
    join of rows sent in those lists applies, computed once for every field sent in the same lists."""
    at = {k: i for i, k in enumerate(itertools.chain.from_iterable(lists))}
    return np.fromiter(map(at.__getitem__, keys), dtype=np.int64, count=len(keys))


def _join(field: str, keys: list[str], sent: list[tuple[list[str], torch.Tensor, torch.Tensor | None]],
          order: np.ndarray | None = None) -> torch.Tensor:
    """The rows of ``keys`` (in order) from what each holder sent (its keys, in the order it read them, with their
    values and offsets); anything with a length comes back jagged, whichever rank sent it and however long its rows
    happen to be. ``order``: :func:`_positions` of ``keys`` in the senders' lists, when the caller has it."""
    for ks, flat, offsets in sent:
        _check_rows(field, ks, flat, offsets)
    if len(sent) == 1:  # one holder sent every key, in this order: its buffer is the field (no second copy)
        (_, flat, offsets), = sent
        return _as_joined(flat) if offsets is None else nested_from_values(flat, offsets)
    if order is None:
        order = _positions(keys, [ks for ks, _, _ in sent])
    joined = _join_rows([(flat, offsets) for _, flat, offsets in sent], order)
    if joined is not None:
        return joined
    # parts of different dtypes or row shapes: the per-column join decides, or names the problem
    cols = [Column(field, flat, None if offsets is None else offsets.tolist(), ks) for ks, flat, offsets in sent]
    jagged = any(c.offsets is not None or c.values.dim() > 1 for c in cols)
    row_of = {k: (c, i) for c in cols for i, k in enumerate(c.keys)}
    return gather_field(field, [row_of[k] for k in keys], jagged)


def _join_rows(parts: list[tuple[torch.Tensor, torch.Tensor | None]], order: np.ndarray) -> torch.Tensor | None:
    """Rows ``order`` of the parts laid end to end, with one concatenation and one gather whatever the number of
    keys: 0-d rows dense, rows with a length jagged. None when the parts do not share a dtype and row shape."""
    if len({flat.dtype for flat, _ in parts}) != 1:
        return None
    if all(offsets is None and flat.dim() == 1 for flat, offsets in parts):  # one scalar per key
        return torch.cat([flat for flat, _ in parts]).index_select(0, torch.from_numpy(order))
    tokens, lengths = [], []
    for flat, offsets in parts:
        if offsets is not None:
            tokens.append(flat)
            lengths.append(offsets.diff().numpy())
        elif flat.dim() >= 2:  # dense rows of one length
            tokens.append(flat.reshape(-1, *flat.shape[2:]))
            lengths.append(np.full(flat.shape[0], flat.shape[1], dtype=np.int64))
        else:
            return None
    if len({t.shape[1:] for t in tokens}) != 1:
        return None
    every = np.concatenate(lengths)
    starts = np.zeros_like(every)
    np.cumsum(every[:-1], out=starts[1:])
    rows = every[order]
    values = torch.cat(tokens).index_select(0, torch.from_numpy(row_ranges(starts[order], rows)))
    return nested_from_lengths(values, rows)


_ALIGN = 8  # every tensor of a message starts at a multiple of this many bytes, so it is read in place


Packed = tuple  # (values, offsets or None[, digest of the keys they belong to, or None])


def _encode(payload: dict[str, Packed]) -> torch.Tensor:
    """One uint8 message of packed fields: an int64 header length, a JSON header (field, dtype, shape, offsets
    count, keys' digest per field) and each tensor's raw bytes; no pickle, and the tensors are copied once."""
    return torch.cat(_encoded_chunks(payload))


def _encoded_chunks(payload: dict[str, Packed]) -> list[torch.Tensor]:
    """The parts of :func:`_encode`'s message, in order (CPU uint8 tensors, each a multiple of 8 bytes)."""
    header, parts = [], []
    for name, (values, offsets, *digest) in payload.items():
        header.append([name, str(values.dtype).removeprefix("torch."), list(values.shape),
                       -1 if offsets is None else offsets.numel(), digest[0] if digest else None])
        parts += [values] if offsets is None else [values, offsets.to(torch.int64)]
    head = json.dumps(header).encode()
    chunks = [torch.tensor([len(head)], dtype=torch.int64).view(torch.uint8),
              _padded(torch.frombuffer(bytearray(head), dtype=torch.uint8))]
    chunks += [_padded(t.detach().contiguous().reshape(-1).view(torch.uint8)) for t in parts]
    return [c.cpu() for c in chunks]


#: bytes of a frame sent at once, shared out by the world (:meth:`ShardedStore._exchange_framed`)
FIRST_PART_TOTAL = 4 << 20


def first_part_bytes(world: int) -> int:
    """Bytes of each frame a rank of ``world`` sends at once (a multiple of 8; 2 MiB on 2 ranks, 64 KiB from 64)."""
    return max(64 << 10, FIRST_PART_TOTAL // max(world, 1)) // _ALIGN * _ALIGN


def _frame(payload: dict[str, Packed] | None) -> torch.Tensor:
    """:func:`_encode`'s message of ``payload`` (nothing for None) behind the frame's own int64 byte count."""
    return frame([] if payload is None else _encoded_chunks(payload))


def _padded(raw: torch.Tensor) -> torch.Tensor:
    gap = -raw.numel() % _ALIGN
    return raw if not gap else torch.cat([raw, raw.new_zeros(gap)])


def _decode(msg: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, int | None]]:
    """What :func:`_encode` packed, each field as (values, offsets, keys' digest); the tensors are views of
    ``msg`` (a CPU uint8 tensor)."""
    at = _ALIGN
    n = int(msg[:at].view(torch.int64)[0])
    header = json.loads(bytes(msg[at:at + n].numpy()))
    at += n + (-n % _ALIGN)

    def take(dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        nonlocal at
        size = math.prod(shape) * dtype.itemsize
        t = msg[at:at + size].view(dtype).reshape(shape)
        at += size + (-size % _ALIGN)
        return t

    out = {}
    for name, dtype, shape, n_offsets, digest in header:
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise DataPlaneError(f"field {name!r}: a peer sent values of an unknown dtype {dtype!r}")
        values = take(dt, shape)
        out[name] = (values, None if n_offsets < 0 else take(torch.int64, [n_offsets]), digest)
    return out


class ShardedStore(StepStore):
    """A :class:`~protocol.store.StepStore` spanning all ranks: local values, replicated tags and locations.

    ``local`` is this rank's :class:`protocol.LocalStore`. Methods named like the store verbs act locally and are
    safe to call from any subset of ranks; :meth:`sync` and :meth:`fetch` are collectives over ``group``, and
    :meth:`fetch_planned` and :meth:`sync_planned` are called by every rank but communicate only what they must.
    """

    def __init__(self, local: KVStore, group: Any = None, device: torch.device | str = "cpu"):
        self.local = local
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._tags: dict[str, dict[str, dict]] = defaultdict(dict)
        # partition -> field -> key -> the rank holding it (per field, so a put records its keys in one update)
        self._where: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
        self._pending: list[tuple[str, list[str], list[dict] | None, list[str]]] = []
        self.bytes_received = 0
        self.bytes_sent = 0
        self._gloo = dist.is_initialized() and dist.get_backend(group) == "gloo"

    # ---- local verbs ------------------------------------------------------------------------------------
    def kv_batch_put(self, keys: Sequence[str], partition_id: str, fields: TensorDict | None = None,
                     tags: Sequence[dict] | None = None, overwrite: bool = False):
        """Write values into this rank's store; tags and locations reach other ranks at the next :meth:`sync`."""
        meta = self.local.kv_batch_put(list(keys), partition_id, fields=fields, tags=list(tags) if tags else None,
                                       overwrite=overwrite)
        names = list(fields.keys()) if fields is not None else []
        self._pending.append((partition_id, list(keys), copy_tags(tags) if tags else None, names))
        self._apply(self.rank, self._pending[-1])
        return meta

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        """Tags of every key on every rank as of the last :meth:`sync` (plus this rank's own later writes).

        Keys come sorted, so every rank lists them in the same order (each rank learns its own writes first and
        the others' at sync; a plan built from insertion order would differ between ranks)."""
        parts = [partition_id] if partition_id is not None else sorted(self._tags)
        return {p: {k: copy_tag(self._tags[p][k]) for k in sorted(self._tags.get(p, {}))} for p in parts}

    def kv_clear(self, keys: Sequence[str], partition_id: str) -> int:
        """Drop keys everywhere they are known; every rank calls this with the same keys (deterministic).

        Returns how many of the keys were known (had a tag) before the call."""
        keys = list(keys)
        if keys:  # keys this rank never held are skipped by the local store, and marked cleared here too
            self.local.kv_clear(keys, partition_id)
        tags = self._tags.get(partition_id, {})
        gone = set(keys)
        self._pending = [  # unsynced writes of cleared keys must not resurrect them on other ranks
            (p, [k for k in ks if not (p == partition_id and k in gone)],
             None if ts is None else [t for k, t in zip(ks, ts) if not (p == partition_id and k in gone)], names)
            for p, ks, ts, names in self._pending]
        known = len(gone.intersection(tags))
        for table in (tags, *self._where.get(partition_id, {}).values()):
            if len(gone) >= len(table) and gone.issuperset(table):  # the usual clear: a whole step at once
                table.clear()
            else:
                for k in gone:
                    table.pop(k, None)
        return known

    def kv_clear_partition(self, partition_id: str) -> int:
        """Clear every key of ``partition_id`` this rank knows of (tags) or holds (values), with no collective: each
        rank clears what it holds and knows of (a shutdown's clear). Returns how many keys that was."""
        known = set(self._tags.get(partition_id, {})) | set(self.local.kv_list(partition_id).get(partition_id, {}))
        if known:
            self.kv_clear(sorted(known), partition_id)
        return len(known)

    def tags_of(self, keys: Sequence[str], partition_id: str) -> list[dict]:
        tags = self._tags.get(partition_id, {})
        missing = [k for k in keys if k not in tags]
        if missing:
            raise DataPlaneError(f"{len(missing)} key(s) have no tag in partition {partition_id!r}: {missing[:5]}")
        return copy_tags(tags[k] for k in keys)

    kv_batch_get_tags = tags_of  # the store verb, so protocol code (agent loop, replay buffer) runs on this view

    def location(self, key: str, field: str, partition_id: str) -> int:
        try:
            return self._where[partition_id][field][key]
        except KeyError:
            raise DataPlaneError(f"field {field!r} of key {key!r} (partition {partition_id!r}) is held by no rank") \
                from None

    def holds(self, key: str, field: str, partition_id: str) -> bool:
        """Whether this rank holds ``field`` of ``key``; known from its own writes, before any sync."""
        return self._where.get(partition_id, {}).get(field, {}).get(key) == self.rank

    def _ranks_of(self, keys: Sequence[str], partition_id: str, field: str) -> list[int]:
        """The rank holding ``field`` of each of ``keys`` (one pass; a key or field no rank holds is named)."""
        held = self._where.get(partition_id, {}).get(field, {})
        try:
            return list(map(held.__getitem__, keys))
        except KeyError:
            for k in keys:
                self.location(k, field, partition_id)
            raise

    def num_keys(self) -> int:
        """Replicated tags plus values still held in this rank's local store (0 once a step is cleared)."""
        return sum(len(v) for v in self._tags.values()) + self.local.num_keys()

    def local_keys(self, keys: Sequence[str], partition_id: str, field: str) -> list[str]:
        """Those of ``keys`` whose ``field`` this rank holds, in order."""
        me = self.rank
        return [k for k, r in zip(keys, self._ranks_of(keys, partition_id, field)) if r == me]

    def read_local(self, keys: Sequence[str], partition_id: str, fields: Sequence[str]) -> TensorDict:
        """``fields`` of keys this rank holds, straight from its local store (no communication)."""
        return self.local.read_local(keys, partition_id, fields)

    # ---- collectives ------------------------------------------------------------------------------------
    def sync(self, also: Any = None) -> list[Any]:
        """Replicate the tags and value locations written since the last sync (all ranks call it).

        ``also`` (picklable) travels in the same round trip: every rank's ``also`` comes back, indexed by rank, so a
        small check that must happen here anyway costs no collective of its own."""
        pending, self._pending = self._pending, []
        if self.world == 1:
            return [also]
        gathered = gather_objects((pending, also), group=self.group, device=self.device)
        for src, (updates, _) in enumerate(gathered):
            if src == self.rank:
                continue
            for update in updates:
                self._apply(src, update)
        return [extra for _, extra in gathered]

    def sync_planned(self, writes: Sequence[Sequence[str]], partition_id: str, fields: Sequence[str]) -> None:
        """:meth:`sync` of one put that every rank knows of, without communication: rank ``r`` wrote ``fields``
        (values, no tags) of ``writes[r]`` (the same lists on every rank: from the replicated plan or locations).

        Every rank calls it. This rank's own entry must be exactly one of its unsynced puts (none when its list is
        empty), which it takes off the pending list; the peers' entries are recorded as their writes. So when every
        rank passes its own check, what each rank records is what every rank wrote."""
        writes, fields = [list(w) for w in writes], list(fields)
        if len(writes) != self.world:
            raise ValueError(f"sync_planned: {len(writes)} key lists for {self.world} ranks (one per rank)")
        own, wrote = writes[self.rank], sorted(fields)
        at = [i for i, (p, ks, tags, names) in enumerate(self._pending)
              if p == partition_id and tags is None and ks == own and sorted(names) == wrote]
        others = [i for i, (p, _, _, names) in enumerate(self._pending)
                  if p == partition_id and i not in at and set(names) & set(fields)]
        if len(at) != (1 if own else 0) or others:
            raise DataPlaneError(
                f"sync_planned: this rank's unsynced puts of partition {partition_id!r} are not the one put of "
                f"{fields} to its {len(own)} planned key(s): "
                f"{[(len(ks), names) for p, ks, _, names in self._pending if p == partition_id]}")
        self._pending = [put for i, put in enumerate(self._pending) if i not in at]
        for src, keys in enumerate(writes):
            if src != self.rank and keys:
                self._apply(src, (partition_id, keys, None, fields))

    def fetch(self, keys: Sequence[str], partition_id: str, fields: Sequence[str]) -> TensorDict:
        """Collective: every rank gets the ``fields`` of its own ``keys`` (possibly none), in the order asked."""
        keys, fields = list(keys), list(fields)
        held_here = self._holders(partition_id, keys, fields)  # fails before the collective, naming the culprit
        mine = (partition_id, keys, fields)
        requests = gather_objects(mine, group=self.group, device=self.device) if self.world > 1 else [mine]
        served = [held_here if dst == self.rank else self._holders(part, want, names)
                  for dst, (part, want, names) in enumerate(requests)]
        return self._serve(requests, served, exchange=True)

    def fetch_planned(self, wants: Sequence[Sequence[str]], partition_id: str, fields: Sequence[str]) -> TensorDict:
        """Collective :meth:`fetch` when every rank knows what every rank asks: ``wants[r]`` are rank ``r``'s keys,
        the same lists on every rank (from the replicated plan or locations). No request travels, and when every
        rank holds all it asks for nothing does: the values are read in place. Returns this rank's fields.

        A rank whose ``wants`` differ from a peer's gets a :class:`DataPlaneError` for the values it received."""
        wants, fields = [list(w) for w in wants], list(fields)
        if len(wants) != self.world:
            raise ValueError(f"fetch_planned: {len(wants)} key lists for {self.world} ranks (one per rank)")
        served = [self._holders(partition_id, want, fields) for want in wants]  # every rank raises the same error
        moves = any(src != dst for dst, held in enumerate(served) for src in held)  # the same on every rank
        return self._serve([(partition_id, want, fields) for want in wants], served, exchange=moves)

    def _serve(self, requests: list[tuple[str, list[str], list[str]]], served: list[dict[int, dict[str, list[str]]]],
               exchange: bool) -> TensorDict:
        """Send each rank what it asked (``requests[dst]``) of the values held here (``served[dst]``: its holders,
        as :meth:`_holders`), receive this rank's, and join them in the order asked."""
        me = self.rank
        partition_id, keys, fields = requests[me]
        held_here = served[me]
        # a field this rank holds for every key is read in place below; what other ranks asked for is packed
        whole = [f for f, ks in held_here.get(me, {}).items() if len(ks) == len(keys)]
        outgoing: list[dict | None] = [None] * self.world
        for dst, (part, _, _) in enumerate(requests):
            if dst != me:
                outgoing[dst] = self._packed(served[dst].get(me, {}), part, digests=True)

        # each field's senders in rank order (this rank among them) and the key list asked of each
        senders = {f: [(src, held[f]) for src, held in sorted(held_here.items()) if f in held]
                   for f in fields if f not in whole}

        def local() -> tuple[dict | None, TensorDict | None, dict[int, int], dict[tuple[int, ...], np.ndarray]]:
            """What needs no peer, done while the peers' values travel: this rank's own values of its keys, the
            digest of each key list asked of a peer, and the permutation of each set of lists a join lays end to
            end (fields sent in the same lists share one)."""
            own = {f: ks for f, ks in held_here.get(me, {}).items() if f not in whole}
            read = self.local.kv_batch_get(keys, partition_id, select_fields=whole) if keys and whole else None
            digests = {id(ks): key_digest(ks) for src, held in held_here.items() if src != me for ks in held.values()}
            orders = {}
            for lists in senders.values():
                layout = tuple(id(ks) for _, ks in lists)
                if len(lists) > 1 and layout not in orders:
                    orders[layout] = _positions(keys, [ks for _, ks in lists])
            return self._packed(own, partition_id, digests=False), read, digests, orders

        # nothing moves: what is addressed to other ranks is empty, and this rank's own part is all it gets
        received, (own, read, digests, orders) = self._exchange(outgoing, local) if exchange else (outgoing, local())
        received[me] = own
        if not keys:
            return TensorDict({}, batch_size=[0])
        out = dict.fromkeys(fields)
        if whole:
            out.update({f: _as_joined(read.get(f)) for f in whole})
        # the sender's key order is known here (replicated locations), so only tensors travelled
        for f, lists in senders.items():
            sent = []
            for src, ks in lists:
                payload = received[src]
                if payload is None or f not in payload:
                    raise DataPlaneError(f"rank {src} sent nothing for field {f!r} of {len(ks)} key(s) it holds")
                values, offsets, digest = payload[f]
                if src != me and digest != digests[id(ks)]:
                    raise DataPlaneError(f"field {f!r}: rank {src} sent the values of other keys than the {len(ks)} "
                                         f"this rank asked of it (the ranks' requests or locations differ)")
                sent.append((ks, values, offsets))
            out[f] = _join(f, keys, sent, orders.get(tuple(id(ks) for _, ks in lists)))
        return batch_of(out, len(keys))

    def _packed(self, by_field: dict[str, list[str]], partition_id: str, digests: bool) -> dict | None:
        """The values of ``by_field`` (field -> keys) held here, packed for a transfer (one read per key list: fields
        held together share one); each with the digest of its keys when it goes to a peer (None: nothing asked)."""
        reads: dict[int, tuple[list[str], list[str]]] = {}
        for f, ks in by_field.items():
            reads.setdefault(id(ks), (ks, []))[1].append(f)
        packed = {}
        for ks, names in reads.values():
            digest = key_digest(ks) if digests else None  # the receiver checks it asked for these keys
            packed.update({f: (*parts, digest)
                           for f, parts in self.local.kv_batch_get_packed(ks, partition_id, names).items()})
        return {f: packed[f] for f in by_field} if packed else None

    def split_by_holder(self, keys: Sequence[str], partition_id: str, field: str) -> list[list[str]]:
        """``keys`` split by the rank holding ``field`` (index = rank), each share in order; the same on every rank."""
        out: list[list[str]] = [[] for _ in range(self.world)]
        for k, r in zip(keys, self._ranks_of(keys, partition_id, field)):
            out[r].append(k)
        return out

    def _holders(self, partition_id: str, keys: Sequence[str], fields: Sequence[str]
                 ) -> dict[int, dict[str, list[str]]]:
        """Rank -> field -> those of ``keys`` whose value of the field that rank holds, in the order of ``keys``."""
        out: dict[int, dict[str, list[str]]] = {}
        seen: list[tuple[list[int], dict[int, list[str]]]] = []  # fields written together share one split
        for f in fields:
            ranks = self._ranks_of(keys, partition_id, f)
            split = next((sp for known, sp in seen if known == ranks), None)
            if split is None:
                held = set(ranks)
                if len(held) == 1:  # the common case: one rank holds the field of every key
                    split = {ranks[0]: list(keys)}
                else:
                    split = {r: list(itertools.compress(keys, map(r.__eq__, ranks))) for r in sorted(held)}
                seen.append((ranks, split))
            for r, ks in split.items():
                out.setdefault(r, {})[f] = ks
        return out

    # ---- internals --------------------------------------------------------------------------------------
    def _apply(self, src: int, update: tuple[str, list[str], list[dict] | None, list[str]]) -> None:
        """Record ``src``'s write; a peer's tags arrive unpickled (objects no one else holds) and are kept as they
        are, this rank's own are copied (its pending list keeps the originals until the next sync)."""
        partition_id, keys, tags, names = update
        view = self._tags[partition_id]
        own = src == self.rank
        if tags is None:
            for key in keys:
                view.setdefault(key, {})
        else:
            for key, tag in zip(keys, tags):
                known = view.get(key)
                if known is None:
                    view[key] = dict(tag) if own else tag
                else:
                    known.update(tag)
        if names:
            where, at = self._where[partition_id], dict.fromkeys(keys, src)
            for f in names:
                held = where.get(f)
                if held is None:
                    where[f] = dict(at)
                else:
                    held.update(at)

    def _exchange(self, outgoing: list[dict | None], meanwhile: Callable[[], Any]) -> tuple[list[dict | None], Any]:
        """Send ``outgoing[dst]`` to each peer; return what each peer sent here (index = source; None for this rank)
        and what ``meanwhile()`` returns: it runs once the transfers are posted, so local work overlaps them."""
        received: list[dict | None] = [None] * self.world
        if self.world == 1:
            return received, meanwhile()
        if self._gloo:
            return self._exchange_framed(outgoing, received, meanwhile)
        blobs = [_encode(p) if (p is not None and dst != self.rank) else None for dst, p in enumerate(outgoing)]
        sizes = torch.tensor([0 if b is None else b.numel() for b in blobs], dtype=torch.int64, device=self.device)
        matrix = [torch.zeros_like(sizes) for _ in range(self.world)]
        dist.all_gather(matrix, sizes, group=self.group)
        ops, inbox = [], {}
        for src in range(self.world):
            n = int(matrix[src][self.rank])
            if src != self.rank and n:
                inbox[src] = torch.empty(n, dtype=torch.uint8, device=self.device)
                ops.append(dist.P2POp(dist.irecv, inbox[src], global_rank(self.group, src), group=self.group))
        for dst, blob in enumerate(blobs):
            if blob is not None:
                ops.append(dist.P2POp(dist.isend, blob.to(self.device), global_rank(self.group, dst),
                                      group=self.group))
                self.bytes_sent += blob.numel()
        reqs = dist.batch_isend_irecv(ops) if ops else []
        try:
            done = meanwhile()
        finally:  # the transfers complete whatever the local work did
            for req in reqs:
                req.wait()
        for src, buf in inbox.items():
            self.bytes_received += buf.numel()
            received[src] = _decode(buf.cpu())
        return received, done

    def _exchange_framed(self, outgoing: list[dict | None], received: list[dict | None], meanwhile: Callable[[], Any]
                         ) -> tuple[list[dict | None], Any]:
        """:meth:`_exchange` without telling sizes first (:func:`exchange_frames`): every rank sends every other
        rank one frame (8 bytes when it sends nothing), the first :func:`first_part_bytes` of it at once, a longer
        frame's rest as a second part. So a fetch that moves little takes one round trip after its request, not two."""
        frames = {dst: _frame(outgoing[dst]) for dst in range(self.world) if dst != self.rank}
        got, done = exchange_frames(frames, first_part_bytes(self.world), self.group, meanwhile)
        self.bytes_sent += sum(f.numel() - _ALIGN for f in frames.values())
        for src, msg in got.items():
            if msg.numel() > _ALIGN:  # a frame of 8 bytes carries nothing
                self.bytes_received += msg.numel() - _ALIGN
                received[src] = _decode(msg[_ALIGN:])
        return received, done

