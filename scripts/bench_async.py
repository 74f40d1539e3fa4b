"""Throughput of the trainer modes on a task with long-tailed response lengths, side by side, on 2 gloo ranks.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_async.py --steps 8 --out /tmp/bench_async.json

The shipped ``grpo_tiny`` task and model, with an agent loop that gives one prompt in eight a 64-token response
budget and the others 8 tokens (per prompt, so a GRPO group is all long or all short). Each mode is one
``torchrun --nproc_per_node=2`` of this script with the same config, seed and number of steps (every step trains
``train_batch_size x rollout.n`` trajectories, in 2 mini-batch updates): ``sync``, ``colocate_async`` (one warm-up
batch ahead, partial rollout in ``--chunk``-token chunks) and ``separate_async`` (rank 1 generates, rank 0 trains;
one warm-up batch ahead; 2 mini-batch updates and one weight sync per step, as in the other modes). The first
``--skip`` steps are left out (start-up). Printed per mode: trajectories per second (trained trajectories over the
summed step times), the median step time, and each rank role's idle share (``timing_s/trainer_idle`` and
``timing_s/rollout_idle`` over the step time; in separate_async the first is the training rank's wait for groups,
the second the rollout rank's time without generation), then the ratio to sync.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = {
    "sync": ("trainer.mode=sync",),
    "colocate_async": ("trainer.mode=colocate_async", "trainer.colocate_async.num_warmup_batches=1"),
    "separate_async": ("trainer.mode=separate_async", "trainer.separate_async.num_warmup_batches=1",
                       "trainer.separate_async.rollout_ranks=1"),
}
LONG, SHORT, ONE_IN = 64, 8, 8


def _register_long_tail() -> None:
    """The ``long_tail`` agent loop: single turn, with a response budget of LONG tokens for one prompt in ONE_IN."""
    from protocol.rollout.agent_loop import SingleTurnAgentLoop
    from protocol.rollout.agent_loop.base import register_agent_loop

    @register_agent_loop("long_tail")
    class LongTailAgentLoop(SingleTurnAgentLoop):
        async def run(self, prompt: Any, sampling_params: Any = None, **kwargs: Any):
            ids = self.prompt_to_ids(prompt)
            long = zlib.crc32(json.dumps(ids).encode()) % ONE_IN == 0
            params = {**(sampling_params or {}), "max_tokens": LONG if long else SHORT}
            return await super().run(prompt, params, **kwargs)


def worker(overrides: list[str]) -> int:
    """One training run under torchrun (this script with ``--worker``)."""
    _register_long_tail()
    from rldispatch.config import load_config
    from rldispatch.lifecycle import run

    return run(load_config(str(ROOT / "configs" / "grpo_tiny.yaml"), overrides))


def _summary(records: list[dict], skip: int) -> dict[str, float]:
    rs = records[skip:]
    seconds = sum(r["timing_s/step"] for r in rs)
    trajectories = sum(r["replay/num_trajectories"] for r in rs)
    return {"steps": len(rs), "trajectories": trajectories, "seconds": seconds,
            "trajectories_per_s": trajectories / seconds,
            "step_s_median": statistics.median(r["timing_s/step"] for r in rs),
            "trainer_idle_share": sum(r["timing_s/trainer_idle"] for r in rs) / seconds,
            "rollout_idle_share": sum(r["timing_s/rollout_idle"] for r in rs) / seconds,
            "response_length_mean": statistics.mean(r["response_length/mean"] for r in rs),
            "partial_ratio": statistics.mean(r.get("partial/partial_ratio", 0.0) for r in rs),
            "staleness_mean": statistics.mean(r.get("off_policy/trajectory_staleness/mean", 0.0) for r in rs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--chunk", type=int, default=8, help="rollout.partial_rollout_chunk of the async modes")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every mode this many times, interleaved (A B C A B C ...); each figure is the median "
                         "over rounds, so a load spike on a shared machine distorts one round of one mode only")
    ap.add_argument("--out", type=Path, default=Path("bench_async.json"))
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker)
    base = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.val_freq=0", "trainer.save_freq=0",
            f"trainer.total_steps={args.steps}", "rollout.agent_loop=long_tail", f"data.max_response_length={LONG}",
            "data.val_batch_size=4", "data.train_size=256", "data.val_size=8", "trainer.run_dir_exists=overwrite",
            f"rollout.partial_rollout_chunk={args.chunk}"]
    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        data = [f"data.train_files=[{tmp}/data/train.parquet]", f"data.val_files=[{tmp}/data/val.parquet]"]
        for n in range(args.rounds):
            for i, mode in enumerate(args.modes):
                run_dir = Path(tmp) / mode
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                       f"--master_port={29600 + n * len(MODES) + i}", __file__, "--worker", *base, *data,
                       *MODES[mode], f"trainer.run_dir={run_dir}"]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
                if proc.returncode != 0:
                    print(proc.stderr[-4000:], file=sys.stderr)
                    return proc.returncode
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                rounds[mode].append(_summary(records, args.skip))
                print(f"round {n + 1} {mode}: {rounds[mode][-1]['trajectories_per_s']:.1f} traj/s", flush=True)
    results: dict[str, Any] = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                               for mode, runs in rounds.items()}
    for mode, runs in rounds.items():
        results[mode]["rounds_trajectories_per_s"] = [r["trajectories_per_s"] for r in runs]
    sync = results.get("sync")
    print(f"{'mode':16} {'traj/s':>8} {'vs sync':>8} {'step s':>8} {'trainer idle':>13} {'rollout idle':>13} "
          f"{'partial':>8} {'staleness':>9}")
    for mode, r in results.items():
        if isinstance(r, str):
            print(f"{mode:16} {r}")
            continue
        ratio = r["trajectories_per_s"] / sync["trajectories_per_s"] if sync else float("nan")
        r["speedup_vs_sync"] = ratio
        print(f"{mode:16} {r['trajectories_per_s']:8.1f} {ratio:8.2f} {r['step_s_median']:8.2f} "
              f"{r['trainer_idle_share']:13.2f} {r['rollout_idle_share']:13.2f} {r['partial_ratio']:8.2f} "
              f"{r['staleness_mean']:9.2f}")
    args.out.write_text(json.dumps({"config": {"steps": args.steps, "skip": args.skip, "chunk": args.chunk,
                                               "long": LONG, "short": SHORT, "one_in": ONE_IN, "ranks": 2,
                                               "rounds": args.rounds},
                                    "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
