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
from backends.model.reward_model import chat_input_ids
from backends.config import LoraConfig
from dispatch import Topology
from protocol.algos.reward import RewardConfig
from protocol.rollout.tokenizer import load_tokenizer
from protocol.store.batching import jagged_rows
from protocol.store.keys import uid_of
from rldispatch.config import RunConfig
from rldispatch.judge import JUDGE_FIELD
from rldispatch.step_state import StepState

__all__ = ["RewardModelRole", "RM_FIELD", "build_reward_model_engine", "combined_scores", "learned_weights"]

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


def learned_weights(reward: RewardConfig) -> dict[str, float]:
    """The store field of each model that scores this run's trajectories (a reward model, a judge) -> its weight
    in the trajectory score."""
    return {f: w for f, w, on in ((RM_FIELD, reward.model.weight, reward.model.enabled),
                                  (JUDGE_FIELD, reward.judge.weight, reward.judge.enable)) if on}


def combined_scores(reward: RewardConfig, rule: torch.Tensor, learned: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trajectory scores the advantage uses: ``reward.rule_weight * rule`` plus each model's weighted scores
    (``learned``: the fields of :func:`learned_weights`; all padded [n, L] rows with the score at the last policy
    token)."""
    weights = learned_weights(reward)
    out = reward.rule_weight * rule
    for name, scores in learned.items():
        out = out + weights[name] * scores
    return out


class RewardModelRole:
    """The reward model's engine, scoring each step's inference shares into the store. With
    ``reward.model.retokenize`` it reads each trajectory in its own chat template and tokenizer: the row's prompt
    messages and the response decoded by the policy's tokenizer (special tokens skipped)."""

    def __init__(self, cfg: RunConfig, topology: Topology, store: Any, policy_tokenizer: Any):
        self.cfg, self.store = cfg, store
        self.engine = build_reward_model_engine(cfg, topology)
        self.dp_rank = topology.dp_rank(store.rank)
        self.policy_tokenizer = policy_tokenizer
        self.tokenizer = load_tokenizer(cfg.reward.model.hf_path) if cfg.reward.model.retokenize else None

    def _own_ids(self, meta: Any, inputs: TensorDict, rows_by_uid: dict[str, dict]) -> list[torch.Tensor]:
        """The reward model's token ids of each sample of the share (a padding sample: one token, scored 0)."""
        out = []
        ids_rows, masks = jagged_rows(inputs["input_ids"]), jagged_rows(inputs["response_mask"])
        for key, tags, ids, mask in zip(meta.keys, meta.tags, ids_rows, masks):
            if tags.get("is_padding"):
                out.append(torch.tensor([self.tokenizer.eos_token_id]))
                continue
            response = self.policy_tokenizer.decode(ids[ids.numel() - mask.numel():].tolist(), skip_special=True)
            out.append(torch.tensor(chat_input_ids(self.tokenizer, rows_by_uid[uid_of(key)]["raw_prompt"], response)))
        return out

    def score(self, st: StepState, rows_by_uid: dict[str, dict]) -> None:
        """Score this rank's inference share; its replica's reporting rank writes ``rm_model_scores`` and records
        ``reward/model/*`` (real samples) and ``reward/model/truncated``. ``rows_by_uid``: the dataset rows of the
        step's prompts (their ``raw_prompt`` is what a re-tokenizing reward model reads)."""
        meta = st.mine
        if st.infer_inputs is None:
            raise RuntimeError("the reward model scores the inference inputs the old-log-prob stage fetched; none "
                               "were fetched this step")
        if not len(meta):
            return
        share = Share(st.infer_inputs, [list(mb) for mb in st.plan.infer_micro_batches(self.dp_rank)])
        own = self._own_ids(meta, st.infer_inputs, rows_by_uid) if self.tokenizer is not None else None
        out = self.engine.infer_batch(share, input_ids=own)
        if out is None:
            return
        self.store.kv_batch_put(meta.keys, meta.partition_id, TensorDict({RM_FIELD: out["rm_scores"]},
                                                                          batch_size=[len(meta)]))
        pad = torch.tensor([bool(t.get("is_padding", False)) for t in meta.tags])
        st.stats.masked("reward/model", out["scores"].double(), pad)
        st.stats.sum("reward/model/truncated", float(out["rm_truncated"][~pad].sum()))
