"""The step's small collectives: Python objects and a few scalars, in as few round trips as the data allows.

A GRPO step exchanges metadata between ranks a dozen times (tag syncs, fetch requests, metrics). Each round trip
costs a fixed latency, which at small batches is most of the step's overhead, so these helpers take one round
trip where ``torch.distributed``'s own take two.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["INLINE_BYTES", "INLINE_TOTAL", "inline_bytes", "gather_objects", "key_digest", "check_digests"]

#: Pickled bytes an object may always have to travel with its size in the first round trip (larger: a second).
INLINE_BYTES = 16384
#: Up to this many bytes in all travel in the first round trip, shared by the ranks: a small world inlines more
#: (an all-gather of 64 KiB per rank costs about what one of 16 KiB does on 2 ranks; a round trip costs more).
INLINE_TOTAL = 131072


def inline_bytes(world: int) -> int:
    """Pickled bytes each of ``world`` ranks sends with its size in :func:`gather_objects`' first all-gather."""
    return max(INLINE_BYTES, INLINE_TOTAL // max(world, 1))
_HEAD = 8  # the int64 byte count in front of each rank's inline bytes


def gather_objects(obj: Any, group: Any = None, device: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, indexed by group rank (this rank's entry is ``obj`` itself).

    Like ``all_gather_object`` but with one all-gather instead of two while every rank's pickle fits in
    :func:`inline_bytes` of the world: each rank sends its byte count and its bytes together. A larger object
    anywhere takes a second all-gather of every rank's bytes. ``device``: where the tensors travel (a GPU under NCCL).
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    inline = inline_bytes(world)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
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

