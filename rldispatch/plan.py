"""The step's dispatch: padding samples plus the train and inference plans, seen as KVBatchMetas per DP rank."""
from __future__ import annotations

from dataclasses import dataclass

from tensordict import TensorDict

from dispatch import BatchSettings, DispatchPlan, INT_FIELDS, Topology, WorkloadModel, build_plan, make_padding, \
    padding_count, read_plan_tags
from protocol.store.meta import KVBatchMeta
from rldispatch.config import RunConfig

__all__ = ["batch_settings", "StepPlan", "MiniBatchShare", "make_step_plan"]


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
                                  model.hidden_size
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
        workload=WorkloadModel.from_hidden_size(hidden),
    )


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

    def rank_meta(self, full: KVBatchMeta, dp_rank: int) -> KVBatchMeta:
        """All samples of ``dp_rank`` for inference (log-probs), in the inference plan's order."""
        return full.select_idxs(self.infer.ranks[dp_rank].mini_batches[0].indices)

    def infer_micro_batches(self, dp_rank: int) -> list[list[int]]:
        return self.infer.ranks[dp_rank].mini_batches[0].micro_batches

    def mini_batches(self, dp_rank: int) -> list[MiniBatchShare]:
        return [MiniBatchShare(mb.indices, mb.micro_batches) for mb in self.train.ranks[dp_rank].mini_batches]


def make_step_plan(meta: KVBatchMeta, topology: Topology, cfg: RunConfig, step: int) -> StepPlan:
    """Pad the sampled batch to the multiple the step needs, then plan training and inference (pure, same on all ranks)."""
    train_settings = batch_settings(cfg, topology, step)
    count = padding_count(len(meta), train_settings.padding_multiple(topology))
    pad = make_padding(count, global_steps=step, fields=list(INT_FIELDS), seed=cfg.trainer.seed * 1_000_003 + step)
    keys = list(meta.keys) + pad.keys
    tags = list(meta.tags) + list(pad.tags)  # planning reads tags and never edits them (tests/dispatch/test_plan.py)
    read = read_plan_tags(tags, keys, need_groups=train_settings.group_partition)  # once for both plans
    train = build_plan(read, topology, train_settings)
    infer = build_plan(read, topology, batch_settings(cfg, topology, step, inference=True))
    return StepPlan(keys=keys, padding_keys=pad.keys, padding_tags=pad.tags,
                    padding_fields=pad.data if count else None, train=train, infer=infer)
