"""Trajectory rewards: reward managers by name, their configuration, and ``rm_scores`` at the last policy token.

* **Scorers** (:mod:`protocol.algos.scorers`) map one decoded response to a float or to a dict with ``"score"``
  and extra per-trajectory values; :func:`default_compute_score` picks one by ``data_source`` with the reference
  system's signature and results. A user's function with that signature comes from
  ``custom_reward_function.path`` / ``.name``.
* A **reward manager** turns a batch of :class:`RewardInput` into a :class:`RewardResult` (a float32 score per
  trajectory plus the extra values), selected by ``reward.manager``: ``naive`` scores each response on its own,
  ``dapo`` adds the over-length penalty of ``reward.overlong_buffer``, ``batch`` hands the whole batch to one call
  of the user's function. A score that is not finite *as float32* (NaN, inf, or 1e39 overflowing) is an error
  naming the data source and the trajectory key, whatever produced it.
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
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Literal

import torch
from torch import Tensor

from protocol.algos.judge import JudgeConfig
from protocol.algos.scorers import (
    RewardError,
    Scorer,
    UnknownDataSourceError,
    default_compute_score,
    exact_match_score,
    get_scorer,
    known_scorers,
    load_reward_function,
    needs_ground_truth,
    register_scorer,
)
from protocol.algos.scorers.gsm8k import compute_score as gsm8k_compute_score, gsm8k_score
from protocol.batch.nested import jagged_to_padded, nested_lengths, padded_to_jagged
from protocol.registry import Registry
import protocol.rollout.tasks  # noqa: F401  (the learnable tasks register their scorers by data_source)

__all__ = [
    "GSM8KTrainConfig",
    "RewardModelConfig",
    "JudgeConfig",
    "RewardError",
    "UnknownDataSourceError",
    "Scorer",
    "register_scorer",
    "get_scorer",
    "known_scorers",
    "needs_ground_truth",
    "default_compute_score",
    "load_reward_function",
    "RewardInput",
    "RewardResult",
    "RewardManager",
    "NaiveRewardManager",
    "DAPORewardManager",
    "BatchRewardManager",
    "register_reward_manager",
    "make_reward_manager",
    "known_reward_managers",
    "OverlongBufferConfig",
    "RewardConfig",
    "CustomRewardFunctionConfig",
    "build_reward_manager",
    "numeric_extras",
    "last_policy_index",
    "compute_rm_scores",
    "gsm8k_score",
    "exact_match_score",
]


# ------------------------------------------------------------------------------------------------- reward managers


@dataclass
class RewardInput:
    """One trajectory to score: its valid response tokens and what its scorer needs.

    ``response_ids`` / ``response_mask`` have length ``response_len`` (no padding); ``reward_score`` is a score
    already produced by the rollout (environment), used instead of the scorer when present. ``key`` (the
    trajectory key) names the trajectory in errors.
    """

    response_ids: Sequence[int] | Tensor
    data_source: str
    ground_truth: Any = None
    extra_info: Mapping[str, Any] | None = None
    response_mask: Sequence[int] | Tensor | None = None
    reward_score: float | None = None
    is_padding: bool = False
    key: str | None = None


@dataclass
class RewardResult:
    """Scores float32 [n] in input order, plus each extra value the scorers returned (one list entry per input;
    None where an input gave no such value, as padding samples never do)."""

    scores: Tensor
    extras: dict[str, list[Any]] = field(default_factory=dict)


def _split_result(data_source: str, result: Any) -> tuple[float, dict[str, Any]]:
    """``(score, extra values)`` of one scorer result: a number, or a dict with a numeric ``"score"``."""
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
    if hasattr(result, "item") and callable(result.item) and not isinstance(result, (int, float)):
        result = result.item()  # numpy scalars
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise RewardError(f"scorer of data_source {data_source!r} returned {type(result).__name__} {result!r}; "
                          f"expected a number or a dict with a numeric 'score'")
    try:
        return float(result), extra
    except OverflowError:  # an int beyond float range: refused below as a non-finite score
        return (math.inf if result > 0 else -math.inf), extra


class RewardManager:
    """Base reward manager: ``__call__(items) -> RewardResult``; padding samples always score 0.

    Subclasses implement :meth:`score_one` (one trajectory) or :meth:`score_items` (all non-padding inputs).
    """

    def __call__(self, items: Sequence[RewardInput]) -> RewardResult:
        items = list(items)
        for i, item in enumerate(items):
            if not isinstance(item, RewardInput):
                raise RewardError(f"reward input {i} must be a RewardInput, got {type(item).__name__}")
        real = [i for i, item in enumerate(items) if not item.is_padding]
        scored = self.score_items([items[i] for i in real]) if real else []
        if len(scored) != len(real):
            raise RewardError(f"{type(self).__name__} returned {len(scored)} results for {len(real)} trajectories")
        values = [0.0] * len(items)
        extras: dict[str, list[Any]] = {}
        for i, (value, extra) in zip(real, scored):
            values[i] = value
            for k, v in extra.items():
                extras.setdefault(k, [None] * len(items))[i] = v
        scores = torch.tensor(values, dtype=torch.float32)
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise RewardError(
                f"trajectory {items[i].key or f'#{i}'} (data_source {items[i].data_source!r}) scored {values[i]!r}, "
                f"which is {scores[i].item()} as float32; expected a finite score ({len(bad)} of {len(items)} "
                f"trajectories are not finite)")
        return RewardResult(scores, extras)

    def score_items(self, items: list[RewardInput]) -> list[tuple[float, dict[str, Any]]]:
        """``(score, extra values)`` of each non-padding trajectory, in order (by default :meth:`score_one` each)."""
        return [self.score_one(item) for item in items]

    def score_one(self, item: RewardInput) -> tuple[float, dict[str, Any]]:
        """The score of one non-padding trajectory and its extra values."""
        raise NotImplementedError(f"{type(self).__name__} implements neither score_items nor score_one")


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
        if not (values.dtype.is_floating_point or values.dtype.is_complex):
            return values.tolist()  # already Python ints
        return [int(x) for x in values.tolist()]
    return [int(x) for x in values]


@register_reward_manager("naive")
class NaiveRewardManager(RewardManager):
    """Decode each response and score it with ``compute_score`` (:func:`default_compute_score` by default).

    ``compute_score`` is called with keywords ``data_source, solution_str, ground_truth, extra_info``, as the
    reference system calls it. ``decode`` turns token ids into text (the tokenizer's ``decode``).
    ``policy_tokens_only`` decodes only the tokens with ``response_mask == 1`` (tool observations removed); by
    default the whole response is decoded. ``use_rollout_score`` takes ``RewardInput.reward_score`` when the
    rollout already produced one.
    """

    def __init__(self, decode: Callable[[list[int]], str], *, compute_score: Callable[..., Any] | None = None,
                 policy_tokens_only: bool = False, use_rollout_score: bool = True) -> None:
        if not callable(decode):
            raise RewardError(f"reward manager needs a callable decode (tokenizer.decode), got {type(decode).__name__}")
        if compute_score is not None and not callable(compute_score):
            raise RewardError(f"compute_score must be callable, got {type(compute_score).__name__}")
        self.decode = decode
        self.compute_score = compute_score or default_compute_score
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
        """The score of one non-padding trajectory and its extra values."""
        if self.use_rollout_score and item.reward_score is not None:
            return _split_result(item.data_source, item.reward_score)
        result = self.compute_score(data_source=item.data_source, solution_str=self.text(item),
                                    ground_truth=item.ground_truth, extra_info=item.extra_info)
        return _split_result(item.data_source, result)


def _policy_len(item: RewardInput) -> int:
    if item.response_mask is not None:
        return sum(_ids("response_mask", item.response_mask))
    return len(_ids("response_ids", item.response_ids))


@register_reward_manager("dapo")
class DAPORewardManager(NaiveRewardManager):
    """Naive scores plus DAPO's soft over-length penalty on the policy length (``response_mask.sum()``).

    With ``L = max_response_len`` and buffer ``B = buffer_len``: a response of ``len > L - B`` policy tokens gets
    ``-penalty_factor * min(1, (len - (L - B)) / B)`` added (extra values ``overlong_reward`` and ``overlong``).
    ``buffer_len = 0`` turns the penalty off (plain naive scores, as with ``overlong_buffer.enable=false``).
    """

    def __init__(self, decode: Callable[[list[int]], str], *, max_response_len: int, buffer_len: int = 0,
                 penalty_factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(decode, **kwargs)
        if isinstance(max_response_len, bool) or not isinstance(max_response_len, int) or max_response_len < 1:
            raise RewardError(f"data.max_response_length must be a positive int for the dapo reward manager, got "
                              f"{max_response_len!r}")
        if not 0 <= buffer_len <= max_response_len:
            raise RewardError(f"reward.overlong_buffer.len must be in [0, data.max_response_length="
                              f"{max_response_len}], got {buffer_len}")
        if penalty_factor < 0:
            raise RewardError(f"reward.overlong_buffer.penalty_factor must be >= 0, got {penalty_factor}")
        self.max_response_len, self.buffer_len, self.penalty_factor = max_response_len, buffer_len, penalty_factor

    def overlong_reward(self, policy_len: int) -> float:
        """The penalty (<= 0) for a response of ``policy_len`` policy tokens."""
        if self.buffer_len == 0:
            return 0.0
        excess = policy_len - (self.max_response_len - self.buffer_len)
        return -self.penalty_factor * min(1.0, excess / self.buffer_len) if excess > 0 else 0.0

    def score_one(self, item: RewardInput) -> tuple[float, dict[str, Any]]:
        value, extra = super().score_one(item)
        if self.buffer_len == 0:
            return value, extra
        penalty = self.overlong_reward(_policy_len(item))
        return value + penalty, {**extra, "overlong_reward": penalty, "overlong": penalty < 0}


@register_reward_manager("batch")
class BatchRewardManager(NaiveRewardManager):
    """Decode every response, then score the whole batch in one ``compute_score`` call.

    ``compute_score(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...])`` returns one
    result (a number or a dict with ``"score"``) per trajectory, in order. Scores the rollout produced are used
    as they are, and those trajectories are not passed.
    """

    def __init__(self, decode: Callable[[list[int]], str], *, compute_score: Callable[..., Any] | None = None,
                 **kwargs: Any) -> None:
        if compute_score is None:
            raise RewardError("reward.manager=batch needs a batch scoring function: set custom_reward_function.path "
                              "and .name to a function taking data_sources, solution_strs, ground_truths, extra_infos")
        super().__init__(decode, compute_score=compute_score, **kwargs)

    def score_items(self, items: list[RewardInput]) -> list[tuple[float, dict[str, Any]]]:
        out: list[tuple[float, dict[str, Any]] | None] = [None] * len(items)
        todo = []
        for i, item in enumerate(items):
            if self.use_rollout_score and item.reward_score is not None:
                out[i] = _split_result(item.data_source, item.reward_score)
            else:
                todo.append(i)
        if todo:
            results = self.compute_score(data_sources=[items[i].data_source for i in todo],
                                         solution_strs=[self.text(items[i]) for i in todo],
                                         ground_truths=[items[i].ground_truth for i in todo],
                                         extra_infos=[items[i].extra_info for i in todo])
            results = list(results)
            if len(results) != len(todo):
                raise RewardError(f"the batch compute_score returned {len(results)} results for {len(todo)} "
                                  f"trajectories; expected one per trajectory")
            for i, result in zip(todo, results):
                out[i] = _split_result(items[i].data_source, result)
        return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------- configuration


@dataclass
class OverlongBufferConfig:
    """DAPO's over-length penalty (``reward.overlong_buffer``): ramps to ``-penalty_factor`` over the last ``len``
    tokens before ``data.max_response_length``; used by ``reward.manager=dapo`` when ``enable``."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.len, bool) or not isinstance(self.len, int) or self.len < 0:
            raise RewardError(f"reward.overlong_buffer.len must be an int >= 0, got {self.len!r}")
        if self.enable and self.len == 0:
            raise RewardError("reward.overlong_buffer.enable=true needs reward.overlong_buffer.len > 0")
        if self.penalty_factor < 0:
            raise RewardError(f"reward.overlong_buffer.penalty_factor must be >= 0, got {self.penalty_factor}")


