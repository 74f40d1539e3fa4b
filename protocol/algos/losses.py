"""Policy-gradient losses and their aggregation over tokens, normalised by the counts of the whole optimizer step.

Every loss here is a *share* of the step loss: it divides by ``global_tokens`` / ``global_seqs``, the counts of the
whole optimizer step summed over micro-batches and DP ranks (see :func:`global_counts`), never by the local
micro-batch size. Summing the returned losses (and their gradients) over any split of the step into
micro-batches and ranks therefore gives exactly the full-batch loss, whatever the DP size or micro-batch split.

Aggregation modes (``loss_mat`` [n, L], ``mask`` [n, L], ``T`` = global_tokens, ``S`` = global_seqs):

* ``token-mean``:              ``sum(loss * mask) / T``
* ``seq-mean-token-sum``:      ``sum_i sum_t(loss_it * mask_it) / S``
* ``seq-mean-token-mean``:     ``sum_i [sum_t(loss_it * mask_it) / sum_t mask_it] / S`` (a row with no masked
  token contributes 0 but still counts in ``S`` unless it is a padding sample)
* ``seq-mean-token-sum-norm``: ``sum(loss * mask) / (S * H)`` where ``H = horizon`` is a fixed token horizon
  (normally the configured maximum response length). ``H`` must not depend on the micro-batch (e.g. its padded
  width), or the split invariance is lost; so it is a required keyword for this mode.

Example::

    >>> import torch
    >>> loss = torch.tensor([[1.0, 2.0, 9.0]]); mask = torch.tensor([[1, 1, 0]])
    >>> agg_loss(loss, mask, "token-mean", global_tokens=2, global_seqs=1)
    tensor(1.5000)
"""
from __future__ import annotations

from typing import Literal, Mapping, get_args

import torch
from torch import Tensor

from protocol.algos.kl import kl_penalty

__all__ = [
    "LossAggMode",
    "LOSS_AGG_MODES",
    "LOG_RATIO_BOUND",
    "agg_loss",
    "global_counts",
    "policy_loss",
    "entropy_bonus",
    "kl_loss",
    "value_loss",
]

# how per-token losses become one number (config key actor.loss.loss_agg_mode)
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

# |log(pi / pi_old)| is clamped to this before exp(): the ratio stays within [e^-20, e^20] (finite in fp32/bf16).
# Such a token is clipped by the PPO clip anyway, so the clamp changes no gradient of a clipped objective.
LOG_RATIO_BOUND = 20.0

Count = float | int | Tensor


def _count(name: str, value: Count) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a scalar tensor, got {type(value).__name__} {value!r}")
    return float(value)


def _check_mat(name: str, mat: Tensor, mask: Tensor) -> None:
    if not isinstance(mat, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mat).__name__}")
    if mat.dim() != 2:
        raise ValueError(f"{name} must be padded [n, L], got shape {tuple(mat.shape)}")
    if mat.shape != mask.shape:
        raise ValueError(f"{name} shape {tuple(mat.shape)} != response_mask shape {tuple(mask.shape)}")


