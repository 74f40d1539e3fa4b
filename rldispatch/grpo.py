"""The synchronous GRPO step, wired from protocol, dispatch and backends; every rank runs this code (SPMD).

One step: prompts -> uid per prompt -> rollout on each DP replica's reporting rank -> store -> reward ->
balance and dispatch plan -> old log-probs -> reference log-probs -> KL -> advantage -> actor update
(ppo_epochs x mini-batches) -> metrics -> ``kv_clear`` of every key of the step -> weight sync to the rollout.

The controller holds :class:`protocol.store.meta.KVBatchMeta` objects only; values stay where they were produced and
move point to point through :class:`trainer.dataplane.ShardedStore`.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from tensordict import TensorDict

from backends.base import get_engine_class
from dispatch import Topology
from protocol.algos.advantage import compute_advantage, get_advantage_fn, session_inputs_from_keys
from protocol.rollout.agent_loop import build_agent_loop, builtin_tools, run_groups
from protocol.rollout.dataset import RLHFDataset
from protocol.invariants import assert_invariants
from protocol.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty
from protocol.store.meta import KVBatchMeta
from protocol.batch.nested import nested_lengths, response_from_nested, response_to_nested, to_nested
from protocol.store.replay_buffer import ReplayBuffer, ReplayBufferError
import protocol.rollout.tasks  # noqa: F401  (registers the task scorers by data_source)
from protocol.algos.reward import RewardInput, compute_rm_scores, make_reward_manager
from protocol.store import LocalStore
from protocol.rollout.tokenizer import load_tokenizer
from rldispatch.bridge import StoreBridge
from rldispatch.config import RunConfig
from rldispatch.dataplane import ShardedStore
from rldispatch.faults import FaultInjectingLoop, fails
from rldispatch.metrics import MetricsLogger, Timer, distributed_masked_stats, sample_lengths
from rldispatch.ref import build_reference
from rldispatch.plan import batch_settings, make_step_plan
from rldispatch.rollout import RolloutWorker
from rldispatch.schema import to_plain
from rldispatch.trace import TraceRecorder

__all__ = ["GRPOTrainer", "run", "NoUsableGroupsError"]

logger = logging.getLogger(__name__)
TRAIN, VAL = "train", "val"


class NoUsableGroupsError(RuntimeError):
    """A step whose every prompt group failed or was dropped: nothing can be trained on."""


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str) -> DistContext:
    """gloo on CPU, NCCL on GPUs; a plain ``python scripts/train.py`` runs as a world of one."""
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if use_cuda else "gloo")
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


_SUMMED = ("tokens", "seqs", "micro_batches", "skipped", "time")
_LAST = ("global_step", "lr")


def combine_update_metrics(updates: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's ``actor/*`` metrics from its optimizer steps: counts add up, lr is the last, the rest average."""
    out: dict[str, float] = {}
    for k in sorted({k for u in updates for k in u}):
        vals = [float(u[k]) for u in updates if u.get(k) is not None]
        if not vals:
            continue
        out[f"actor/{k}"] = sum(vals) if k in _SUMMED else vals[-1] if k in _LAST else sum(vals) / len(vals)
    out["actor/optimizer_steps"] = float(len(updates))
    return out


def _ground_truth(row: dict) -> Any:
    rm = row.get("reward_model") or {}
    if isinstance(rm, dict) and "ground_truth" in rm:
        return rm["ground_truth"]
    return (row.get("extra_info") or {}).get("ground_truth")


