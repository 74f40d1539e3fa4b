"""Cost of the GRPO step's non-model stages per trajectory, from 512 to 32768 trajectories, on 1 and 2 gloo ranks.

The trainer's own stage methods run on a :class:`rldispatch.grpo.GRPOTrainer` built without engines: rollout
generation is a synthetic token sampler (instant), reference log-probs are written synthetically, and everything
else is the real code path — agent-loop post-processing and store puts, replay sampling, padding and planning, the
dispatch fetch of each rank's share, reward scoring with the built-in scorers, bypass old log-probs, KL metrics,
advantage, metrics, clear and the step-boundary garbage collection (``trainer.gc_interval``; ``--gc-interval 0``
times the same step with Python's automatic collector instead). A linear step costs the same milliseconds per 1k
trajectories at every size::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step_overhead.py --out /tmp/overhead.json
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step_overhead.py --sizes 512,2048 --worlds 1

Prints per stage: ms per 1k trajectories at each size and the growth ratio of that figure per size doubling
(1.0 = linear; 2.0 = quadratic); then the step's non-model wall time per 1k trajectories, the min-max over the
steps, and how flat the cost per trajectory is over the sizes. After a warm-up step, each size measures pairs of
steps until ``--budget-s`` is spent (at least 3 pairs, so a small size gets many): one step with barriers between
the stages (a stage's time is its own: on 2 ranks its slowest rank's), one without, as the trainer runs (its wall
time: the slowest rank's stages back to back). Figures are medians over the steps. The exchanges go over gloo, as in
the trainer; on a machine whose cores are all busy (2 ranks on 2 cores) a gloo message may wait a scheduler tick
for gloo's own thread, so the smallest size's cost per trajectory is not expected to be flat there.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the non-model stages timed, in step order ("rollout_put" is the rollout minus generation)
STAGES = ("rollout_put", "sample", "plan", "reward", "dispatch", "old_log_prob", "kl", "advantage", "metrics",
          "clear", "gc")
ROLLOUT_N = 8


class SyntheticRollout:
    """A rollout engine (every verb of :class:`backends.rollout.RolloutEngine`) that stands in for the model:
    instant, deterministic random responses with log-probs.

    Each reseed draws one step's tokens in bulk (``pool`` responses: the step's trajectories), so a call costs two
    list slices: the generation is the model's time, not the step overhead this script measures.
    """

    def __init__(self, vocab: int, max_tokens: int, stop_ids: set[int], pool: int):
        self.vocab, self.max_tokens, self.stop_token_ids, self.pool = vocab, max_tokens, frozenset(stop_ids), pool
        self.weights_version = 0
        self.reseed(0)

    def reseed(self, seed: int, rank: int | None = 0) -> None:
        rng = np.random.default_rng([seed, rank or 0])
        self._lengths = rng.integers(1, self.max_tokens + 1, size=self.pool).tolist()
        self._ids = rng.integers(4, self.vocab, size=self.pool + self.max_tokens).tolist()
        self._logprobs = (-rng.random(self.pool + self.max_tokens)).tolist()
        self._next = 0

    async def agenerate(self, prompt_ids, sampling_params=None):
        from protocol.rollout.agent_loop.base import Generated

        i = self._next
        self._next = (i + 1) % self.pool
        end = i + self._lengths[i]
        return Generated(self._ids[i:end], self._logprobs[i:end], (self.weights_version,))

    def load_weights(self, weights, version=None) -> None:
        self.weights_version = self.weights_version + 1 if version is None else int(version)

    def load_adapters(self, adapters, scale, version=None) -> None:
        self.load_weights(adapters, version)

    def weight_dtypes(self) -> dict:
        return {}

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


def build_trainer(size: int, rank: int, world: int, work: Path, gc_interval: int = 1):
    """A GRPOTrainer of the shipped tiny config for ``size`` trajectories, with every component but the engines."""
    from dispatch import Topology
    from protocol.algos.kl import FixedKLController
    from protocol.algos.reward import build_reward_manager
    from protocol.rollout.dataset import RLHFDataset
    from protocol.rollout.tasks.data import write_task_data
    from protocol.rollout.tokenizer import decode_response, load_tokenizer, resolve_tokenizer, stop_token_ids
    from protocol.store import LocalStore
    from rldispatch.bridge import StoreBridge
    from rldispatch.config import load_config
    from rldispatch.dataplane import ShardedStore
    from rldispatch.gc_policy import StepGC
    from rldispatch.grpo import GRPOTrainer
    from rldispatch.launch import DistContext
    from rldispatch.metrics import MetricsLogger
    from rldispatch.prompts import PromptStream
    from rldispatch.rollout import LocalRollout
    from rldispatch.schedules import Seams, SyncSchedule
    from rldispatch.trace import TraceRecorder

    prompts = size // ROLLOUT_N
    data = work / "data"
    cfg = load_config("grpo_tiny", [
        f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={max(prompts // 4, 1)}",
        f"data.train_files=[{data}/train.parquet]", f"data.val_files=[{data}/val.parquet]",
        "rollout.log_prob_mode=bypass", "algorithm.use_kl_in_reward=true", f"trainer.run_dir={work}/run",
        f"trainer.gc_interval={gc_interval}"])
    if rank == 0 and not (data / "train.parquet").exists():
        write_task_data(str(data), cfg.data.task, train=prompts, val=8, seed=0)
    if world > 1:
        dist.barrier()
    t = GRPOTrainer.__new__(GRPOTrainer)  # __init__ would build the engines
    t.cfg, t.ctx = cfg, DistContext(rank, world, torch.device("cpu"))
    t.run_dir = Path(cfg.trainer.run_dir)
    t.topology = Topology.from_config(cfg.actor.parallel, world)
    t.dp_ranks = [t.topology.dp_rank(r) for r in range(world)]
    t.dp_rank, t.reporting = t.dp_ranks[rank], t.topology.is_reporting(rank)
    t.tokenizer = load_tokenizer(resolve_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))
    t.train_set = RLHFDataset(cfg.data.train_files, t.tokenizer, cfg.data.max_prompt_length,
                              prompt_key=cfg.data.prompt_key)
    t.store = ShardedStore(LocalStore())
    t.bridge, t.ref_bridge = StoreBridge(None, t.store), None
    t.critic = t.reward_model = t.judge = None  # no critic, no reward model, no judge: the GRPO step
    engine = SyntheticRollout(cfg.model.vocab_size, cfg.data.max_response_length, stop_token_ids(t.tokenizer),
                              pool=size)
    holders = [t.topology.reporting_rank(d) for d in range(t.topology.dp_size)]
    t.rollout = LocalRollout(cfg, engine, t.tokenizer, t.store, partial=False, rank=t.dp_rank, holders=holders,
                             me=rank)
    t.stream = PromptStream(t.train_set, cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
    t.reward_manager = build_reward_manager(
        cfg.reward, cfg.custom_reward_function,
        decode=functools.partial(decode_response, t.tokenizer, stop_ids=engine.stop_token_ids),
        max_response_len=cfg.data.max_response_length)
    t.kl_ctrl = FixedKLController(cfg.algorithm.kl_ctrl.kl_coef)
    t.metrics = MetricsLogger(t.run_dir, rank == 0, tensorboard=False)
    t.trace = TraceRecorder(str(work / f"trace{rank}.jsonl"), enabled=False, rank=rank)
    t.gc = StepGC(cfg.trainer.gc_interval)  # started by the caller, as fit() does
    t.step = 0
    # trainer.mode=sync: generate the step's prompts, then train on them
    t.schedule = SyncSchedule(Seams(cfg, t.stream, t.store, t.rollout, lambda: {}, holders), 0)
    return t


def one_step(t, step: int, on_stage=None, barriers: bool = True) -> dict[str, float]:
    """One step of the non-model stages; returns seconds per stage on this rank.

    ``barriers``: the ranks meet before each stage, so a stage's time is its own (without them, as in the trainer,
    a stage also waits for the peers' previous stages to end). ``on_stage(name)`` is called as each stage starts
    (the complexity test counts operations per stage with it).
    """
    from rldispatch.rollout import TRAIN
    from rldispatch.step_state import StepState

    t.step = step
    st = StepState(step)
    times: dict[str, float] = {}
    world = t.ctx.world

    def timed(name, fn, *args):
        if world > 1 and barriers:
            dist.barrier()
        if on_stage is not None:
            on_stage(name.removesuffix("_fetch").removesuffix("_finish"))
        t0 = time.perf_counter()
        out = fn(*args)
        times[name] = time.perf_counter() - t0
        return out

    timed("rollout_put", t._generate, None, st)
    meta = timed("sample", t._sample, None, st)
    full = timed("plan", t._plan, meta, st)
    timed("reward", t._compute_reward, full, st)
    st.mine = timed("dispatch", lambda: st.plan.rank_meta(full, t.dp_rank))
    inputs = timed("dispatch_fetch", t.bridge.fetch_infer_inputs, st.mine, t._infer_wants(st))
    times["dispatch"] += times.pop("dispatch_fetch")
    timed("old_log_prob", t._bypass_old_log_probs, st.own, st.own_pad)
    t.store.sync()
    # what the engines would write on the rank that scores the share (not timed): the old log-probs (the same
    # values as the bypass wrote, so a rank holding both sees no conflict) and the reference's, shifted
    share = st.mine.keys if t.reporting else []
    old = t.store.fetch(share, TRAIN, ["old_log_probs"])
    if share:
        t.store.kv_batch_put(share, TRAIN, TensorDict({"old_log_probs": old["old_log_probs"],
                                                       "ref_log_prob": old["old_log_probs"] - 0.1},
                                                      batch_size=[len(share)]))
    t.store.sync()
    timed("kl", t._kl_metrics, st, inputs)
    timed("advantage", t._compute_advantage, full, st)
    timed("metrics", t._sample_metrics, st.own, st.own_pad, st.stats)
    timed("clear", t._clear, full, st)
    timed("gc", t._collect_garbage, None, st)
    # the trainer reduces the step's metrics once at its end (one collective) and logs them
    timed("metrics_finish", lambda: t.metrics.log(step + 1, t._finish(st, 1.0)))
    times["metrics"] += times.pop("metrics_finish")
    return times


def more(pairs: int, elapsed: float, steps: int | None, budget_s: float, least: int, most: int) -> bool:
    """Whether to measure another pair of steps, agreed by the ranks (rank 0's clock decides): ``steps - 1`` pairs
    when given, else until ``budget_s`` is spent, at least ``least`` pairs (a median of few steps at a small size
    is one collective's latency tail away from another) and at most ``most``."""
    if steps is not None:
        return pairs < steps - 1
    go = torch.tensor([pairs < least or (elapsed < budget_s and pairs < most)], dtype=torch.int64)
    if dist.get_world_size() > 1:
        dist.broadcast(go, src=0)
    return bool(go)


def worker(rank: int, world: int, sizes: list[int], steps: int | None, port: int, work: str, out: str,
           gc_interval: int, budget_s: float = 4.0, least: int = 3, most: int = 60) -> None:
    """Every size: one warm-up step, then pairs of measured steps (:func:`more`); records each stage's median and
    the median step wall time, with their spreads, of the slowest rank."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for size in sizes:
            t = build_trainer(size, rank, world, Path(work) / f"n{size}", gc_interval)
            t.gc.start()
            runs, walls = [one_step(t, 0)], []  # the first step warms caches up
            # steps with barriers between the stages (each stage's own time) alternate with steps without (the
            # non-model wall time of a step as the trainer runs it: each rank's stages back to back)
            start = time.perf_counter()
            while more(len(walls), time.perf_counter() - start, steps, budget_s, least, most):
                runs.append(one_step(t, 2 * len(walls) + 1))
                walls.append(sum(one_step(t, 2 * len(walls) + 2, barriers=False).values()))
            t.gc.stop()
            measured = runs[1:] or runs
            local = {k: [r[k] for r in measured] for k in STAGES}
            gathered: list = [None] * world
            dist.all_gather_object(gathered, (local, walls))
            # a stage's time in a step is its slowest rank's; so is a step's wall time
            per_step = {k: [max(g[0][k][i] for g in gathered) for i in range(len(measured))] for k in STAGES}
            totals = [sum(per_step[k][i] for k in STAGES) for i in range(len(measured))]
            wall = [max(g[1][i] for g in gathered) for i in range(len(walls))]
            results[size] = {k: statistics.median(v) for k, v in per_step.items()}
            results[size]["total"] = statistics.median(totals)
            results[size]["total_min"], results[size]["total_max"] = min(totals), max(totals)
            results[size]["wall"] = statistics.median(wall) if wall else results[size]["total"]
            results[size]["wall_min"], results[size]["wall_max"] = (min(wall), max(wall)) if wall else (0.0, 0.0)
            results[size]["steps"] = len(measured)
            t.metrics.close()
            if rank == 0:
                print(f"  world={world} n={size}: stages {results[size]['total'] * 1e3:.0f} ms, step wall "
                      f"{results[size]['wall'] * 1e3:.0f} ms (medians of {len(measured)} steps each)", flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def flatness(results: dict[int, dict[str, float]], key: str = "total") -> dict[str, float]:
    """``key``'s (the stages' total, or the step's wall time) cost per trajectory at each size over the median of
    the sizes: the farthest size's deviation, and the largest over the smallest (1.0: the same at every size)."""
    per_k = {n: results[n][key] / n for n in results}
    mid = statistics.median(per_k.values())
    return {"max_deviation": max(abs(v / mid - 1) for v in per_k.values()),
            "max_over_min": max(per_k.values()) / min(per_k.values())}


def table(results: dict[int, dict[str, float]], world: str) -> tuple[str, dict]:
    """Per stage: ms per 1k trajectories at each size and the growth ratio per doubling of the size."""
    sizes = sorted(results)
    rows, growth = [], {}
    head = f"{'world=' + str(world):<14}" + "".join(f"{n:>9}" for n in sizes) + "   growth/doubling"
    for k in (*STAGES, "total"):
        per_k = [results[n][k] * 1e3 / (n / 1000) for n in sizes]
        doublings = [(per_k[i + 1] / max(per_k[i], 1e-9)) ** (1 / math.log2(sizes[i + 1] / sizes[i]))
                     for i in range(len(sizes) - 1)]
        growth[k] = doublings
        rows.append(f"{k:<14}" + "".join(f"{v:>9.1f}" for v in per_k) + "   "
                    + " ".join(f"{g:.2f}" for g in doublings))
    def row(name: str, cells: list) -> None:
        rows.append(f"{name:<14}" + "".join(f"{c:>9}" for c in cells))

    for key in ("total", "wall"):
        if all(f"{key}_min" in results[n] for n in sizes):
            if key == "wall":
                row("step wall", [f"{results[n]['wall'] * 1e6 / n:.1f}" for n in sizes])
            row(f"{key} min-max", [f"{results[n][key + '_min'] * 1e6 / n:.0f}-{results[n][key + '_max'] * 1e6 / n:.0f}"
                                   for n in sizes])
    if all("steps" in results[n] for n in sizes):
        row("steps", [results[n]["steps"] for n in sizes])
    for key, what in (("total", "stages' total"), ("wall", "step wall")):
        if all(key in results[n] for n in sizes):
            flat = flatness(results, key)
            rows.append(f"per trajectory, {what}: farthest size {flat['max_deviation'] * 100:.0f} % from the median "
                        f"of the sizes, largest / smallest {flat['max_over_min']:.2f}")
    return "\n".join([head + "   (ms per 1k trajectories)", *rows]), growth


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="512,2048,8192,32768", help="trajectories per step, comma-separated")
    p.add_argument("--worlds", default="1,2", help="gloo world sizes to run, comma-separated")
    p.add_argument("--steps", type=int, default=None,
                   help="a warm-up step, then STEPS-1 measured pairs of steps (one with barriers between the stages, one "
                        "without) per size (default: as many pairs as fill --budget-s, at least 3 and at most 60)")
    p.add_argument("--budget-s", type=float, default=4.0, help="seconds of measured steps per size (without --steps)")
    p.add_argument("--gc-interval", type=int, default=1, help="trainer.gc_interval (0: Python's automatic GC)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    bad = [s for s in sizes if s % (ROLLOUT_N * 4) or s < ROLLOUT_N * 4]
    if bad:
        raise ValueError(f"--sizes: {bad} are not multiples of {ROLLOUT_N * 4} (rollout.n=8 x 4 mini-batches)")
    report = {"sizes": sizes, "stages": list(STAGES), "gc_interval": a.gc_interval, "worlds": {}}
    with tempfile.TemporaryDirectory() as work:
        for world in [int(w) for w in a.worlds.split(",")]:
            name = str(world)
            res_path = Path(work) / f"res{name}.json"
            port = 29000 + random.Random(f"{os.getpid()}:{name}").randrange(2000)
            mp.start_processes(worker, args=(world, sizes, a.steps, port, work, str(res_path), a.gc_interval,
                                             a.budget_s),
                               nprocs=world, join=True, start_method="spawn")
            results = {int(k): v for k, v in json.loads(res_path.read_text()).items()}
            text, growth = table(results, name)
            print(text, flush=True)
            report["worlds"][name] = {"seconds": results, "growth_per_doubling": growth,
                                      "flatness": flatness(results), "wall_flatness": flatness(results, "wall")}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
