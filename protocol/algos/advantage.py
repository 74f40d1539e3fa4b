"""Advantage estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, GAE) in a registry.

Every estimator takes padded ``token_level_rewards`` [n, L] and ``response_mask`` [n, L] (1 = policy token) and
returns ``(advantages, returns)`` [n, L], exactly zero where the mask is 0 and on padding rows.

Common keyword inputs:

* ``index`` – the group (prompt uid) of each row: a list or a numpy object array of length n.
* ``is_padding`` – bool [n]; padding rows never enter a group statistic or a whitening and get 0.
* ``session_index`` / ``is_final_output`` (outcome estimators only) – for sessions that return several outputs:
  ``session_index[i] = (uid, session_id)`` of row i and ``is_final_output[i]`` marks the one output per session
  whose score is the session's score. The session is the unit of the group statistics, and its advantage is
  broadcast to all of its outputs. Without ``is_final_output`` every session must have exactly one row.

Outcome estimators score a trajectory by the sum of its rewards over policy positions (``response_mask == 1``);
a group of one carries no relative signal and gets advantage 0.

Example::

    >>> import torch
    >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]]); m = torch.ones(2, 2)
    >>> adv, ret = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=["a", "a"])
    >>> adv[:, 0]
    tensor([ 0.7071, -0.7071])
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from protocol.checks import only_types
from protocol.store.keys import parse_trajectory_key
from protocol.registry import Registry

__all__ = [
    "AdvantageFn",
    "register_advantage",
    "known_advantages",
    "get_advantage_fn",
    "compute_advantage",
    "trajectory_scores",
    "session_inputs_from_keys",
    "masked_whiten",
    "whiten_moments",
    "whiten_by_moments",
    "grpo_advantage",
    "rloo_advantage",
    "reinforce_pp_baseline_advantage",
    "reinforce_pp_advantage",
    "gae_advantage",
]

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
_REGISTRY: Registry[AdvantageFn] = Registry("advantage estimator", key="algorithm.adv_estimator")


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: make an estimator selectable by ``algorithm.adv_estimator = name``."""
    return _REGISTRY.register(name)


def known_advantages() -> list[str]:
    """Names of the registered advantage estimators."""
    return _REGISTRY.names()


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered under ``name``; an unknown name lists the known ones."""
    return _REGISTRY.get(name)


def compute_advantage(name: str, **kw: Any) -> tuple[Tensor, Tensor]:
    """Run the estimator ``name`` with keyword inputs; an argument it does not take is an error naming them."""
    fn = get_advantage_fn(name)
    params = inspect.signature(fn).parameters
    unknown = sorted(set(kw) - set(params))
    if unknown:
        raise TypeError(f"advantage estimator {name!r} does not take {unknown}; it takes {sorted(params)}")
    return fn(**kw)


# ----------------------------------------------------------------------------------------------------------- inputs


def _check_inputs(rewards: Tensor, mask: Tensor, is_padding: Tensor | None) -> tuple[Tensor, Tensor]:
    """Validate shapes; return (bool mask with padding rows cleared, bool real-row vector)."""
    if not isinstance(rewards, Tensor) or rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be a padded [n, L] tensor, got "
                         f"{tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__}")
    if not isinstance(mask, Tensor) or mask.shape != rewards.shape:
        raise ValueError(f"response_mask must have the shape of token_level_rewards {tuple(rewards.shape)}, got "
                         f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
    n = rewards.shape[0]
    if is_padding is None:
        real = torch.ones(n, dtype=torch.bool, device=rewards.device)
    else:
        is_padding = torch.as_tensor(is_padding, device=rewards.device)
        if is_padding.shape != (n,):
            raise ValueError(f"is_padding must have shape [n]=({n},), got {tuple(is_padding.shape)}")
        real = ~is_padding.bool()
    return mask.bool() & real[:, None], real


def _as_list(name: str, values: Any, n: int) -> list:
    if values is None:
        raise ValueError(f"{name} is required (one entry per row, n={n})")
    seq = list(values.tolist() if isinstance(values, np.ndarray) else values)
    if len(seq) != n:
        raise ValueError(f"{name} has {len(seq)} entries, expected one per row (n={n})")
    return seq


def trajectory_scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Per-row score [n]: the sum of rewards over policy positions (response_mask == 1) only."""
    mask = response_mask.bool()
    return torch.where(mask, token_level_rewards, torch.zeros((), dtype=token_level_rewards.dtype,
                                                              device=token_level_rewards.device)).sum(-1)


