"""torchrun worker: distributed_masked_stats and StepStats over 2 ranks equal masked_stats over the union; the step's
small collectives (gather_objects, the key-order digests) give every rank the same answer."""
import math

import torch
import torch.distributed as dist

from backends.comm import allreduce_counts
from rldispatch.collectives import (INLINE_BYTES, INLINE_TOTAL, check_digests, gather_objects, global_rank,
                                    inline_bytes, key_digest)
from rldispatch.metrics import ComputeClock, MetricsError, StepStats, distributed_masked_stats, masked_stats


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(11, generator=gen) * 3 + 1
    pad = torch.rand(11, generator=gen) < 0.3
    split = [slice(0, 4), slice(4, 11)]
    mine = split[rank]
    got = distributed_masked_stats(values[mine], pad[mine], "r")
    want = masked_stats(values, pad, "r")
    for k in want:
        assert math.isclose(got[k], want[k], rel_tol=1e-9, abs_tol=1e-9), (k, got[k], want[k])
    # one rank with only padding still works
    only = torch.tensor([True] * 3) if rank == 0 else torch.tensor([False, True, False])
    vals = torch.tensor([100.0, 200.0, 300.0]) if rank == 0 else torch.tensor([1.0, 50.0, 3.0])
    got = distributed_masked_stats(vals, only, "r")
    assert got == {"r/mean": 2.0, "r/std": 1.0, "r/min": 1.0, "r/max": 3.0}, got
    # all padding everywhere is an error on every rank
    try:
        distributed_masked_stats(torch.ones(2), torch.ones(2, dtype=torch.bool), "r")
    except MetricsError as exc:
        assert "all 2 ranks" in str(exc)
    else:
        raise SystemExit("expected MetricsError")
    step_stats(rank, values, pad, split)
    compute_clock(rank)
    collectives(rank)
    dist.barrier()
    print("OK", rank)


def step_stats(rank: int, values: torch.Tensor, pad: torch.Tensor, split: list[slice]) -> None:
    """One reduce of many metrics equals one collective per metric; a name on one rank is that rank's alone."""
    mine = split[rank]
    s = StepStats()
    s.masked("r", values[mine], pad[mine])
    s.masked("only_mean", values[mine] * 2, pad[mine], keep=("mean",))
    s.sum("n", float((~pad[mine]).sum()))
    s.per_rank("bytes", 10.0 * (rank + 1))
    s.spread("t", 2.0 + 4.0 * rank)
    if rank == 1:
        s.masked("extra", torch.tensor([4.0, 6.0]))
        s.sum("late", 5.0)
    got = s.reduce()
    want = {**distributed_masked_stats(values[mine], pad[mine], "r"),
            "only_mean/mean": distributed_masked_stats(values[mine] * 2, pad[mine], "x")["x/mean"],
            "n": float((~pad).sum()), "bytes/rank0": 10.0, "bytes/rank1": 20.0, "bytes/max": 20.0,
            "t/max": 6.0, "t/mean": 4.0, "t/straggler_ratio": 1.5,
            "extra/mean": 5.0, "extra/std": 1.0, "extra/min": 4.0, "extra/max": 6.0, "late": 5.0}
    assert got == want, (got, want)  # the same floats: the same moments combined in the same rank order
    partial = StepStats()
    if rank == 0:
        partial.per_rank("bytes", 1.0)
    refused(partial, "ranks [1] did not record")  # a per-rank value one rank did not record
    partial = StepStats()
    if rank == 1:
        partial.spread("t", 1.0)
    refused(partial, "t: a per-rank value that ranks [0] did not record")
    padding = StepStats()
    padding.masked("p", torch.ones(2), torch.ones(2, dtype=torch.bool))
    refused(padding, "all 2 ranks")  # every sample is padding


def compute_clock(rank: int) -> None:
    """A rank blocked in a gloo collective while its peer computes counts (almost) none of that wait as compute."""
    clock = ComputeClock("cpu")
    dist.barrier()
    with clock.region("update"):
        if rank == 1:  # the straggler: a fixed amount of work (CPU-seconds do not grow with a loaded machine)
            a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
            for _ in range(300):
                a = torch.tanh(a @ a)
        dist.barrier()
    got = torch.tensor([clock.seconds["update"]] * 2, dtype=torch.float64)
    seen = [torch.zeros_like(got) for _ in range(2)]
    dist.all_gather(seen, got)
    waited, worked = float(seen[0][0]), float(seen[1][0])
    assert worked > 0.05 and waited < 0.25 * worked, (waited, worked)


def refused(stats: StepStats, fragment: str) -> None:
    """``stats.reduce()`` raises MetricsError naming ``fragment`` (on every rank)."""
    try:
        stats.reduce()
    except MetricsError as exc:
        assert fragment in str(exc), exc
    else:
        raise SystemExit(f"expected MetricsError mentioning {fragment!r}")


def collectives(rank: int) -> None:
    """Under gloo a small object takes one round trip and a large one on either rank two; each rank's own entry is
    its object."""
    small = {"rank": rank, "keys": [f"k{i}" for i in range(rank + 3)]}
    got = gather_objects(small)
    assert got == [{"rank": r, "keys": [f"k{i}" for i in range(r + 3)]} for r in range(2)], got
    assert got[rank] is small
    inline = inline_bytes(2)
    assert inline == max(INLINE_BYTES, INLINE_TOTAL // 2) and inline_bytes(64) == INLINE_BYTES
    # count the round trips: point-to-point batches under gloo; all-gathers on the NCCL path, taken here by letting
    # gather_objects see another backend name (the all-gather is gloo's)
    for counted_name, backend in (("batch_isend_irecv", "gloo"), ("all_gather", "nccl")):
        calls = []
        real, get_backend = getattr(dist, counted_name), dist.get_backend

        def counted(*args, _real=real, **kwargs):
            calls.append(1)
            return _real(*args, **kwargs)

        setattr(dist, counted_name, counted)
        dist.get_backend = lambda group=None, _name=backend: _name
        try:
            for size, trips in ((inline - 64, 1), (inline + 64, 2)):  # pickles just under and over the inline size
                big = bytes(range(256)) * (size // 256) if rank == 1 else b"x"
                calls.clear()
                got = gather_objects(big)
                assert got[0] == b"x" and got[1] == bytes(range(256)) * (size // 256) and len(calls) == trips, \
                    (backend, size, len(calls))
            assert gather_objects(None) == [None, None]
            assert gather_objects(b"") == [b"", b""]
        finally:
            setattr(dist, counted_name, real)
            dist.get_backend = get_backend
    assert gather_objects(None) == [None, None]
    sub = dist.new_group([0, 1])  # a group's framed exchange names its peers by global rank
    assert global_rank(sub, 1 - rank) == 1 - rank and global_rank(None, 1) == 1
    assert gather_objects(("sub", rank), group=sub) == [("sub", 0), ("sub", 1)]
    check_digests(gather_objects(key_digest(["a", "b"])), "keys", 2)
    assert key_digest(["a", "b"]) != key_digest(["b", "a"])
    try:
        check_digests(gather_objects(key_digest(["a", "b"] if rank == 0 else ["b", "a"])), "the step's key order", 2)
    except RuntimeError as exc:
        assert "the step's key order differs between ranks" in str(exc) and "ranks [1]" in str(exc), exc
    else:
        raise SystemExit("expected a divergence error on every rank")
    assert allreduce_counts([1.0 + rank, 0.25]) == [3.0, 0.5]


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
