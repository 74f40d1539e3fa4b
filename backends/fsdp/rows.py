"""Which rows of a parameter this rank holds: FSDP2's dim-0 sharding, read from a DTensor's placements."""
from __future__ import annotations

__all__ = ["local_rows"]


def local_rows(param) -> tuple[int, int]:
    """The global row range ``[start, stop)`` along dim 0 that this rank holds of ``param``.

    FSDP2 shards dim 0 like ``torch.chunk`` over each ``Shard(0)`` mesh axis (chunks of ``ceil(rows / n)``, the
    last ones shorter or empty); ``Replicate`` axes (HSDP) hold every row. A plain tensor holds all its rows.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return 0, int(param.shape[0])
    coord = param.device_mesh.get_coordinate()
    start, length = 0, int(param.shape[0])
    for axis, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or placement.dim != 0:
            raise ValueError(f"parameter placement {placement} is not supported (FSDP shards dim 0 only)")
        n = param.device_mesh.size(axis)
        chunk = -(-length // n)
        lo = min(coord[axis] * chunk, length)
        hi = min(lo + chunk, length)
        start, length = start + lo, hi - lo
    return start, start + length
