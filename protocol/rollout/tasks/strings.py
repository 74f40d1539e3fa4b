"""String-transformation tasks (copy, reverse, repeat) with a partial-credit reward per character and for length."""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from protocol.rollout.tasks.base import Task, TaskError, TaskExample, register_task

__all__ = [
    "EOS_TEXT", "WRONG_CHAR", "normalize_response", "char_match_score", "length_match_score", "string_score",
    "StringTask", "CopyTask", "ReverseTask", "RepeatTask",
]


EOS_TEXT = "<|eos|>"
_SPECIAL = re.compile(r"<\|[a-z_0-9]+\|>")
WRONG_CHAR = "\ufffd"


def normalize_response(text: str) -> str:
    """The answer a response gives: one final ``<|eos|>`` removed, every other special token one wrong character.

    Decode responses with specials kept (``tokenizer.decode(ids, skip_special=False)``): a response padded with
    special tokens (or whitespace) is then not the answer, so the policy cannot hide filler from the scorer and
    must learn to stop. Nothing is stripped: a space is a character like any other.
    """
    if not isinstance(text, str):
        raise TaskError(f"response_text must be a str, got {type(text).__name__}")
    if text.endswith(EOS_TEXT):
        text = text[: -len(EOS_TEXT)]
    return _SPECIAL.sub(WRONG_CHAR, text)


def char_match_score(response: str, target: str) -> float:
    """Position-wise matches divided by the longer length: in [0, 1], 1.0 exactly when ``response == target``.

    Dense enough to learn from random weights (every right character counts) yet verifiable: extra or missing
    characters dilute the score, so only the exact answer reaches 1.

    >>> char_match_score("abx", "abc")
    0.6666666666666666
    """
    longest = max(len(response), len(target))
    if longest == 0:
        return 1.0
    matches = sum(1 for a, b in zip(response, target) if a == b)
    return matches / longest


def length_match_score(response: str, target: str) -> float:
    """``min(len) / max(len)`` of the two strings: 1.0 exactly when the lengths agree (two empty strings: 1.0)."""
    longest = max(len(response), len(target))
    return 1.0 if longest == 0 else min(len(response), len(target)) / longest


def string_score(response: str, target: str, length_weight: float = 0.5) -> float:
    """``(1 - w) * char_match_score + w * length_match_score``: in [0, 1], 1.0 exactly when ``response == target``.

    The length term rewards stopping at the right place from the first step (a random policy samples eos early
    now and then), so the policy learns to end its answer while it learns the characters.

    >>> string_score("bbbbbb", "bbb")
    0.5
    """
    if not 0.0 <= length_weight < 1.0:
        raise TaskError(f"length_weight must be in [0, 1), got {length_weight!r}")
    return (1.0 - length_weight) * char_match_score(response, target) + length_weight * length_match_score(
        response, target)


@dataclass
class StringTask(Task):
    """A random word over ``alphabet`` of ``min_len..max_len`` characters, transformed by ``transform``."""

    alphabet: str = "abcd"
    min_len: int = 3
    max_len: int = 6
    verb: str = "copy"
    length_weight: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.length_weight < 1.0:
            raise TaskError(f"{self.name}: length_weight must be in [0, 1), got {self.length_weight!r}")
        if not self.alphabet or len(set(self.alphabet)) != len(self.alphabet):
            raise TaskError(f"{self.name}: alphabet must be non-empty distinct characters, got {self.alphabet!r}")
        bad = [c for c in self.alphabet if c not in string.ascii_letters + string.digits]
        if bad:
            raise TaskError(f"{self.name}: alphabet may hold only ASCII letters and digits, got {bad!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise TaskError(f"{self.name}: need 1 <= min_len <= max_len, got min_len={self.min_len}, "
                            f"max_len={self.max_len}")

    def transform(self, word: str) -> str:
        """The answer for ``word``."""
        raise NotImplementedError

    def sample(self, rng: random.Random) -> TaskExample:
        n = rng.randint(self.min_len, self.max_len)
        word = "".join(rng.choice(self.alphabet) for _ in range(n))
        return TaskExample(prompt=f"{self.verb}: {word}", ground_truth=self.transform(word), params={"word": word})

    def score(self, response_text: str, ground_truth: str, extra_info: dict | None = None) -> float:
        if not isinstance(ground_truth, str):
            raise TaskError(f"{self.name}: ground_truth must be a str, got {type(ground_truth).__name__}")
        weight = self.length_weight
        if extra_info is not None and extra_info.get("length_weight") is not None:
            weight = float(extra_info["length_weight"])
        return string_score(normalize_response(response_text), ground_truth, weight)

    def score_params(self) -> dict:
        return {"length_weight": float(self.length_weight)}


@register_task("copy")
@dataclass
class CopyTask(StringTask):
    """``copy: abdc`` -> ``abdc``: the response repeats the word."""

    verb: str = "copy"

    def transform(self, word: str) -> str:
        return word


@register_task("reverse")
@dataclass
class ReverseTask(StringTask):
    """``reverse: abdc`` -> ``cdba``: the response is the word backwards."""

    verb: str = "reverse"

    def transform(self, word: str) -> str:
        return word[::-1]


@register_task("repeat")
@dataclass
class RepeatTask(StringTask):
    """``repeat: c3`` -> ``ccc``: one letter written a given number of times (learnable from random weights)."""

    verb: str = "repeat"

    def transform(self, word: str) -> str:
        return word

    def sample(self, rng: random.Random) -> TaskExample:
        n = rng.randint(self.min_len, self.max_len)
        ch = rng.choice(self.alphabet)
        return TaskExample(prompt=f"{self.verb}: {ch}{n}", ground_truth=ch * n, params={"word": ch, "count": n})
