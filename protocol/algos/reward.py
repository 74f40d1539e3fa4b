"""Rule-based trajectory scoring: scorers registered by ``data_source``, reward managers registered by name, and
the placement of a trajectory score on its last policy token (``rm_scores``).

* A **scorer** maps ``(response_text, ground_truth, extra_info)`` to a float, or to a dict with a ``"score"``
  entry plus extra per-trajectory values (e.g. ``"acc"``). Register one with ``@register_scorer("my_source")``.
  A ``data_source`` without a registered scorer falls back to the task of that name in :mod:`protocol.rollout.tasks`.
* A **reward manager** turns a batch of :class:`RewardInput` into a :class:`RewardResult` (a float32 score per
  trajectory plus the scorers' extra values). ``"naive"`` decodes each response and calls the scorer of its
  ``data_source``; ``"overlong"`` adds a linear penalty for responses that run into the length limit.
* :func:`compute_rm_scores` writes each score at the trajectory's LAST policy token (the last position with
  ``response_mask == 1``) and 0 elsewhere. A response without any policy token has no action to reward: its
  score is *dropped* (the row stays all-zero) and counted (``with_dropped=True``), never written at a padding or
  observation position, and never into another row. Padding samples must have score 0.

Example::

    >>> import torch
    >>> compute_rm_scores(torch.tensor([1.0, 2.0]), torch.tensor([[1, 1, 0], [1, 0, 1]]))
    tensor([[0., 1., 0.],
            [0., 0., 2.]])
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from protocol.registry import Registry

__all__ = [
    "RewardError",
    "Scorer",
    "register_scorer",
    "get_scorer",
    "known_scorers",
    "RewardInput",
    "RewardResult",
    "RewardManager",
    "NaiveRewardManager",
    "OverlongRewardManager",
    "register_reward_manager",
    "make_reward_manager",
    "known_reward_managers",
    "last_policy_index",
    "compute_rm_scores",
    "gsm8k_score",
    "exact_match_score",
]


class RewardError(ValueError):
    """An unknown data_source or reward manager, a scorer result of the wrong type, or mis-shaped score inputs."""


Scorer = Callable[[str, Any, "Mapping[str, Any] | None"], "float | Mapping[str, Any]"]
_SCORERS: Registry[Scorer] = Registry("scorer for data_source", error=RewardError)


def register_scorer(name: str) -> Callable[[Scorer], Scorer]:
    """Decorator: score trajectories whose ``data_source == name`` with the decorated function."""
    return _SCORERS.register(name)


def _task_names() -> list[str]:
    try:
        from protocol.rollout.tasks import known_tasks
    except ImportError:  # tasks are optional for the reward registry
        return []
    return known_tasks()


def known_scorers() -> list[str]:
    """Every data_source that can be scored: registered scorers and the tasks of :mod:`protocol.rollout.tasks`."""
    return sorted(set(_SCORERS.names()) | set(_task_names()))


def get_scorer(data_source: str) -> Scorer:
    """The scorer of ``data_source`` (a registered scorer, else the task's ``score``); unknown -> lists the known."""
    if data_source in _SCORERS:
        return _SCORERS.get(data_source)
    if data_source in _task_names():
        from protocol.rollout.tasks import get_task

        return get_task(data_source).score
    raise RewardError(f"no scorer for data_source {data_source!r}; known data sources: {known_scorers()}")


# ------------------------------------------------------------------------------------------------- built-in scorers

_GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")


@register_scorer("gsm8k")
def gsm8k_score(response_text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when the last ``#### <number>`` of the response equals the ground truth (commas ignored), else 0.0."""
    found = _GSM8K_ANSWER.findall(response_text)
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").rstrip(".")
    return 1.0 if answer == str(ground_truth).replace(",", "").strip() else 0.0


@register_scorer("exact_match")
def exact_match_score(response_text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when the stripped response equals the stripped ground truth, else 0.0."""
    return 1.0 if response_text.strip() == str(ground_truth).strip() else 0.0


# ------------------------------------------------------------------------------------------------- reward managers


@dataclass
class RewardInput:
    """One trajectory to score: its valid response tokens and what its scorer needs.

    ``response_ids`` / ``response_mask`` have length ``response_len`` (no padding); ``reward_score`` is a score
    already produced by the rollout (environment), used instead of the scorer when present.
    """

    response_ids: Sequence[int] | Tensor
    data_source: str
    ground_truth: Any = None
    extra_info: Mapping[str, Any] | None = None
    response_mask: Sequence[int] | Tensor | None = None
    reward_score: float | None = None
    is_padding: bool = False


@dataclass
class RewardResult:
    """Scores float32 [n] in input order, plus each extra value the scorers returned (one list entry per input)."""

    scores: Tensor
    extras: dict[str, list[Any]] = field(default_factory=dict)


class RewardManager:
    """Base reward manager: ``__call__(items) -> RewardResult``; padding samples always score 0."""

    def __call__(self, items: Sequence[RewardInput]) -> RewardResult:
        scores: list[float] = []
        extras: dict[str, list[Any]] = {}
        for i, item in enumerate(items):
            if not isinstance(item, RewardInput):
                raise RewardError(f"reward input {i} must be a RewardInput, got {type(item).__name__}")
            if item.is_padding:
                value, extra = 0.0, {}
            else:
                value, extra = self.score_one(item)
            if not math.isfinite(value):
                raise RewardError(f"reward input {i} (data_source {item.data_source!r}) scored {value}; "
                                  f"expected a finite number")
            for k in extra:
                extras.setdefault(k, [None] * i)
            for k, lst in extras.items():
                lst.append(extra.get(k))
            scores.append(value)
        return RewardResult(torch.tensor(scores, dtype=torch.float32), extras)

    def score_one(self, item: RewardInput) -> tuple[float, dict[str, Any]]:
        """The score of one non-padding trajectory and its extra values."""
        raise NotImplementedError


_MANAGERS: Registry[Callable[..., RewardManager]] = Registry("reward manager", key="reward.manager",
                                                             error=RewardError)


def register_reward_manager(name: str):
    """Class decorator: make a reward manager selectable by ``reward.manager = name``."""
    return _MANAGERS.register(name)


def known_reward_managers() -> list[str]:
    """Names of the registered reward managers."""
    return _MANAGERS.names()


def make_reward_manager(name: str, **kwargs: Any) -> RewardManager:
    """A reward manager by name; an unknown name lists the known ones."""
    return _MANAGERS.get(name)(**kwargs)


def _ids(name: str, values: Sequence[int] | Tensor) -> list[int]:
    if isinstance(values, Tensor):
        if values.dim() != 1:
            raise RewardError(f"{name} must be 1-D (one trajectory, no padding), got shape {tuple(values.shape)}")
        return [int(x) for x in values.tolist()]
    return [int(x) for x in values]


def _split_result(data_source: str, result: Any) -> tuple[float, dict[str, Any]]:
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardError(f"scorer of data_source {data_source!r} returned a dict without 'score': "
                              f"{sorted(result)}")
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    else:
        extra = {}
    if isinstance(result, Tensor) and result.numel() == 1:
        result = result.item()
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise RewardError(f"scorer of data_source {data_source!r} returned {type(result).__name__} {result!r}; "
                          f"expected a number or a dict with a 'score'")
    return float(result), extra


@register_reward_manager("naive")
class NaiveRewardManager(RewardManager):
    """Decode each response and score it with the scorer of its ``data_source``.

    ``decode`` turns token ids into text (the tokenizer's ``decode``). ``policy_tokens_only`` decodes only the
    tokens with ``response_mask == 1`` (tool observations removed); by default the whole response is decoded.
    ``use_rollout_score`` takes ``RewardInput.reward_score`` when the rollout already produced one.
    """

    def __init__(self, decode: Callable[[list[int]], str], *, policy_tokens_only: bool = False,
                 use_rollout_score: bool = True) -> None:
        if not callable(decode):
            raise RewardError(f"reward manager needs a callable decode (tokenizer.decode), got {type(decode).__name__}")
        self.decode = decode
        self.policy_tokens_only = policy_tokens_only
        self.use_rollout_score = use_rollout_score

    def text(self, item: RewardInput) -> str:
        """The decoded response of one trajectory."""
        ids = _ids("response_ids", item.response_ids)
        if self.policy_tokens_only:
            if item.response_mask is None:
                raise RewardError("policy_tokens_only=True needs RewardInput.response_mask")
            mask = _ids("response_mask", item.response_mask)
            if len(mask) != len(ids):
                raise RewardError(f"response_mask has {len(mask)} entries, response_ids {len(ids)}; expected equal")
            ids = [t for t, m in zip(ids, mask) if m]
        return self.decode(ids)

    def score_one(self, item: RewardInput) -> tuple[float, dict[str, Any]]:
        if self.use_rollout_score and item.reward_score is not None:
            return _split_result(item.data_source, item.reward_score)
        scorer = get_scorer(item.data_source)
        return _split_result(item.data_source, scorer(self.text(item), item.ground_truth, item.extra_info))


@register_reward_manager("overlong")
class OverlongRewardManager(NaiveRewardManager):
    """Naive scores plus a soft over-length penalty on the policy length (``policy_len``; all tokens without mask).

    With ``L = max_response_len`` and buffer ``B``: a response longer than ``L - B`` gets
    ``-penalty_factor * min(1, (len - (L - B)) / B)`` added (extra value ``overlong_penalty``).
    """

    def __init__(self, decode: Callable[[list[int]], str], *, max_response_len: int, buffer_len: int,
                 penalty_factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(decode, **kwargs)
        if not 0 < buffer_len <= max_response_len:
            raise RewardError(f"reward.overlong: need 0 < buffer_len <= max_response_len, got buffer_len="
                              f"{buffer_len}, max_response_len={max_response_len}")
        if penalty_factor < 0:
            raise RewardError(f"reward.overlong.penalty_factor must be >= 0, got {penalty_factor}")
        self.max_response_len, self.buffer_len, self.penalty_factor = max_response_len, buffer_len, penalty_factor

    def score_one(self, item: RewardInput) -> tuple[float, dict[str, Any]]:
        value, extra = super().score_one(item)
        n = sum(_ids("response_mask", item.response_mask)) if item.response_mask is not None else \
            len(_ids("response_ids", item.response_ids))
        excess = n - (self.max_response_len - self.buffer_len)
        penalty = -self.penalty_factor * min(1.0, excess / self.buffer_len) if excess > 0 else 0.0
        return value + penalty, {**extra, "overlong_penalty": penalty}


# ---------------------------------------------------------------------------------------------- rm_scores placement


def last_policy_index(response_mask: Tensor) -> Tensor:
    """Per row [n] the position of the last policy token (last ``response_mask == 1``), or -1 when there is none."""
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2:
        raise RewardError(f"response_mask must be a padded [n, L] tensor, got "
                          f"{tuple(response_mask.shape) if isinstance(response_mask, Tensor) else type(response_mask)}")
    n, L = response_mask.shape
    if L == 0:
        return torch.full((n,), -1, dtype=torch.long, device=response_mask.device)
    pos = torch.arange(L, device=response_mask.device).expand(n, L)
    return torch.where(response_mask.bool(), pos, torch.full_like(pos, -1)).max(dim=-1).values


def compute_rm_scores(
    scores: Tensor,
    response_mask: Tensor,
    *,
    is_padding: Tensor | None = None,
    with_dropped: bool = False,
) -> Tensor | tuple[Tensor, int]:
    """``rm_scores`` [n, L] (dtype of ``scores``, float32 normally): each row's score at its last policy token.

    Accepts a padded ``response_mask`` [n, L] (returns padded) or a jagged nested one (returns jagged with the same
    lengths). A non-padding row without a policy token has its score dropped and counted; ``with_dropped=True``
    returns ``(rm_scores, n_dropped)``. A padding row with a non-zero score is an error.
    """
    jagged = isinstance(response_mask, Tensor) and response_mask.is_nested
    if jagged:
        lengths = [int(t.shape[0]) for t in response_mask.unbind()]
        mask = response_mask.to_padded_tensor(0) if lengths else response_mask.new_zeros(0, 0)
        if mask.dim() != 2:
            raise RewardError(f"jagged response_mask must hold 1-D rows, got padded shape {tuple(mask.shape)}")
    else:
        mask = response_mask
    idx = last_policy_index(mask)
    n, L = mask.shape
    if not isinstance(scores, Tensor) or scores.shape != (n,):
        raise RewardError(f"scores must be a [n]=({n},) tensor, got "
                          f"{tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__}")
    if not scores.is_floating_point():
        scores = scores.to(torch.float32)
    real = torch.ones(n, dtype=torch.bool, device=mask.device)
    if is_padding is not None:
        if not isinstance(is_padding, Tensor) or is_padding.shape != (n,):
            raise RewardError(f"is_padding must be a [n]=({n},) tensor, got "
                              f"{tuple(is_padding.shape) if isinstance(is_padding, Tensor) else type(is_padding)}")
        real = ~is_padding.bool().to(mask.device)
        bad = (~real & (scores.to(mask.device) != 0)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(f"padding samples must score 0; rows {bad} have scores "
                              f"{scores[bad].tolist()}")
    placed = real & (idx >= 0)
    out = torch.zeros((n, L), dtype=scores.dtype, device=mask.device)
    rows = placed.nonzero().flatten()
    out[rows, idx[rows]] = scores.to(mask.device)[rows]
    dropped = int((real & (idx < 0)).sum())
    if jagged:
        out = torch.nested.as_nested_tensor([out[i, :lengths[i]] for i in range(n)], layout=torch.jagged)
    return (out, dropped) if with_dropped else out
