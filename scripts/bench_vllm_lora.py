"""A LoRA policy's two ways into vLLM, side by side on one checkpoint: merged weights reloaded in place (what the
trainer does: ``W + scale * B @ A`` written as safetensors, the server's workers reload them) and vLLM's own LoRA
path (the adapters written as a PEFT folder, ``/v1/load_lora_adapter``, requests naming the adapter). For each of
``--syncs`` adapter versions: the seconds a sync takes, greedy generation of ``--prompts`` prompts, and the two
paths' tokens and log-probs compared (and both against a float64 recompute of the merged model).

    python scripts/bench_vllm_lora.py --model /path/to/smollm2 --out runs/bench_vllm_lora.json

Needs the engine environment (`make setup-vllm`); prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from backends.model.hf import convert_hf_state_dict, load_hf_checkpoint, read_hf_config, read_weight_files  # noqa: E402
from backends.model.lora import LoraSpec, adapter_shapes, merge_adapters, resolve_targets  # noqa: E402
from backends.model.peft_export import save_peft_adapter  # noqa: E402
from backends.rollout.vllm import VllmConfig, VllmEngine, require_engine_python  # noqa: E402
from backends.rollout.vllm_server import VllmServer  # noqa: E402
from protocol.rollout.tokenizer import load_tokenizer  # noqa: E402


def _adapters(cfg, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """Adapters of a trained look: A ~ N(0, 1/sqrt(in)), B ~ N(0, 0.02) (B = 0 at a LoRA's start moves nothing)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in adapter_shapes(cfg, spec).items():
        std = 1 / shape[1] ** 0.5 if name.endswith("lora_A") else 0.02
        out[name] = torch.randn(shape, generator=g) * std
    return out


async def _complete(server: VllmServer, model: str, prompts: list[list[int]], tokens: int, stops: list[int]):
    import aiohttp

    async def one(session, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "detokenize": False,
                "skip_special_tokens": False, "stop_token_ids": stops}
        async with session.post(server.url + "/v1/completions", json=body) as r:
            payload = await r.json(content_type=None)
            if r.status != 200:
                raise RuntimeError(f"/v1/completions answered {r.status}: {str(payload)[:1000]}")
        c = payload["choices"][0]
        return [int(t) for t in c["token_ids"]], [float(x) for x in c["logprobs"]["token_logprobs"]]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        return await asyncio.gather(*[one(session, p) for p in prompts])


def _logprobs64(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32)).double()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face causal-LM folder (head size vLLM's CPU build takes)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--syncs", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default="runs/bench_vllm_lora.json")
    args = ap.parse_args(argv)

    cfg = read_hf_config(args.model)
    tok = load_tokenizer(args.model)
    spec = LoraSpec(rank=args.rank, alpha=args.alpha, targets=resolve_targets("all-linear"))
    base = convert_hf_state_dict(read_weight_files(args.model), cfg)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {7 * i + 3} + {5 * i + 2}?"}])
               for i in range(args.prompts)]
    opts = VllmConfig()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-lora-"))

    merged_engine = VllmEngine(cfg, tok, opts, seed=0)
    lora_server = VllmServer(require_engine_python(opts), [
        "--model", args.model, "--skip-tokenizer-init", "--generation-config", "vllm", "--dtype", opts.dtype,
        "--logprobs-mode", "processed_logprobs", "--max-model-len", str(cfg.max_position_embeddings),
        "--seed", "0", "--distributed-executor-backend", "uni", "--no-enable-chunked-prefill", "--enforce-eager",
        "--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "1"],
        {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
         "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": str(opts.kv_cache_gb),
         "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(opts.threads)}, work / "lora_server.log")
    stops = sorted(merged_engine.stop_token_ids)
    rows = []
    try:
        lora_server.wait_ready(opts.startup_timeout_s)
        loop = asyncio.new_event_loop()
        ref = load_hf_checkpoint(args.model).double()  # the float64 recompute; each sync's merged weights go in
        previous = None
        for k in range(args.syncs):
            adapters = _adapters(cfg, spec, seed=k)
            t0 = time.perf_counter()
            merged = merge_adapters({**base, **adapters}, spec.scale)
            merge_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            merged_engine.load_weights(merged, version=k)
            merged_sync_s = time.perf_counter() - t0 + merge_s
            t0 = time.perf_counter()
            folder = work / f"adapter{k}"
            save_peft_adapter(str(folder), {f"{n}": t for n, t in adapters.items()}, spec)
            if previous is not None:
                lora_server.post("/v1/unload_lora_adapter", {"lora_name": previous})
            lora_server.post("/v1/load_lora_adapter", {"lora_name": f"a{k}", "lora_path": str(folder)})
            lora_sync_s = time.perf_counter() - t0
            previous = f"a{k}"
            t0 = time.perf_counter()
            got_m = loop.run_until_complete(_complete(merged_engine._live(), merged_engine._live().name, prompts,
                                                      args.tokens, stops))
            gen_m = time.perf_counter() - t0
            t0 = time.perf_counter()
            got_l = loop.run_until_complete(_complete(lora_server, f"a{k}", prompts, args.tokens, stops))
            gen_l = time.perf_counter() - t0
            ref.load_state_dict({n: t.double() for n, t in merged.items()})
            same = sum(a[0] == b[0] for a, b in zip(got_m, got_l))
            diff_ml, err_m, err_l = 0.0, 0.0, 0.0
            for p, (tm, lm), (tl, ll) in zip(prompts, got_m, got_l):
                n = next((i for i, (a, b) in enumerate(zip(tm, tl)) if a != b), min(len(tm), len(tl)))
                if n:
                    diff_ml = max(diff_ml, max(abs(a - b) for a, b in zip(lm[:n], ll[:n])))
                err_m = max(err_m, float((torch.tensor(lm, dtype=torch.float64) - _logprobs64(ref, p, tm)).abs().max()))
                err_l = max(err_l, float((torch.tensor(ll, dtype=torch.float64) - _logprobs64(ref, p, tl)).abs().max()))
            toks_m, toks_l = sum(len(t) for t, _ in got_m), sum(len(t) for t, _ in got_l)
            rows.append({"sync": k, "merged_sync_s": merged_sync_s, "merge_s": merge_s, "lora_sync_s": lora_sync_s,
                         "merged_tokens_per_s": toks_m / gen_m, "lora_tokens_per_s": toks_l / gen_l,
                         "same_greedy_responses": same, "prompts": len(prompts),
                         "max_logprob_gap_between_paths": diff_ml, "merged_vs_float64": err_m,
                         "lora_vs_float64": err_l})
            print(json.dumps(rows[-1]), flush=True)
        loop.close()
    finally:
        merged_engine.close()
        lora_server.close()
    steady = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in steady) for k in rows[0] if isinstance(rows[0][k], float)}
    print("\n| path | sync (s) | greedy tokens/s | max |log-prob - float64| |")
    print("|---|---|---|---|")
    print(f"| merged weights, reloaded | {med['merged_sync_s']:.3f} | {med['merged_tokens_per_s']:.1f} | "
          f"{max(r['merged_vs_float64'] for r in rows):.2e} |")
    print(f"| vLLM LoRA (PEFT folder) | {med['lora_sync_s']:.3f} | {med['lora_tokens_per_s']:.1f} | "
          f"{max(r['lora_vs_float64'] for r in rows):.2e} |")
    print(f"same greedy responses: {sum(r['same_greedy_responses'] for r in rows)} of "
          f"{sum(r['prompts'] for r in rows)}; largest log-prob gap between the paths "
          f"{max(r['max_logprob_gap_between_paths'] for r in rows):.2e}")
    out = {"model": args.model, "rank": args.rank, "alpha": args.alpha, "prompts": args.prompts,
           "tokens": args.tokens, "syncs": rows, "median_after_first": med,
           "machine": f"{os.uname().machine}, {os.cpu_count()} CPUs"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
