"""GPU check of the megatron engine: transformer-engine layers in bf16, packed (THD) micro-batches, log-prob parity
with the project's reference model, and train-step time (context parallel is not implemented by the engine yet).

Run on the device machine (one process per GPU)::

    torchrun --nproc_per_node=$(nvidia-smi -L | wc -l) scripts/gpu_check_megatron.py --out runs/gpu_megatron.json

For every parallel layout that fits the GPU count (TP, PP, TPxPP, PP with VPP, each with the remaining
ranks as DP) it prints max / mean |log p_megatron - log p_reference| over all response tokens (the reference is
the plain-torch model in fp32; bf16 layers make ~1e-2 differences normal) and the mean time of a train step
on a larger model. Exits non-zero when a layout's max difference exceeds --tol.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from backends.base import Share  # noqa: E402
from backends.config import EngineConfig, MegatronConfig, OptimConfig  # noqa: E402
from protocol.algos.logprob import token_logprobs_and_entropy  # noqa: E402
from backends.megatron.engine import MegatronEngine  # noqa: E402
from backends.model.config import ModelConfig  # noqa: E402
from backends.model.llama import LlamaModel  # noqa: E402
from dispatch.topology import Topology  # noqa: E402
from protocol.batch.nested import to_nested  # noqa: E402
from tensordict import TensorDict  # noqa: E402

PARITY_MODEL = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                           num_kv_heads=4)
SPEED_MODEL = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                          num_kv_heads=8)


def layouts(world: int) -> list[MegatronConfig]:
    """Parallel layouts that fit ``world`` GPUs (remaining ranks become DP)."""
    out = [MegatronConfig()]
    for tp, pp, vpp, cp in ((2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1)):
        if world % (tp * pp * cp) == 0 and tp * pp * cp <= world:
            out.append(MegatronConfig(tp=tp, pp=pp, vpp=vpp, cp=cp))
    return out


def samples(n: int, vocab: int, seed: int, max_prompt: int = 64, max_resp: int = 192) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids, masks, old, adv = [], [], [], []
    for _ in range(n):
        p = int(torch.randint(1, max_prompt, (1,), generator=g))
        r = int(torch.randint(1, max_resp, (1,), generator=g))
        ids.append(torch.randint(0, vocab, (p + r,), generator=g))
        masks.append(torch.ones(r, dtype=torch.long))
        old.append(-torch.rand(r, generator=g) * 3)
        adv.append(torch.randn(r, generator=g))
    return TensorDict({"input_ids": to_nested(ids), "response_mask": to_nested(masks),
                       "old_log_probs": to_nested(old), "advantages": to_nested(adv)}, batch_size=[n])


def reference(model_cfg: ModelConfig, data: TensorDict, seed: int) -> list[torch.Tensor]:
    model = LlamaModel.from_seed(model_cfg, seed).cuda()
    ids = data["input_ids"]
    off = ids.offsets()
    pos = torch.cat([torch.arange(int(l)) for l in off.diff()])
    rl = data["response_mask"].offsets().diff()
    with torch.no_grad():
        logits = model(ids.values().cuda(), pos.cuda(), off.to(torch.int32).cuda())
        lp, _ = token_logprobs_and_entropy(logits, ids.values().cuda(), off.to(torch.int32).cuda(), rl)
    return [t.cpu() for t in torch.split(lp, rl.tolist())]


def my_share(data: TensorDict, topo: Topology, n_micro: int) -> tuple[Share, list[int]]:
    dp, size = topo.dp_rank(dist.get_rank()), topo.dp_size
    pos = list(range(dp, data.batch_size[0], size))
    per = -(-len(pos) // n_micro)
    mbs = [list(range(i, min(i + per, len(pos)))) for i in range(0, len(pos), per)]
    return Share(data[pos], mbs), pos


def gather(out, pos: list[int]) -> dict[int, torch.Tensor]:
    mine = {p: v.cpu() for p, v in zip(pos, out["log_probs"].unbind())} if out is not None else {}
    parts: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, mine)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON to this file (rank 0)")
    ap.add_argument("--tol", type=float, default=0.1, help="max |log p| difference allowed in bf16")
    ap.add_argument("--steps", type=int, default=5, help="timed train steps per layout")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check_megatron: no CUDA device; run the CPU tests instead (tests/backends/test_megatron*.py)")
        return 2
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world, rank = dist.get_world_size(), dist.get_rank()
    results, failed = [], False
    data = samples(16, PARITY_MODEL.vocab_size, seed=0)
    ref = reference(PARITY_MODEL, data, seed=3)
    for par in layouts(world):
        name = f"tp{par.tp}-pp{par.pp}-vpp{par.vpp}-cp{par.cp}"
        topo = Topology.from_config({"backend": "megatron", "tp": par.tp, "pp": par.pp, "vpp": par.vpp,
                                     "cp": par.cp}, world)
        cfg = EngineConfig(model=PARITY_MODEL, megatron=par, optim=OptimConfig(lr=1e-5), seed=3)
        eng = MegatronEngine(cfg, topo)
        try:
            share, pos = my_share(data, topo, 2 * par.pp)
            got = gather(eng.infer_batch(share), pos)
            diffs = torch.cat([(got[i] - ref[i]).abs() for i in range(len(ref))])
            row = {"layout": name, "dp": topo.dp_size, "max_abs_logprob_diff": float(diffs.max()),
                   "mean_abs_logprob_diff": float(diffs.mean()), "te_layers": eng.use_te, "packed": eng.packed}
        finally:
            eng.close()
        speed_cfg = EngineConfig(model=SPEED_MODEL, megatron=par, optim=OptimConfig(lr=1e-5), seed=3)
        eng = MegatronEngine(speed_cfg, topo)
        try:
            big = samples(8 * topo.dp_size, SPEED_MODEL.vocab_size, seed=1, max_prompt=256, max_resp=768)
            share, _ = my_share(big, topo, 2 * par.pp)
            eng.train_batch(share)  # warm-up
            times = []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                m = eng.train_batch(share)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            tokens = float(m["tokens"])
            row.update(step_time_s=statistics.mean(times), tokens_per_step=tokens,
                       tokens_per_s=tokens / statistics.mean(times))
        finally:
            eng.close()
        failed |= row["max_abs_logprob_diff"] > args.tol
        results.append(row)
        if rank == 0:
            print(f"{name:22s} dp={row['dp']} max|dlogp|={row['max_abs_logprob_diff']:.3e} "
                  f"mean|dlogp|={row['mean_abs_logprob_diff']:.3e} step={row['step_time_s'] * 1e3:8.1f} ms "
                  f"tok/s={row['tokens_per_s']:10.0f}", flush=True)
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"world_size": world, "device": torch.cuda.get_device_name(), "results": results}, fh, indent=2)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
