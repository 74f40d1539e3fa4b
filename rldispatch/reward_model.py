"""The reward model: a frozen sequence classifier on the actor's FSDP ranks, scoring the step's inference shares
(the plan that serves log-probs and values: balanced, padding samples tagged and scored 0). Its per-trajectory
scores are written as ``rm_model_scores`` (the ``rm_scores`` contract: the score at the last policy token) and
combined with the rule-based ``rm_scores`` in the advantage stage (``reward.model.weight`` /
``reward.rule_weight``)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tensordict import TensorDict

from backends.base import Share
from backends.config import LoraConfig
from dispatch import Topology
from protocol.algos.reward import RewardConfig
from rldispatch.config import RunConfig
from rldispatch.judge import JUDGE_FIELD
from rldispatch.step_state import StepState

__all__ = ["RewardModelRole", "RM_FIELD", "build_reward_model_engine", "combined_scores"]

#: the store field of the reward model's scores (beside the rule-based ``rm_scores``)
RM_FIELD = "rm_model_scores"


def build_reward_model_engine(cfg: RunConfig, topology: Topology) -> Any:
    """The reward model folder on the actor's FSDP section (the actor's mesh, DP ranks and token budget)."""
    from backends.fsdp.reward_model import FSDPRewardModelEngine
    from backends.model.reward_model import read_reward_config

    rm = cfg.reward.model
    ec = dataclasses.replace(cfg.engine_config(), model=read_reward_config(rm.hf_path), lora=LoraConfig())
    return FSDPRewardModelEngine(ec, topology, max_length=rm.max_length, truncation=rm.truncation,
                                 micro_batch_size=rm.micro_batch_size)


def combined_scores(reward: RewardConfig, rule: torch.Tensor, learned: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trajectory scores the advantage uses: ``reward.rule_weight * rule`` plus each model's weighted scores
    (``learned``: ``rm_model_scores`` / ``rm_judge_scores``; all padded [n, L] rows with the score at the last
    policy token)."""
    weights = {RM_FIELD: reward.model.weight, JUDGE_FIELD: reward.judge.weight}
    out = reward.rule_weight * rule
    for name, scores in learned.items():
        out = out + weights[name] * scores
    return out


class RewardModelRole:
    """The reward model's engine, scoring each step's inference shares into the store."""

    def __init__(self, cfg: RunConfig, topology: Topology, store: Any):
        self.cfg, self.store = cfg, store
        self.engine = build_reward_model_engine(cfg, topology)
        self.dp_rank = topology.dp_rank(store.rank)

    def score(self, st: StepState) -> None:
        """Score this rank's inference share; its replica's reporting rank writes ``rm_model_scores`` and records
        ``reward/model/*`` (real samples) and ``reward/model/truncated``."""
        meta = st.mine
        if st.infer_inputs is None:
            raise RuntimeError("the reward model scores the inference inputs the old-log-prob stage fetched; none "
                               "were fetched this step")
        if not len(meta):
            return
        share = Share(st.infer_inputs, [list(mb) for mb in st.plan.infer_micro_batches(self.dp_rank)])
        out = self.engine.infer_batch(share)
        if out is None:
            return
        self.store.kv_batch_put(meta.keys, meta.partition_id, TensorDict({RM_FIELD: out["rm_scores"]},
                                                                          batch_size=[len(meta)]))
        pad = torch.tensor([bool(t.get("is_padding", False)) for t in meta.tags])
        st.stats.masked("reward/model", out["scores"].double(), pad)
        st.stats.sum("reward/model/truncated", float(out["rm_truncated"][~pad].sum()))
