"""Benchmark: a real pretrained model (default SmolLM2-135M-Instruct) on one CPU thread, the project against
transformers, same weights, same prompts, in one run.

* rollout: tokens/s of the embedded sampler (``backends.model.generate``) against ``transformers`` ``generate``
  (sdpa attention, sampling at temperature 1, the same batch of rows, a fixed number of new tokens: no stop token,
  so both produce exactly rows x new tokens), the two alternating ``--repeats`` times;
* train: tokens/s of forward + backward of the token log-probs on packed micro-batches (the project's model)
  against a plain ``transformers`` forward + backward of the same rows padded, and the achieved GFLOP/s
  (6 x params x tokens plus attention) against a measured fp32 matmul peak of this machine (one thread);
* ``--profile``: where the sampler's decode time goes (torch.profiler, top operators), and the bound of a decode
  step (bytes of weights read, FLOPs).

    rldispatch models smollm2 --out models/smollm2
    OMP_NUM_THREADS=1 python scripts/bench_real_model.py --model models/smollm2 --out runs/bench_real_model.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def _prompts(tokenizer, rows: int, seed: int) -> list[list[int]]:
    """``rows`` chat-templated prompts of the shipped arithmetic task (its val-style problems)."""
    from protocol.rollout.tasks.arithmetic import ArithmeticTask

    task, rng = ArithmeticTask(), random.Random(seed)
    out = []
    for _ in range(rows):
        ex = task.sample(rng)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append(list(ids))
    return out


def matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """fp32 GFLOP/s of an n x n matmul on this thread (the best of ``repeats``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    """Seconds ``fn`` takes: this process's CPU time (one thread: its compute, unaffected by other processes
    sharing the cores), or the wall clock with ``--wall``."""
    clock = time.perf_counter if _WALL else time.process_time
    t = clock()
    fn()
    return clock() - t


_WALL = False


def rollout_ours(model, prompts, new_tokens: int, seed: int) -> float:
    from backends.model.generate import generate

    outs, _ = generate(model, prompts, new_tokens, temperature=1.0, eos_token_id=None, seed=seed)
    assert all(len(o) == new_tokens for o in outs)
    return len(prompts) * new_tokens


def rollout_hf(model, prompts, new_tokens: int, seed: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                             pad_token_id=pad_id)
    assert out.shape[1] == width + new_tokens
    return len(prompts) * new_tokens


def _sequences(prompts, new_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    return [p + [g.randrange(vocab) for _ in range(g.randint(new_tokens // 2, new_tokens))] for p in prompts]


def _packed_step(model, seqs) -> None:
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    logits = model(ids, pos, cu)
    nxt = torch.cat([ids[s + 1:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    keep = torch.cat([torch.arange(s, e - 1) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    lp = torch.log_softmax(logits[keep].float(), -1).gather(-1, nxt[:, None])
    lp.sum().backward()


def _padded_step(model, seqs, pad_id: int) -> None:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (lp * mask[:, 1:]).sum().backward()


def _micro(seqs, micro: int):
    return [seqs[i:i + micro] for i in range(0, len(seqs), micro)]


def train_flops(cfg, seqs) -> float:
    """6 x (non-embedding params + output head) x tokens, plus the causal attention's 6 x 2 x L^2/2 x d per layer."""
    d, h, kv, hd, f, v, n = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                             cfg.vocab_size, cfg.num_layers)
    per_token = n * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f) + d * v
    tokens = sum(len(s) for s in seqs)
    attn = sum(n * 6 * h * hd * len(s) ** 2 for s in seqs)  # QK^T and PV, forward (x1) and backward (x2), causal
    return 6 * per_token * tokens + attn


def decode_bound(cfg, rows: int, context: int) -> dict[str, float]:
    """What one decode step must do: weights read once (fp32 bytes), and its FLOPs for ``rows`` rows."""
    d, h, kv, hd, f, v, n = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                             cfg.vocab_size, cfg.num_layers)
    params = n * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f) + d * v
    kv_bytes = rows * n * 2 * kv * hd * context * 4
    return {"weight_bytes": 4.0 * params, "kv_cache_bytes": float(kv_bytes),
            "flops": 2.0 * params * rows + rows * n * 4 * h * hd * context}


def profile_decode(model, prompts, new_tokens: int, top: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    from backends.model.generate import generate

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, prompts, new_tokens, temperature=1.0, eos_token_id=None, seed=0)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2", help="a Hugging Face folder (rldispatch models smollm2)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each side")
    ap.add_argument("--micro", type=int, default=8, help="rows per training micro-batch")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: rollout,train")
    ap.add_argument("--profile", action="store_true", help="print the sampler's top operators")
    ap.add_argument("--wall", action="store_true",
                    help="time with the wall clock (default: CPU time, which a machine shared with other jobs "
                         "does not distort)")
    ap.add_argument("--out", default="runs/bench_real_model.json")
    args = ap.parse_args(argv)
    global _WALL
    _WALL = args.wall
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.model.hf import load_hf_checkpoint

    tok = AutoTokenizer.from_pretrained(args.model)
    ours = load_hf_checkpoint(args.model)
    theirs = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    cfg = ours.cfg
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompts = _prompts(tok, args.rows, seed=0)
    skip = set(filter(None, args.skip.split(",")))
    report: dict = {"model": args.model, "threads": torch.get_num_threads(), "clock": "wall" if _WALL else "cpu", "rows": args.rows,
                    "new_tokens": args.new_tokens, "prompt_tokens": [len(p) for p in prompts]}
    peak = matmul_peak()
    report["matmul_peak_gflops"] = peak
    rows = [("fp32 matmul peak (1024^3)", f"{peak:.1f} GFLOP/s", "")]
    if "rollout" not in skip:
        ours.eval(), theirs.eval()
        rollout_ours(ours, prompts[:2], 4, 0), rollout_hf(theirs, prompts[:2], 4, 0, pad)  # warm-up
        t_ours, t_hf = [], []
        for r in range(args.repeats):
            t_ours.append(args.rows * args.new_tokens / _timed(lambda: rollout_ours(ours, prompts, args.new_tokens, r)))
            t_hf.append(args.rows * args.new_tokens / _timed(lambda: rollout_hf(theirs, prompts, args.new_tokens, r,
                                                                                 pad)))
        mo, mh = statistics.median(t_ours), statistics.median(t_hf)
        bound = decode_bound(cfg, args.rows, max(len(p) for p in prompts) + args.new_tokens // 2)
        report["rollout"] = {"ours_tokens_per_s": t_ours, "hf_tokens_per_s": t_hf, "ratio": mo / mh,
                             "decode_bound": bound}
        rows += [("rollout tokens/s: project sampler", f"{mo:.1f}", " ".join(f"{x:.1f}" for x in t_ours)),
                 ("rollout tokens/s: transformers generate", f"{mh:.1f}", " ".join(f"{x:.1f}" for x in t_hf)),
                 ("rollout ratio (project / transformers)", f"{mo / mh:.2f}x", ""),
                 ("decode step: weights read / FLOPs", f"{bound['weight_bytes'] / 1e6:.0f} MB",
                  f"{bound['flops'] / 1e9:.2f} GFLOP for {args.rows} rows")]
    if "train" not in skip:
        seqs = _sequences(prompts, args.new_tokens, cfg.vocab_size, seed=1)
        tokens = sum(len(s) for s in seqs)
        flops = train_flops(cfg, seqs)
        ours.train(), theirs.train()
        t_ours, t_hf = [], []
        for _ in range(args.repeats):
            ours.zero_grad(set_to_none=True)
            t_ours.append(_timed(lambda: [_packed_step(ours, mb) for mb in _micro(seqs, args.micro)]))
            theirs.zero_grad(set_to_none=True)
            t_hf.append(_timed(lambda: [_padded_step(theirs, mb, pad) for mb in _micro(seqs, args.micro)]))
        so, sh = statistics.median(t_ours), statistics.median(t_hf)
        padded = sum(len(mb) * max(len(s) for s in mb) for mb in _micro(seqs, args.micro))
        report["train"] = {"tokens": tokens, "padded_tokens": padded, "flops": flops, "ours_s": t_ours,
                           "hf_s": t_hf, "ours_tokens_per_s": tokens / so, "hf_tokens_per_s": tokens / sh,
                           "ours_gflops": flops / so / 1e9, "hf_gflops": flops / sh / 1e9}
        rows += [("train tokens/s: project packed fwd+bwd", f"{tokens / so:.1f}",
                  f"{flops / so / 1e9:.1f} GFLOP/s = {100 * flops / so / 1e9 / peak:.0f}% of peak"),
                 ("train tokens/s: transformers padded fwd+bwd", f"{tokens / sh:.1f}",
                  f"{flops / sh / 1e9:.1f} GFLOP/s; {padded - tokens} pad tokens of {padded}"),
                 ("train ratio (project / transformers)", f"{sh / so:.2f}x", "")]
    print_table(f"{args.model}: {args.rows} rows x {args.new_tokens} new tokens, {torch.get_num_threads()} thread, "
                f"{report['clock']} time", rows)
    if args.profile:
        ours.eval()
        report["profile"] = profile_decode(ours, prompts, args.new_tokens)
        print(report["profile"])
    write_json(report, args.out)
    return 0


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    """``title``, then one line per (name, value, note) row, names and values aligned."""
    width = max(len(r[0]) for r in rows)
    print(title)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>12}  {note}")


def write_json(report: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
