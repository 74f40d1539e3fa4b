"""Per-token KL estimators between the policy and the reference, KL coefficient controllers, and the KL reward penalty.

Estimators of KL(pi || ref) from one sample per token, with ``d = log_prob - ref_log_prob``:

* ``"kl"`` / ``"k1"``: ``d`` (unbiased, high variance, can be negative);
* ``"abs"``: ``|d|``;
* ``"mse"`` / ``"k2"``: ``0.5 * d**2`` (biased, low variance; its gradient is ``d * grad(log_prob)``, which is
  the unbiased gradient of KL when sampling from the policy);
* ``"low_var_kl"`` / ``"k3"``: ``exp(-d') - 1 + d'`` with ``d' = clamp(d, -20, 20)``, then clamped to
  ``[0, 10]`` (unbiased, non-negative, low variance; computed as ``expm1(-d') + d'`` so rounding never makes
  it negative);
* straight-through ``"k1+"`` and ``"k3+"`` (``"low_var_kl+"``): the *value* of k1 / k3 with the *gradient* of k2,
  i.e. ``k2 + (k - k2).detach()``. The value reports the chosen estimator while the gradient is the unbiased
  per-sample gradient of KL.

Example::

    >>> import torch
    >>> kl_penalty(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]), "mse")
    tensor([0.0000, 0.5000])
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch
from torch import Tensor

__all__ = [
    "KL_KINDS",
    "LOG_RATIO_CLAMP",
    "K3_CLAMP",
    "kl_penalty",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "apply_kl_penalty",
]

# Bound of the log-ratio before exp() in k3: exp(20) ~ 4.9e8 stays finite in float32 (and bf16).
LOG_RATIO_CLAMP = 20.0
# Bound of the k3 value itself: a single token cannot contribute more than 10 nats.
K3_CLAMP = 10.0

_ALIASES = {
    "kl": "k1", "k1": "k1",
    "abs": "abs",
    "mse": "k2", "k2": "k2",
    "low_var_kl": "k3", "k3": "k3",
    "k1+": "k1+",
    "k3+": "k3+", "low_var_kl+": "k3+",
}
KL_KINDS: tuple[str, ...] = tuple(_ALIASES)


def _check_pair(log_prob: Tensor, ref_log_prob: Tensor) -> None:
    if not isinstance(log_prob, Tensor) or not isinstance(ref_log_prob, Tensor):
        raise TypeError(f"log_prob and ref_log_prob must be tensors, got {type(log_prob).__name__} and "
                        f"{type(ref_log_prob).__name__}")
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(f"log_prob shape {tuple(log_prob.shape)} != ref_log_prob shape {tuple(ref_log_prob.shape)}")


def _k3(d: Tensor) -> Tensor:
    nd = torch.clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log(ref / pi)
    # expm1(x) - x is the same quantity without the cancellation of exp(x) - 1 near 0; it is non-negative in
    # exact arithmetic, so the lower clamp at 0 only removes rounding (a -1e-16 would read as a negative KL)
    return torch.clamp(torch.expm1(nd) - nd, 0.0, K3_CLAMP)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of the policy from the reference (same shape as the inputs); ``kind`` in KL_KINDS."""
    _check_pair(log_prob, ref_log_prob)
    canon = _ALIASES.get(kind) if isinstance(kind, str) else None
    if canon is None:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {list(KL_KINDS)}")
    d = log_prob - ref_log_prob
    if canon == "k1":
        return d
    if canon == "abs":
        return d.abs()
    k2 = 0.5 * d.square()
    if canon == "k2":
        return k2
    if canon == "k3":
        return _k3(d)
    value = d if canon == "k1+" else _k3(d)
    return k2 + (value - k2).detach()


class KLController(Protocol):
    """Holds the current KL coefficient ``value`` and adapts it from the measured KL."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


@dataclass
class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing."""

    coef: float

    def __post_init__(self) -> None:
        if not math.isfinite(float(self.coef)) or self.coef < 0:
            raise ValueError(f"kl_ctrl.kl_coef must be a finite number >= 0, got {self.coef!r}")

    @property
    def value(self) -> float:
        return float(self.coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards ``target_kl``.

    ``err = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + err * n_steps / horizon``.
    An update with ``n_steps >= 5 * horizon`` is refused (the multiplier could reach 0 or turn negative).
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        if not math.isfinite(float(init_coef)) or init_coef < 0:
            raise ValueError(f"kl_ctrl.kl_coef must be a finite number >= 0, got {init_coef!r}")
        if not target_kl > 0:
            raise ValueError(f"kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl!r}")
        if not horizon > 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon!r}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by ``1 + clip(kl/target - 1, ±0.2) * n_steps / horizon``."""
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        if 0.2 * n_steps >= self.horizon:  # the multiplier could reach <= 0 and flip or kill the coefficient
            raise ValueError(f"kl_ctrl.horizon={self.horizon} is too short for updates of n_steps={n_steps}; "
                             f"expected horizon > 0.2 * n_steps = {0.2 * n_steps}")
        err = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target_kl={self.target_kl}, horizon={self.horizon})"


def make_kl_controller(kind: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1,
                       horizon: float = 10000) -> FixedKLController | AdaptiveKLController:
    """Build a controller from config keys ``kl_ctrl.type`` (fixed | adaptive), ``kl_coef``, ``target_kl``, ``horizon``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"kl_ctrl.type must be 'fixed' or 'adaptive', got {kind!r}")


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    controller: KLController,
    kind: str = "kl",
    *,
    is_padding: Tensor | None = None,
    update_controller: bool = False,
) -> tuple[Tensor, Mapping[str, float]]:
    """``token_level_rewards = token_level_scores - beta * kl * response_mask`` with ``beta = controller.value``.

    Metrics: ``kl_penalty`` (the measured KL: mean over non-padding sequences with at least one policy token of
    the per-sequence masked token mean) and ``kl_coef`` (the beta used). The controller is not touched unless
    ``update_controller=True`` (then ``controller.update(kl_penalty, n_steps=that number of sequences)``); with
    several ranks the caller should instead update it once per step with the all-reduced KL, so every rank keeps
    the same coefficient.
    """
    _check_pair(old_log_prob, ref_log_prob)
    if token_level_scores.shape != old_log_prob.shape or response_mask.shape != old_log_prob.shape:
        raise ValueError(f"token_level_scores {tuple(token_level_scores.shape)}, old_log_prob "
                         f"{tuple(old_log_prob.shape)} and response_mask {tuple(response_mask.shape)} must have "
                         f"the same [n, L] shape")
    mask = response_mask.bool()
    if is_padding is not None:
        if is_padding.shape != mask.shape[:1]:
            raise ValueError(f"is_padding shape {tuple(is_padding.shape)} != [n] = {tuple(mask.shape[:1])}")
        mask = mask & ~is_padding.bool()[:, None]
    zero = torch.zeros((), dtype=old_log_prob.dtype, device=old_log_prob.device)
    kld = kl_penalty(torch.where(mask, old_log_prob, zero), torch.where(mask, ref_log_prob, zero), kind)
    kld = torch.where(mask, kld, zero)
    beta = float(controller.value)
    rewards = token_level_scores - beta * kld.to(token_level_scores.dtype)
    tokens = mask.sum(-1)
    valid = tokens > 0
    per_seq = kld.sum(-1)[valid] / tokens[valid].to(kld.dtype)
    current_kl = float(per_seq.mean()) if per_seq.numel() else 0.0
    if update_controller:
        controller.update(current_kl, int(valid.sum()))
    return rewards, {"kl_penalty": current_kl, "kl_coef": beta}