def session_inputs_from_keys(keys: Sequence[str]) -> dict[str, list]:
    """``index``, ``session_index`` and ``is_final_output`` for the outcome estimators, from trajectory keys.

    The final output of a session is the one with the highest ``index`` among the keys given. Pass the result as
    keyword arguments: ``compute_advantage("grpo", ..., **session_inputs_from_keys(keys))``.

    >>> session_inputs_from_keys(["a_0_0", "a_0_1", "a_1_0"])["is_final_output"]
    [False, True, True]
    """
    parsed = [parse_trajectory_key(k) for k in keys]
    last: dict[tuple[str, int], int] = {}
    for uid, session, index in parsed:
        last[(uid, session)] = max(index, last.get((uid, session), -1))
    return {
        "index": [uid for uid, _, _ in parsed],
        "session_index": [(uid, session) for uid, session, _ in parsed],
        "is_final_output": [index == last[(uid, session)] for uid, session, index in parsed],
    }


def _units(scores: Tensor, real: Tensor, index: Any, session_index: Any, is_final_output: Any
           ) -> tuple[Tensor, Tensor, Tensor, int]:
    """Group the real rows into scored units (rows, or sessions with a final output).

    Returns (unit_scores [u], unit_group [u] int64, row_unit [n] int64 with -1 for padding rows, n_groups).
    """
    n = scores.shape[0]
    uids = _as_list("index", index, n)
    real_rows = [i for i, r in enumerate(real.tolist()) if r]  # one conversion, not a tensor index per row
    row_unit = [-1] * n
    if session_index is None and is_final_output is not None:
        raise ValueError("is_final_output is given without session_index; pass both or neither")
    sessions = None if session_index is None else _as_list("session_index", session_index, n)
    if sessions is None or _one_row_sessions(real_rows, uids, sessions, is_final_output, n):
        unit_rows = real_rows  # every real row is its own unit
        for u, i in enumerate(real_rows):
            row_unit[i] = u
        unit_uids = [uids[i] for i in real_rows]
    else:
        finals = None if is_final_output is None else [bool(x) for x in _as_list("is_final_output",
                                                                                    is_final_output, n)]
        unit_of: dict[tuple, int] = {}
        unit_rows_d: dict[int, list[int]] = {}
        unit_uids = []
        for i in real_rows:
            s = sessions[i]
            try:
                s_uid, s_id = s
            except (TypeError, ValueError):
                raise ValueError(f"session_index[{i}] must be a (uid, session_id) pair, got {s!r}") from None
            if s_uid != uids[i]:
                raise ValueError(f"row {i}: session_index uid {s_uid!r} != index uid {uids[i]!r}")
            key = (s_uid, s_id)
            if key not in unit_of:
                unit_of[key] = len(unit_uids)
                unit_uids.append(s_uid)
            row_unit[i] = unit_of[key]
            unit_rows_d.setdefault(unit_of[key], []).append(i)
        unit_rows = []
        for key, u in unit_of.items():
            rows = unit_rows_d[u]
            chosen = rows if finals is None else [i for i in rows if finals[i]]
            if len(chosen) != 1:
                what = "rows (pass is_final_output)" if finals is None else "rows marked is_final_output"
                raise ValueError(f"session {key!r} has {len(chosen)} {what} among rows {rows}; expected exactly 1")
            unit_rows.append(chosen[0])
    group_ids: dict[Any, int] = {}
    unit_group = torch.tensor([group_ids.setdefault(u, len(group_ids)) for u in unit_uids], dtype=torch.long)
    rows_t = torch.tensor(unit_rows, dtype=torch.long)
    unit_scores = scores.detach().cpu()[rows_t] if len(unit_rows) else scores.new_zeros(0).cpu()
    return unit_scores, unit_group, torch.tensor(row_unit, dtype=torch.long), len(group_ids)


