"""The step's small collectives: Python objects and a few scalars, in as few round trips as the data allows.

A GRPO step exchanges metadata between ranks a dozen times (tag syncs, fetch requests, metrics). Each round trip
costs a fixed latency, which at small batches is most of the step's overhead, so these helpers take one round
trip where ``torch.distributed``'s own take two.
"""
from __future__ import annotations

import functools
import hashlib
import pickle
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist


__all__ = ["INLINE_BYTES", "INLINE_TOTAL", "inline_bytes", "gather_objects", "global_rank", "frame", "exchange_frames",
           "key_digest", "check_digests"]

#: Pickled bytes an object may always have to travel with its size in the first round trip (larger: a second).
INLINE_BYTES = 16384
#: Up to this many bytes in all travel in the first round trip, shared by the ranks: a small world inlines more
#: (an all-gather of 64 KiB per rank costs about what one of 16 KiB does on 2 ranks; a round trip costs more).
INLINE_TOTAL = 131072


def inline_bytes(world: int) -> int:
    """Pickled bytes each of ``world`` ranks sends with its size in :func:`gather_objects`' first all-gather."""
    return max(INLINE_BYTES, INLINE_TOTAL // max(world, 1))
_HEAD = 8  # the int64 byte count in front of a rank's inline bytes (all-gather) or of a frame


def gather_objects(obj: Any, group: Any = None, device: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, indexed by group rank (this rank's entry is ``obj`` itself).

    Like ``all_gather_object`` but in one round trip while every rank's pickle fits in :func:`inline_bytes` of the
    world. Under gloo each rank sends its pickle straight to every peer (:func:`exchange_frames`: point-to-point
    messages of the pickle's own size, whose wait has no all-gather's latency tail); a larger pickle sends its rest
    as a second part. Elsewhere (NCCL) each rank sends its byte count and its bytes in one all-gather of a fixed
    size, and a larger object anywhere takes a second all-gather. ``device``: where the tensors travel (a GPU
    under NCCL).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    me = dist.get_rank(group)
    inline = inline_bytes(world)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if dist.get_backend(group) == "gloo":
        mine = frame([torch.frombuffer(bytearray(data), dtype=torch.uint8)])
        got, _ = exchange_frames({r: mine for r in range(world) if r != me}, _HEAD + inline, group)
        return [obj if src == me else pickle.loads(got[src][_HEAD:].numpy().tobytes()) for src in range(world)]
    head = np.zeros(_HEAD + inline, dtype=np.uint8)
    head[:_HEAD] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
    if len(data) <= inline:
        head[_HEAD:_HEAD + len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = _all_gather_bytes(head, world, group, device)
    sizes = [int(r[:_HEAD].view(np.int64)[0]) for r in rows]
    if max(sizes) <= inline:
        blobs = [r[_HEAD:_HEAD + n] for r, n in zip(rows, sizes)]
    else:
        padded = np.zeros(max(sizes), dtype=np.uint8)
        padded[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        blobs = [r[:n] for r, n in zip(_all_gather_bytes(padded, world, group, device), sizes)]
    return [obj if src == me else pickle.loads(blob.tobytes()) for src, blob in enumerate(blobs)]


def _all_gather_bytes(buf: np.ndarray, world: int, group: Any, device: Any) -> list[np.ndarray]:
    t = torch.from_numpy(buf)
    if device is not None:
        t = t.to(device)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    return [p.cpu().numpy() for p in parts]


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (point-to-point ops name peers by global rank)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def frame(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """One message for :func:`exchange_frames`: the CPU uint8 ``chunks`` behind the frame's own byte count (int64,
    the count included), so a receiver knows how much of its buffer holds the frame."""
    size = _HEAD + sum(c.numel() for c in chunks)
    return torch.cat([torch.tensor([size], dtype=torch.int64).view(torch.uint8), *chunks])


def exchange_frames(frames: Mapping[int, torch.Tensor], first: int, group: Any = None,
                    meanwhile: Callable[[], Any] | None = None) -> tuple[dict[int, torch.Tensor], Any]:
    """Under gloo, send every peer its :func:`frame` ``frames[peer]`` and receive each peer's frame; returns
    ({peer: its frame}, what ``meanwhile()`` returned).

    The first ``first`` bytes of each frame travel at once into a buffer of that size (gloo receives a shorter
    message into a longer buffer), so no size travels ahead; a longer frame sends its rest as a second part.
    ``meanwhile()`` runs once the first parts are posted, so local work overlaps the transfer; the transfers
    complete whatever it does."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [r for r in range(world) if r != me]
    to_global = functools.partial(global_rank, group)
    inbox = {src: torch.empty(first, dtype=torch.uint8) for src in peers}
    ops = [dist.P2POp(dist.irecv, inbox[src], to_global(src), group=group) for src in peers]
    ops += [dist.P2POp(dist.isend, frames[dst][:first], to_global(dst), group=group) for dst in peers]
    reqs = dist.batch_isend_irecv(ops) if ops else []
    try:
        done = meanwhile() if meanwhile is not None else None
    finally:
        for req in reqs:
            req.wait()
    totals = {src: int(inbox[src][:_HEAD].view(torch.int64)[0]) for src in peers}
    ops = []
    for src, total in totals.items():
        if total > first:  # the rest follows: received straight behind the first part
            whole = torch.empty(total, dtype=torch.uint8)
            whole[:first] = inbox[src]
            inbox[src] = whole
            ops.append(dist.P2POp(dist.irecv, whole[first:], to_global(src), group=group))
    ops += [dist.P2POp(dist.isend, frames[dst][first:], to_global(dst), group=group) for dst in peers
            if frames[dst].numel() > first]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return {src: inbox[src][:total] for src, total in totals.items()}, done


def key_digest(items: Sequence[str]) -> int:
    """An 8-byte digest of an ordered sequence of str without newlines (store keys): equal on two ranks only if,
    in practice, the sequences are."""
    return int.from_bytes(hashlib.sha256("\n".join(items).encode()).digest()[:8], "little", signed=True)


def check_digests(seen: Sequence[int], what: str, count: int) -> None:
    """Raise when the ranks' :func:`key_digest` values ``seen`` (indexed by rank) differ; ``count`` is how many items
    this rank digested. Every rank must plan from the same ordered keys; a divergence would silently train on wrong
    shares."""
    if len(set(seen)) > 1:
        differ = [r for r, d in enumerate(seen) if d != seen[0]]
        raise RuntimeError(f"{what} differs between ranks (rank {dist.get_rank()} holds {count} items; ranks "
                           f"{differ} disagree with rank 0); the replicated tag view is out of sync")

