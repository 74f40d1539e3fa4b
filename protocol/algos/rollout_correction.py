"""Rollout correction: importance weights and rejection masks between the rollout policy and the proximal policy.

The semantics are the reference system's (verl ``algorithm.rollout_correction``). With ``log_ratio = log pi_old -
log pi_rollout`` per token (``pi_old`` = the proximal policy the actor recomputed, ``pi_rollout`` = the policy
that sampled, possibly several weight versions older in an asynchronous run):

* ``rollout_is="token"``:    ``w_t = min(exp(clamp(log_ratio_t, +-20)), threshold)``
* ``rollout_is="sequence"``: ``w_t = min(exp(clamp(sum_t log_ratio_t, +-20)), threshold)``, one value per sequence
* weights are 0 where the response mask is 0 and never above ``rollout_is_threshold`` (truncated IS); the policy
  loss multiplies each token's PPO loss by them (:func:`protocol.algos.losses.policy_loss`).
* ``rollout_rs`` (comma-separated options, every one must pass) rejects tokens or whole sequences by a divergence
  estimator of ``log_ratio`` (k1 = ``-log_ratio``, k2 = ``log_ratio^2 / 2``, k3 = ``exp(log_ratio) - 1 -
  log_ratio``), aggregated per ``token``, ``seq_sum``, ``seq_mean`` or ``seq_max``; k1 options take a
  ``"lower_upper"`` ratio bound (kept when ``log lower <= k1 <= log upper``), the others an upper bound. Rejected
  tokens leave the response mask, so they leave the loss's normaliser too.

Metrics are reduced over ranks from the sums of :func:`correction_sums` (:func:`correction_metrics`):
``rollout_corr/rollout_is_mean`` (mean weight over tokens), ``rollout_corr/rollout_is_eff_sample_size``
(``E[w]^2 / E[w^2]`` over tokens, the normalised effective sample size), ``rollout_corr/rollout_is_ratio_fraction_high``
(share of raw ratios above the cap: tokens in token mode, sequences in sequence mode), ``rollout_corr/kl``
(``E[log pi_rollout - log pi_old]`` over tokens) and ``rollout_corr/rollout_rs_masked_fraction``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping

import torch
from torch import Tensor

from protocol.algos.losses import LOG_RATIO_BOUND
from protocol.config import ConfigError

__all__ = ["RolloutCorrectionConfig", "RolloutCorrectionError", "RS_OPTIONS", "is_weights", "rejection_mask",
           "correction_sums", "correction_metrics", "parse_rs", "rollout_correction"]

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


class RolloutCorrectionError(ConfigError):
    """A rollout-correction setting that cannot be honoured; the message names the key."""


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction`` (the reference system's keys and defaults)."""

    rollout_is: Literal["token", "sequence"] | None = None  # None = no IS weights
    rollout_is_threshold: float = 2.0  # truncation cap of the IS weights
    rollout_rs: str | None = None  # rejection options, comma-separated (RS_OPTIONS)
    rollout_rs_threshold: str | float | None = None  # one per option, comma-separated; "lower_upper" for k1 options
    bypass_mode: bool = False  # old log-probs = the rollout's own (needs rollout.log_prob_mode=bypass)

    def __post_init__(self) -> None:
        if not self.rollout_is_threshold > 0:
            raise RolloutCorrectionError(f"algorithm.rollout_correction.rollout_is_threshold must be > 0, got "
                                         f"{self.rollout_is_threshold}")
        if self.rollout_rs is not None:
            parse_rs(self.rollout_rs, self.rollout_rs_threshold)
        elif self.rollout_rs_threshold is not None:
            raise RolloutCorrectionError("algorithm.rollout_correction.rollout_rs_threshold is set but rollout_rs "
                                         "is null; set rollout_rs too or remove the threshold")

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


def parse_rs(rollout_rs: str, thresholds: str | float | None) -> list[tuple[str, float | None, float]]:
    """``[(option, lower, upper)]`` of ``rollout_rs`` and its thresholds (lower only for k1 options)."""
    key = "algorithm.rollout_correction.rollout_rs"
    options = [o.strip() for o in str(rollout_rs).split(",") if o.strip()]
    if not options:
        raise RolloutCorrectionError(f"{key} must name at least one option of {list(RS_OPTIONS)}")
    bad = [o for o in options if o not in RS_OPTIONS]
    if bad:
        raise RolloutCorrectionError(f"{key}: unknown option(s) {bad}; expected options of {list(RS_OPTIONS)}")
    if thresholds is None:
        raise RolloutCorrectionError(f"{key}={rollout_rs!r} needs {key}_threshold (one per option)")
    specs = [s.strip() for s in str(thresholds).split(",")]
    if len(specs) == 1 and len(options) > 1:
        specs *= len(options)
    if len(specs) != len(options):
        raise RolloutCorrectionError(f"{key}_threshold has {len(specs)} entries for {len(options)} options")
    out = []
    for option, spec in zip(options, specs):
        try:
            parts = [float(x) for x in spec.split("_")]
        except ValueError:
            raise RolloutCorrectionError(f"{key}_threshold: {spec!r} for {option} is not a number") from None
        if option.endswith("k1"):
            if len(parts) != 2:
                raise RolloutCorrectionError(f"{key}_threshold: {option} needs 'lower_upper' ratio bounds, got "
                                             f"{spec!r}")
            lower, upper = parts
        else:
            if len(parts) != 1:
                raise RolloutCorrectionError(f"{key}_threshold: {option} takes one upper bound, got {spec!r}")
            lower, upper = None, parts[0]
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise RolloutCorrectionError(f"{key}_threshold: bounds of {option} must be positive (lower <= upper), "
                                         f"got {spec!r}")
        out.append((option, lower, upper))
    return out


