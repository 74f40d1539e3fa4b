"""FSDP engine built from a Hugging Face checkpoint on the meta device: each rank's shards equal the checkpoint's."""
from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist

from backends.base import get_engine_class
from backends.config import EngineConfig, FSDPConfig
from backends.fsdp import checkpoint as ckpt
from backends.model.hf import load_hf_checkpoint, read_hf_config


def check(checkpoint: str, fsdp_size: int) -> None:
    cfg = read_hf_config(checkpoint)
    engine = get_engine_class("fsdp")(EngineConfig(model=cfg, fsdp=FSDPConfig(fsdp_size=fsdp_size)))
    want = load_hf_checkpoint(checkpoint).state_dict()
    got = engine.get_weights()
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"rank {dist.get_rank()}: weights differ from the checkpoint: {bad[:5]}"
    # every parameter is sharded: this rank's local rows are its chunk of the full tensor, nothing more
    for name, p in engine.model.named_parameters():
        start, stop = ckpt.local_rows(p)
        assert torch.equal(p.to_local(), want[name][start:stop]), name
    total = sum(t.numel() for t in want.values())
    local = sum(p.to_local().numel() for p in engine.model.parameters())
    shard_world = dist.get_world_size() if fsdp_size in (-1, dist.get_world_size()) else fsdp_size
    assert local <= -(-total // shard_world) + 64 * len(want), (local, total)
    if dist.get_rank() == 0:
        print(f"OK meta load {checkpoint} fsdp_size={fsdp_size} local={local} total={total} "
              f"maxrss_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+", help="CHECKPOINT:FSDP_SIZE ...")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    for spec in args.specs:
        path, size = spec.rsplit(":", 1)
        check(path, int(size))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
