"""The GRPO step, wired from protocol, dispatch and backends; every rank runs this code (SPMD). When and where
generation runs around the step (``trainer.mode``) is the schedule's (:mod:`rldispatch.schedule`).

One step: prompts -> uid per prompt -> rollout on each DP replica's reporting rank -> store -> reward ->
balance and dispatch plan -> old log-probs -> reference log-probs -> KL -> (with a critic: values) -> advantage ->
(critic update) -> actor update (ppo_epochs x mini-batches) -> metrics -> ``kv_clear`` of every key of the step ->
weight sync to the rollout.

The controller holds :class:`protocol.store.meta.KVBatchMeta` objects only; values stay where they were produced and
move point to point through :class:`trainer.dataplane.ShardedStore`.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import random
import shutil
import signal
import sys
import time
import uuid
from datetime import timedelta
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from tensordict import TensorDict

from backends.base import get_engine_class
from backends.comm import allreduce_counts
from dispatch import Topology
from protocol.algos.advantage import (compute_advantage, get_advantage_fn, session_inputs_from_keys,
                                     whiten_by_moments, whiten_moments)
from protocol.rollout.agent_loop import build_agent_loop, builtin_tools, run_groups
from protocol.rollout.dataset import DatasetError, RLHFDataset, ground_truth_of
from protocol.invariants import assert_invariants
from protocol.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty
from protocol.store.meta import KVBatchMeta
from protocol.batch.nested import jagged_to_padded, nested_lengths, padded_to_jagged_many, to_nested
from protocol.store.replay_buffer import ReplayBuffer, ReplayBufferError
from protocol.algos.rollout_correction import correction_metrics, rollout_correction
import protocol.rollout.tasks  # noqa: F401  (registers the task scorers by data_source)
from protocol.algos.reward import (RewardError, RewardInput, RewardResult, build_reward_manager,
                                   compute_rm_scores, needs_ground_truth, numeric_extras)
from protocol.store import LocalStore
from protocol.store.batching import batch_of, jagged_rows
from protocol.store.keys import uid_of
from protocol.rollout.tokenizer import check_vocab_fits, decode_response, load_tokenizer, resolve_tokenizer
from rldispatch.bridge import StoreBridge
from rldispatch.step_state import StepState
from rldispatch.config import ConfigError, RunConfig
from rldispatch.collectives import check_digests, gather_objects, key_digest
from rldispatch.run_dir import (RUN_RECORD, check_resume_config, checkpoint_candidates, claim_run_dir,
                                write_run_record)
from rldispatch.dataplane import ShardedStore
from rldispatch.faults import FaultInjectingLoop, fails
from rldispatch.gc_policy import StepGC
from rldispatch.metrics import (
    ComputeClock, MetricsLogger, StepStats, Timer, distributed_masked_stats, explained_variance, sample_lengths,
)
from rldispatch.ref import build_reference
from rldispatch.plan import batch_settings, prepare_step_plan
from rldispatch.rollout import RolloutWorker, VersionedGenerate, run_to_end
from rldispatch.schedule import build_schedule
from rldispatch.separate import RolloutRank, SeparateAsyncSchedule, split_world
from rldispatch.summary import RunSummary
from protocol.config import to_plain
from rldispatch.trace import TraceRecorder

__all__ = ["GRPOTrainer", "run", "NoUsableGroupsError", "NonFiniteUpdateError", "die_with_parent", "MODEL_STAGES",
           "overhead_fraction"]

logger = logging.getLogger(__name__)
TRAIN, VAL = "train", "val"


class NoUsableGroupsError(RuntimeError):
    """A step whose every prompt group failed or was dropped: nothing can be trained on."""


class NonFiniteUpdateError(RuntimeError):
    """An update left a non-finite weight or loss and ``trainer.on_nonfinite=stop``."""


def die_with_parent() -> None:
    """Under a launcher (torchrun), end this worker when the launcher dies, so no orphan keeps training.

    Linux delivers SIGKILL on the parent's death (``PR_SET_PDEATHSIG``); elsewhere nothing is set up.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this worker outlives a killed launcher",
                       ctypes.get_errno())
    if parent == 1 or os.getppid() != parent:  # the launcher died before the call
        os._exit(1)


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device
    link: Any = None  # trainer.mode=separate_async: the split world's links to the rollout ranks (rldispatch.separate)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str, timeout_s: float | None = None) -> DistContext:
    """gloo on CPU, NCCL on GPUs; a plain ``python scripts/train.py`` runs as a world of one.

    ``timeout_s`` (``trainer.dist_timeout_s``) bounds every collective: a stuck or dead peer ends the job.
    """
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=float(timeout_s))}
        dist.init_process_group("nccl" if use_cuda else "gloo", **kwargs)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), device)


def step_uids(seed: int, step: int, count: int, partition: str = TRAIN) -> list[str]:
    """The same fresh uids on every rank, derived from (seed, step): no collective, and a resumed run reuses them."""
    rng = random.Random(f"{partition}:{seed}:{step}")
    return [uuid.UUID(int=rng.getrandbits(128), version=4).hex for _ in range(count)]


def batch_indices(num_rows: int, batch_size: int, step: int, seed: int, shuffle: bool) -> list[int]:
    """Dataset rows of ``step``: an epoch-wise permutation seeded by (seed, epoch), so a resumed run sees the same."""
    per_epoch = num_rows // batch_size
    if per_epoch == 0:
        raise ValueError(f"the training set has {num_rows} rows, fewer than data.train_batch_size={batch_size}")
    epoch, pos = divmod(step, per_epoch)
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(num_rows, generator=g).tolist()
    else:
        order = list(range(num_rows))
    return order[pos * batch_size:(pos + 1) * batch_size]


#: Stages whose time is the models' (rollout generation, log-probs of the policy and the reference, the update,
#: the weight sync); every other stage (sample, plan, reward, advantage, clear) is the step's own overhead.
MODEL_STAGES = ("rollout", "old_log_prob", "ref", "values", "critic_update", "update", "weight_sync")
#: what the advantage stage writes, on the rank that generated each group
ADVANTAGE_FIELDS = ("token_level_scores", "token_level_rewards", "advantages", "returns")
#: what the critic's update reads
CRITIC_FIELDS = ("input_ids", "response_mask", "values", "returns")
#: the step's sums behind ``critic/vf_explained_var`` (reduced with the other metrics, then replaced by it)
_EV_SUMS = tuple(f"critic/explained_var_sums/{k}" for k in ("n", "r", "rr", "d", "dd"))