def _check(log_ratio: Tensor, mask: Tensor) -> Tensor:
    if log_ratio.dim() != 2 or log_ratio.shape != mask.shape:
        raise ValueError(f"log_ratio {tuple(log_ratio.shape)} and response_mask {tuple(mask.shape)} must be the "
                         f"same padded [n, L] shape")
    return mask.bool()


def _seq_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, log_ratio, torch.zeros((), dtype=log_ratio.dtype)).sum(-1, keepdim=True)


def is_weights(log_ratio: Tensor, response_mask: Tensor, level: str, threshold: float) -> tuple[Tensor, Tensor]:
    """``(weights, raw)``: truncated IS weights and the untruncated ones, both 0 off the mask; see module doc."""
    mask = _check(log_ratio, response_mask)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    elif level == "sequence":
        raw = torch.exp(_seq_log_ratio(log_ratio, mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).expand_as(log_ratio)
    else:
        raise RolloutCorrectionError(f"algorithm.rollout_correction.rollout_is must be token, sequence or null, got "
                                     f"{level!r}")
    raw = torch.where(mask, raw, torch.zeros((), dtype=raw.dtype))
    return raw.clamp(max=threshold), raw


def rejection_mask(log_ratio: Tensor, response_mask: Tensor, rollout_rs: str, thresholds: str | float | None
                   ) -> Tensor:
    """The response mask with rejected tokens (or whole sequences) set to 0; every option must pass."""
    mask = _check(log_ratio, response_mask)
    lr = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    zero = torch.zeros((), dtype=lr.dtype)
    estimators = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.exp(lr) - 1.0 - lr}
    counts = mask.sum(-1, keepdim=True).clamp(min=1).to(lr.dtype)
    keep = torch.ones_like(mask)
    for option, lower, upper in parse_rs(rollout_rs, thresholds):
        level, kind = option.rsplit("_", 1)
        k = torch.where(mask, estimators[kind], zero)
        if level == "token":
            stat = k
        elif level == "seq_sum":
            stat = k.sum(-1, keepdim=True)
        elif level == "seq_mean":
            stat = k.sum(-1, keepdim=True) / counts
        else:  # seq_max of a non-negative estimator (k2, k3); an empty row has 0
            stat = k.max(-1, keepdim=True).values
        if lower is not None:
            ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            ok = stat <= upper
        keep = keep & ok.expand_as(mask)
    return (mask & keep).to(response_mask.dtype)


def correction_sums(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, weights: Tensor | None,
                    raw: Tensor | None, level: str | None, threshold: float, kept_mask: Tensor | None
                    ) -> dict[str, float]:
    """This rank's additive shares of the correction metrics (sum them over ranks, then :func:`correction_metrics`)."""
    mask = _check(old_log_prob, response_mask)
    m = mask.to(torch.float64)
    out = {"tokens": float(m.sum()), "kl": float(((rollout_log_prob - old_log_prob).double() * m).sum())}
    if weights is not None:
        w = weights.double().clamp(0.0, threshold) * m
        out["w"] = float(w.sum())
        out["w2"] = float((w * w).sum())
        if level == "sequence":
            seqs = mask.any(-1)
            lr = _seq_log_ratio(old_log_prob - rollout_log_prob, mask).squeeze(-1)
            out["high"] = float((lr[seqs] > math.log(threshold)).sum())
            out["units"] = float(seqs.sum())
        else:
            out["high"] = float(((raw > threshold) & mask).sum())
            out["units"] = out["tokens"]
    if kept_mask is not None:
        out["rejected"] = float((mask & ~kept_mask.bool()).sum())
    return out


def correction_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """``rollout_corr/*`` from summed :func:`correction_sums` (empty when no token was seen)."""
    n = sums.get("tokens", 0.0)
    if n <= 0:
        return {}
    out = {"rollout_corr/kl": sums["kl"] / n}
    if "w" in sums:
        mean, mean_sq = sums["w"] / n, sums["w2"] / n
        out["rollout_corr/rollout_is_mean"] = mean
        out["rollout_corr/rollout_is_eff_sample_size"] = mean * mean / mean_sq if mean_sq > 0 else 0.0
        out["rollout_corr/rollout_is_ratio_fraction_high"] = sums["high"] / max(sums["units"], 1.0)
    if "rejected" in sums:
        out["rollout_corr/rollout_rs_masked_fraction"] = sums["rejected"] / n
    return out


def rollout_correction(config: RolloutCorrectionConfig, old_log_prob: Tensor, rollout_log_prob: Tensor,
                       response_mask: Tensor) -> tuple[Tensor | None, Tensor | None, dict[str, float]]:
    """``(weights, kept, sums)`` of one batch under ``config``: the IS weights (``rollout_is`` set), the rejection
    mask (``rollout_rs`` set; 1 = kept) and this batch's :func:`correction_sums`."""
    mask = _check(old_log_prob, response_mask)
    log_ratio = old_log_prob - rollout_log_prob
    kept = rejection_mask(log_ratio, mask, config.rollout_rs, config.rollout_rs_threshold).bool() \
        if config.rollout_rs else None
    weights = raw = None
    if config.rollout_is:
        weights, raw = is_weights(log_ratio, mask, config.rollout_is, config.rollout_is_threshold)
    sums = correction_sums(old_log_prob, rollout_log_prob, mask, weights, raw, config.rollout_is,
                           config.rollout_is_threshold, kept)
    return weights, kept, sums
