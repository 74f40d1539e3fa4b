"""Collectives the engines share."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["allreduce_counts"]


def allreduce_counts(values: list[float], group=None, device: torch.device | str = "cpu") -> list[float]:
    """Sum a few scalars (token/sequence counts, metric sums) over ``group`` in one collective (float64).

    Without a process group (one process) the values come back as they are:

    >>> allreduce_counts([3, 0.5])
    [3.0, 0.5]
    """
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t.tolist()
