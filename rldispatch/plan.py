"""The step's dispatch: padding samples plus the train and inference plans, seen as KVBatchMetas per DP rank."""
from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tensordict import TensorDict

from dispatch import BatchSettings, DispatchPlan, INT_FIELDS, MiniBatchWork, PlanJob, Topology, WorkloadModel, \
    make_padding, padding_count, read_plan_tags
from protocol.store.meta import KVBatchMeta
from rldispatch.config import RunConfig, vision_config

__all__ = ["batch_settings", "StepPlan", "StepPlanJob", "MiniBatchShare", "prepare_step_plan", "make_step_plan"]


def batch_settings(cfg: RunConfig, topology: Topology, step: int, *, inference: bool = False) -> BatchSettings:
    """The dispatch settings of the run; ``inference`` makes the whole batch one mini-batch (log-probs).

    The one place run config keys become :class:`dispatch.BatchSettings` fields (dispatch knows no config keys):

    ============================  =======================================  =============================
    BatchSettings field           run config key                           inference (log-probs)
    ============================  =======================================  =============================
    ppo_mini_batch_size           actor.ppo_mini_batch_size                None (one mini-batch)
    rollout_n                     rollout.n                                same
    ppo_epochs                    actor.ppo_epochs                         1
    shuffle                       actor.shuffle                            False
    seed                          trainer.seed * 100003 + step             same
    micro_batch_size_per_gpu      actor.micro_batch_size_per_gpu, unless   same
                                  actor.use_dynamic_bsz
    max_token_len_per_gpu         actor.max_token_len_per_gpu, if          same
                                  actor.use_dynamic_bsz
    group_partition               actor.balance.group_level                same
    balance                       actor.balance.enabled                    same
    small_ends                    the topology's pp > 1                    same
    workload                      actor.balance.hidden_size or             same
                                  model.hidden_size (+ a vision-language
                                  policy's tower: WorkloadModel.with_vision)
    ============================  =======================================  =============================
    """
    a = cfg.actor
    hidden = a.balance.hidden_size or cfg.model.hidden_size
    return BatchSettings(
        ppo_mini_batch_size=None if inference else a.ppo_mini_batch_size,
        rollout_n=cfg.rollout.n,
        ppo_epochs=1 if inference else a.ppo_epochs,
        shuffle=False if inference else a.shuffle,
        seed=cfg.trainer.seed * 100_003 + step,
        micro_batch_size_per_gpu=None if a.use_dynamic_bsz else a.micro_batch_size_per_gpu,
        max_token_len_per_gpu=a.max_token_len_per_gpu if a.use_dynamic_bsz else None,
        group_partition=a.balance.group_level,
        balance=a.balance.enabled,
        small_ends=topology.pp > 1,
        workload=_workload(cfg, hidden),
    )


def _workload(cfg: RunConfig, hidden: int) -> WorkloadModel:
    """The decoder's workload; a vision-language policy's adds its tower's cost per image patch and span."""
    work = WorkloadModel.from_hidden_size(hidden)
    vl = vision_config(cfg)
    if vl is None:
        return work
    v = vl.vision
    return work.with_vision(width=v.embed_dim, mlp_matrices=v.mlp_matrices, mlp_width=v.mlp_width, blocks=v.depth,
                            decoder_layers=vl.text.num_layers)


@dataclass
class MiniBatchShare:
    """One optimizer step of one DP rank: positions into the step's key list and the micro-batch split."""

    indices: list[int]
    micro_batches: list[list[int]]

    def meta(self, full: KVBatchMeta) -> KVBatchMeta:
        return full.select_idxs(self.indices)


@dataclass
class StepPlan:
    """Real and padding keys of the step in one list; ``train`` and ``infer`` plans index into it."""

    keys: list[str]
    padding_keys: list[str]
    padding_tags: list[dict]
    padding_fields: TensorDict | None
    train: DispatchPlan
    infer: DispatchPlan

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.train.metrics)

    def full_meta(self, store, partition_id: str = "train") -> KVBatchMeta:
        return KVBatchMeta.adopt(partition_id, list(self.keys), store.tags_of(self.keys, partition_id))  # fresh copies

    def keys_of(self, indices: Sequence[int]) -> list[str]:
        """The step's keys at ``indices`` (positions into :attr:`keys`): a share named from the plan alone."""
        return [self.keys[i] for i in indices]

    def _infer_share(self, dp_rank: int):
        return self.infer.ranks[dp_rank].mini_batches[0]  # inference: one mini-batch of every sample

    def rank_meta(self, full: KVBatchMeta, dp_rank: int) -> KVBatchMeta:
        """All samples of ``dp_rank`` for inference (log-probs), in the inference plan's order."""
        return full.select_idxs(self._infer_share(dp_rank).indices)

    def infer_keys(self, dp_rank: int) -> list[str]:
        """The keys of :meth:`rank_meta`, from the plan alone (every rank can name every rank's share)."""
        return self.keys_of(self._infer_share(dp_rank).indices)

    def infer_micro_batches(self, dp_rank: int) -> list[list[int]]:
        return self._infer_share(dp_rank).micro_batches

    def mini_batches(self, dp_rank: int) -> list[MiniBatchShare]:
        return [MiniBatchShare(mb.indices, mb.micro_batches) for mb in self.train.ranks[dp_rank].mini_batches]

    def train_shares(self, dp_ranks: Sequence[int], dp_rank: int) -> list[tuple[MiniBatchShare, list[list[str]]]]:
        """``dp_rank``'s mini-batches in order, each with the keys every store rank ``r`` (DP rank ``dp_ranks[r]``)
        trains on in the same optimizer step: the ``wants`` of its planned fetch."""
        shares = [self.mini_batches(d) for d in dp_ranks]
        return [(mb, [self.keys_of(of_rank[i].indices) for of_rank in shares])
                for i, mb in enumerate(self.mini_batches(dp_rank))]


