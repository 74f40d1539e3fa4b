"""Benchmark: peak RSS per rank and step time of a LoRA actor against full fine-tuning (FSDP2 or Megatron, CPU ranks).

Each mode runs in its own torchrun launch (so each rank's peak RSS is that mode's alone) on a Hugging Face folder,
with what a GRPO step keeps in memory: the actor engine, the reference (full fine-tuning: a second frozen engine;
LoRA: the actor with adapters off, no second model) and the rollout's model copy, which takes the actor's full
(merged) weights after every update. A step is: reference log-probs, old log-probs, one AdamW update with a KL
loss, weight sync to the rollout copy, on random token sequences.

    OMP_NUM_THREADS=1 python scripts/bench_lora.py --model /work/models/smollm2 --steps 2 --out runs/bench_lora.json
    OMP_NUM_THREADS=1 python scripts/bench_lora.py --model /work/models/smollm2 --backend megatron --tp 2 \
        --out runs/bench_lora_megatron.json

On Megatron the full fine-tuning reference is the actor's own model with the frozen initial weights swapped in
(the engine keeps one megatron-core parallel state per process), so it holds a full weight copy, not a second
engine; with LoRA it is the actor with adapters off.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from backends.base import Share, get_engine_class  # noqa: E402
from backends.config import EngineConfig, LoraConfig, MegatronConfig, OptimConfig, PolicyLossConfig  # noqa: E402
from protocol.batch.nested import to_nested  # noqa: E402

MODES = ("full", "lora")


def _rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _batch(n: int, prompt: int, response: int, vocab: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, vocab, (prompt + response,), generator=g) for _ in range(n)]
    lp = [-torch.rand(response, generator=g) * 3 - 1 for _ in range(n)]
    return TensorDict({"input_ids": to_nested(ids), "response_mask": to_nested([torch.ones(response, dtype=torch.long)
                                                                                 for _ in range(n)]),
                       "old_log_probs": to_nested(lp), "ref_log_prob": to_nested([x - 0.01 for x in lp]),
                       "advantages": to_nested([torch.randn(response, generator=g) for _ in range(n)])},
                      batch_size=[n])


def worker(args) -> None:
    from backends.model.hf import read_hf_config
    from backends.model.llama import LlamaModel
    from rldispatch.ref import build_reference

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = read_hf_config(args.model)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank) if args.mode == "lora" else LoraConfig()
    ec = EngineConfig(model=cfg, optim=OptimConfig(name="adamw", lr=1e-5), seed=0, lora=lora,
                      loss=PolicyLossConfig(use_kl_loss=True), megatron=MegatronConfig(tp=args.tp))
    topo = None
    if args.backend == "megatron":
        from dispatch.topology import Topology

        topo = Topology.from_config(ec.megatron, dist.get_world_size())
    rss0 = _current_rss_mib()
    t0 = time.perf_counter()
    engine_cls = get_engine_class(args.backend)
    actor = engine_cls(ec, topo)
    ref = build_reference(args.backend, engine_cls, ec, topo, actor)
    sampler = LlamaModel(cfg)  # the rollout's copy of the policy (every rank, as each DP replica generates)
    sampler.requires_grad_(False)
    build_s = time.perf_counter() - t0
    modules = actor.chunks if args.backend == "megatron" else [actor.model]
    trainable = sum(p.numel() for m in modules for p in m.parameters() if p.requires_grad)
    total = sum(p.numel() for m in modules for p in m.parameters())  # megatron: this rank's shard
    mbs = [list(range(i, min(args.samples, i + args.micro))) for i in range(0, args.samples, args.micro)]
    stages: dict[str, list[float]] = {k: [] for k in ("ref", "old", "update", "sync", "step")}
    for step in range(args.warmup + args.steps):
        share = Share(_batch(args.samples, args.prompt, args.response, cfg.vocab_size, 100 * step + rank), mbs)
        dist.barrier()
        marks = [time.perf_counter()]
        ref.infer_batch(share)
        marks.append(time.perf_counter())
        actor.infer_batch(share)
        marks.append(time.perf_counter())
        actor.train_batch(share)
        marks.append(time.perf_counter())
        sampler.load_state_dict(actor.get_weights())
        dist.barrier()
        marks.append(time.perf_counter())
        for key, a, b in zip(("ref", "old", "update", "sync"), marks, marks[1:]):
            stages[key].append(b - a)
        stages["step"].append(marks[-1] - marks[0])
    result = {"rank": rank, "mode": args.mode, "backend": args.backend, "tp": args.tp, "peak_rss_mib": _rss_mib(), "rss_before_mib": rss0,
              "build_s": build_s, "trainable_params": trainable, "params": total,
              "second_model": type(ref).__name__ != "AdapterFreeReference",
              **{f"{k}_s": statistics.median(v[args.warmup:]) for k, v in stages.items()}}
    with open(os.path.join(args.result_dir, f"{args.mode}_rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local Hugging Face folder (e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", choices=("fsdp", "megatron"), default="fsdp")
    ap.add_argument("--tp", type=int, default=1, help="megatron: tensor-parallel degree (the rest is DP)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank, all projections)")
    ap.add_argument("--samples", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="runs/bench_lora.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                   "--master_addr=127.0.0.1", f"--master_port={_free_port()}", __file__, "--worker", "--mode", mode,
                   "--result-dir", tmp, "--model", args.model, "--rank", str(args.rank),
                   "--backend", args.backend, "--tp", str(args.tp),
                   "--samples", str(args.samples), "--micro", str(args.micro), "--prompt", str(args.prompt),
                   "--response", str(args.response), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                   "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
            subprocess.run(cmd, check=True, env=env)
            rows += [json.load(open(os.path.join(tmp, f"{mode}_rank{r}.json"))) for r in range(args.nproc)]
    print(f"\nbackend {args.backend}" + (f" (tp={args.tp})" if args.backend == "megatron" else ""))
    print(f"{'mode':<6}{'rank':>5}{'trainable':>12}{'2nd model':>10}{'peak RSS MiB':>14}{'step s':>9}"
          f"{'ref s':>8}{'old s':>8}{'update s':>10}{'sync s':>8}{'build s':>9}")
    for r in rows:
        print(f"{r['mode']:<6}{r['rank']:>5}{r['trainable_params']:>12,}{'yes' if r['second_model'] else 'no':>10}"
              f"{r['peak_rss_mib']:>14.0f}{r['step_s']:>9.2f}{r['ref_s']:>8.2f}{r['old_s']:>8.2f}{r['update_s']:>10.2f}"
              f"{r['sync_s']:>8.2f}{r['build_s']:>9.1f}")
    by = {m: [r for r in rows if r["mode"] == m] for m in MODES}
    summary = {}
    if by["full"] and by["lora"]:
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        summary = {"rss_ratio_lora_over_full": mean(by["lora"], "peak_rss_mib") / mean(by["full"], "peak_rss_mib"),
                   "step_ratio_lora_over_full": mean(by["lora"], "step_s") / mean(by["full"], "step_s"),
                   "update_ratio_lora_over_full": mean(by["lora"], "update_s") / mean(by["full"], "update_s")}
        print("LoRA / full: " + ", ".join(f"{k} = {v:.2f}" for k, v in summary.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "mode", "result_dir")},
                   "rows": rows, "summary": summary, "torch": torch.__version__}, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