def _masked(mat: Tensor, mask: Tensor) -> Tensor:
    """``mat`` with exact zeros where ``mask`` is 0 (inf/NaN at padding cannot leak, in value or in gradient)."""
    return torch.where(mask, mat, torch.zeros((), dtype=mat.dtype, device=mat.device))


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    mode: str,
    *,
    global_tokens: Count,
    global_seqs: Count,
    horizon: float | None = None,
) -> Tensor:
    """Aggregate a per-token loss [n, L] into this micro-batch's share of the step loss (a scalar); see module doc."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {list(LOSS_AGG_MODES)}")
    if not isinstance(loss_mask, Tensor):
        raise TypeError(f"loss_mask must be a torch.Tensor, got {type(loss_mask).__name__}")
    _check_mat("loss_mat", loss_mat, loss_mask)
    mask = loss_mask.bool()
    masked = _masked(loss_mat, mask)
    empty = not bool(mask.any())
    if mode == "token-mean":
        denom = _count("global_tokens", global_tokens)
        name = "global_tokens"
    else:
        denom = _count("global_seqs", global_seqs)
        name = "global_seqs"
        if mode == "seq-mean-token-sum-norm":
            if horizon is None:
                raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs horizon= (a fixed token horizon, "
                                 "normally the maximum response length); got none")
            h = _count("horizon", horizon)
            if not h > 0:
                raise ValueError(f"horizon must be > 0 for 'seq-mean-token-sum-norm', got {h}")
            denom *= h
    if denom <= 0:
        if empty:  # nothing to normalise: a zero that keeps the graph (all-padding micro-batch)
            return masked.sum() * 0.0
        raise ValueError(f"{name} must be > 0 when the loss mask has {int(mask.sum())} token(s), got {denom}; "
                         f"pass the token/sequence counts of the whole optimizer step (global_counts, all-reduced)")
    if mode == "seq-mean-token-mean":
        tokens = mask.sum(-1)
        per_seq = masked.sum(-1) / tokens.clamp(min=1).to(masked.dtype)
        return per_seq.sum() / denom
    return masked.sum() / denom


def global_counts(response_mask: Tensor, is_padding: Tensor | None = None) -> tuple[int, int]:
    """Local ``(tokens, seqs)`` of a batch, to be all-reduced over micro-batches and DP ranks by the engine.

    ``tokens`` = masked tokens of non-padding rows; ``seqs`` = number of non-padding rows (every row when
    ``is_padding`` is None; a real row without a policy token still counts as a sequence).
    """
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2:
        raise ValueError(f"response_mask must be a padded [n, L] tensor, got "
                         f"{tuple(response_mask.shape) if isinstance(response_mask, Tensor) else type(response_mask)}")
    mask = response_mask.bool()
    if is_padding is None:
        return int(mask.sum()), int(mask.shape[0])
    if not isinstance(is_padding, Tensor) or is_padding.shape != mask.shape[:1]:
        raise ValueError(f"is_padding must be a [n]={tuple(mask.shape[:1])} tensor, got "
                         f"{tuple(is_padding.shape) if isinstance(is_padding, Tensor) else type(is_padding)}")
    real = ~is_padding.bool()
    return int((mask & real[:, None]).sum()), int(real.sum())


def policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: Count,
    global_seqs: Count,
    horizon: float | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Mapping[str, Tensor]]:
    """Dual-clip PPO loss and its metrics; every tensor [n, L] padded, ``response_mask`` 0 on padding/observation.

    Per token, with ``r = exp(clamp(log_prob - old_log_prob, ±LOG_RATIO_BOUND))`` and advantage ``A``:
    ``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``, and for ``A < 0`` additionally
    ``l = min(l, -A clip_ratio_c)`` (dual clip: the loss of a negative-advantage token is capped at
    ``clip_ratio_c * |A|``). With ``rollout_is_weights`` (truncated importance weights of the proximal over the
rollout policy, :mod:`protocol.algos.rollout_correction`) each ``l`` is multiplied by its token's weight. The loss
is :func:`agg_loss` of ``l`` in ``loss_agg_mode``.

    Metrics (detached scalars, each ``sum over masked tokens / global_tokens``, so they add up over micro-batches
    and ranks to the step value): ``clipfrac`` (the clipped term was chosen), ``clipfrac_lower`` (the dual clip
    was active), ``approx_kl`` (mean of ``old_log_prob - log_prob``).
    """
    if not isinstance(response_mask, Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor, got {type(response_mask).__name__}")
    for name, t in (("old_log_prob", old_log_prob), ("log_prob", log_prob), ("advantages", advantages)):
        _check_mat(name, t, response_mask)
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    mask = response_mask.bool()
    old = _masked(old_log_prob.detach().to(log_prob.dtype), mask)
    adv = _masked(advantages.detach().to(log_prob.dtype), mask)
    log_ratio = torch.clamp(_masked(log_prob, mask) - old, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * clip_ratio_c
    dual = torch.minimum(clipped, loss3)
    negative = adv < 0
    per_token = torch.where(negative, dual, clipped)
    if rollout_is_weights is not None:
        _check_mat("rollout_is_weights", rollout_is_weights, response_mask)
        per_token = per_token * _masked(rollout_is_weights.detach().to(per_token.dtype), mask)
    loss = agg_loss(per_token, mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                    horizon=horizon)

    with torch.no_grad():
        metrics = {
            "clipfrac": _token_share(loss2 > loss1, mask, global_tokens),
            "clipfrac_lower": _token_share((clipped > loss3) & negative, mask, global_tokens),
            "approx_kl": _token_share(-log_ratio, mask, global_tokens),
        }
    return loss, metrics


def _token_share(values: Tensor, mask: Tensor, global_tokens: Count) -> Tensor:
    total = _masked(values.to(torch.float32), mask).sum()
    denom = _count("global_tokens", global_tokens)
    if denom <= 0:
        if not bool(mask.any()):
            return total * 0.0
        raise ValueError(f"global_tokens must be > 0 when the mask has {int(mask.sum())} token(s), got {denom}")
    return total / denom


def entropy_bonus(
    entropy: Tensor,
    response_mask: Tensor,
    mode: str,
    global_tokens: Count,
    global_seqs: Count,
    *,
    horizon: float | None = None,
) -> Tensor:
    """The aggregated entropy (:func:`agg_loss` of ``entropy``); the engine subtracts ``entropy_coeff`` times it."""
    return agg_loss(entropy, response_mask, mode, global_tokens=global_tokens, global_seqs=global_seqs,
                    horizon=horizon)


def kl_loss(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kind: str,
    mode: str,
    global_tokens: Count,
    global_seqs: Count,
    *,
    horizon: float | None = None,
) -> Tensor:
    """The aggregated per-token KL of the policy from the reference (:func:`protocol.algos.kl.kl_penalty` of ``kind``)."""
    if not isinstance(response_mask, Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor, got {type(response_mask).__name__}")
    _check_mat("log_prob", log_prob, response_mask)
    _check_mat("ref_log_prob", ref_log_prob, response_mask)
    mask = response_mask.bool()
    ref = _masked(ref_log_prob.detach().to(log_prob.dtype), mask)
    kld = kl_penalty(_masked(log_prob, mask), ref, kind)
    return agg_loss(kld, mask, mode, global_tokens=global_tokens, global_seqs=global_seqs, horizon=horizon)


def value_loss(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: Count,
    global_seqs: Count,
    horizon: float | None = None,
) -> tuple[Tensor, Mapping[str, Tensor]]:
    """The critic's clipped value loss and its metrics; every tensor [n, L] padded, ``response_mask`` 0 off policy.

    ``vpreds`` are the critic's current predictions, ``values`` the predictions made before the update (when the
    advantages were computed) and ``returns`` the targets. Per token, with ``c = cliprange_value``:
    ``v_clip = clamp(vpreds, values - c, values + c)`` and ``l = max((vpreds - returns)^2, (v_clip - returns)^2)``;
    the loss is ``0.5 *`` :func:`agg_loss` of ``l`` in ``loss_agg_mode`` (the reference system's
    ``compute_value_loss``, normalised by the counts of the whole optimizer step).

    Metrics (detached, ``sum over masked tokens / global_tokens``, so they add up over micro-batches and ranks):
    ``vf_clipfrac`` (the clipped term was the larger) and ``vpred_mean``.
    """
    if not isinstance(response_mask, Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor, got {type(response_mask).__name__}")
    for name, t in (("vpreds", vpreds), ("values", values), ("returns", returns)):
        _check_mat(name, t, response_mask)
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    mask = response_mask.bool()
    pred = _masked(vpreds, mask)
    old = _masked(values.detach().to(vpreds.dtype), mask)
    target = _masked(returns.detach().to(vpreds.dtype), mask)
    # clipped by value, as the reference's clip_by_value: inside the range it is ``pred`` exactly (old + clamp(pred -
    # old) rounds when their signs differ, and that rounding alone would count a token in vf_clipfrac)
    clipped = torch.clamp(pred, old - cliprange_value, old + cliprange_value)
    loss1 = (pred - target) ** 2
    loss2 = (clipped - target) ** 2
    per_token = torch.maximum(loss1, loss2)
    loss = 0.5 * agg_loss(per_token, mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                          horizon=horizon)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": _token_share(loss2 > loss1, mask, global_tokens),
            "vpred_mean": _token_share(pred.detach(), mask, global_tokens),
        }
    return loss, metrics