def overhead_fraction(times: dict[str, float], step_seconds: float) -> float:
    """The step's non-model share: the summed ``timing_s/<stage>`` of stages not in MODEL_STAGES over the step."""
    model = {f"timing_s/{s}" for s in MODEL_STAGES} | {"timing_s/step", "timing_s/overhead_fraction"}
    other = sum(v for k, v in times.items() if k.startswith("timing_s/") and k not in model)
    return other / step_seconds if step_seconds > 0 else 0.0


_SUMMED = ("tokens", "seqs", "micro_batches", "skipped", "nonfinite", "time")
_SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}
_LAST = ("global_step", "lr")


def combine_update_metrics(updates: Sequence[dict[str, float]], prefix: str = "actor/") -> dict[str, float]:
    """One step's ``actor/*`` (or ``critic/*``) metrics from its optimizer steps: counts add up, lr is the last, the
    rest average."""
    out: dict[str, float] = {}
    for k in sorted({k for u in updates for k in u}):
        vals = [float(u[k]) for u in updates if u.get(k) is not None]
        if not vals:
            continue
        out[f"{prefix}{k}"] = sum(vals) if k in _SUMMED else vals[-1] if k in _LAST else sum(vals) / len(vals)
    out[f"{prefix}optimizer_steps"] = float(len(updates))
    return out