def _one_row_sessions(real_rows: list[int], uids: list, sessions: list, is_final_output: Any, n: int) -> bool:
    """Each real row is a session of its own (single-turn: one output per session), every session a ``(uid, id)``
    pair of its row's uid and marked final; False otherwise (the general path decides, and names what is wrong)."""
    picked = [sessions[i] for i in real_rows]
    if not only_types(picked, _TUPLE) or set(map(len, picked)) - {2}:
        return False
    try:
        if len(set(picked)) != len(picked):
            return False
    except TypeError:  # an unhashable session id
        return False
    if [s[0] for s in picked] != [uids[i] for i in real_rows]:
        return False
    if is_final_output is not None:
        finals = _as_list("is_final_output", is_final_output, n)
        return all(bool(finals[i]) for i in real_rows)
    return True


_TUPLE = frozenset({tuple})


def _group_stats(x: Tensor, group: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-unit (group size, group mean, unbiased group std; std is 0 for groups of one)."""
    x64 = x.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(x64))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, x64)
    mean = total / count.clamp(min=1)
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, (x64 - mean[group]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return count[group], mean[group], std[group]


def _broadcast(unit_adv: Tensor, row_unit: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Row advantage = its unit's scalar × mask; rows without a unit (padding) get 0."""
    per_row = torch.zeros(row_unit.shape[0], dtype=torch.float64)
    has = row_unit >= 0
    per_row[has] = unit_adv.to(torch.float64)[row_unit[has]]
    per_row = per_row.to(device=mask.device, dtype=dtype)
    return per_row[:, None] * mask.to(dtype)


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(values - mean) / sqrt(var + eps)`` over masked positions (unbiased var); zero where the mask is 0."""
    m = mask.bool()
    count = int(m.sum())
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if count == 0:
        return torch.zeros_like(values)
    v = torch.where(m, values, zero).to(torch.float64)
    mean = v.sum() / count
    var = torch.where(m, (v - mean) ** 2, torch.zeros((), dtype=torch.float64, device=values.device)).sum()
    var = var / (count - 1) if count > 1 else var * 0.0
    out = (v - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out.to(values.dtype), zero)


def whiten_moments(values: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """``(count, sum, sum of squares)`` of ``values`` over masked positions, in float64: what the holders of parts
    of a batch add up (one all-reduce) so that :func:`whiten_by_moments` whitens each part as the whole batch."""
    m = mask.bool()
    v = torch.where(m, values.to(torch.float64), torch.zeros((), dtype=torch.float64, device=values.device))
    return float(m.sum()), float(v.sum()), float((v * v).sum())


def whiten_by_moments(values: Tensor, mask: Tensor, moments: Sequence[float], *, shift_mean: bool = True,
                      eps: float = 1e-8) -> Tensor:
    """:func:`masked_whiten` of a part of a batch, with the whole batch's summed :func:`whiten_moments`: the mean
    and the unbiased variance of every masked value of the batch. Zero where the mask is 0."""
    count, total, total_sq = (float(x) for x in moments)
    m = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if count == 0:
        return torch.zeros_like(values)
    mean = total / count
    var = max(total_sq - total * mean, 0.0) / (count - 1) if count > 1 else 0.0
    v = torch.where(m, values, zero).to(torch.float64)
    out = (v - mean) / math.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out.to(values.dtype), zero)


# ------------------------------------------------------------------------------------------------ outcome estimators


@register_advantage("grpo")
def grpo_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | np.ndarray,
    *,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    is_padding: Tensor | None = None,
    session_index: Sequence[Any] | np.ndarray | None = None,
    is_final_output: Sequence[bool] | np.ndarray | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO: ``(s - mean_g) / (std_g + epsilon)`` per uid group (unbiased std); ``norm_adv_by_std=False`` is Dr.GRPO.

    ``returns`` equal ``advantages``.
    """
    mask, real = _check_inputs(token_level_rewards, response_mask, is_padding)
    scores = trajectory_scores(token_level_rewards, mask)
    s, group, row_unit, n_groups = _units(scores, real, index, session_index, is_final_output)
    count, mean, std = _group_stats(s, group, n_groups)
    adv = s.to(torch.float64) - mean
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    out = _broadcast(adv, row_unit, mask, token_level_rewards.dtype)
    return out, out.clone()


@register_advantage("grpo_no_std")
def dr_grpo_advantage(token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | np.ndarray, *,
                      is_padding: Tensor | None = None, session_index: Any = None, is_final_output: Any = None
                      ) -> tuple[Tensor, Tensor]:
    """Dr.GRPO: GRPO without the division by the group std (``s - mean_g``)."""
    return grpo_advantage(token_level_rewards, response_mask, index, norm_adv_by_std=False, is_padding=is_padding,
                          session_index=session_index, is_final_output=is_final_output)


@register_advantage("rloo")
def rloo_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | np.ndarray,
    *,
    is_padding: Tensor | None = None,
    session_index: Sequence[Any] | np.ndarray | None = None,
    is_final_output: Sequence[bool] | np.ndarray | None = None,
) -> tuple[Tensor, Tensor]:
    """RLOO: ``s_i - mean_{j != i} s_j`` within the uid group (leave-one-out baseline); ``returns = advantages``."""
    mask, real = _check_inputs(token_level_rewards, response_mask, is_padding)
    scores = trajectory_scores(token_level_rewards, mask)
    s, group, row_unit, n_groups = _units(scores, real, index, session_index, is_final_output)
    count, mean, _ = _group_stats(s, group, n_groups)
    s64 = s.to(torch.float64)
    loo = (mean * count - s64) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, s64 - loo, torch.zeros_like(s64))
    out = _broadcast(adv, row_unit, mask, token_level_rewards.dtype)
    return out, out.clone()


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_pp_baseline_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | np.ndarray,
    *,
    is_padding: Tensor | None = None,
    session_index: Sequence[Any] | np.ndarray | None = None,
    is_final_output: Sequence[bool] | np.ndarray | None = None,
    epsilon: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: ``s - mean_g`` broadcast over policy tokens, then whitened over all policy tokens of
    the batch (padding rows excluded); ``returns = advantages``."""
    mask, real = _check_inputs(token_level_rewards, response_mask, is_padding)
    scores = trajectory_scores(token_level_rewards, mask)
    s, group, row_unit, n_groups = _units(scores, real, index, session_index, is_final_output)
    count, mean, _ = _group_stats(s, group, n_groups)
    centred = torch.where(count > 1, s.to(torch.float64) - mean, torch.zeros(s.shape, dtype=torch.float64))
    out = _broadcast(centred, row_unit, mask, torch.float64)
    out = masked_whiten(out, mask, eps=epsilon).to(token_level_rewards.dtype)
    return out, out.clone()


# -------------------------------------------------------------------------------------------- token-level estimators


def _discounted_sum(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_next`` over policy positions; non-policy positions pass the running value through."""
    ret = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        ret[:, t] = torch.where(m, running, torch.zeros_like(running))
    return ret


