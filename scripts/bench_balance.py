"""Benchmark: our equal-count partitioner vs equal-size Karmarkar–Karp vs contiguous chunks vs the lower bound.

    python scripts/bench_balance.py [--out runs/bench_balance.json] [--quick] [--repeats 3]

For n in {256, 512, 2048, 16384} samples, DP in {2, 8, 16, 32, 64, 128} and three length mixes
(dispatch.synthetic: lognormal, bimodal, uniform; seq_len up to 16384, workload of hidden size 4096),
prints max/mean workload of each method, our gap to dispatch.lower_bound (at least the mean and the
largest sample plus the n/DP - 1 smallest; see its docstring), and the wall time per call (median of
--repeats). Targets: gap <= 1% wherever the bound is reachable
(bound/mean close to 1) and < 50 ms for 16384 samples over 128 ranks.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from dispatch import (
    DISTRIBUTIONS,
    WorkloadModel,
    balance_partitions,
    contiguous_partitions,
    imbalance,
    karmarkar_karp,
    lower_bound,
    partition_loads,
    synthetic_lengths,
)

SIZES = (256, 512, 2048, 16384)
DPS = (2, 8, 16, 32, 64, 128)


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def run(sizes, dps, dists, repeats: int, seed: int) -> list[dict]:
    model = WorkloadModel.from_hidden_size(4096)
    rows = []
    for dist in dists:
        for n in sizes:
            w = model(synthetic_lengths(dist, n, seed=seed, max_len=16384))
            for dp in dps:
                if n % dp or n < dp:
                    continue
                mean = float(w.sum()) / dp
                ours, t_ours = timed(lambda: balance_partitions(w, dp), repeats)
                kk, t_kk = timed(lambda: karmarkar_karp(w, dp), repeats)
                bound = lower_bound(w, dp) / mean
                r = {
                    "dist": dist, "n": n, "dp": dp, "per_rank": n // dp,
                    "ours": imbalance(partition_loads(w, ours)),
                    "kk": imbalance(partition_loads(w, kk)),
                    "contiguous": imbalance(partition_loads(w, contiguous_partitions(n, dp))),
                    "bound": bound,
                    "ms_ours": 1e3 * t_ours, "ms_kk": 1e3 * t_kk,
                }
                r["gap_to_bound"] = r["ours"] / bound - 1.0
                rows.append(r)
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'dist':>9} {'n':>6} {'dp':>4} {'n/dp':>5} | {'ours':>7} {'KK':>7} {'contig':>7} {'bound':>7} | " \
             f"{'gap%':>6} | {'ms ours':>8} {'ms KK':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['dist']:>9} {r['n']:>6} {r['dp']:>4} {r['per_rank']:>5} | {r['ours']:7.4f} {r['kk']:7.4f} "
              f"{r['contiguous']:7.4f} {r['bound']:7.4f} | {100 * r['gap_to_bound']:6.2f} | "
              f"{r['ms_ours']:8.2f} {r['ms_kk']:7.2f}")


def summarise(rows: list[dict]) -> dict:
    reachable = [r for r in rows if r["bound"] <= 1.001]
    big = [r for r in rows if r["n"] == 16384 and r["dp"] == 128]
    return {
        "never_worse_than_kk": all(r["ours"] <= r["kk"] + 1e-12 for r in rows),
        "max_gap_where_bound_reachable": max((r["gap_to_bound"] for r in reachable), default=0.0),
        "max_gap_overall": max(r["gap_to_bound"] for r in rows),
        "ms_16384_over_128": max((r["ms_ours"] for r in big), default=None),
        "mean_ours": statistics.mean(r["ours"] for r in rows),
        "mean_kk": statistics.mean(r["kk"] for r in rows),
        "mean_contiguous": statistics.mean(r["contiguous"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows and summary as JSON here")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per cell (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="n in {256, 512} only")
    args = ap.parse_args(argv)
    sizes = SIZES[:2] if args.quick else SIZES
    rows = run(sizes, DPS, DISTRIBUTIONS, args.repeats, args.seed)
    print_table(rows)
    summary = summarise(rows)
    print()
    for k, v in summary.items():
        print(f"{k:32s} {v}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