class GRPOTrainer:
    """Holds the run's components; :meth:`fit` runs ``trainer.total_steps`` GRPO steps under the run's schedule."""

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.run_dir = Path(cfg.trainer.run_dir)
        claim_run_dir(self.run_dir, cfg.trainer, is_main=ctx.is_main)  # refuse another run's folder (every rank)
        dist.barrier()
        self.topology = Topology.from_config(cfg.actor.parallel, ctx.world)
        self.dp_rank = self.topology.dp_rank(ctx.rank)
        self.reporting = self.topology.is_reporting(ctx.rank)
        batch_settings(cfg, self.topology, step=0).check(self.topology)  # refuse undividable batches before rollout
        self.tokenizer = load_tokenizer(resolve_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))
        check_vocab_fits(self.tokenizer, cfg.model.vocab_size)  # before any engine is built
        self._ensure_data()
        d = cfg.data
        # every row's data_source and ground truth are checked against the scorers before step 0 (a custom reward
        # function decides for itself which rows it can score)
        check = None if cfg.custom_reward_function.path else needs_ground_truth
        self.train_set, self.val_set = (self._dataset(key, check) for key in ("train_files", "val_files"))
        if len(self.train_set) < d.train_batch_size:
            raise ConfigError(f"data.train_batch_size={d.train_batch_size} exceeds the {len(self.train_set)} usable "
                              f"rows of data.train_files {d.train_files}")

        engine_cls = get_engine_class(cfg.actor.backend)
        self.engine = engine_cls(cfg.engine_config(), self.topology)
        self.ref_engine = build_reference(cfg.actor.backend, engine_cls, cfg.engine_config(), self.topology,
                                          self.engine) if cfg.ref.enabled else None

        self.critic = self._build_critic() if cfg.critic.enabled else None

        self.store = ShardedStore(LocalStore(), device=ctx.device)
        self.bridge = StoreBridge(self.engine, self.store)
        self.ref_bridge = StoreBridge(self.ref_engine, self.store) if self.ref_engine is not None else None
        self.critic_bridge = StoreBridge(self.critic, self.store) if self.critic is not None else None
        self.replay = ReplayBuffer(self.store, TRAIN, max_off_policy_threshold=cfg.replay.max_off_policy_threshold,
                                   off_policy_strategy=cfg.replay.off_policy_strategy,
                                   failure_policy=cfg.replay.failure_policy,
                                   mode="sync" if cfg.trainer.mode == "sync" else "async")
        self.rollout = RolloutWorker(cfg.model, self.tokenizer, device=ctx.device, seed=cfg.trainer.seed,
                                     rank=self.dp_rank)
        self.loop = asyncio.new_event_loop()  # the rollout's sessions run on it, step after step
        loop_kwargs = {"max_turns": cfg.rollout.max_turns, "tools": builtin_tools()} \
            if cfg.rollout.agent_loop == "tool" else {}
        partial = cfg.rollout.partial_rollout if cfg.rollout.partial_rollout is not None else cfg.trainer.mode != "sync"
        generate = VersionedGenerate(self.rollout, cfg.rollout.partial_rollout_chunk if partial else None)
        self.agent_loop = build_agent_loop(cfg.rollout.agent_loop, generate, tokenizer=self.tokenizer,
                                           max_response_length=cfg.data.max_response_length, **loop_kwargs)
        # only the stop token that ended the response is dropped; other special tokens stay in the decoded text:
        # a scorer that never saw them would let the policy pad its answer with <|pad|> and still score full marks
        build = functools.partial(
            build_reward_manager, cfg.reward, cfg.custom_reward_function,
            decode=functools.partial(decode_response, self.tokenizer, stop_ids=self.rollout.stop_token_ids),
            max_response_len=cfg.data.max_response_length)
        self.reward_manager = build()
        # validation scores gsm8k strictly whatever the training reward's shaping
        self.val_reward_manager = build(train=False) if cfg.reward.gsm8k_train.shaped else self.reward_manager
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = FixedKLController(kc.kl_coef) if kc.type == "fixed" else \
            AdaptiveKLController(kc.kl_coef, kc.target_kl, kc.horizon)
        self.metrics = MetricsLogger(self.run_dir, ctx.is_main, tensorboard=cfg.trainer.tensorboard)
        trace_path = cfg.trace.path or str(self.run_dir / f"trace.rank{ctx.rank}.jsonl")
        self.trace = TraceRecorder(trace_path, enabled=cfg.trace.enabled, rank=ctx.rank)
        self.gc = StepGC(cfg.trainer.gc_interval)
        self.step = 0
        self._resumed_schedule: dict | None = None
        self._maybe_resume()
        self.rollout.load_weights(self.engine.get_weights(), version=self.step)  # version = the step it serves
        self.schedule = SeparateAsyncSchedule(self) if cfg.trainer.mode == "separate_async" else build_schedule(self)
        self.schedule.restore(self._resumed_schedule)

    # ------------------------------------------------------------------------------------------------ setup
    def _dataset(self, key: str, check) -> RLHFDataset:
        """The rows of ``data.<key>``; a file, row or column that cannot be used is a config error naming the key."""
        d = self.cfg.data
        try:
            return RLHFDataset(getattr(d, key), self.tokenizer, d.max_prompt_length, prompt_key=d.prompt_key,
                               filter_overlong_prompts=d.filter_overlong_prompts, needs_ground_truth=check)
        except (DatasetError, RewardError) as exc:  # every rank reads the same files: all stop here alike
            raise ConfigError(f"data.{key}: {exc}") from exc

    def _build_critic(self):
        """The value model on its own FSDP section, whose topology must give the actor's DP ranks (one plan), or a
        Megatron critic in the actor's megatron-core parallel state (the actor's topology)."""
        if self.cfg.actor.backend == "megatron":
            from backends.megatron.critic import MegatronCriticEngine

            return MegatronCriticEngine(self.cfg.critic_engine_config(), self.topology)
        from backends.fsdp.critic import FSDPCriticEngine

        topology = Topology.from_config(self.cfg.critic.fsdp, self.ctx.world)
        if topology.dp_size != self.topology.dp_size or \
                [topology.dp_rank(r) for r in range(self.ctx.world)] != \
                [self.topology.dp_rank(r) for r in range(self.ctx.world)]:
            raise ConfigError(f"critic.fsdp gives logical DP {topology.dp_size}, the actor's section gives "
                              f"{self.topology.dp_size}: the critic must have the actor's DP ranks")
        return FSDPCriticEngine(self.cfg.critic_engine_config(), topology)

    def _ensure_data(self) -> None:
        """Generate the configured task's parquet files on first use (rank 0), so the quick start needs no download."""
        d = self.cfg.data
        missing = [f for f in [*d.train_files, *d.val_files] if not Path(f).exists()]
        failed = ""
        if missing and self.ctx.is_main:
            from protocol.rollout.tasks.data import write_task_data

            out_dirs = {str(Path(f).parent) for f in missing}
            try:
                for out in out_dirs:
                    logger.info("generating task %r data into %s", d.task, out)
                    write_task_data(out, d.task, train=d.train_size, val=d.val_size, seed=self.cfg.trainer.seed)
            except (OSError, ValueError) as exc:  # reach the barrier all the same: every rank then stops below
                failed = f" ({type(exc).__name__}: {exc})"
        dist.barrier()
        for key in ("train_files", "val_files"):
            still = [f for f in getattr(d, key) if not Path(f).exists()]
            if still:
                raise ConfigError(f"data.{key}: {still} not found, and data.task={d.task!r} could not generate "
                                  f"them{failed}")

    def _checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step}"

    def _maybe_resume(self) -> None:
        """``trainer.resume``: a folder, or ``auto`` = the newest checkpoint that loads (each skipped one is named
        with its reason). The saved config is compared first: model, layout and data-order changes are refused."""
        mode = self.cfg.trainer.resume
        if mode == "never":
            return
        if mode == "auto":
            candidates = checkpoint_candidates(self.run_dir / "checkpoints")
            if not candidates:
                if self.ctx.is_main:
                    logger.info("trainer.resume=auto: no checkpoint under %s; starting fresh", self.run_dir)
                return
        else:
            if not Path(mode).is_dir():
                raise ConfigError(f"trainer.resume={mode!r}: checkpoint folder {mode} does not exist; give a "
                                  "checkpoint folder (run_dir/checkpoints/step_N), auto or never")
            candidates = [Path(mode)]
        skipped = []
        for path in candidates:
            record = path / RUN_RECORD
            if record.is_file():  # refused changes raise (a config error is not a damaged checkpoint)
                changes = check_resume_config(json.loads(record.read_text()), to_plain(self.cfg), str(path))
            else:
                changes = []
            try:
                extra = self.engine.load_checkpoint(str(path))
                self._load_critic(path, int(extra["step"]))
                error = ""
            except Exception as exc:  # a damaged or partial checkpoint: say why, try the previous one
                extra, error = {}, f"{type(exc).__name__}: {exc}"
            failed = allreduce_counts([1.0 if error else 0.0], device=self.ctx.device)[0]
            if not failed:
                break
            skipped.append((path, error or "another rank could not load it"))
            if mode != "auto":
                raise RuntimeError(f"trainer.resume={mode!r}: cannot load the checkpoint: {skipped[-1][1]}")
            logger.warning("trainer.resume=auto: skipping checkpoint %s (%s)", path, skipped[-1][1])
        else:
            raise RuntimeError("trainer.resume=auto: no checkpoint under " f"{self.run_dir / 'checkpoints'} loads: "
                               + "; ".join(f"{p.name}: {why}" for p, why in skipped)
                               + ". Set trainer.resume=never with trainer.run_dir_exists=overwrite to start over")
        if not (path / RUN_RECORD).is_file() and "config" in extra:  # a checkpoint from before run.json
            changes = check_resume_config({"config": extra["config"]}, to_plain(self.cfg), str(path))
        self.step = int(extra["step"])
        self._resumed_schedule = extra.get("schedule")
        if "kl_coef" in extra and isinstance(self.kl_ctrl, AdaptiveKLController):
            self.kl_ctrl.value = float(extra["kl_coef"])  # the adaptive coefficient is state; a fixed one is config
        dropped = self.metrics.keep_through(self.step)
        if self.ctx.is_main:
            for key, old, new in changes:
                logger.info("resume: %s changed %r -> %r (applied)", key, old, new)
            logger.info("resumed from %s at step %d%s", path, self.step,
                        f"; dropped {dropped} metrics records after it" if dropped else "")

    def _load_critic(self, path: Path, step: int) -> None:
        """The critic's state from ``path/critic`` (written beside the actor's), for the same step."""
        if self.critic is None:
            return
        folder = path / "critic"
        if not folder.is_dir():
            raise FileNotFoundError(f"{path} holds no critic (no {folder.name}/ folder) but critic.enabled=true")
        saved = int(self.critic.load_checkpoint(str(folder)).get("step", -1))
        if saved != step:
            raise ValueError(f"{folder}: the critic was saved at step {saved}, the actor at step {step}")

    def save_checkpoint(self) -> None:
        """Write into ``step_N.partial`` and rename when every rank is done; ``latest`` names it only then, so a
        killed save leaves the previous checkpoint as the newest intact one."""
        path = self._checkpoint_dir(self.step)
        partial = path.with_name(path.name + ".partial")
        if self.ctx.is_main and partial.exists():
            shutil.rmtree(partial)  # a killed save's leftovers
        dist.barrier()
        extra = {"step": self.step, "kl_coef": float(self.kl_ctrl.value), "config": to_plain(self.cfg)}
        schedule = self.schedule.state()
        if schedule is not None:
            extra["schedule"] = schedule  # an async run's prompt stream and outstanding prompts
        self.engine.save_checkpoint(str(partial), extra_state=extra)
        if self.critic is not None:  # beside the actor's; an export reads the actor's weights only
            self.critic.save_checkpoint(str(partial / "critic"), extra_state={"step": self.step})
        dist.barrier()
        if self.ctx.is_main:
            write_run_record(partial, self.step, to_plain(self.cfg))
            if path.exists():
                shutil.rmtree(path)
            os.replace(partial, path)
            marker = self.run_dir / "checkpoints" / "latest"
            marker.with_suffix(".tmp").write_text(path.name)
            os.replace(marker.with_suffix(".tmp"), marker)
        dist.barrier()

    # ------------------------------------------------------------------------------------------------ rollout
    def _my_prompts(self, count: int) -> list[int]:
        """Positions of a submission's prompts this rank generates: round robin over the DP replicas' reporting
        ranks."""
        dp = self.topology.dp_size
        return [i for i in range(count) if i % dp == self.dp_rank] if self.reporting else []

    def _rollout(self, rows: list[dict], uids: list[str], partition: str, step: int, sampling: dict,
                 seed_step: int | None = -1, wait: bool = True) -> asyncio.Task | None:
        """Each DP replica's reporting rank generates its share of prompts (round robin) into its local store.

        ``seed_step`` reseeds the sampling stream as step ``seed_step`` (default: ``step``; None: no reseed).
        ``wait=False`` returns the generation's task on the trainer's loop instead of running it to the end."""
        mine = self._my_prompts(len(rows))
        seed_step = step if seed_step == -1 else seed_step
        task = None
        if mine:
            if seed_step is not None:
                self.rollout.reseed(self.cfg.trainer.seed * 7919 + seed_step * 2 + (partition == VAL),
                                    rank=self.dp_rank)
            frac = self.cfg.debug.inject_rollout_failures if partition == TRAIN else 0.0
            kwargs = []
            for i in mine:
                kw: dict[str, Any] = {}
                if self.cfg.rollout.agent_loop == "tool":
                    kw["tools_kwargs"] = (rows[i].get("extra_info") or {}).get("tools_kwargs") or {}
                if fails(uids[i], frac):
                    kw["inject_failure"] = True
                kwargs.append(kw)
            loop = FaultInjectingLoop(self.agent_loop) if frac > 0 else self.agent_loop
            groups = run_groups(self.store, [uids[i] for i in mine], [rows[i]["raw_prompt"] for i in mine],
                                self.cfg.rollout.n if partition == TRAIN else 1, loop, step, partition, sampling,
                                row_kwargs=kwargs)
            if not wait:
                return self.loop.create_task(groups)
            run_to_end(self.loop, groups, cancel_left=not self.schedule.keeps_generating)
        if wait:
            self.store.sync()
        return task

    def _score(self, keys: list[str], partition: str, rows_by_uid: dict[str, dict],
               pad: torch.Tensor | None = None) -> RewardResult:
        """Reward of this rank's own trajectories (scores and the scorers' extra values); writes ``rm_scores`` at
        the last policy token. ``pad``: the keys' ``is_padding`` flags when the caller has them (else read)."""
        if not keys:
            return RewardResult(torch.zeros(0))
        td = self.store.read_local(keys, partition, ["responses", "response_mask"])
        padding = pad.tolist() if pad is not None else \
            [bool(t.get("is_padding")) for t in self.store.tags_of(keys, partition)]
        responses, masks = jagged_rows(td["responses"]), jagged_rows(td["response_mask"])  # cut once each
        items = []
        for key, is_pad, response, mask in zip(keys, padding, responses, masks):
            row = rows_by_uid.get(uid_of(key), {})
            items.append(RewardInput(response_ids=response, data_source=row.get("data_source", ""),
                                     ground_truth=ground_truth_of(row), extra_info=row.get("extra_info"),
                                     response_mask=mask, is_padding=is_pad, key=key))
        result = (self.val_reward_manager if partition == VAL else self.reward_manager)(items)
        rm = compute_rm_scores(result.scores, td["response_mask"])
        self.store.kv_batch_put(keys, partition, batch_of({"rm_scores": rm}, len(keys)))
        return result

    @staticmethod
    def _reward_extra_metrics(result: RewardResult, pad: torch.Tensor, stats: StepStats) -> None:
        """``reward/extra/<name>/mean`` over every rank's real samples of each numeric extra value a scorer returned
        (a rank whose trajectories gave no such value contributes none)."""
        for name, (values, missing) in numeric_extras(result).items():
            stats.masked(f"reward/extra/{name}", values, missing | pad, keep=("mean",))

    # ------------------------------------------------------------------------------------------------ the step
    def train_step(self) -> dict[str, float]:
        """One GRPO step: each stage takes the step's :class:`KVBatchMeta` and returns it; the schedule fills the
        rollout and sample stages."""
        st = StepState(self.step, self._sample_prompts(), compute=ComputeClock(self.ctx.device))
        t_step = time.perf_counter()
        batch = self._stage("rollout", st, self._generate, None)             # 1. sessions -> local stores
        batch = self._stage("sample", st, self._sample, batch)               # 2. terminal groups, oldest first
        batch = self._stage("plan", st, self._plan, batch)                   # 3. padding + balanced DP shares
        batch = self._stage("reward", st, self._compute_reward, batch)       # 4. rm_scores
        batch = self._stage("old_log_prob", st, self._compute_old_log_prob, batch)  # 5. old log-probs, entropy
        if self.ref_bridge is not None:
            batch = self._stage("ref", st, self._compute_ref_log_prob, batch)  # 6. reference log-probs, KL
        if self.critic_bridge is not None:
            batch = self._stage("values", st, self._compute_values, batch)   # 6b. the critic's values
        batch = self._stage("advantage", st, self._compute_advantage, batch)  # 7. rewards -> advantages
        if self.critic_bridge is not None:
            batch = self._stage("critic_update", st, self._update_critic, batch)  # 7b. value loss, same batches
        batch = self._stage("update", st, self._update_actor, batch)         # 8. ppo_epochs x mini-batches
        self._stage("clear", st, self._clear, batch)                         # 9. kv_clear of the whole step
        self._stage("weight_sync", st, self._sync_weights, batch)            # 10. new weights to the rollout
        self._stage("gc", st, self._collect_garbage, batch)                  # 11. cyclic garbage (gc_interval)
        with self._where("metrics", st.step):  # its reductions are collectives too (and a schedule's receives)
            return self._finish(st, time.perf_counter() - t_step)

    def _stage(self, name: str, st: StepState, fn, batch: KVBatchMeta | None) -> KVBatchMeta | None:
        with Timer(name, st.times), self._where(name, st.step):
            return fn(batch, st)

    @contextlib.contextmanager
    def _where(self, stage: str, step: int):
        """An exception leaving ``stage`` (a peer's timeout included) says which rank, step and stage it came from."""
        try:
            yield
        except Exception as exc:
            if not getattr(exc, "_rldispatch_where", False):
                exc.add_note(f"[rank {self.ctx.rank}/{self.ctx.world}] in step {step}, stage {stage!r}")
                exc._rldispatch_where = True
            raise

    def _sample_prompts(self) -> tuple[list[dict], list[str]]:
        return self._prompts_at(self.step * self.cfg.data.train_batch_size, self.cfg.data.train_batch_size)

    def _prompts_at(self, start: int, count: int) -> tuple[list[dict], list[str]]:
        """Prompts ``start .. start + count - 1`` of the training stream: prompt ``p`` is position ``p % B`` of
        step ``p // B``'s batch (rows and uids), so a step of ``B`` prompts takes exactly that step's batch."""
        cfg, B = self.cfg, self.cfg.data.train_batch_size
        rows, uids = [], []
        for batch in range(start // B, (start + count - 1) // B + 1):
            lo, hi = max(start - batch * B, 0), min(start + count - batch * B, B)
            idx = batch_indices(len(self.train_set), B, batch, cfg.trainer.seed, cfg.data.shuffle)[lo:hi]
            rows += [self.train_set[i] for i in idx]
            uids += step_uids(cfg.trainer.seed, batch, B)[lo:hi]
        return rows, uids

    def _train_sampling(self) -> dict:
        cfg = self.cfg
        return {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                "max_tokens": cfg.data.max_response_length}

    def _generate(self, _: None, st: StepState) -> None:
        self.schedule.generate(st)
        self.trace.select(st.uids[0])
        return None

    def _sample(self, _: None, st: StepState) -> KVBatchMeta:
        cfg, B = self.cfg, self.cfg.data.train_batch_size
        try:
            meta = self.schedule.sample(st, B)
        except ReplayBufferError as exc:
            raise NoUsableGroupsError(
                f"step {st.step}: no usable prompt group among {B} (replay.failure_policy="
                f"{cfg.replay.failure_policy!r}); see the rollout errors above. {exc}") from exc
        st.metrics.update({k: float(v) for k, v in (meta.extra_info.get("metrics") or {}).items()
                           if isinstance(v, (int, float))})
        st.sampled = meta
        self._trace("rollout", meta, ["prompts", "responses", "input_ids", "response_mask"], "agent_loop", "reward")
        return meta

    def _plan(self, meta: KVBatchMeta, st: StepState) -> KVBatchMeta:
        """Pad and plan (pure: every rank reaches the same plan); returns real + padding keys with their tags.

        The ranks split the plan's mini-batches and exchange them on the padding's sync, with the key-order check.
        """
        job = prepare_step_plan(meta, self.topology, self.cfg, st.step)
        if job.padding_keys and self.ctx.is_main:
            self.store.kv_batch_put(job.padding_keys, TRAIN, job.padding_fields, job.padding_tags)
        seen = self.store.sync(also=(key_digest(job.keys), job.run_share(self.store.rank, self.store.world)))
        # a divergent key order stops here, before any rank uses a plan
        check_digests([digest for digest, _ in seen], "the step's key order", len(job.keys))
        plan = job.finish({p: r for _, share in seen for p, r in share.items()})
        st.plan = plan
        st.metrics.update(plan.metrics)
        full = plan.full_meta(self.store)
        st.owners = self.store.split_by_holder(full.keys, TRAIN, "responses")  # what each rank generated
        st.own = st.owners[self.store.rank]
        st.own_pad = self._padding_flags(st.own, full)
        return full

    def _compute_reward(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        result = self._score(st.own, TRAIN, self.schedule.rows, st.own_pad)
        st.stats.masked("reward/score", result.scores.double(), st.own_pad)
        self._reward_extra_metrics(result, st.own_pad, st.stats)
        st.stats.sum("samples/real", float((~st.own_pad).sum()))
        st.stats.sum("samples/padding", float(st.own_pad.sum()))
        # no sync: nothing reads the scores before the advantage, and their locations reach the peers with the
        # old-log-prob stage's sync (before it, a peer would find no location for them: a DataPlaneError)
        self._trace("reward", st.sampled, ["rm_scores"], "reward_manager", "advantage")
        return full

    def _compute_old_log_prob(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        cfg = self.cfg
        st.mine = st.plan.rank_meta(full, self.dp_rank)
        recompute = cfg.rollout.log_prob_mode == "recompute"
        st.infer_inputs = self.bridge.fetch_infer_inputs(st.mine, self._infer_wants(st)) \
            if recompute or self.ref_bridge is not None or self.critic_bridge is not None else None
        if recompute:
            with st.compute.region("infer"):
                self.bridge.infer(st.mine, st.plan.infer_micro_batches(self.dp_rank),
                                  outputs={"log_probs": "old_log_probs", "entropy": "entropy"},
                                  temperature=cfg.rollout.temperature, with_entropy=True, data=st.infer_inputs)
        else:
            self._bypass_old_log_probs(st.own, st.own_pad)
        self.store.sync()
        self._trace("old_log_prob", st.sampled, ["old_log_probs"], "actor.infer_batch", "actor.train_batch")
        return full

    def _compute_ref_log_prob(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        """Reference log-probs, and the KL metrics on the rank that produced them (no values travel for them)."""
        with st.compute.region("infer"):
            self.ref_bridge.infer(st.mine, st.plan.infer_micro_batches(self.dp_rank),
                                  outputs={"log_probs": "ref_log_prob"}, temperature=self.cfg.rollout.temperature,
                                  data=st.infer_inputs)
        self.store.sync()
        self._kl_metrics(st, st.infer_inputs)
        self._trace("ref", st.sampled, ["ref_log_prob"], "ref.infer_batch", "kl")
        return full

    def _compute_values(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        """The critic's value of every response token, on the inference share the log-probs used (no new fetch)."""
        with st.compute.region("infer"):
            self.critic_bridge.infer(st.mine, st.plan.infer_micro_batches(self.dp_rank),
                                     outputs={"values": "values"}, data=st.infer_inputs)
        self.store.sync()
        self._trace("values", st.sampled, ["values"], "critic.infer_batch", "advantage")
        return full

    def _kl_metrics(self, st: StepState, inputs: TensorDict) -> None:
        """``kl/*`` over real samples: per-sample masked mean of the estimator, from this rank's written share."""
        mine, stats = st.mine, st.stats
        kl_vals, pad = torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
        wrote = len(mine) and self.reporting  # it wrote the share; other ranks of the replica did not
        # recomputed old log-probs were written here too; in bypass mode they sit with the rollout (a collective)
        bypass = None if self.cfg.rollout.log_prob_mode == "recompute" else \
            self.store.fetch_planned(self._infer_wants(st, reporting_only=True), TRAIN, ["old_log_probs"])
        if wrote:
            fields = ["ref_log_prob"] if bypass is not None else ["ref_log_prob", "old_log_probs"]
            td = self.store.read_local(mine.keys, TRAIN, fields)
            old_lp = (bypass if bypass is not None else td)["old_log_probs"]
            mask = jagged_to_padded(inputs["response_mask"]).float()
            old, ref = jagged_to_padded(old_lp).float(), jagged_to_padded(td["ref_log_prob"]).float()
            per_token = kl_penalty(old, ref, self.cfg.algorithm.kl_penalty) * mask
            kl_vals = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).double()
            pad = torch.tensor([bool(t.get("is_padding")) for t in mine.tags], dtype=torch.bool)
        stats.masked("kl", kl_vals, pad)

    def _compute_advantage(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        self._advantage(st.owners, st.own_pad, st.stats)
        # each rank wrote its own groups' fields, which every rank knows: their locations need no collective
        rc = self.cfg.algorithm.rollout_correction
        corrected = (("rollout_is_weights",) if rc.rollout_is else ()) + (("response_mask",) if rc.rollout_rs else ())
        self.store.sync_planned(st.owners, TRAIN, ADVANTAGE_FIELDS + corrected)
        self._trace("advantage", st.sampled, ["token_level_rewards", "advantages", "returns"], "advantage", "actor")
        if self.cfg.debug.check_invariants:
            self._check_invariants(st.own)
        return full

    def _update_actor(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        if self.critic is None or st.step >= self.cfg.critic.warmup_steps:  # the critic's warm-up: no update
            shares = [st.plan.mini_batches(self.topology.dp_rank(r)) for r in range(self.store.world)]
            use_is = self.cfg.algorithm.rollout_correction.rollout_is is not None
            with st.compute.region("update"):
                updates = [self.bridge.train(mb.meta(full), mb.micro_batches,
                                             use_kl_loss=self.cfg.actor.loss.use_kl_loss,
                                             wants=[st.plan.keys_of(of_rank[i].indices) for of_rank in shares],
                                             use_is_weights=use_is)
                           for i, mb in enumerate(st.plan.mini_batches(self.dp_rank))]
            st.metrics.update(combine_update_metrics(updates))
        self._sample_metrics(st.own, st.own_pad, st.stats)
        return full

    def _update_critic(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        """The value loss over the actor's mini- and micro-batches (ppo_epochs x mini-batches, one optimizer step
        each)."""
        shares = [st.plan.mini_batches(self.topology.dp_rank(r)) for r in range(self.store.world)]
        with st.compute.region("update"):
            updates = [self.critic_bridge.train(mb.meta(full), mb.micro_batches, fields=CRITIC_FIELDS,
                                                wants=[st.plan.keys_of(of_rank[i].indices) for of_rank in shares])
                       for i, mb in enumerate(st.plan.mini_batches(self.dp_rank))]
        st.metrics.update(combine_update_metrics(updates, prefix="critic/"))
        return full

    def _clear(self, full: KVBatchMeta, st: StepState) -> None:
        self.replay.clear(st.sampled, extra_keys=st.plan.padding_keys)
        self.schedule.after_clear(st)
        st.stats.sum("store/keys_after_clear", float(self.store.num_keys()))

    def _collect_garbage(self, _: KVBatchMeta | None, st: StepState) -> None:
        self.gc.step_done(st.step)

    def _sync_weights(self, _: KVBatchMeta | None, st: StepState) -> None:
        weights = self.engine.get_weights()
        self.rollout.load_weights(weights, version=st.step + 1)
        self.schedule.sync_weights(weights, st.step + 1)

    def _finish(self, st: StepState, seconds: float) -> dict[str, float]:
        m = st.metrics
        st.stats.per_rank("dataplane/bytes_received", self.store.bytes_received)
        self.store.bytes_received = 0
        self._rank_time_stats(st)
        m.update(st.stats.reduce(device=self.ctx.device))  # the step's one metrics collective
        if _EV_SUMS[0] in m:
            m["critic/vf_explained_var"] = explained_variance(*(m.pop(k) for k in _EV_SUMS))
        corr = {k[len("rollout_corr/_"):]: m.pop(k) for k in [k for k in m if k.startswith("rollout_corr/_")]}
        m.update(correction_metrics(corr))
        m.update(self.schedule.step_metrics(st, seconds))
        if isinstance(self.kl_ctrl, AdaptiveKLController) and "kl/mean" in m:
            self.kl_ctrl.update(m["kl/mean"], n_steps=self.cfg.data.train_batch_size)
        m["kl/coef"] = float(self.kl_ctrl.value)
        st.times["timing_s/step"] = seconds
        st.times["timing_s/overhead_fraction"] = overhead_fraction(st.times, seconds)
        m.update(st.times)
        tokens = float(sum(t["seq_len"] for t in st.sampled.tags))
        m["perf/tokens_per_s"] = tokens / max(seconds, 1e-9)
        return m

    def _rank_time_stats(self, st: StepState) -> None:
        """``perf/rank_time/{infer,update}`` and their total: each rank's compute, max / mean / straggler ratio.

        Every rank records the same names (the stages run on every rank; a stage switched off records nothing)."""
        secs = st.compute.seconds
        for name in ("infer", "update"):
            if name in secs:
                st.stats.spread(f"perf/rank_time/{name}", secs[name])
        st.stats.spread("perf/rank_time", sum(secs.values()))

    def _check_invariants(self, own: list[str]) -> None:
        """debug.check_invariants: the field invariants of this rank's trajectories once every field is written."""
        if not own:
            return
        fields = ["prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask", "rm_scores",
                  "advantages", "returns"]  # values sit with the critic's inference share, not necessarily here
        td = self.store.read_local(own, TRAIN, fields)
        assert_invariants(td, keys=own, tags=self.store.tags_of(own, TRAIN))

    def _infer_wants(self, st: StepState, reporting_only: bool = False) -> list[list[str]]:
        """Every store rank's keys of its inference share (index = rank), from the replicated plan, for a planned
        fetch (only the replicas' reporting ranks ask, with ``reporting_only``)."""
        topo = self.topology
        return [st.plan.infer_keys(topo.dp_rank(r)) if not reporting_only or topo.is_reporting(r) else []
                for r in range(self.store.world)]

    def _padding_flags(self, keys: list[str], full: KVBatchMeta) -> torch.Tensor:
        """``is_padding`` of each of ``keys``, from the step's replicated tags in ``full``."""
        padding = {k for k, t in zip(full.keys, full.tags) if t.get("is_padding")}
        return torch.tensor([k in padding for k in keys], dtype=torch.bool)

    def _bypass_old_log_probs(self, own: list[str], own_pad: torch.Tensor) -> None:
        """Bypass mode: the rollout's own log-probs are the old log-probs (padding samples get zeros)."""
        real = [k for k, p in zip(own, own_pad.tolist()) if not p]
        pad = [k for k, p in zip(own, own_pad.tolist()) if p]
        if real:
            td = self.store.read_local(real, TRAIN, ["rollout_log_probs"])
            self.store.kv_batch_put(real, TRAIN, batch_of({"old_log_probs": td["rollout_log_probs"]}, len(real)))
        if pad:
            td = self.store.read_local(pad, TRAIN, ["response_mask"])
            zeros = [torch.zeros(r.shape[0], dtype=torch.float32) for r in td["response_mask"].unbind()]
            self.store.kv_batch_put(pad, TRAIN, batch_of({"old_log_probs": to_nested(zeros)}, len(pad)))

    def _rollout_correction(self, own: list[str], pad: torch.Tensor, old_lp: torch.Tensor, mask: torch.Tensor,
                            lengths: Any, stats: StepStats) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``algorithm.rollout_correction`` on this rank's groups: the mask the advantage uses and the fields to write
        with it, ``rollout_is_weights`` (with ``rollout_is``) and the rejection-masked ``response_mask`` (with
        ``rollout_rs``)."""
        rc = self.cfg.algorithm.rollout_correction
        real = [k for k, p in zip(own, pad.tolist()) if not p]
        rollout_lp = torch.zeros_like(old_lp)
        if real:  # padding samples have no rollout log-probs (their mask is 0)
            got = jagged_to_padded(self.store.read_local(real, TRAIN, ["rollout_log_probs"])["rollout_log_probs"])
            rollout_lp[(~pad).nonzero().squeeze(-1), :got.shape[1]] = got.float()
        weights, kept, sums = rollout_correction(rc, old_lp, rollout_lp, mask.bool() & ~pad[:, None])
        for k, v in sums.items():
            stats.sum(f"rollout_corr/_{k}", v)
        fields = {}
        if weights is not None:
            fields["rollout_is_weights"] = padded_to_jagged_many((weights.float(),), lengths)[0]
        if kept is not None:
            mask = (kept | (mask.bool() & pad[:, None])).to(mask.dtype)
            fields["response_mask"] = padded_to_jagged_many((mask.to(torch.int64),), lengths)[0]
        return mask, fields

    def _advantage(self, owners: list[list[str]], pad: torch.Tensor, stats: StepStats) -> None:
        """On the rank that holds each group (all of a group is generated on one rank): rewards, advantages.

        ``owners[r]``: the keys rank ``r`` generated. Old and reference log-probs travel here only when the KL
        penalty enters the reward or the rollout correction compares them with the rollout's; the scores and masks
        are already here (nothing travels without them).
        """
        own = owners[self.store.rank]
        cfg = self.cfg
        in_reward = cfg.algorithm.use_kl_in_reward  # config validation guarantees a reference
        critic = self.critic is not None
        correct = cfg.algorithm.rollout_correction.enabled
        need = ["rm_scores", "response_mask"] + (["old_log_probs", "ref_log_prob"] if in_reward else []) \
            + (["old_log_probs"] if correct and not in_reward else []) + (["values"] if critic else [])
        td = self.store.fetch_planned(owners, TRAIN, need)
        moments = [0.0, 0.0, 0.0]
        if own:
            lengths = nested_lengths(td["response_mask"])
            mask = jagged_to_padded(td["response_mask"]).float()
            corrected: dict[str, torch.Tensor] = {}
            if correct:
                mask, corrected = self._rollout_correction(own, pad, jagged_to_padded(td["old_log_probs"]).float(),
                                                           mask, lengths, stats)
            scores = jagged_to_padded(td["rm_scores"]).float()
            if in_reward:
                old = jagged_to_padded(td["old_log_probs"]).float()
                ref = jagged_to_padded(td["ref_log_prob"]).float()
                rewards, _ = apply_kl_penalty(scores, old, ref, mask, self.kl_ctrl, cfg.algorithm.kl_penalty)
            else:
                rewards = scores
            index = [uid_of(k) for k in own]
            kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=index, is_padding=pad,
                          norm_adv_by_std=cfg.algorithm.norm_adv_by_std, gamma=cfg.algorithm.gamma,
                          lam=cfg.algorithm.lam)
            if critic:  # whitened below over the whole step's policy tokens, not this rank's alone
                kwargs.update(values=jagged_to_padded(td["values"]).float(), whiten=False)
            kwargs.update(session_inputs_from_keys(own))  # multi-output sessions: advantage of the final output
            takes = inspect.signature(get_advantage_fn(cfg.algorithm.adv_estimator)).parameters
            adv, ret = compute_advantage(cfg.algorithm.adv_estimator,
                                         **{k: v for k, v in kwargs.items() if k in takes})
            if critic:
                real = mask.bool() & ~pad[:, None]
                moments = list(whiten_moments(adv, real))
                self._value_metrics(kwargs["values"], ret, real, stats)
        if critic:  # the one collective of a critic's advantage: the step's (count, sum, sum of squares)
            moments = allreduce_counts(moments, device=self.ctx.device)
        if own:
            if critic:
                adv = whiten_by_moments(adv, real, moments)
            values = (scores, rewards, adv.float(), ret.float())
            fields = dict(zip(ADVANTAGE_FIELDS, padded_to_jagged_many(values, lengths)), **corrected)
            self.store.kv_batch_put(own, TRAIN, batch_of(fields, len(own)), overwrite=bool(corrected))

    @staticmethod
    def _value_metrics(values: torch.Tensor, returns: torch.Tensor, real: torch.Tensor, stats: StepStats) -> None:
        """``critic/values/mean``, ``critic/returns/mean`` over the step's policy tokens, and the sums behind
        ``critic/vf_explained_var`` (this rank's real samples; every rank's add up)."""
        v, r = values[real].double(), returns[real].double()
        stats.masked("critic/values", v, keep=("mean",))
        stats.masked("critic/returns", r, keep=("mean",))
        d = r - v
        for name, x in zip(_EV_SUMS, (float(r.numel()), r.sum(), (r * r).sum(), d.sum(), (d * d).sum())):
            stats.sum(name, float(x))

    def _sample_metrics(self, own: list[str], pad: torch.Tensor, stats: StepStats) -> None:
        """Response and policy length statistics over real samples (padding excluded), over all ranks."""
        if own:
            resp_len, policy_len = sample_lengths(self.store.read_local(own, TRAIN, ["response_mask"])["response_mask"])
        else:
            resp_len = policy_len = torch.zeros(0, dtype=torch.int64)
        stats.masked("response_length", resp_len.double(), pad)
        stats.masked("policy_length", policy_len.double(), pad)

    def _trace(self, stage: str, meta: KVBatchMeta, fields: list[str], producer: str, consumer: str) -> None:
        if not self.trace.enabled:
            return
        sel = [k for k in meta.keys if uid_of(k) == self.trace.sample_uid]
        own = [k for k in sel if all(self.store.holds(k, f, TRAIN) for f in fields)]
        if not own:
            return
        td = self.store.read_local(own, TRAIN, fields)
        self.trace.record(stage, td, own, self.store.tags_of(own, TRAIN), producer=producer, consumer=consumer)

    # ------------------------------------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy rollout of the first ``data.val_batch_size`` validation prompts; mean rule-based score."""
        n = min(self.cfg.data.val_batch_size, len(self.val_set))
        rows = [self.val_set[i] for i in range(n)]
        uids = step_uids(self.cfg.trainer.seed, self.step, n, VAL)
        sampling = {"temperature": 0.0, "top_p": 1.0, "max_tokens": self.cfg.data.max_response_length}
        self._rollout(rows, uids, VAL, self.step, sampling)
        keys = [k for k in self.store.kv_list(VAL).get(VAL, {}) if "_" in k]
        own = self.store.local_keys(keys, VAL, "responses")
        scores = self._score(own, VAL, dict(zip(uids, rows))).scores
        stats = distributed_masked_stats(scores.double(), None, "val/score", device=self.ctx.device) if keys \
            else {}
        self.store.kv_clear(keys, VAL)
        self.store.kv_clear(uids, VAL)
        return {k: v for k, v in stats.items() if k.endswith("/mean") or k.endswith("/std")}

    def _timed_validate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        out = self.validate()
        return {**out, "timing_s/val": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> int:
        """Train to ``trainer.total_steps`` (or to the step boundary after SIGTERM/SIGINT); returns the exit code."""
        cfg = self.cfg
        self.exit_code = 0
        self._signals: list[int] = []
        self._install_signal_handlers()
        bar = None
        if self.ctx.is_main and cfg.trainer.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.trainer.total_steps, initial=self.step, desc="grpo", dynamic_ncols=True)
        if self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(to_plain(cfg), indent=2))
        self._started = time.perf_counter()
        self.summary = RunSummary(start_step=self.step)
        with self._where("validate", self.step):
            pending_val = self._timed_validate() if self.step == 0 else {}
        self.summary.record(self.step, pending_val)
        self.gc.start()
        try:
            self.schedule.begin()
            code = self._loop(pending_val, bar)
        finally:
            self.gc.stop()
            try:
                self.schedule.end()
            finally:
                self.loop.close()
        if self.ctx.is_main:
            print(self.summary.text(self.step, cfg.trainer.total_steps, time.perf_counter() - self._started,
                                    self.run_dir, self.metrics.path, code), flush=True)
        return code

    def _loop(self, pending_val: dict[str, float], bar: Any) -> int:
        cfg = self.cfg
        while self.step < cfg.trainer.total_steps:
            metrics = {**pending_val, **self.train_step()}
            pending_val = {}
            self._check_update(metrics)
            self.step += 1
            last = self.step == cfg.trainer.total_steps
            if cfg.trainer.val_freq and self.step % cfg.trainer.val_freq == 0 or last:
                with self._where("validate", self.step):
                    metrics.update(self._timed_validate())
                self.summary.record(self.step, metrics)
            metrics["progress/elapsed_s"] = time.perf_counter() - self._started
            self.metrics.log(self.step, metrics)
            signum = self._signal_seen()
            if (cfg.trainer.save_freq and self.step % cfg.trainer.save_freq == 0) or last or \
                    (signum and cfg.trainer.save_on_signal):
                with self._where("checkpoint", self.step):
                    self.save_checkpoint()
            if signum:
                logger.warning("rank %d: %s received; %s at step %d, exiting", self.ctx.rank,
                               signal.Signals(signum).name,
                               "checkpoint saved" if cfg.trainer.save_on_signal else "no checkpoint "
                               "(trainer.save_on_signal=false)", self.step)
                self.exit_code = _SIGNAL_EXIT.get(signum, 128 + signum)
                break
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/score/mean', float('nan')):.3f}",
                                s_per_step=f"{metrics['timing_s/step']:.1f}")
        if bar is not None:
            bar.close()
        self.metrics.close()
        self.trace.close()
        return self.exit_code

    def _install_signal_handlers(self) -> None:
        """SIGTERM (a scheduler's preemption) and SIGINT are noted and acted on at the next step boundary; a second
        one ends the process at once."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def note(signum: int, _frame) -> None:
            if self._signals:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            self._signals.append(signum)

        for signum in _SIGNAL_EXIT:
            signal.signal(signum, note)

    def _signal_seen(self) -> int:
        """The signal any rank has received (every rank agrees, so all stop at the same step), or 0; one small
        gather, not an all-reduce."""
        return max(gather_objects(self._signals[0] if self._signals else 0, device=self.ctx.device))

    def _check_update(self, metrics: dict[str, float]) -> None:
        """A non-finite update was rolled back by the engine (``on_nonfinite=skip``: said and counted) or stops the
        run (``stop``)."""
        for model, loss in (("actor", "loss"), ("critic", "vf_loss")):
            bad = metrics.get(f"{model}/nonfinite", 0.0)
            if not bad:
                continue
            detail = ", ".join(f"{k}={metrics.get(k)}" for k in (f"{model}/{loss}", f"{model}/grad_norm",
                                                                  f"{model}/lr"))
            if self.cfg.trainer.on_nonfinite == "stop":
                raise NonFiniteUpdateError(
                    f"step {self.step + 1}: {int(bad)} of {int(metrics.get(f'{model}/optimizer_steps', 1))} "
                    f"optimizer steps gave non-finite weights or loss ({detail}); trainer.on_nonfinite=stop. "
                    f"Lower {model}.optim.lr or raise {model}.optim.eps, or set trainer.on_nonfinite=skip to roll "
                    "such updates back")
            if self.ctx.is_main:
                logger.warning("step %d: %d %s optimizer step(s) gave non-finite weights or loss (%s); rolled back "
                               "to the pre-step weights and optimizer state (trainer.on_nonfinite=skip)",
                               self.step + 1, int(bad), model, detail)


def run(cfg: RunConfig) -> int:
    """Entry point of ``scripts/train.py``: set up the process group, train, tear down; returns the exit code."""
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    if cfg.trainer.mode == "separate_async":  # the world splits: the last ranks generate, the others train
        split = split_world(cfg)
        ctx = DistContext(dist.get_rank(), dist.get_world_size(), split.device, link=split)
    else:
        split, ctx = None, init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    torch.manual_seed(cfg.trainer.seed)
    try:
        if split is not None and split.role == "rollout":
            return RolloutRank(cfg, split).serve()
        return GRPOTrainer(cfg, ctx).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
