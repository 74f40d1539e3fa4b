"""GSM8K's rule: the answer is the number after the last ``#### `` in the response's final 300 characters.

Matches the reference system's ``openai/gsm8k`` scorer: strict extraction needs ``####``, one space, then the
number (``-``, digits, ``.`` and ``,``); commas and ``$`` are removed and the string is compared exactly with the
ground truth, so ``#### 7.`` and ``####7`` do not answer ``7``. Only the last 300 characters are searched.

>>> compute_score("Ann has 3 + 4 = 7 pens. #### 7", "7"), compute_score("#### 7.", "7"), compute_score("####7", "7")
(1.0, 0.0, 0.0)
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from protocol.algos.scorers.registry import RewardError, register_scorer

__all__ = ["CLIP_CHARS", "extract_solution", "compute_score", "gsm8k_score"]

CLIP_CHARS = 300  # the final answer sits at the end; searching only the tail keeps the regex cheap
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"(-?[0-9.,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer a response gives (None: none found) among its last :data:`CLIP_CHARS` characters.

    ``strict``: the last ``#### <number>``, commas and ``$`` removed. ``flexible``: the last number-like run
    that is not just ``.`` (no ``####`` needed).
    """
    if method not in ("strict", "flexible"):
        raise RewardError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")
    if not isinstance(solution_str, str):
        raise RewardError(f"solution_str must be a str, got {type(solution_str).__name__}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    if not found:
        return None
    return next((c for c in reversed(found) if c not in ("", ".")), found[0])


def _truth_text(ground_truth: Any) -> str:
    # an integer ground truth compares as its decimal string (the reference system would never match it)
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        return str(ground_truth)
    if not isinstance(ground_truth, str):
        raise RewardError(f"openai/gsm8k: ground_truth must be a str (reward_model.ground_truth), got "
                          f"{type(ground_truth).__name__} {ground_truth!r}")
    return ground_truth


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong one in the right format, 0 for no answer."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == _truth_text(ground_truth) else float(format_score)


@register_scorer("openai/gsm8k")
def gsm8k_score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """The ``openai/gsm8k`` scorer: strict extraction, 1.0 right, 0.0 otherwise."""
    return compute_score(solution_str, ground_truth)
