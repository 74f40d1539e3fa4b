"""Peak resident memory per rank while the FSDP engine starts from a Hugging Face checkpoint, vs the checkpoint size.

    python scripts/bench_load.py                       # ~0.6 GB fp32 checkpoint, 2 ranks
    python scripts/bench_load.py --hidden 2048 --layers 16 --world 4 --json bench_load.json

Writes a random Llama-layout checkpoint (safetensors, split into several files with model.safetensors.index.json),
then under torchrun measures on every rank the growth of peak RSS (``ru_maxrss``) from just before the model is built
to just after it holds its weights, for two ways of building it:

* ``meta``: the engine's way — meta-device model, ``fully_shard``, each rank reads only its own rows;
* ``full``: every rank materialises the whole checkpoint and the whole model, then shards it (the former way).

Prints a table (MB and the ratio to the checkpoint size) and writes the numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _rss_mb() -> tuple[float, float]:
    """(peak RSS, current RSS) of this process in MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as fh:
        current = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return peak, current


def worker(mode: str, checkpoint: str, out_dir: str) -> None:
    """One rank: build the sharded model from ``checkpoint`` the ``mode`` way; write its RSS figures as JSON."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from backends.config import EngineConfig
    from backends.fsdp.engine import FSDPEngine
    from backends.model.hf import initial_model, read_hf_config

    dist.init_process_group("gloo")
    cfg = read_hf_config(checkpoint)
    dist.barrier()
    before, _ = _rss_mb()
    if mode == "meta":
        engine = FSDPEngine(EngineConfig(model=cfg))
        local = sum(p.to_local().numel() * p.element_size() for p in engine.model.parameters())
    else:
        model = initial_model(cfg, 0)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    peak, current = _rss_mb()
    rank = dist.get_rank()
    Path(out_dir, f"{mode}_rank{rank}.json").write_text(json.dumps(
        {"mode": mode, "rank": rank, "world": dist.get_world_size(), "rss_before_mb": before, "peak_mb": peak,
         "current_mb": current, "local_params_mb": local / 2**20}))
    dist.barrier()
    dist.destroy_process_group()


def write_checkpoint(path: Path, args: argparse.Namespace) -> float:
    """A random checkpoint of the requested size in ``path``; returns its weight bytes in MB."""
    import torch

    from backends.model.config import ModelConfig
    from backends.model.hf_export import save_hf_checkpoint
    from backends.model.llama import LlamaModel

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_layers=args.layers, num_heads=max(1, args.hidden // 64),
                      num_kv_heads=max(1, args.hidden // 256), max_position_embeddings=4096)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaModel(cfg).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    save_hf_checkpoint(str(path), sd, cfg, max_shard_bytes=int(args.shard_mb * 2**20))
    return sum(t.numel() * t.element_size() for t in sd.values()) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shard-mb", type=float, default=200.0, help="size of each safetensors file")
    ap.add_argument("--json", default="bench_load.json")
    ap.add_argument("--worker", nargs=3, metavar=("MODE", "CHECKPOINT", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        size_mb = write_checkpoint(ckpt, args)
        files = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
        rows = []
        for mode in ("full", "meta"):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.world}",
                   "--master_addr=127.0.0.1", f"--master_port={29600 + os.getpid() % 300}", __file__,
                   "--worker", mode, str(ckpt), tmp]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                           stdout=subprocess.DEVNULL)
            rows += [json.loads(Path(tmp, f"{mode}_rank{r}.json").read_text()) for r in range(args.world)]
    print(f"checkpoint: {size_mb:.0f} MB fp32 in {len(files)} safetensors files; world {args.world}")
    print(f"{'mode':<5} {'rank':>4} {'local params MB':>15} {'peak RSS growth MB':>18} {'growth / checkpoint':>19}")
    for r in rows:
        r["growth_mb"] = r["peak_mb"] - r["rss_before_mb"]
        r["growth_over_checkpoint"] = r["growth_mb"] / size_mb
        print(f"{r['mode']:<5} {r['rank']:>4} {r['local_params_mb']:>15.0f} {r['growth_mb']:>18.0f} "
              f"{r['growth_over_checkpoint']:>19.2f}")
    Path(args.json).write_text(json.dumps({"checkpoint_mb": size_mb, "files": len(files), "world": args.world,
                                           "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                                           "ranks": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
