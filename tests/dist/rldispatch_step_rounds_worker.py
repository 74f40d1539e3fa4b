"""torchrun worker (2 ranks): the collectives each non-model stage of a real step takes, at two batch sizes.

Every collective the step's code starts is counted by stage; each rank writes its counts to ``rounds<rank>.json`` in
the work folder (argv[1]) for tests/rldispatch/test_step_complexity.py to check.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
COUNTED = ("all_gather", "all_reduce", "broadcast", "all_gather_object", "batch_isend_irecv", "all_to_all_single")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("bench_step_overhead", REPO / "scripts" / "bench_step_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stage, counts = ["-"], {}
    for name in COUNTED:  # the data plane calls these through the module, so the wrappers see every call
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            if stage[0] != "-":
                counts.setdefault(stage[0], Counter())[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    barrier = dist.barrier
    work = Path(sys.argv[1])
    out = {}
    for size in (64, 256):
        t = bench.build_trainer(size, rank, world, work / f"n{size}")
        t.gc.start()
        bench.one_step(t, 0)
        counts.clear()

        def on_stage(name: str) -> None:
            stage[0] = name

        bench.one_step(t, 1, on_stage=on_stage)
        stage[0] = "-"
        t.gc.stop()
        t.metrics.close()
        out[size] = {k: dict(v) for k, v in counts.items()}
        barrier()
    (work / f"rounds{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
