"""Benchmark: rollout with vLLM against the embedded sampler and transformers' ``generate``, same weights, same
prompts, in one run; then (``--train-steps N``) GRPO steps of a config with each engine.

* rollout: the same ``--rows`` chat-templated arithmetic prompts, ``--new-tokens`` sampled tokens each at
  temperature 1 with no stop token (every engine produces exactly rows x new tokens), the engines alternating
  ``--repeats`` times. Tokens per wall second, and per CPU second (this process plus, for vLLM, its server's whole
  process tree: the API server, the engine core and the worker);
* weight sync: seconds of the vLLM engine's ``load_weights`` (the whole model, pause and resume included);
* train (``--train-steps``): ``torchrun`` runs of ``--config`` (default ``grpo_smollm2``) with
  ``rollout.engine=embedded`` and ``=vllm``, one after the other: median seconds per step, rollout seconds, rollout
  tokens/s (response tokens / ``timing_s/rollout``) and ``timing_s/weight_sync`` over the steps after the first.

    rldispatch models smollm2 --out models/smollm2 && make setup-vllm
    python scripts/bench_vllm.py --model models/smollm2 --train-steps 4 --out runs/bench_vllm.json
    python scripts/bench_vllm.py --device cuda --vllm-dtype bfloat16 ...    # on a GPU (scripts/gpu_bench_vllm.sh)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from bench_real_model import _prompts, print_table, rollout_hf, write_json  # noqa: E402


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def _clocked(fn, server_pid: int | None = None) -> tuple[float, float, object]:
    """(wall s, CPU s of this process and of the server's tree, fn's result)."""
    c0 = time.process_time() + (_tree_cpu_s(server_pid) if server_pid else 0.0)
    w0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - w0
    cpu = time.process_time() + (_tree_cpu_s(server_pid) if server_pid else 0.0) - c0
    return wall, cpu, out


def _vllm_generate(engine, prompts, new_tokens: int):
    async def go():
        return await asyncio.gather(*[engine.agenerate(p, {"temperature": 1.0, "max_tokens": new_tokens})
                                      for p in prompts])
    outs = asyncio.run(go())
    assert all(len(o[0]) == new_tokens for o in outs), [len(o[0]) for o in outs]
    return outs


def _embedded_generate(engine, prompts, new_tokens: int):
    outs = engine.generate_batch(prompts, {"temperature": 1.0, "max_tokens": new_tokens})
    assert all(len(o[0]) == new_tokens for o in outs), [len(o[0]) for o in outs]
    return outs


def bench_rollout(args, report: dict, rows: list) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.model.hf import load_hf_checkpoint
    from backends.rollout import EmbeddedEngine, VllmConfig, VllmEngine
    from protocol.rollout.tokenizer import load_tokenizer

    device = torch.device(args.device)
    tok = load_tokenizer(args.model)
    ours = load_hf_checkpoint(args.model)
    cfg, weights = ours.cfg, ours.state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    theirs.to(device).eval()
    hf_tok = AutoTokenizer.from_pretrained(args.model)
    pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else 0
    prompts = _prompts(hf_tok, args.rows, seed=0)
    report["prompt_tokens"] = [len(p) for p in prompts]

    embedded = EmbeddedEngine(cfg, tok, device=device, seed=0)
    embedded.load_weights(weights, version=1)
    embedded.stop_token_ids = frozenset()  # fixed-length responses in every engine
    eager = {"auto": None, "true": True, "false": False}[args.enforce_eager]
    vllm = VllmEngine(cfg, tok, VllmConfig(python=args.vllm_python, threads=args.threads, dtype=args.vllm_dtype,
                                           enforce_eager=eager), device=device, seed=0)
    try:
        vllm.stop_token_ids = frozenset()
        syncs = []
        for v in range(1 + args.repeats):
            syncs.append(_clocked(lambda: vllm.load_weights(weights, version=1 + v))[0])
        syncs = syncs[1:]  # the first load waits for the server's start and warms its code paths
        report["vllm_startup_s"] = vllm.startup_s
        pid = vllm.server.proc.pid
        # warm-up of every engine (vLLM compiles and allocates at its first requests)
        _vllm_generate(vllm, prompts, 8), _embedded_generate(embedded, prompts[:2], 4)
        rollout_hf(theirs, [p for p in prompts[:2]], 4, 0, pad)
        res: dict[str, list[tuple[float, float]]] = {"vllm": [], "embedded": [], "transformers": []}
        n = args.rows * args.new_tokens
        for r in range(args.repeats):
            vllm.reseed(r)
            w, c, _ = _clocked(lambda: _vllm_generate(vllm, prompts, args.new_tokens), pid)
            res["vllm"].append((w, c))
            embedded.reseed(r)
            w, c, _ = _clocked(lambda: _embedded_generate(embedded, prompts, args.new_tokens))
            res["embedded"].append((w, c))
            w, c, _ = _clocked(lambda: rollout_hf(theirs, prompts, args.new_tokens, r, pad))
            res["transformers"].append((w, c))
    finally:
        vllm.close()
    out = {}
    for name, runs in res.items():
        out[name] = {"wall_s": [w for w, _ in runs], "cpu_s": [c for _, c in runs],
                     "tokens_per_s": statistics.median(n / w for w, _ in runs),
                     "tokens_per_cpu_s": statistics.median(n / c for _, c in runs)}
    out["ratio_vllm_over_embedded"] = out["vllm"]["tokens_per_s"] / out["embedded"]["tokens_per_s"]
    out["ratio_vllm_over_transformers"] = out["vllm"]["tokens_per_s"] / out["transformers"]["tokens_per_s"]
    out["weight_sync_s"] = syncs
    report["rollout"] = out
    for name in ("vllm", "embedded", "transformers"):
        rows.append((f"rollout tokens/s: {name}", f"{out[name]['tokens_per_s']:.1f}",
                     f"{out[name]['tokens_per_cpu_s']:.1f} per CPU s; wall s "
                     + " ".join(f"{w:.2f}" for w in out[name]["wall_s"])))
    rows += [("rollout ratio vllm / embedded", f"{out['ratio_vllm_over_embedded']:.2f}x", ""),
             ("rollout ratio vllm / transformers", f"{out['ratio_vllm_over_transformers']:.2f}x", ""),
             ("vllm weight sync s (whole model)", f"{statistics.median(syncs):.2f}",
              " ".join(f"{s:.2f}" for s in syncs)),
             ("vllm server start-up s", f"{report['vllm_startup_s']:.1f}", "")]


def _train(args, engine: str, work: Path) -> dict:
    from backends.rollout.vllm_server import free_port

    run_dir = work / f"train-{engine}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(REPO / "scripts" / "train.py"), "--config", args.config, f"model.hf_path={Path(args.model).resolve()}",
           f"rollout.engine={engine}", f"trainer.total_steps={args.train_steps}", "trainer.val_freq=0",
           "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.tensorboard=false",
           f"trainer.run_dir={run_dir}", f"data.train_files=[{work}/data/train.parquet]",
           f"data.val_files=[{work}/data/val.parquet]", f"rollout.vllm.python={args.vllm_python}",
           f"rollout.vllm.dtype={args.vllm_dtype}", f"rollout.vllm.threads={args.threads}",
           *args.train_override]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=args.train_timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{engine} training exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = recs[1:] or recs  # the first step holds the engines' warm-up
    cfg = json.loads((run_dir / "config.json").read_text())  # the run's resolved config
    per_step = cfg["data"]["train_batch_size"] * cfg["rollout"]["n"]

    def med(key):
        vals = [r[key] for r in later if key in r]
        return statistics.median(vals) if vals else None

    tok_s = [r["response_length/mean"] * per_step / r["timing_s/rollout"] for r in later]
    return {"wall_s": wall, "steps": len(recs), "step_s": med("timing_s/step"), "rollout_s": med("timing_s/rollout"),
            "weight_sync_s": med("timing_s/weight_sync"), "rollout_tokens_per_s": statistics.median(tok_s),
            "response_length_mean": med("response_length/mean"),
            "rollout_probs_diff_max": med("training/rollout_probs_diff_max")}


def bench_train(args, report: dict, rows: list) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        out = {e: _train(args, e, work) for e in ("embedded", "vllm")}
    out["step_ratio_embedded_over_vllm"] = out["embedded"]["step_s"] / out["vllm"]["step_s"]
    out["rollout_ratio_vllm_over_embedded"] = (out["vllm"]["rollout_tokens_per_s"]
                                               / out["embedded"]["rollout_tokens_per_s"])
    report["train"] = out
    for e in ("embedded", "vllm"):
        o = out[e]
        rows.append((f"{args.config} s/step: {e}", f"{o['step_s']:.2f}",
                     f"rollout {o['rollout_s']:.2f} s at {o['rollout_tokens_per_s']:.1f} tokens/s; weight sync "
                     f"{o['weight_sync_s']:.2f} s; mean response {o['response_length_mean']:.0f} tokens"))
    rows += [(f"{args.config} step speed-up (embedded s / vllm s)", f"{out['step_ratio_embedded_over_vllm']:.2f}x", ""),
             (f"{args.config} rollout tokens/s ratio vllm / embedded",
              f"{out['rollout_ratio_vllm_over_embedded']:.2f}x", "")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2", help="a Hugging Face folder (rldispatch models smollm2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each engine")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of every engine: torch's for the embedded one and transformers, vLLM's worker")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--enforce-eager", choices=["auto", "true", "false"], default="auto",
                    help="rollout.vllm.enforce_eager (auto: eager on the CPU, CUDA graphs on GPUs)")
    ap.add_argument("--train-steps", type=int, default=0, help="GRPO steps per engine (0: rollout section only)")
    ap.add_argument("--config", default="grpo_smollm2")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--train-override", nargs="*", default=[], help="more train.py overrides (key=value)")
    ap.add_argument("--train-timeout-s", type=float, default=3600.0, help="limit of each training run")
    ap.add_argument("--skip-rollout", action="store_true", help="only the training section")
    ap.add_argument("--out", default="runs/bench_vllm.json")
    args = ap.parse_args(argv)
    args.vllm_python = str(Path(args.vllm_python).absolute())  # not resolve(): a venv python is a symlink
    torch.set_num_threads(args.threads)
    report: dict = {"model": args.model, "device": args.device, "rows": args.rows, "new_tokens": args.new_tokens,
                    "repeats": args.repeats, "threads": args.threads, "vllm_dtype": args.vllm_dtype,
                    "cpu_count": os.cpu_count()}
    rows: list[tuple[str, str, str]] = []
    if not args.skip_rollout:
        bench_rollout(args, report, rows)
        print_table(f"{args.model} on {args.device}: {args.rows} rows x {args.new_tokens} new tokens, medians of "
                    f"{args.repeats}", rows)
    if args.train_steps:
        bench_train(args, report, rows)
    print_table(f"{args.model} on {args.device}: {args.rows} rows x {args.new_tokens} new tokens, medians of "
                f"{args.repeats}", rows)
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
