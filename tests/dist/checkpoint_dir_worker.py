"""2-rank worker: both engines save twice into one folder cleanly, refuse a foreign folder, and stay quiet.

With the project's known-warnings filter installed first (as ``rldispatch train`` does), builds a megatron engine
(DP=2, distributed optimizer) and an FSDP engine, takes a step, saves, plants a stale shard file, saves again into
the same folder and loads it back; a folder holding a file no checkpoint writes is refused on every rank and left
as it was; a megatron TP=2 engine takes one step. Every warning and every log record at WARNING or above is recorded from the first import on; the worker
fails when any was emitted. Prints one ``OK <check>`` line per passed check.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_caught = warnings.catch_warnings(record=True)
WARNED = _caught.__enter__()  # kept open for the whole run: what the console would show is recorded instead

from rldispatch.known_warnings import install  # noqa: E402

install()  # as rldispatch train does, in front of the interpreter's default filters


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


LOGGED = _Records()
logging.getLogger().addHandler(LOGGED)
logging.getLogger("torch").addHandler(LOGGED)  # torch's loggers do not propagate to the root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron_common import MODEL, MegatronConfig, engine_config, make_samples, share_of, topology  # noqa: E402

from backends.checkpoint_dir import NotACheckpointDir  # noqa: E402
from backends.config import EngineConfig, FSDPConfig, OptimConfig  # noqa: E402
from dispatch.topology import Topology  # noqa: E402

N = 8


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def positions(topo) -> list[int]:
    return list(range(topo.dp_rank(dist.get_rank()), N, topo.dp_size))


def shared_tmpdir() -> str:
    holder = [tempfile.mkdtemp(prefix="ckdir_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def save_twice_and_load(eng, share, path: str, name: str) -> None:
    """Save, plant a stale file, save again into the same folder: the stale file is gone and the load round-trips."""
    eng.train_batch(share)
    eng.save_checkpoint(path, {"global_steps": 1})
    first = sorted(os.listdir(path))
    dist.barrier()  # every rank has listed the folder before rank 0 plants the stale file
    if dist.get_rank() == 0:
        open(os.path.join(path, "__9_9.distcp"), "wb").close()  # what a save from a larger world would leave
    dist.barrier()
    eng.save_checkpoint(path, {"global_steps": 1})
    second = sorted(os.listdir(path))
    assert second == first, (name, first, second)
    weights = eng.get_weights()
    eng.train_batch(share)
    extra = eng.load_checkpoint(path)
    assert extra == {"global_steps": 1}, extra
    back = eng.get_weights()
    diff = max(float((back[k] - weights[k]).abs().max()) for k in weights)
    assert diff == 0.0, (name, diff)
    log(f"OK {name} save twice into one folder: {len(first)} entries, stale file removed, load == saved")


def refuses_foreign(eng, path: str, name: str) -> None:
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "notes.txt"), "w") as f:
            f.write("mine")
    dist.barrier()
    try:
        eng.save_checkpoint(path, {})
    except NotACheckpointDir as exc:
        assert "notes.txt" in str(exc) and "trainer.run_dir" in str(exc), str(exc)
    else:
        raise AssertionError(f"{name}: a save into a folder holding notes.txt did not raise")
    assert sorted(os.listdir(path)) == ["notes.txt"], os.listdir(path)
    dist.barrier()
    log(f"OK {name} refuses a folder holding foreign files, on every rank, and leaves it untouched")


def main() -> None:
    dist.init_process_group("gloo")
    root = shared_tmpdir()
    data = make_samples(N, seed=5)

    from backends.megatron.engine import MegatronEngine

    par = MegatronConfig(tp=1, use_distributed_optimizer=True)
    topo = topology(par, dist.get_world_size())
    eng = MegatronEngine(engine_config(par), topo)
    save_twice_and_load(eng, share_of(data, positions(topo), 2), os.path.join(root, "meg", "step_1"),
                        "megatron dp=2 dist_opt")
    refuses_foreign(eng, os.path.join(root, "meg_foreign"), "megatron")
    eng.close()
    tp2 = MegatronConfig(tp=2, use_distributed_optimizer=True)  # TP > 1 adds megatron-core's TP-layer warnings
    ttopo = topology(tp2, dist.get_world_size())
    teng = MegatronEngine(engine_config(tp2), ttopo)
    teng.train_batch(share_of(data, positions(ttopo), 2))
    teng.close()
    log("OK megatron tp=2 step")

    from backends.fsdp.engine import FSDPEngine

    ftopo = Topology.from_config({"backend": "fsdp", "ulysses_sp": 1, "fsdp_size": -1}, dist.get_world_size())
    feng = FSDPEngine(EngineConfig(model=MODEL, fsdp=FSDPConfig(),
                                   optim=OptimConfig(name="adamw", lr=0.01, eps=1e-3), seed=3), ftopo)
    save_twice_and_load(feng, share_of(data, positions(ftopo), 2), os.path.join(root, "fsdp", "step_1"), "fsdp dp=2")
    refuses_foreign(feng, os.path.join(root, "fsdp_foreign"), "fsdp")

    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(root)
    noisy = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in WARNED] + LOGGED.records
    assert not noisy, "warnings or log lines emitted:\n" + "\n".join(noisy)
    log("OK quiet: no warning and no log line at WARNING or above on this rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # a failed check on one rank must end the launch, not leave the other in a collective
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
