"""Print the dispatch plan of one training step for a config and a world size: no GPU, no torch.distributed.

    python scripts/plan.py --config configs/grpo_tiny.yaml --world 64 [--synthetic lognormal|bimodal|uniform]
    python scripts/plan.py --config configs/grpo_tiny.yaml --world 8 --lengths lengths.txt actor.megatron.tp=2

Shows the topology (rank -> coordinates), the logical DP, and per DP rank the samples, padding, tokens,
workload and micro-batch counts, with the workload imbalance (max/mean) before (contiguous split) and after
balancing — the same figures the trainer logs as ``dispatch/*`` step metrics.

``--lengths FILE``: one trajectory per line, either ``seq_len`` or ``prompt_len response_len`` (``#`` comments).
Without it, ``data.train_batch_size x rollout.n`` synthetic lengths up to
``data.max_prompt_length + data.max_response_length`` are drawn (``--samples`` overrides the count).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dispatch import (
    DISTRIBUTIONS,
    PlanError,
    Topology,
    build_plan,
    make_padding,
    padding_count,
    synthetic_lengths,
)
from rldispatch.plan import batch_settings


def read_lengths(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """seq_len per trajectory (and prompt_len when the file gives two columns)."""
    seq, prompt = [], []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise SystemExit(f"{path}:{lineno}: expected 'seq_len' or 'prompt_len response_len', got {line!r}")
        if len(nums) == 1 and nums[0] >= 1:
            seq.append(nums[0])
        elif len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
            prompt.append(nums[0])
            seq.append(nums[0] + nums[1])
        else:
            raise SystemExit(f"{path}:{lineno}: expected 'seq_len' or 'prompt_len response_len' (>= 1), got {line!r}")
    if prompt and len(prompt) != len(seq):
        raise SystemExit(f"{path}: mixes one- and two-column lines")
    return np.array(seq, dtype=np.int64), (np.array(prompt, dtype=np.int64) if prompt else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="trainer YAML (defaults: rldispatch/config.py)")
    ap.add_argument("--world", type=int, required=True, help="number of training processes (GPUs)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--lengths", default=None, help="file of trajectory lengths (see above)")
    src.add_argument("--synthetic", default="lognormal", choices=DISTRIBUTIONS, help="length mix to draw")
    ap.add_argument("--samples", type=int, default=None, help="trajectories to draw (default: batch x rollout.n)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic lengths")
    ap.add_argument("--max-rows", type=int, default=64, help="rows of the topology table to print")
    ap.add_argument("--json", default=None, help="also write the metrics and per-rank figures to this file")
    ap.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. actor.megatron.tp=2")
    args = ap.parse_args(argv)

    from rldispatch.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        topo = Topology.from_config(cfg.actor.parallel, args.world)
        settings = batch_settings(cfg, topo, step=0)
        settings.check(topo)
    except ConfigError as exc:  # every layer's configuration errors subclass it
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if args.lengths:
        seq, prompt = read_lengths(args.lengths)
        source = args.lengths
    else:
        n = args.samples if args.samples is not None else cfg.data.train_batch_size * cfg.rollout.n
        seq = synthetic_lengths(args.synthetic, n, seed=args.seed, max_len=max_len, min_len=2)
        prompt = None
        source = f"synthetic {args.synthetic} (max seq_len {max_len}, seed {args.seed})"
    if prompt is None:
        prompt = np.maximum(1, np.minimum(seq - 1, cfg.data.max_prompt_length))
    tags = [{"prompt_len": int(p), "response_len": int(s - p), "seq_len": int(s), "is_padding": False}
            for p, s in zip(prompt, seq)]
    keys = [f"t{i:07x}_0_0" for i in range(len(tags))]
    pad = make_padding(padding_count(len(tags), settings.padding_multiple(topo)), seed=0, fields=[])
    try:
        plan = build_plan(tags + pad.tags, topo, settings, keys=keys + pad.keys)
    except (PlanError, ValueError) as exc:
        print(f"cannot plan: {exc}", file=sys.stderr)
        return 2

    print("== topology")
    print(topo.summary())
    print(topo.table(max_rows=args.max_rows))
    print(f"\n== logical DP = {topo.dp_size}  (seq_shards {topo.seq_shards}, micro-batch group {topo.microbatch_group})")
    print(f"batch: {len(tags)} trajectories from {source}; +{len(pad)} padding "
          f"(multiple {settings.padding_multiple(topo)}); mini-batch {settings.mini_batch_samples} trajectories, "
          f"{settings.ppo_epochs} epoch(s), micro-batches by "
          + (f"token budget {settings.token_cap(topo)}" if settings.max_token_len_per_gpu else
             f"size {settings.micro_batch_size_per_gpu}"))
    print("\n== per DP rank (all mini-batches of the step)")
    print(plan.table())
    print("\n== step metrics")
    for k, v in plan.metrics.items():
        print(f"{k:40s} {v:.4f}")
    if args.json:
        out = {"topology": topo.summary(), "metrics": plan.metrics,
               "ranks": [{"dp_rank": r.dp_rank, "samples": r.num_samples, "padding": r.padding, "tokens": r.tokens,
                          "workload": r.workload, "micro_batches": r.num_micro_batches} for r in plan.ranks]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
