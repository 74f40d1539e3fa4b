"""``arithmetic``: short multi-step integer word problems written in the reference system's GSM8K row format.

A row is what its GSM8K preprocessing writes (``data_source="openai/gsm8k"``, ``prompt`` = one user message:
the question and the instruction to answer after ``####``, ``ability="math"``,
``reward_model={"style": "rule", "ground_truth": "<integer>"}``, ``extra_info={split, index, answer, question}``
with the worked solution ending in ``#### <integer>``), so it is scored by the strict ``openai/gsm8k`` scorer.

>>> import random
>>> ex = ArithmeticTask().sample(random.Random(0))
>>> ex.params["solution"].endswith("#### " + ex.ground_truth)
True
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from protocol.algos.scorers.gsm8k import compute_score as gsm8k_compute_score
from protocol.rollout.tasks.base import Task, TaskError, TaskExample, register_task

__all__ = ["INSTRUCTION", "DATA_SOURCE", "ArithmeticTask"]

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"
_NAMES = (("Ann", "She"), ("Ben", "He"), ("Cara", "She"), ("Dev", "He"), ("Eli", "He"), ("Fay", "She"))
_ITEMS = ("apples", "pens", "cards", "shells", "stamps", "marbles")


@register_task("arithmetic")
@dataclass
class ArithmeticTask(Task):
    """Two-step problems (add then subtract, multiply then add or subtract, add then share) on numbers up to
    ``max_operand``; every answer is a non-negative integer. ``steps=1`` writes one-step problems of the same four
    operations (add, subtract, multiply, share), a training curriculum for a model that cannot yet do two."""

    max_operand: int = 12
    steps: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.max_operand, bool) or not isinstance(self.max_operand, int) or self.max_operand < 3:
            raise TaskError(f"arithmetic: max_operand must be an int >= 3, got {self.max_operand!r}")
        if isinstance(self.steps, bool) or self.steps not in (1, 2):
            raise TaskError(f"arithmetic: steps must be 1 or 2, got {self.steps!r}")

    def sample(self, rng: random.Random) -> TaskExample:
        name, they = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        top = self.max_operand
        kind = rng.randrange(4)
        if self.steps == 1:
            return self._one_step(rng, kind, name, they, item)
        if kind == 0:
            a, b = rng.randint(2, top), rng.randint(2, top)
            c = rng.randint(1, a + b)
            question = (f"{name} has {a} {item}. {they} buys {b} more, then gives {c} to a friend. "
                        f"How many {item} does {name} have now?")
            lines, answer = [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"], a + b - c
        elif kind == 1:
            a, b = rng.randint(2, top), rng.randint(2, top)
            c = rng.randint(1, a * b)
            question = f"{name} buys {a} bags with {b} {item} in each. {they} loses {c} of them. How many are left?"
            lines, answer = [f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"], a * b - c
        elif kind == 2:
            a, b, c = rng.randint(2, top), rng.randint(2, top), rng.randint(1, top)
            question = f"A box holds {a} {item}. {name} fills {b} boxes and adds {c} more. How many {item} in all?"
            lines, answer = [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}"], a * b + c
        else:
            k, each = rng.randint(2, 6), rng.randint(1, top)
            a = rng.randint(1, k * each - 1)
            b = k * each - a
            question = (f"{name} has {a} {item} and finds {b} more. {they} shares them equally among {k} friends. "
                        f"How many does each friend get?")
            lines, answer = [f"{a} + {b} = {a + b}", f"{a + b} / {k} = {each}"], each
        solution = "\n".join(lines) + f"\n#### {answer}"
        return TaskExample(prompt=f"{question} {INSTRUCTION}", ground_truth=str(answer),
                           params={"question": question, "solution": solution})

    def _one_step(self, rng: random.Random, kind: int, name: str, they: str, item: str) -> TaskExample:
        """A one-step problem of operation ``kind`` (add, subtract, multiply, share), answered as one line."""
        top = self.max_operand
        if kind == 0:
            a, b = rng.randint(2, top), rng.randint(2, top)
            question = f"{name} has {a} {item}. {they} buys {b} more. How many {item} does {name} have now?"
            step, answer = f"{a} + {b} = {a + b}", a + b
        elif kind == 1:
            a = rng.randint(2, top)
            c = rng.randint(1, a)
            question = f"{name} has {a} {item}. {they} gives {c} to a friend. How many {item} does {name} have now?"
            step, answer = f"{a} - {c} = {a - c}", a - c
        elif kind == 2:
            a, b = rng.randint(2, top), rng.randint(2, top)
            question = f"{name} buys {a} bags with {b} {item} in each. How many {item} does {name} have?"
            step, answer = f"{a} * {b} = {a * b}", a * b
        else:
            k, each = rng.randint(2, 6), rng.randint(1, top)
            question = (f"{name} has {k * each} {item}. {they} shares them equally among {k} friends. "
                        f"How many does each friend get?")
            step, answer = f"{k * each} / {k} = {each}", each
        return TaskExample(prompt=f"{question} {INSTRUCTION}", ground_truth=str(answer),
                           params={"question": question, "solution": f"{step}\n#### {answer}"})

    def score(self, response_text: str, ground_truth: str, extra_info: dict | None = None) -> float:
        """The strict ``openai/gsm8k`` score: 1.0 for ``#### <answer>`` in the response's last 300 characters."""
        return gsm8k_compute_score(response_text, ground_truth)

    def target_response(self, example: TaskExample) -> str:
        return example.params["solution"]

    def make_row(self, index: int, rng: random.Random, split: str = "train") -> dict[str, Any]:
        """One row exactly as the reference system's GSM8K preprocessing writes it."""
        ex = self.sample(rng)
        return {
            "data_source": DATA_SOURCE,
            "prompt": self.messages(ex),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ex.ground_truth},
            "extra_info": {"split": split, "index": int(index), "answer": ex.params["solution"],
                           "question": ex.params["question"]},
        }