class GRPOTrainer:
    """Holds the run's components; :meth:`fit` runs ``trainer.total_steps`` synchronous GRPO steps."""

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.run_dir = Path(cfg.trainer.run_dir)
        self.topology = Topology.from_config(cfg.topology_config(), ctx.world)
        self.dp_rank = self.topology.dp_rank(ctx.rank)
        self.reporting = self.topology.is_reporting(ctx.rank)
        batch_settings(cfg, self.topology, step=0).check(self.topology)  # refuse undividable batches before rollout
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self._ensure_data()
        d = cfg.data
        self.train_set = RLHFDataset(d.train_files, self.tokenizer, d.max_prompt_length,
                                     filter_overlong_prompts=d.filter_overlong_prompts)
        self.val_set = RLHFDataset(d.val_files, self.tokenizer, d.max_prompt_length,
                                   filter_overlong_prompts=d.filter_overlong_prompts)

        engine_cls = get_engine_class(cfg.actor.backend)
        self.engine = engine_cls(cfg.engine_config(), self.topology)
        self.ref_engine = build_reference(cfg.actor.backend, engine_cls, cfg.engine_config(), self.topology,
                                          self.engine) if cfg.ref.enabled else None

        self.store = ShardedStore(LocalStore(), device=ctx.device)
        self.bridge = StoreBridge(self.engine, self.store)
        self.ref_bridge = StoreBridge(self.ref_engine, self.store) if self.ref_engine is not None else None
        self.replay = ReplayBuffer(self.store, TRAIN, parameter_sync_step=cfg.replay.parameter_sync_step,
                                   max_off_policy_threshold=cfg.replay.max_off_policy_threshold,
                                   off_policy_strategy=cfg.replay.off_policy_strategy,
                                   failure_policy=cfg.replay.failure_policy)
        self.rollout = RolloutWorker(cfg.model, self.tokenizer, device=ctx.device, seed=cfg.trainer.seed,
                                     rank=self.dp_rank)
        loop_kwargs = {"max_turns": cfg.rollout.max_turns, "tools": builtin_tools()} \
            if cfg.rollout.agent_loop == "tool" else {}
        self.agent_loop = build_agent_loop(cfg.rollout.agent_loop, self.rollout.agenerate, tokenizer=self.tokenizer,
                                           max_response_length=cfg.data.max_response_length, **loop_kwargs)
        # special tokens stay in the decoded text: a scorer that never saw them would let the policy pad its answer
        # with <|pad|> and still score full marks
        self.reward_manager = make_reward_manager("naive", decode=functools.partial(self.tokenizer.decode,
                                                                                    skip_special=False))
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = FixedKLController(kc.kl_coef) if kc.type == "fixed" else \
            AdaptiveKLController(kc.kl_coef, kc.target_kl, kc.horizon)
        self.metrics = MetricsLogger(self.run_dir, ctx.is_main, tensorboard=cfg.trainer.tensorboard)
        trace_path = cfg.trace.path or str(self.run_dir / f"trace.rank{ctx.rank}.jsonl")
        self.trace = TraceRecorder(trace_path, enabled=cfg.trace.enabled, rank=ctx.rank)
        self.step = 0
        self._maybe_resume()
        self.rollout.load_weights(self.engine.get_weights())

    # ------------------------------------------------------------------------------------------------ setup
    def _ensure_data(self) -> None:
        """Generate the configured task's parquet files on first use (rank 0), so the quick start needs no download."""
        d = self.cfg.data
        missing = [f for f in [*d.train_files, *d.val_files] if not Path(f).exists()]
        if missing and self.ctx.is_main:
            from protocol.rollout.tasks.data import write_task_data

            out_dirs = {str(Path(f).parent) for f in missing}
            for out in out_dirs:
                logger.info("generating task %r data into %s", d.task, out)
                write_task_data(out, d.task, train=d.train_size, val=d.val_size, seed=self.cfg.trainer.seed)
        dist.barrier()
        still = [f for f in [*d.train_files, *d.val_files] if not Path(f).exists()]
        if still:
            raise FileNotFoundError(f"data files not found and not generated: {still}; check data.train_files / "
                                    f"data.val_files (generated files are named train.parquet and val.parquet)")

    def _checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step}"

    def _latest_checkpoint(self) -> Path | None:
        marker = self.run_dir / "checkpoints" / "latest"
        if not marker.exists():
            return None
        return self.run_dir / "checkpoints" / marker.read_text().strip()

    def _maybe_resume(self) -> None:
        mode = self.cfg.trainer.resume
        if mode == "never":
            return
        path = self._latest_checkpoint() if mode == "auto" else Path(mode)
        if path is None:
            if self.ctx.is_main:
                logger.info("trainer.resume=auto: no checkpoint under %s; starting fresh", self.run_dir)
            return
        if not path.exists():
            raise FileNotFoundError(f"trainer.resume={mode!r}: checkpoint folder {path} does not exist")
        extra = self.engine.load_checkpoint(str(path))
        self.step = int(extra["step"])
        if "kl_coef" in extra and isinstance(self.kl_ctrl, AdaptiveKLController):
            self.kl_ctrl.value = float(extra["kl_coef"])  # the adaptive coefficient is state; a fixed one is config
        if self.ctx.is_main:
            logger.info("resumed from %s at step %d", path, self.step)

    def save_checkpoint(self) -> None:
        path = self._checkpoint_dir(self.step)
        self.engine.save_checkpoint(str(path), extra_state={"step": self.step, "kl_coef": float(self.kl_ctrl.value),
                                                             "config": to_plain(self.cfg)})
        dist.barrier()
        if self.ctx.is_main:
            (self.run_dir / "checkpoints" / "latest").write_text(path.name)

    # ------------------------------------------------------------------------------------------------ rollout
    def _rollout(self, rows: list[dict], uids: list[str], partition: str, step: int, sampling: dict) -> None:
        """Each DP replica's reporting rank generates its share of prompts (round robin) into its local store."""
        dp = self.topology.dp_size
        mine = [i for i in range(len(rows)) if i % dp == self.dp_rank] if self.reporting else []
        if mine:
            self.rollout.reseed(self.cfg.trainer.seed * 7919 + step * 2 + (partition == VAL), rank=self.dp_rank)
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
            asyncio.run(run_groups(
                self.store, [uids[i] for i in mine], [rows[i]["raw_prompt"] for i in mine],
                self.cfg.rollout.n if partition == TRAIN else 1, loop, step, partition, sampling, row_kwargs=kwargs))
        self.store.sync()

    def _local_keys(self, keys: Sequence[str], partition: str, field: str = "responses") -> list[str]:
        return [k for k in keys if self.store.location(k, field, partition) == self.ctx.rank]

    def _score(self, keys: list[str], partition: str, rows_by_uid: dict[str, dict]) -> torch.Tensor:
        """Rule-based reward of this rank's own trajectories; writes ``rm_scores`` at the last policy token."""
        if not keys:
            return torch.zeros(0)
        td = self.store.local.kv_batch_get(keys, partition, select_fields=["responses", "response_mask"],
                                           jagged=["responses", "response_mask"])
        tags = self.store.tags_of(keys, partition)
        items = []
        for i, (key, tag) in enumerate(zip(keys, tags)):
            row = rows_by_uid.get(key.split("_", 1)[0], {})
            items.append(RewardInput(response_ids=td["responses"][i], data_source=row.get("data_source", ""),
                                     ground_truth=_ground_truth(row), extra_info=row.get("extra_info"),
                                     response_mask=td["response_mask"][i], is_padding=bool(tag.get("is_padding"))))
        scores = self.reward_manager(items).scores
        rm = compute_rm_scores(scores, td["response_mask"])
        self.store.kv_batch_put(keys, partition, TensorDict({"rm_scores": rm}, batch_size=[len(keys)]))
        return scores

    # ------------------------------------------------------------------------------------------------ the step
    def train_step(self) -> dict[str, float]:
        cfg, step = self.cfg, self.step
        times: dict[str, float] = {}
        m: dict[str, float] = {}
        t_step = time.perf_counter()
        B = cfg.data.train_batch_size
        rows = [self.train_set[i] for i in batch_indices(len(self.train_set), B, step, cfg.trainer.seed,
                                                          cfg.data.shuffle)]
        uids = step_uids(cfg.trainer.seed, step, B)
        rows_by_uid = dict(zip(uids, rows))
        self.trace.select(uids[0])
        sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "max_tokens": cfg.data.max_response_length}
        with Timer("rollout", times):
            self._rollout(rows, uids, TRAIN, step, sampling)
        with Timer("sample", times):
            try:
                # sync mode: every group of the step is terminal now, so fewer than B usable groups means
                # some failed or went stale; train on the rest rather than wait for groups that never come
                meta = self.replay.sample(B, current_step=step, timeout=cfg.replay.sample_timeout_s, partial_ok=True)
            except ReplayBufferError as exc:
                raise NoUsableGroupsError(
                    f"step {step}: no usable prompt group among {B} (replay.failure_policy="
                    f"{cfg.replay.failure_policy!r}); see the rollout errors above. {exc}") from exc
        m.update({k: float(v) for k, v in (meta.extra_info.get("metrics") or {}).items()
                  if isinstance(v, (int, float))})
        self._trace("rollout", meta, ["prompts", "responses", "input_ids", "response_mask"], "agent_loop", "reward")

        with Timer("plan", times):
            plan = make_step_plan(meta, self.topology, cfg, step)
            self._check_same_everywhere(plan.keys, "the step's key order")
            if plan.padding_keys and self.ctx.is_main:
                self.store.kv_batch_put(plan.padding_keys, TRAIN, plan.padding_fields, plan.padding_tags)
            self.store.sync()
        m.update(plan.metrics)
        full = plan.full_meta(self.store)  # real + padding keys with their replicated tags

        with Timer("reward", times):
            own = self._local_keys(full.keys, TRAIN)  # the trajectories (and padding samples) this rank holds
            own_pad = self._padding_flags(own)
            scores = self._score(own, TRAIN, rows_by_uid)
            m.update(distributed_masked_stats(scores.double(), own_pad, "reward/score", device=self.ctx.device))
            counts = torch.tensor([float((~own_pad).sum()), float(own_pad.sum())], dtype=torch.float64,
                                  device=self.ctx.device)
            dist.all_reduce(counts)
            m["samples/real"], m["samples/padding"] = float(counts[0]), float(counts[1])
            self.store.sync()
        self._trace("reward", meta, ["rm_scores"], "reward_manager", "advantage")

        my_all = plan.rank_meta(full, self.dp_rank)
        recompute = cfg.rollout.log_prob_mode == "recompute"
        inputs = self.bridge.fetch_infer_inputs(my_all) if recompute or self.ref_bridge is not None else None
        with Timer("old_log_prob", times):
            if recompute:
                self.bridge.infer(my_all, plan.infer_micro_batches(self.dp_rank),
                                  outputs={"log_probs": "old_log_probs", "entropy": "entropy"},
                                  temperature=cfg.rollout.temperature, with_entropy=True, data=inputs)
            else:
                self._bypass_old_log_probs(own, own_pad)
            self.store.sync()
        self._trace("old_log_prob", meta, ["old_log_probs"], "actor.infer_batch", "actor.train_batch")
        if self.ref_bridge is not None:
            with Timer("ref", times):
                self.ref_bridge.infer(my_all, plan.infer_micro_batches(self.dp_rank),
                                      outputs={"log_probs": "ref_log_prob"}, temperature=cfg.rollout.temperature,
                                      data=inputs)
                self.store.sync()
            self._trace("ref", meta, ["ref_log_prob"], "ref.infer_batch", "kl")

        with Timer("advantage", times):
            own_mask, adv_metrics = self._advantage(own, own_pad)
            m.update(adv_metrics)
            self.store.sync()
        self._trace("advantage", meta, ["token_level_rewards", "advantages", "returns"], "advantage", "actor")
        if cfg.debug.check_invariants:
            self._check_invariants(own)

        with Timer("update", times):
            updates = []
            for mb in plan.mini_batches(self.dp_rank):
                updates.append(self.bridge.train(mb.meta(full), mb.micro_batches,
                                                 use_kl_loss=cfg.actor.loss.use_kl_loss))
            m.update(combine_update_metrics(updates))
        m.update(self._sample_metrics(own_mask, own_pad))

        with Timer("clear", times):
            self.replay.clear(meta, extra_keys=plan.padding_keys)
            self.store.kv_clear(uids, TRAIN)  # prompt keys of groups the replay buffer dropped earlier
            left = torch.tensor([self.store.num_keys() + self.store.local.stats().get("keys", 0)], dtype=torch.int64,
                                device=self.ctx.device)
            dist.all_reduce(left)
            m["store/keys_after_clear"] = float(left.item())
        with Timer("weight_sync", times):
            self.rollout.load_weights(self.engine.get_weights())
        if isinstance(self.kl_ctrl, AdaptiveKLController) and "kl/mean" in m:
            self.kl_ctrl.update(m["kl/mean"], n_steps=B)
        m["kl/coef"] = float(self.kl_ctrl.value)
        times["timing_s/step"] = time.perf_counter() - t_step
        m.update(times)
        tokens = float(sum(t["seq_len"] for t in meta.tags))
        m["perf/tokens_per_s"] = tokens / max(times["timing_s/step"], 1e-9)
        m.update(self._bytes_metrics())
        return m

    def _check_invariants(self, own: list[str]) -> None:
        """debug.check_invariants: the field invariants of this rank's trajectories once every field is written."""
        if not own:
            return
        fields = ["prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask", "rm_scores",
                  "advantages", "returns"]
        td = self.store.local.kv_batch_get(own, TRAIN, select_fields=fields, jagged=fields)
        assert_invariants(td, keys=own, tags=self.store.tags_of(own, TRAIN))

    def _check_same_everywhere(self, items: Sequence[str], what: str) -> None:
        """Every rank must plan from the same ordered keys; a divergence would silently train on wrong shares."""
        import hashlib

        digest = hashlib.sha256("\n".join(items).encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=self.ctx.device)
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if lo.item() != hi.item():
            raise RuntimeError(f"{what} differs between ranks (rank {self.ctx.rank} holds {len(items)} items); "
                               "the replicated tag view is out of sync")

    def _padding_flags(self, keys: list[str]) -> torch.Tensor:
        """``is_padding`` of each key, from the replicated tags."""
        return torch.tensor([bool(t.get("is_padding")) for t in self.store.tags_of(keys, TRAIN)], dtype=torch.bool)

    def _bypass_old_log_probs(self, own: list[str], own_pad: torch.Tensor) -> None:
        """Bypass mode: the rollout's own log-probs are the old log-probs (padding samples get zeros)."""
        real = [k for k, p in zip(own, own_pad.tolist()) if not p]
        pad = [k for k, p in zip(own, own_pad.tolist()) if p]
        if real:
            td = self.store.local.kv_batch_get(real, TRAIN, select_fields=["rollout_log_probs"],
                                               jagged=["rollout_log_probs"])
            self.store.kv_batch_put(real, TRAIN, TensorDict({"old_log_probs": td["rollout_log_probs"]},
                                                            batch_size=[len(real)]))
        if pad:
            td = self.store.local.kv_batch_get(pad, TRAIN, select_fields=["response_mask"], jagged=["response_mask"])
            zeros = [torch.zeros(r.shape[0], dtype=torch.float32) for r in td["response_mask"].unbind()]
            self.store.kv_batch_put(pad, TRAIN, TensorDict({"old_log_probs": to_nested(zeros)}, batch_size=[len(pad)]))

    def _advantage(self, own: list[str], pad: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, float]]:
        """On the rank that holds each group (all of a group is generated on one rank): KL, rewards, advantages.

        Returns the jagged ``response_mask`` of ``own`` (None when the rank holds nothing) and the KL metrics.
        """
        cfg = self.cfg
        need = ["rm_scores", "response_mask"] + (["old_log_probs", "ref_log_prob"] if self.ref_bridge else [])
        td = self.store.fetch(own, TRAIN, need)
        out: dict[str, float] = {}
        kl_vals = torch.zeros(0, dtype=torch.float64)
        if own:
            lengths = nested_lengths(td["response_mask"])
            mask = response_from_nested(td["response_mask"]).float()
            scores = response_from_nested(td["rm_scores"]).float()
            if self.ref_bridge is not None:
                old = response_from_nested(td["old_log_probs"]).float()
                ref = response_from_nested(td["ref_log_prob"]).float()
                per_token = kl_penalty(old, ref, cfg.algorithm.kl_penalty) * mask
                kl_vals = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).double()
            if cfg.algorithm.use_kl_in_reward:  # config validation guarantees a reference
                rewards, _ = apply_kl_penalty(scores, old, ref, mask, self.kl_ctrl, cfg.algorithm.kl_penalty)
            else:
                rewards = scores
            index = [k.split("_", 1)[0] for k in own]
            kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=index, is_padding=pad,
                          norm_adv_by_std=cfg.algorithm.norm_adv_by_std, gamma=cfg.algorithm.gamma,
                          lam=cfg.algorithm.lam)
            kwargs.update(session_inputs_from_keys(own))  # multi-output sessions: advantage of the final output
            takes = inspect.signature(get_advantage_fn(cfg.algorithm.adv_estimator)).parameters
            adv, ret = compute_advantage(cfg.algorithm.adv_estimator,
                                         **{k: v for k, v in kwargs.items() if k in takes})
            fields = {"token_level_scores": response_to_nested(scores, lengths),
                      "token_level_rewards": response_to_nested(rewards, lengths),
                      "advantages": response_to_nested(adv.float(), lengths),
                      "returns": response_to_nested(ret.float(), lengths)}
            self.store.kv_batch_put(own, TRAIN, TensorDict(fields, batch_size=[len(own)]))
        if self.ref_bridge is not None:
            out.update(distributed_masked_stats(kl_vals, pad, "kl", device=self.ctx.device))
        return (td["response_mask"] if own else None), out

    def _sample_metrics(self, response_mask: torch.Tensor | None, pad: torch.Tensor) -> dict[str, float]:
        """Response and policy length statistics over real samples (padding excluded), over all ranks."""
        if response_mask is None:
            resp_len = policy_len = torch.zeros(0, dtype=torch.int64)
        else:
            resp_len, policy_len = sample_lengths(response_mask)
        return {**distributed_masked_stats(resp_len.double(), pad, "response_length", device=self.ctx.device),
                **distributed_masked_stats(policy_len.double(), pad, "policy_length", device=self.ctx.device)}

    def _bytes_metrics(self) -> dict[str, float]:
        mine = torch.tensor([float(self.store.bytes_received)], dtype=torch.float64, device=self.ctx.device)
        parts = [torch.zeros_like(mine) for _ in range(self.ctx.world)]
        dist.all_gather(parts, mine)
        self.store.bytes_received = 0
        vals = [float(p.item()) for p in parts]
        out = {f"dataplane/bytes_received/rank{r}": v for r, v in enumerate(vals)}
        out["dataplane/bytes_received/max"] = max(vals)
        return out

    def _trace(self, stage: str, meta: KVBatchMeta, fields: list[str], producer: str, consumer: str) -> None:
        if not self.trace.enabled:
            return
        sel = [k for k in meta.keys if k.split("_", 1)[0] == self.trace.sample_uid]
        own = [k for k in sel if all(self.store.location(k, f, TRAIN) == self.ctx.rank for f in fields)]
        if not own:
            return
        td = self.store.local.kv_batch_get(own, TRAIN, select_fields=fields, jagged=fields)
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
        own = self._local_keys(keys, VAL)
        scores = self._score(own, VAL, dict(zip(uids, rows)))
        stats = distributed_masked_stats(scores.double(), None, "val/score", device=self.ctx.device) if keys \
            else {}
        self.store.kv_clear(keys, VAL)
        self.store.kv_clear(uids, VAL)
        return {k: v for k, v in stats.items() if k.endswith("/mean") or k.endswith("/std")}

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> None:
        cfg = self.cfg
        bar = None
        if self.ctx.is_main and cfg.trainer.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.trainer.total_steps, initial=self.step, desc="grpo", dynamic_ncols=True)
        if self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(to_plain(cfg), indent=2))
        pending_val = self.validate() if self.step == 0 else {}
        while self.step < cfg.trainer.total_steps:
            metrics = {**pending_val, **self.train_step()}
            pending_val = {}
            self.step += 1
            last = self.step == cfg.trainer.total_steps
            if cfg.trainer.val_freq and self.step % cfg.trainer.val_freq == 0 or last:
                metrics.update(self.validate())
            self.metrics.log(self.step, metrics)
            if (cfg.trainer.save_freq and self.step % cfg.trainer.save_freq == 0) or last:
                self.save_checkpoint()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/score/mean', float('nan')):.3f}",
                                s_per_step=f"{metrics['timing_s/step']:.1f}")
        if bar is not None:
            bar.close()
        self.metrics.close()
        self.trace.close()


def run(cfg: RunConfig) -> None:
    """Entry point of ``scripts/train.py``: set up the process group, train, tear down."""
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = init_distributed(cfg.trainer.device)
    torch.manual_seed(cfg.trainer.seed)
    try:
        GRPOTrainer(cfg, ctx).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
