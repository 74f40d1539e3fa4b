"""Learnable tasks: seeded prompt generators with rule-based, verifiable scorers, selected by ``data_source``.

* ``repeat`` (``repeat: c3`` -> ``ccc``): the default tiny model learns it with GRPO from random weights on CPU;
* ``copy`` (``copy: abdc`` -> ``abdc``) and ``reverse`` (``reverse: abdc`` -> ``cdba``): harder; they learn
  faster after a short supervised warm-up (:func:`warmup_token_pairs`);
* ``arithmetic``: two-step integer word problems in the reference system's GSM8K format (``data_source =
  "openai/gsm8k"``, answer after ``####``), scored by the strict GSM8K rule;
* ``colors``: which of two colours fills more of a picture (an ``images`` column): only the image answers.

Every string task scores ``(1 - w) * char_match + w * length_match`` (``w = length_weight``, 0.5) of the response decoded
with special tokens kept; only the exact answer (optionally followed by eos) scores 1.
"""
from protocol.rollout.tasks.arithmetic import ArithmeticTask
from protocol.rollout.tasks.base import Task, TaskError, TaskExample, get_task, known_tasks, register_task
from protocol.rollout.tasks.colors import ColorsTask
from protocol.rollout.tasks.data import make_rows, warmup_token_pairs, write_task_data
from protocol.rollout.tasks.strings import (
    CopyTask,
    RepeatTask,
    ReverseTask,
    StringTask,
    char_match_score,
    length_match_score,
    normalize_response,
    string_score,
)

__all__ = [
    "Task", "TaskError", "TaskExample", "get_task", "known_tasks", "register_task",
    "ArithmeticTask", "ColorsTask", "StringTask", "CopyTask", "ReverseTask", "RepeatTask", "char_match_score", "length_match_score", "string_score",
    "normalize_response",
    "make_rows", "write_task_data", "warmup_token_pairs", "score",
]


def score(data_source: str, response_text: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Score a decoded response with the task registered as ``data_source``."""
    return get_task(data_source).score(response_text, ground_truth, extra_info)
