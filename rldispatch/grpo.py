"""The GRPO step, wired from protocol, dispatch and backends; every rank runs this code (SPMD). When and where
generation runs around the step (``trainer.mode``) is the schedule's (:mod:`rldispatch.schedules`); the run's life
around the steps (fit loop, checkpoints, signals) is :mod:`rldispatch.lifecycle`.

One step: prompts -> uid per prompt -> rollout on each DP replica's reporting rank -> store -> reward ->
balance and dispatch plan -> old log-probs -> reference log-probs -> KL -> (with a critic: values) -> advantage ->
(critic update) -> actor update (ppo_epochs x mini-batches) -> metrics -> ``kv_clear`` of every key of the step ->
weight sync to the rollout.

The controller holds :class:`protocol.store.meta.KVBatchMeta` objects only; values stay where they were produced and
move point to point through :class:`rldispatch.dataplane.ShardedStore`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from backends.base import get_engine_class
from backends.rollout import build_rollout_engine
from dispatch import Topology
from protocol.algos.kl import AdaptiveKLController, FixedKLController, kl_penalty
from protocol.algos.reward import RewardInput, RewardResult, build_reward_manager, compute_rm_scores, numeric_extras
from protocol.algos.rollout_correction import correction_metrics
from protocol.batch.nested import jagged_to_padded, to_nested
from protocol.invariants import assert_invariants
import protocol.rollout.tasks  # noqa: F401  (registers the task scorers by data_source)
from protocol.rollout.dataset import ground_truth_of
from protocol.rollout.tokenizer import check_vocab_fits, decode_response, load_tokenizer, resolve_tokenizer
from protocol.store import LocalStore
from protocol.store.batching import batch_of, jagged_rows
from protocol.store.keys import uid_of
from protocol.store.meta import KVBatchMeta
from protocol.store.replay_buffer import ReplayBufferError
from rldispatch.advantage import ADVANTAGE_FIELDS, advantages_on_owners
from rldispatch.bridge import StoreBridge
from rldispatch.checkpoints import Checkpoints, Resumed
from rldispatch.collectives import check_digests, key_digest
from rldispatch.config import RunConfig, vision_config
from rldispatch.critic import CriticRole
from rldispatch.dataplane import ShardedStore
from rldispatch.gc_policy import StepGC
from rldispatch.launch import DistContext
from rldispatch.metrics import (ComputeClock, MetricsLogger, StepStats, Timer, combine_update_metrics,
                                distributed_masked_stats, overhead_fraction, sample_lengths)
from rldispatch.plan import batch_settings, prepare_step_plan
from rldispatch.prompts import PromptStream, load_datasets, step_uids
from rldispatch.ref import build_reference
from rldispatch.rollout import TRAIN, VAL, LocalRollout
from rldispatch.run_dir import claim_run_dir
from rldispatch.schedules import Seams, schedule_class
from rldispatch.step_state import StepState
from rldispatch.judge import JUDGE_FIELD, JudgeRole
from rldispatch.reward_model import RM_FIELD, RewardModelRole
from rldispatch.trace import TraceRecorder

__all__ = ["GRPOTrainer", "NoUsableGroupsError"]

logger = logging.getLogger(__name__)


class NoUsableGroupsError(RuntimeError):
    """A step whose every prompt group failed or was dropped: nothing can be trained on."""


class GRPOTrainer:
    """Holds the run's components and runs one step (:meth:`train_step`) under the run's schedule; the fit loop
    around it is :func:`rldispatch.lifecycle.fit`."""

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.run_dir = Path(cfg.trainer.run_dir)
        claim_run_dir(self.run_dir, cfg.trainer, is_main=ctx.is_main)  # refuse another run's folder (every rank)
        dist.barrier()
        self.topology = Topology.from_config(cfg.actor.parallel, ctx.world)
        self.dp_ranks = [self.topology.dp_rank(r) for r in range(ctx.world)]  # of every rank
        self.dp_rank = self.dp_ranks[ctx.rank]
        self.reporting = self.topology.is_reporting(ctx.rank)
        batch_settings(cfg, self.topology, step=0).check(self.topology)  # refuse undividable batches before rollout
        self.tokenizer = load_tokenizer(resolve_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))
        check_vocab_fits(self.tokenizer, cfg.model.vocab_size)  # before any engine is built
        self.train_set, self.val_set = load_datasets(cfg, self.tokenizer, ctx.is_main)

        engine_cls = get_engine_class(cfg.actor.backend)
        self.engine = engine_cls(cfg.engine_config(), self.topology)
        self.ref_engine = build_reference(cfg.actor.backend, engine_cls, cfg.engine_config(), self.topology,
                                          self.engine) if cfg.ref.enabled else None
        self.store = ShardedStore(LocalStore(), device=ctx.device)
        self.critic = CriticRole(cfg, self.topology, self.store) if cfg.critic.enabled else None
        self.reward_model = RewardModelRole(cfg, self.topology, self.store, self.tokenizer) \
            if cfg.reward.model.enabled else None
        vl = vision_config(cfg)  # a vision-language policy: every engine call gets the samples' images
        self.bridge = StoreBridge(self.engine, self.store, images=vl is not None)
        self.ref_bridge = StoreBridge(self.ref_engine, self.store, images=vl is not None) \
            if self.ref_engine is not None else None

        schedule_cls = schedule_class(cfg.trainer.mode)
        # in separate_async the training ranks generate only validation (round robin, as in the other modes)
        holders = [self.topology.reporting_rank(d) for d in range(self.topology.dp_size)]
        engine = build_rollout_engine(cfg.rollout.engine, vl or cfg.model, self.tokenizer, device=ctx.device,
                                      seed=cfg.trainer.seed, rank=self.dp_rank, generates=ctx.rank in holders,
                                      options=cfg.rollout)
        partial = cfg.rollout.partial_rollout if cfg.rollout.partial_rollout is not None else \
            schedule_cls.partial_rollout
        self.rollout = LocalRollout(cfg, engine, self.tokenizer, self.store, partial=partial, rank=self.dp_rank,
                                    holders=holders, me=ctx.rank, vision=vl.vision if vl is not None else None)
        self.stream = PromptStream(self.train_set, cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        # only the stop token that ended the response is dropped; other special tokens stay in the decoded text:
        # a scorer that never saw them would let the policy pad its answer with <|pad|> and still score full marks
        decode = functools.partial(decode_response, self.tokenizer, stop_ids=engine.stop_token_ids)
        build = functools.partial(build_reward_manager, cfg.reward, cfg.custom_reward_function, decode=decode,
                                  max_response_len=cfg.data.max_response_length)
        self.reward_manager = build()
        # validation scores gsm8k strictly whatever the training reward's shaping
        self.val_reward_manager = build(train=False) if cfg.reward.gsm8k_train.shaped else self.reward_manager
        # the judge answers on the ranks that hold trajectories (validation stays rule-based)
        self.judge = JudgeRole(cfg, decode, device=ctx.device, rank=self.dp_rank) \
            if cfg.reward.judge.enable and ctx.rank in holders else None
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = FixedKLController(kc.kl_coef) if kc.type == "fixed" else \
            AdaptiveKLController(kc.kl_coef, kc.target_kl, kc.horizon)
        self.metrics = MetricsLogger(self.run_dir, ctx.is_main, tensorboard=cfg.trainer.tensorboard)
        trace_path = cfg.trace.path or str(self.run_dir / f"trace.rank{ctx.rank}.jsonl")
        self.trace = TraceRecorder(trace_path, enabled=cfg.trace.enabled, rank=ctx.rank)
        self.gc = StepGC(cfg.trainer.gc_interval)
        self.checkpoints = Checkpoints(cfg, ctx, self.run_dir)
        self.step = 0
        resumed = self.checkpoints.resume(self.engine, self.critic)
        if resumed is not None:
            self._resume(resumed)
        engine.load_weights(self.engine.get_weights(), version=self.step)  # version = the step it serves
        seams = Seams(cfg, self.stream, self.store, self.rollout, self.engine.get_weights, holders, link=ctx.link)
        self.schedule = schedule_cls(seams, self.step)
        self.schedule.restore(resumed.extra.get("schedule") if resumed is not None else None)

    def _resume(self, resumed: Resumed) -> None:
        self.step = resumed.step
        if "kl_coef" in resumed.extra and isinstance(self.kl_ctrl, AdaptiveKLController):
            self.kl_ctrl.value = float(resumed.extra["kl_coef"])  # the adaptive coefficient is state; fixed: config
        dropped = self.metrics.keep_through(self.step)
        if self.ctx.is_main:
            for key, old, new in resumed.changes:
                logger.info("resume: %s changed %r -> %r (applied)", key, old, new)
            logger.info("resumed from %s at step %d%s", resumed.path, self.step,
                        f"; dropped {dropped} metrics records after it" if dropped else "")

    def save_checkpoint(self) -> None:
        """The step's checkpoint: the actor (with the KL coefficient and an async schedule's prompt stream) and
        the critic."""
        extra: dict[str, Any] = {"kl_coef": float(self.kl_ctrl.value)}
        schedule = self.schedule.state(self.step)
        if schedule is not None:
            extra["schedule"] = schedule  # an async run's prompt stream and outstanding prompts
        self.checkpoints.save(self.step, self.engine, self.critic, extra)

    # ------------------------------------------------------------------------------------------------ reward
    def _score(self, keys: list[str], partition: str, rows_by_uid: dict[str, dict],
               pad: torch.Tensor | None = None,
               inputs: tuple[TensorDict, list[RewardInput]] | None = None) -> RewardResult:
        """Reward of this rank's own trajectories (scores and the scorers' extra values); writes ``rm_scores`` at
        the last policy token. ``pad``: the keys' ``is_padding`` flags when the caller has them (else read);
        ``inputs``: the keys' :meth:`_reward_inputs` when the caller read them already."""
        if not keys:
            return RewardResult(torch.zeros(0))
        td, items = inputs or self._reward_inputs(keys, partition, rows_by_uid, pad)
        result = (self.val_reward_manager if partition == VAL else self.reward_manager)(items)
        rm = compute_rm_scores(result.scores, td["response_mask"])
        self.store.kv_batch_put(keys, partition, batch_of({"rm_scores": rm}, len(keys)))
        return result

    def _reward_inputs(self, keys: list[str], partition: str, rows_by_uid: dict[str, dict],
                       pad: torch.Tensor | None) -> tuple[TensorDict, list[RewardInput]]:
        """This rank's ``responses`` / ``response_mask`` of ``keys`` and a :class:`RewardInput` per key."""
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
        return td, items

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
        st = StepState(self.step, compute=ComputeClock(self.ctx.device))
        t_step = time.perf_counter()
        batch = self._stage("rollout", st, self._generate, None)             # 1. sessions -> local stores
        batch = self._stage("sample", st, self._sample, batch)               # 2. terminal groups, oldest first
        batch = self._stage("plan", st, self._plan, batch)                   # 3. padding + balanced DP shares
        batch = self._stage("reward", st, self._compute_reward, batch)       # 4. rm_scores
        if self.cfg.reward.judge.enable:
            batch = self._stage("judge", st, self._compute_judge_scores, batch)  # 4b. the judge's scores
        batch = self._stage("old_log_prob", st, self._compute_old_log_prob, batch)  # 5. old log-probs, entropy
        if self.ref_bridge is not None:
            batch = self._stage("ref", st, self._compute_ref_log_prob, batch)  # 6. reference log-probs, KL
        if self.critic is not None:
            batch = self._stage("values", st, self._compute_values, batch)   # 6b. the critic's values
        if self.reward_model is not None:
            batch = self._stage("reward_model", st, self._compute_rm_scores, batch)  # 6c. the reward model
        batch = self._stage("advantage", st, self._compute_advantage, batch)  # 7. rewards -> advantages
        if self.critic is not None:
            batch = self._stage("critic_update", st, self._update_critic, batch)  # 7b. value loss, same batches
        batch = self._stage("update", st, self._update_actor, batch)         # 8. ppo_epochs x mini-batches
        self._stage("clear", st, self._clear, batch)                         # 9. kv_clear of the whole step
        self._stage("weight_sync", st, self._sync_weights, batch)            # 10. new weights to the rollout
        self._stage("gc", st, self._collect_garbage, batch)                  # 11. cyclic garbage (gc_interval)
        with self.where("metrics", st.step):  # its reductions are collectives too (and a schedule's receives)
            return self._finish(st, time.perf_counter() - t_step)

    def _stage(self, name: str, st: StepState, fn, batch: KVBatchMeta | None) -> KVBatchMeta | None:
        with Timer(name, st.times), self.where(name, st.step):
            return fn(batch, st)

    @contextlib.contextmanager
    def where(self, stage: str, step: int):
        """An exception leaving ``stage`` (a peer's timeout included) says which rank, step and stage it came from."""
        try:
            yield
        except Exception as exc:
            if not getattr(exc, "_rldispatch_where", False):
                exc.add_note(f"[rank {self.ctx.rank}/{self.ctx.world}] in step {step}, stage {stage!r}")
                exc._rldispatch_where = True
            raise

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
        if st.own:
            st.reward_inputs = self._reward_inputs(st.own, TRAIN, self.stream.rows, st.own_pad)
        result = self._score(st.own, TRAIN, self.stream.rows, st.own_pad, inputs=st.reward_inputs)
        # with a reward model the rule's scores are a metric of their own; reward/score is the combination
        st.stats.masked("reward/rule" if self.cfg.reward.learned else "reward/score", result.scores.double(),
                        st.own_pad)
        self._reward_extra_metrics(result, st.own_pad, st.stats)
        st.stats.sum("samples/real", float((~st.own_pad).sum()))
        st.stats.sum("samples/padding", float(st.own_pad.sum()))
        # no sync: nothing reads the scores before the advantage, and their locations reach the peers with the
        # old-log-prob stage's sync (before it, a peer would find no location for them: a DataPlaneError)
        self._trace("reward", st.sampled, ["rm_scores"], "reward_manager", "advantage")
        return full

    def _compute_judge_scores(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        """The judge's score of each trajectory this rank holds (``rm_judge_scores``); ``reward/judge/*`` over real
        samples, and the answers without a usable score counted by kind."""
        scores, failures = torch.zeros(0), []
        if st.own:
            td, items = st.reward_inputs  # read by the reward stage
            result = self.judge.judge(items, self.stream.rows, self.step)
            scores, failures = result.scores, result.failures
            self.store.kv_batch_put(st.own, TRAIN, batch_of(
                {JUDGE_FIELD: compute_rm_scores(scores, td["response_mask"])}, len(st.own)))
        st.stats.masked("reward/judge/score", scores.double(), st.own_pad)
        for kind in ("no_score", "out_of_range"):
            st.stats.sum(f"reward/judge/{kind}", float(sum(f == kind for f in failures)))
        self._trace("judge", st.sampled, [JUDGE_FIELD], "judge", "advantage")
        return full

    def _compute_old_log_prob(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        cfg = self.cfg
        st.mine = st.plan.rank_meta(full, self.dp_rank)
        recompute = cfg.rollout.log_prob_mode == "recompute"
        st.infer_inputs = self.bridge.fetch_infer_inputs(st.mine, self._infer_wants(st)) \
            if recompute or self.ref_bridge is not None or self.critic is not None or self.reward_model is not None \
            else None
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
            self.critic.infer_values(st)
        self.store.sync()
        self._trace("values", st.sampled, ["values"], "critic.infer_batch", "advantage")
        return full

    def _compute_rm_scores(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        """The reward model's score of every trajectory, on the inference share the log-probs used (no new fetch);
        combined with the rule-based scores in the advantage stage."""
        with st.compute.region("infer"):
            self.reward_model.score(st, self.stream.rows)
        self.store.sync()
        self._trace("reward_model", st.sampled, [RM_FIELD], "reward_model.infer_batch", "advantage")
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
        advantages_on_owners(self.cfg, self.store, st.owners, st.own_pad, st.stats, self.kl_ctrl,
                             with_values=self.critic is not None, device=self.ctx.device)
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
            use_is = self.cfg.algorithm.rollout_correction.rollout_is is not None
            with st.compute.region("update"):
                updates = [self.bridge.train(mb.meta(full), mb.micro_batches,
                                             use_kl_loss=self.cfg.actor.loss.use_kl_loss, wants=wants,
                                             use_is_weights=use_is)
                           for mb, wants in st.plan.train_shares(self.dp_ranks, self.dp_rank)]
            st.metrics.update(combine_update_metrics(updates))
        self._sample_metrics(st.own, st.own_pad, st.stats)
        return full

    def _update_critic(self, full: KVBatchMeta, st: StepState) -> KVBatchMeta:
        """The value loss over the actor's mini- and micro-batches (ppo_epochs x mini-batches, one optimizer step
        each)."""
        with st.compute.region("update"):
            updates = self.critic.update(full, st)
        st.metrics.update(combine_update_metrics(updates, prefix="critic/"))
        return full

    def _clear(self, full: KVBatchMeta, st: StepState) -> None:
        self.schedule.replay.clear(st.sampled, extra_keys=st.plan.padding_keys)
        self.schedule.after_clear(st)
        st.stats.sum("store/keys_after_clear", float(self.store.num_keys()))

    def _collect_garbage(self, _: KVBatchMeta | None, st: StepState) -> None:
        self.gc.step_done(st.step)

    def _sync_weights(self, _: KVBatchMeta | None, st: StepState) -> None:
        weights = self.engine.get_weights()
        self.rollout.engine.load_weights(weights, version=st.step + 1)
        self.schedule.sync_weights(weights, st.step + 1)

    def _finish(self, st: StepState, seconds: float) -> dict[str, float]:
        m = st.metrics
        st.stats.per_rank("dataplane/bytes_received", self.store.bytes_received)
        self.store.bytes_received = 0
        self._rank_time_stats(st)
        m.update(self.schedule.step_metrics(st, seconds))  # before the reduce: a schedule may add per-rank values
        m.update(st.stats.reduce(device=self.ctx.device))  # the step's one metrics collective
        CriticRole.finish_metrics(m)
        corr = {k[len("rollout_corr/_"):]: m.pop(k) for k in [k for k in m if k.startswith("rollout_corr/_")]}
        m.update(correction_metrics(corr))
        for stat in ("mean", "max"):  # the reference system's names
            if f"training/rollout_probs_diff/{stat}" in m:
                m[f"training/rollout_probs_diff_{stat}"] = m.pop(f"training/rollout_probs_diff/{stat}")
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
        return [st.plan.infer_keys(d) if not reporting_only or self.topology.is_reporting(r) else []
                for r, d in enumerate(self.dp_ranks)]

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
        self.rollout.submit_share(rows, uids, VAL, self.step, seed_batch=self.step,
                                  cancel_left=not self.schedule.keeps_generating)
        self.store.sync()
        keys = [k for k in self.store.kv_list(VAL).get(VAL, {}) if "_" in k]
        own = self.store.local_keys(keys, VAL, "responses")
        scores = self._score(own, VAL, dict(zip(uids, rows))).scores
        stats = distributed_masked_stats(scores.double(), None, "val/score", device=self.ctx.device) if keys \
            else {}
        self.store.kv_clear(keys, VAL)
        self.store.kv_clear(uids, VAL)
        return {k: v for k, v in stats.items() if k.endswith("/mean") or k.endswith("/std")}

    def timed_validate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        out = self.validate()
        return {**out, "timing_s/val": time.perf_counter() - t0}
