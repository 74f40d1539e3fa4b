"""torchrun worker: distributed_masked_stats over 2 ranks equals masked_stats over the union."""
import math

import torch
import torch.distributed as dist

from rldispatch.metrics import MetricsError, distributed_masked_stats, masked_stats


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
    dist.barrier()
    print("OK", rank)


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
