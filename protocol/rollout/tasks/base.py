"""The task interface: a seeded prompt generator plus a rule-based scorer, registered by ``data_source``."""
from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from protocol.algos.scorers.registry import RewardError, Scorer, register_scorer
from protocol.registry import Registry

__all__ = ["TaskExample", "Task", "TaskError", "register_task", "get_task", "known_tasks"]


class TaskError(ValueError):
    """A task name, task parameter or dataset row that cannot be used; the message names it."""


@dataclass(frozen=True)
class TaskExample:
    """One generated problem: the user message, the verifiable answer and the parameters the scorer needs."""

    prompt: str
    ground_truth: str
    params: dict[str, Any] = field(default_factory=dict)


class Task(abc.ABC):
    """A learnable task: ``sample`` draws a problem from an RNG, ``score`` checks a response against its answer.

    ``name`` is the dataset's ``data_source``; the reward registry dispatches on it.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> TaskExample:
        """One problem drawn from ``rng`` (the only source of randomness, so a seed reproduces the data)."""

    @abc.abstractmethod
    def score(self, response_text: str, ground_truth: str, extra_info: dict | None = None) -> float:
        """The reward in [0, 1] of a decoded response; 1.0 exactly when the response is the answer."""

    def score_params(self) -> dict[str, Any]:
        """Parameters the scorer reads back from ``extra_info``, so a row scores the same under any defaults."""
        return {}

    def messages(self, example: TaskExample) -> list[dict[str, str]]:
        """The chat messages (``raw_prompt``) of a problem: a single user turn."""
        return [{"role": "user", "content": example.prompt}]

    def target_response(self, example: TaskExample) -> str:
        """The response a supervised warm-up trains on (the answer itself by default)."""
        return example.ground_truth

    def make_row(self, index: int, rng: random.Random, split: str = "train") -> dict[str, Any]:
        """One dataset row in the reference system's format: prompt (the message list), data_source,
        extra_info{index, ground_truth, split, ...}, reward_model{style, ground_truth}."""
        ex = self.sample(rng)
        return {
            "prompt": self.messages(ex),
            "data_source": self.name,
            "extra_info": {"index": int(index), "split": split, "ground_truth": ex.ground_truth, **ex.params,
                           **self.score_params()},
            "reward_model": {"style": "rule", "ground_truth": ex.ground_truth},
        }

    def warmup_pairs(self, n: int, seed: int) -> list[tuple[list[dict[str, str]], str]]:
        """``n`` (messages, target response) pairs for an optional supervised warm-up, from the same generator."""
        if n < 0:
            raise TaskError(f"warmup_pairs: n must be >= 0, got {n}")
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            ex = self.sample(rng)
            out.append((self.messages(ex), self.target_response(ex)))
        return out


_TASKS: Registry[Callable[..., Task]] = Registry("task", error=TaskError)
_TASK_SCORERS: dict[str, Scorer] = {}  # task name -> the scorer it registered for data_source = name


def _task_scorer(name: str) -> Scorer:
    """Scores with one default instance of the task ``name``, made at the first call (its parameters come from
    ``extra_info``)."""
    task: Task | None = None

    def score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
        nonlocal task
        if task is None:
            task = get_task(name)
        return task.score(solution_str, ground_truth, extra_info)

    score.__name__ = score.__qualname__ = f"{name}_task_score"
    return score


def register_task(name: str):
    """Class/factory decorator: make a task available as ``data_source = name``, its scorer included."""
    register = _TASKS.register(name)

    def deco(factory):
        register(factory)
        if name not in _TASK_SCORERS:
            scorer = _task_scorer(name)
            try:
                register_scorer(name)(scorer)
            except RewardError as exc:  # a scorer of another kind holds the name: the task cannot be scored
                _TASKS.unregister(name)
                raise TaskError(f"task {name!r} cannot be registered: {exc}") from exc
            _TASK_SCORERS[name] = scorer
        if isinstance(factory, type):  # only once registered: a refused name leaves the class as it was
            factory.name = name
        return factory

    return deco


def known_tasks() -> list[str]:
    """Names of every registered task (the valid ``data_source`` values of generated data)."""
    return _TASKS.names()


def get_task(name: str, **params: Any) -> Task:
    """A fresh task instance by name; an unknown name lists the known ones."""
    factory = _TASKS.get(name)
    try:
        return factory(**params)
    except TypeError as exc:
        raise TaskError(f"task {name!r}: bad parameters {params!r}: {exc}") from exc