RewardManagerName = Literal["naive", "dapo", "batch"]
GSM8K_SOURCE = "openai/gsm8k"


@dataclass
class GSM8KTrainConfig:
    """``reward.gsm8k_train``: the *training* reward of ``openai/gsm8k`` rows, with the reference system's gsm8k
    scorer parameters (``method``: strict needs ``#### <n>``, flexible takes the last number; ``format_score``: the
    reward of a wrong answer in that form). Validation always scores strictly (strict, format_score 0)."""

    method: Literal["strict", "flexible"] = "strict"
    format_score: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in ("strict", "flexible"):
            raise RewardError(f"reward.gsm8k_train.method must be 'strict' or 'flexible', got {self.method!r}")
        if not 0.0 <= float(self.format_score) < 1.0:
            raise RewardError(f"reward.gsm8k_train.format_score must be in [0, 1) (a right answer scores 1), got "
                              f"{self.format_score!r}")

    @property
    def shaped(self) -> bool:
        return self.method != "strict" or float(self.format_score) != 0.0


@dataclass
class RewardModelConfig:
    """``reward.model``: a discriminative reward model (a one-label ``*ForSequenceClassification`` folder) scoring
    every trajectory (prompt + response) on the training ranks. The trajectory's score is
    ``reward.rule_weight * rule score + weight * model score`` (+ the judge's, :class:`JudgeConfig`)."""

    hf_path: str | None = None  # a one-label *ForSequenceClassification folder (None: no reward model)
    weight: float = 1.0  # the model score's weight in the trajectory score
    max_length: int | None = None  # longest sequence it scores (None: its max_position_embeddings)
    truncation: Literal["error", "left"] = "error"  # a longer one: an error, or keep its last max_length tokens
    micro_batch_size: int | None = None  # sequences per forward (None: the plan's inference micro-batches)
    retokenize: bool = False  # read prompt + decoded response in the model folder's own chat template and tokenizer

    @property
    def enabled(self) -> bool:
        return bool(self.hf_path)

    def __post_init__(self) -> None:
        if self.hf_path == "":
            self.hf_path = None
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise RewardError(f"reward.model.weight must be a finite number, got {self.weight!r}")
        for key in ("max_length", "micro_batch_size"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RewardError(f"reward.model.{key} must be a positive integer or null, got {value!r}")


@dataclass
class RewardConfig:
    """The ``reward`` section: which reward manager scores the rollouts, and its settings.

    With a reward model or a judge on, a trajectory's score is ``rule_weight * rule + model.weight * model +
    judge.weight * judge``; the default ``rule_weight`` 0 lets the models' scores replace the rule-based one (the
    reference system's behaviour), which stays a metric (``reward/rule/*``)."""

    manager: RewardManagerName = "naive"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    math_verify: bool = False  # MATH data sources by math-verify's equivalence instead of string normalisation
    gsm8k_train: GSM8KTrainConfig = field(default_factory=GSM8KTrainConfig)
    rule_weight: float = 0.0  # with a reward model or judge: the rule score's weight (0: theirs replace it)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    @property
    def learned(self) -> bool:
        """Whether a model (a reward model or a judge) scores the trajectories."""
        return self.model.enabled or self.judge.enable

    def __post_init__(self) -> None:
        if isinstance(self.rule_weight, bool) or not isinstance(self.rule_weight, (int, float)) \
                or not math.isfinite(self.rule_weight):
            raise RewardError(f"reward.rule_weight must be a finite number, got {self.rule_weight!r}")
        if self.manager not in known_reward_managers():
            _MANAGERS.get(self.manager)  # raises, naming reward.manager and listing the known managers
        if self.overlong_buffer.enable and self.manager != "dapo":
            raise RewardError(f"reward.overlong_buffer.enable=true needs reward.manager=dapo, got "
                              f"reward.manager={self.manager!r}")
        if self.math_verify:
            from protocol.algos.scorers.math_verify import available

            if not available():
                raise RewardError("reward.math_verify=true needs the math-verify package (pip install math-verify)")


@dataclass
class CustomRewardFunctionConfig:
    """``custom_reward_function``: a Python file and the function in it that replaces the built-in scorers.

    The function takes ``data_source, solution_str, ground_truth, extra_info`` (or, with ``reward.manager=batch``,
    their plural lists) plus ``reward_kwargs``, and returns a float or a dict with ``"score"``.
    """

    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RewardError(f"custom_reward_function.name must be a function name, got {self.name!r}")
        if self.path == "":
            self.path = None

    def load(self, batch: bool = False) -> Callable[..., Any] | None:
        """The user's function (None without a path); a missing file or function is an error naming the key."""
        if self.path is None:
            return None
        return load_reward_function(self.path, self.name, batch=batch, kwargs=self.reward_kwargs)


def build_reward_manager(reward: RewardConfig, custom: CustomRewardFunctionConfig,
                         decode: Callable[[list[int]], str], max_response_len: int,
                         train: bool = True) -> RewardManager:
    """The run's reward manager from its config: the user's function when given, else the built-in scorers
    (``openai/gsm8k`` rows with ``reward.gsm8k_train``'s parameters when ``train``)."""
    fn = custom.load(batch=reward.manager == "batch")
    shaping = reward.gsm8k_train if train and reward.gsm8k_train.shaped else None
    if fn is not None and reward.gsm8k_train.shaped:
        raise RewardError("reward.gsm8k_train shapes the built-in gsm8k scorer; with custom_reward_function.path "
                          "set, shape the reward in that function instead")
    if fn is None and (reward.math_verify or shaping is not None):
        def fn(data_source, solution_str, ground_truth, extra_info=None):
            if shaping is not None and data_source == GSM8K_SOURCE:
                return gsm8k_compute_score(solution_str, ground_truth, method=shaping.method,
                                           format_score=float(shaping.format_score))
            return default_compute_score(data_source, solution_str, ground_truth, extra_info,
                                         use_math_verify=reward.math_verify)
    if reward.manager == "dapo":
        buffer = reward.overlong_buffer
        return DAPORewardManager(decode, compute_score=fn, max_response_len=max_response_len,
                                 buffer_len=buffer.len if buffer.enable else 0,
                                 penalty_factor=buffer.penalty_factor)
    return make_reward_manager(reward.manager, decode=decode, compute_score=fn)


def numeric_extras(result: RewardResult) -> dict[str, tuple[Tensor, Tensor]]:
    """Per extra value that is numeric (bools count as 0/1): ``(values float64 [n], missing bool [n])``.

    Other values (a prediction string) stay in ``result.extras`` only; they have no mean.
    """
    out = {}
    n = result.scores.shape[0]
    for name, values in result.extras.items():
        nums = [v for v in values if v is not None]
        if not nums or not all(isinstance(v, (bool, int, float)) for v in nums):
            continue
        missing = torch.tensor([v is None for v in values], dtype=torch.bool)
        vals = torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float64)
        out[name] = (vals.reshape(n), missing.reshape(n))
    return out


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
        lengths = nested_lengths(response_mask)  # from the offsets: no per-row unbind
        mask = jagged_to_padded(response_mask) if lengths.numel() else response_mask.values().new_zeros(0, 0)
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
        out = padded_to_jagged(out, lengths)  # one masked gather, not one slice per row
    return (out, dropped) if with_dropped else out