#: a plan piece's fixed cost in samples: on this project's 2-core CPU machine one of 128 samples took 0.54 ms and
#: its setup alone about 0.45 ms, so small pieces weigh about twice their samples
PIECE_SETUP = 128


@dataclass
class StepPlanJob:
    """A step's padding and its two plans, in pieces (one per mini-batch) that any rank may compute.

    Ranks split the pieces (:meth:`run_share`) and exchange what they computed; every rank then builds the same
    :class:`StepPlan` with :meth:`finish`. One process runs every piece itself (:func:`make_step_plan`).
    """

    keys: list[str]
    padding_keys: list[str]
    padding_tags: list[dict]
    padding_fields: TensorDict | None
    train: PlanJob
    infer: PlanJob

    def _pieces(self) -> list[tuple[PlanJob, int]]:
        return [(job, i) for job in (self.train, self.infer) for i in range(len(job))]

    def owners(self, world: int) -> list[int]:
        """The rank that computes each piece: heaviest piece first to the least-loaded rank (ties: lower rank).

        A piece weighs its samples plus :data:`PIECE_SETUP` (what setting one up costs, in samples)."""
        pieces = self._pieces()
        costs = [job.cost(i) + PIECE_SETUP for job, i in pieces]
        load, owner = [0] * world, [0] * len(pieces)
        for p in sorted(range(len(pieces)), key=lambda q: (-costs[q], q)):
            r = min(range(world), key=lambda x: (load[x], x))
            owner[p] = r
            load[r] += costs[p]
        return owner

    def run_share(self, rank: int, world: int) -> dict[int, MiniBatchWork | Exception]:
        """The pieces ``rank`` of ``world`` computes, by piece number; a piece that fails gives its exception, so
        that every rank raises it in :meth:`finish` (a rank raising alone would leave the others in a collective)."""
        done: dict[int, MiniBatchWork | Exception] = {}
        for p, ((job, i), r) in enumerate(zip(self._pieces(), self.owners(world))):
            if r == rank:
                try:
                    done[p] = job.run(i)
                except Exception as exc:  # noqa: BLE001 - carried to every rank and raised there
                    done[p] = exc if _picklable(exc) else RuntimeError(f"{type(exc).__name__}: {exc}")
        return done

    def finish(self, done: Mapping[int, MiniBatchWork | Exception]) -> StepPlan:
        """The step plan from every piece's result (the first failed piece, in plan order, raises)."""
        pieces = self._pieces()
        missing = [p for p in range(len(pieces)) if p not in done]
        if missing:
            raise RuntimeError(f"the step plan misses {len(missing)} of its {len(pieces)} planned mini-batches")
        results = [done[p] for p in range(len(pieces))]
        failed = next((r for r in results if isinstance(r, Exception)), None)
        if failed is not None:
            raise failed
        n = len(self.train)
        return StepPlan(keys=self.keys, padding_keys=self.padding_keys, padding_tags=self.padding_tags,
                        padding_fields=self.padding_fields, train=self.train.assemble(results[:n]),
                        infer=self.infer.assemble(results[n:]))


def _picklable(exc: Exception) -> bool:
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - any failure means it cannot travel
        return False
    return True


def prepare_step_plan(meta: KVBatchMeta, topology: Topology, cfg: RunConfig, step: int) -> StepPlanJob:
    """Pad the sampled batch to the multiple the step needs and set up its training and inference plans (pure)."""
    train_settings = batch_settings(cfg, topology, step)
    count = padding_count(len(meta), train_settings.padding_multiple(topology))
    pad = make_padding(count, global_steps=step, fields=list(INT_FIELDS) if count else [],  # none: no fields
                       seed=cfg.trainer.seed * 1_000_003 + step)
    keys = list(meta.keys) + pad.keys
    tags = list(meta.tags) + list(pad.tags)  # planning reads tags and never edits them (tests/dispatch/test_plan.py)
    read = read_plan_tags(tags, keys, need_groups=train_settings.group_partition)  # once for both plans
    return StepPlanJob(keys=keys, padding_keys=pad.keys, padding_tags=pad.tags,
                       padding_fields=pad.data if count else None, train=PlanJob(read, topology, train_settings),
                       infer=PlanJob(read, topology, batch_settings(cfg, topology, step, inference=True)))


def make_step_plan(meta: KVBatchMeta, topology: Topology, cfg: RunConfig, step: int) -> StepPlan:
    """Pad the sampled batch to the multiple the step needs, then plan training and inference, every piece here."""
    job = prepare_step_plan(meta, topology, cfg, step)
    return job.finish(job.run_share(0, 1))