@register_advantage("reinforce_plus_plus")
def reinforce_pp_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    is_padding: Tensor | None = None,
    index: Sequence[Any] | np.ndarray | None = None,
    epsilon: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go over policy tokens; advantages are those returns whitened over the batch.

    ``index`` is accepted (and ignored) so that callers can pass one set of inputs to every estimator.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"algorithm.gamma must be in [0, 1], got {gamma}")
    mask, _ = _check_inputs(token_level_rewards, response_mask, is_padding)
    rewards = torch.where(mask, token_level_rewards, torch.zeros_like(token_level_rewards))
    returns = _discounted_sum(rewards, mask, gamma)
    return masked_whiten(returns, mask, eps=epsilon), returns


@register_advantage("gae")
def gae_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    is_padding: Tensor | None = None,
    index: Sequence[Any] | np.ndarray | None = None,
) -> tuple[Tensor, Tensor]:
    """GAE over policy positions: ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next``.

    "next" is the next *policy* position of the row (observation and padding positions are skipped; after the last
    one ``V_next = A_next = 0``). ``returns = A + V`` (before whitening); ``whiten`` then whitens the advantages
    over all policy tokens of the batch.
    """
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"algorithm.gamma and algorithm.lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    mask, _ = _check_inputs(token_level_rewards, response_mask, is_padding)
    if not isinstance(values, Tensor) or values.shape != token_level_rewards.shape:
        raise ValueError(f"values must have the shape of token_level_rewards {tuple(token_level_rewards.shape)}, "
                         f"got {tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__}")
    zero = torch.zeros((), dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    rewards = torch.where(mask, token_level_rewards, zero)
    vals = torch.where(mask, values.detach().to(rewards.dtype), zero)
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        a_t = delta + gamma * lam * next_adv
        next_adv = torch.where(m, a_t, next_adv)
        next_value = torch.where(m, vals[:, t], next_value)
        adv[:, t] = torch.where(m, a_t, zero)
    returns = torch.where(mask, adv + vals, zero)
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns
