"""Throughput of the RL algorithm stages on CPU: advantages, KL penalty, policy loss (fwd+bwd), rm_scores, invariants.

A batch of N trajectories (groups of G, response lengths uniform in [L/4, L], 70% policy tokens) in the padded
[N, L] form the algorithms consume. Reports the median time over repeats and the rate in tokens per second
(policy-loss rows: the fwd+bwd of one micro-batch of ``--mb`` rows). GAE and REINFORCE++ walk the L positions
in a loop, so they scale with L rather than N*L.

    .venv/bin/python scripts/bench_algorithms.py                 # N=1024, G=8, L=1024
    .venv/bin/python scripts/bench_algorithms.py --n 4096 --out algorithms.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.algos.advantage import compute_advantage  # noqa: E402
from protocol.invariants import check_invariants  # noqa: E402
from protocol.store.keys import new_uid, trajectory_key, trajectory_tag  # noqa: E402
from protocol.algos.kl import FixedKLController, apply_kl_penalty  # noqa: E402
from protocol.algos.losses import global_counts, policy_loss  # noqa: E402
from protocol.batch.nested import padded_to_jagged, to_nested  # noqa: E402
from protocol.algos.reward import compute_rm_scores  # noqa: E402


def make_batch(n: int, group: int, L: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, L // 4), L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None] < lengths[:, None]) & (torch.rand(n, L, generator=g) < 0.7)
    mask[:, 0] = True
    uids = [new_uid() for _ in range((n + group - 1) // group)]
    index = [uids[i // group] for i in range(n)]
    scores = (torch.rand(n, generator=g) < 0.5).float()
    return lengths, mask.long(), index, scores, g


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024, help="trajectories")
    ap.add_argument("--group", type=int, default=8, help="trajectories per uid group (rollout.n)")
    ap.add_argument("--len", type=int, default=1024, help="max response length L")
    ap.add_argument("--mb", type=int, default=32, help="rows per policy-loss micro-batch")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=str, default=None, help="write results as JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, L = args.n, args.len
    lengths, mask, index, scores, g = make_batch(n, args.group, L, 0)
    tokens = int(mask.sum())
    rm = compute_rm_scores(scores, mask)
    old = -torch.rand(n, L, generator=g)
    ref = old + 0.1 * torch.randn(n, L, generator=g)
    values = torch.randn(n, L, generator=g)
    ctrl = FixedKLController(0.01)

    rows: list[tuple[str, float, int]] = []
    rows.append(("compute_rm_scores", timed(lambda: compute_rm_scores(scores, mask), args.repeats), tokens))
    rows.append(("apply_kl_penalty k3", timed(lambda: apply_kl_penalty(rm, old, ref, mask, ctrl, "low_var_kl"),
                                              args.repeats), tokens))
    for name, extra in (("grpo", {"index": index}), ("rloo", {"index": index}),
                        ("reinforce_plus_plus_baseline", {"index": index}), ("reinforce_plus_plus", {}),
                        ("gae", {"values": values, "gamma": 1.0, "lam": 0.95})):
        t = timed(lambda: compute_advantage(name, token_level_rewards=rm, response_mask=mask, **extra), args.repeats)
        rows.append((f"advantage {name}", t, tokens))

    mb = slice(0, min(args.mb, n))
    T, S = global_counts(mask[mb])
    adv = torch.randn(n, L, generator=g)

    def pl():
        lp = (old[mb] + 0.05 * torch.randn_like(old[mb])).requires_grad_(True)
        loss, _ = policy_loss(old[mb], lp, adv[mb], mask[mb], global_tokens=T, global_seqs=S)
        loss.backward()

    rows.append((f"policy_loss fwd+bwd ({mb.stop} rows)", timed(pl, args.repeats), T))

    # invariants on a jagged store batch of the same shapes (prompt_len 16)
    P = 16
    m_rows = [mask[i, :int(lengths[i])] for i in range(n)]
    prompts = [torch.randint(5, 100, (P,)) for _ in range(n)]
    responses = [torch.randint(5, 100, (int(lengths[i]),)) for i in range(n)]
    td = TensorDict({
        "prompts": to_nested(prompts), "responses": to_nested(responses),
        "input_ids": to_nested([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
        "position_ids": to_nested([torch.arange(P + int(lengths[i])) for i in range(n)]),
        "response_mask": to_nested(m_rows), "rm_scores": padded_to_jagged(rm, lengths),
    }, batch_size=[n])
    keys = [trajectory_key(index[i], i % args.group, 0) for i in range(n)]
    tags = [trajectory_tag(P, int(lengths[i]), 0) for i in range(n)]
    check = lambda: check_invariants(td, keys=keys, tags=tags)  # noqa: E731
    if check():
        raise SystemExit(f"benchmark batch breaks invariants: {check()[:3]}")
    rows.append(("check_invariants (jagged)", timed(check, max(1, args.repeats // 2)), tokens))

    print(f"N={n} G={args.group} L={L} policy tokens={tokens} threads={torch.get_num_threads()}")
    print(f"{'stage':<42} {'median ms':>10} {'M tok/s':>9}")
    for name, t, tok in rows:
        print(f"{name:<42} {t * 1e3:>10.2f} {tok / t / 1e6:>9.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "config": {**vars(args), "tokens": tokens, "threads": torch.get_num_threads(),
                       "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
            "results": [{"stage": name, "median_s": t, "tokens": tok, "tokens_per_s": tok / t}
                        for name, t, tok in rows]}, indent=2))


if __name__ == "__main__":
    main()
