"""The advantage stage's computation, on the rank that holds each group (all of a group is generated on one rank):
token-level rewards (the KL penalty in the reward, optional), the rollout correction (optional), then advantages
and returns (GRPO per uid; GAE over the critic's values, whitened over the whole step's policy tokens)."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from backends.comm import allreduce_counts
from protocol.algos.advantage import (compute_advantage, get_advantage_fn, session_inputs_from_keys,
                                     whiten_by_moments, whiten_moments)
from protocol.algos.kl import apply_kl_penalty
from protocol.algos.rollout_correction import rollout_correction
from protocol.batch.nested import jagged_to_padded, nested_lengths, padded_to_jagged_many
from protocol.store.batching import batch_of
from protocol.store.keys import uid_of
from rldispatch.config import RunConfig
from rldispatch.critic import CriticRole
from rldispatch.dataplane import ShardedStore
from rldispatch.metrics import StepStats
from rldispatch.reward_model import combined_scores, learned_weights
from rldispatch.rollout import TRAIN

__all__ = ["advantages_on_owners", "ADVANTAGE_FIELDS"]

#: what the advantage stage writes, on the rank that generated each group
ADVANTAGE_FIELDS = ("token_level_scores", "token_level_rewards", "advantages", "returns")


def _rollout_correction(cfg: RunConfig, store: ShardedStore, own: list[str], pad: torch.Tensor, old_lp: torch.Tensor,
                        mask: torch.Tensor, lengths: Any, stats: StepStats
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``algorithm.rollout_correction`` on this rank's groups: the mask the advantage uses and the fields to write
    with it, ``rollout_is_weights`` (with ``rollout_is``) and the rejection-masked ``response_mask`` (with
    ``rollout_rs``). Without a correction only the gap between the rollout's and the trainer's log-probs is
    recorded (``rollout_corr/kl``, ``training/rollout_probs_diff_mean/max``) and the mask is unchanged."""
    rc = cfg.algorithm.rollout_correction
    real = [k for k, p in zip(own, pad.tolist()) if not p]
    rollout_lp = torch.zeros_like(old_lp)
    if real:  # padding samples have no rollout log-probs (their mask is 0)
        got = jagged_to_padded(store.read_local(real, TRAIN, ["rollout_log_probs"])["rollout_log_probs"])
        rollout_lp[(~pad).nonzero().squeeze(-1), :got.shape[1]] = got.float()
    real_mask = mask.bool() & ~pad[:, None]
    # a disabled correction gives no weights and no rejection mask, only the gap's sums
    weights, kept, sums = rollout_correction(rc, old_lp, rollout_lp, real_mask)
    for k, v in sums.items():
        stats.sum(f"rollout_corr/_{k}", v)
    # the reference system's probability gap: |p_rollout - p_trainer| per response token
    stats.masked("training/rollout_probs_diff", (rollout_lp.exp() - old_lp.exp()).abs()[real_mask].double(),
                 keep=("mean", "max"))
    fields = {}
    if weights is not None:
        fields["rollout_is_weights"] = padded_to_jagged_many((weights.float(),), lengths)[0]
    if kept is not None:
        mask = (kept | (mask.bool() & pad[:, None])).to(mask.dtype)
        fields["response_mask"] = padded_to_jagged_many((mask.to(torch.int64),), lengths)[0]
    return mask, fields


def advantages_on_owners(cfg: RunConfig, store: ShardedStore, owners: list[list[str]], pad: torch.Tensor,
                         stats: StepStats, kl_ctrl: Any, *, with_values: bool, device: Any) -> None:
    """On the rank that holds each group (all of a group is generated on one rank): rewards, advantages.

    ``owners[r]``: the keys rank ``r`` generated. Old and reference log-probs travel here only when the KL
    penalty enters the reward or the rollout correction compares them with the rollout's; the scores and masks
    are already here (nothing travels without them).
    """
    own = owners[store.rank]
    in_reward = cfg.algorithm.use_kl_in_reward  # config validation guarantees a reference
    # the rollout's log-probs meet the trainer's: to correct by them, or (recompute mode) to report their gap
    compare = cfg.algorithm.rollout_correction.enabled or cfg.rollout.log_prob_mode == "recompute"
    learned = list(learned_weights(cfg.reward))
    need = ["rm_scores", "response_mask"] + (["old_log_probs", "ref_log_prob"] if in_reward else []) \
        + (["old_log_probs"] if compare and not in_reward else []) + (["values"] if with_values else []) + learned
    td = store.fetch_planned(owners, TRAIN, need)
    moments = [0.0, 0.0, 0.0]
    if own:
        lengths = nested_lengths(td["response_mask"])
        mask = jagged_to_padded(td["response_mask"]).float()
        corrected: dict[str, torch.Tensor] = {}
        if compare:
            mask, corrected = _rollout_correction(cfg, store, own, pad,
                                                  jagged_to_padded(td["old_log_probs"]).float(), mask, lengths,
                                                  stats)
        scores = jagged_to_padded(td["rm_scores"]).float()
        if learned:  # the models' scores with the rule-based ones: what the step trains on
            scores = combined_scores(cfg.reward, scores, {f: jagged_to_padded(td[f]).float() for f in learned})
            stats.masked("reward/score", scores.sum(-1).double(), pad)
        if in_reward:
            old = jagged_to_padded(td["old_log_probs"]).float()
            ref = jagged_to_padded(td["ref_log_prob"]).float()
            rewards, _ = apply_kl_penalty(scores, old, ref, mask, kl_ctrl, cfg.algorithm.kl_penalty)
        else:
            rewards = scores
        index = [uid_of(k) for k in own]
        kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=index, is_padding=pad,
                      norm_adv_by_std=cfg.algorithm.norm_adv_by_std, gamma=cfg.algorithm.gamma,
                      lam=cfg.algorithm.lam)
        if with_values:  # whitened below over the whole step's policy tokens, not this rank's alone
            kwargs.update(values=jagged_to_padded(td["values"]).float(), whiten=False)
        kwargs.update(session_inputs_from_keys(own))  # multi-output sessions: advantage of the final output
        takes = inspect.signature(get_advantage_fn(cfg.algorithm.adv_estimator)).parameters
        adv, ret = compute_advantage(cfg.algorithm.adv_estimator,
                                     **{k: v for k, v in kwargs.items() if k in takes})
        if with_values:
            real = mask.bool() & ~pad[:, None]
            moments = list(whiten_moments(adv, real))
            CriticRole.value_metrics(kwargs["values"], ret, real, stats)
    if with_values:  # the one collective of a critic's advantage: the step's (count, sum, sum of squares)
        moments = allreduce_counts(moments, device=device)
    if own:
        if with_values:
            adv = whiten_by_moments(adv, real, moments)
        values = (scores, rewards, adv.float(), ret.float())
        fields = dict(zip(ADVANTAGE_FIELDS, padded_to_jagged_many(values, lengths)), **corrected)
        store.kv_batch_put(own, TRAIN, batch_of(fields, len(own)), overwrite=bool(corrected))
