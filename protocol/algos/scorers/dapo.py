"""DAPO's rule (``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``): the last ``Answer: ...`` line.

In the response's last 300 characters the last match of ``Answer\\s*:\\s*(.+)`` (any case, to the end of its line)
is the prediction; prediction and ground truth are both normalised (:func:`normalize_final_answer`) and compared
exactly. The result is the reference system's dict: ``score`` 1.0 right / -1.0 wrong, ``acc`` (bool) and ``pred``.

>>> compute_score("... so Answer: 1,234", "1234")["score"], compute_score("the answer is 12", "12")["acc"]
(1.0, False)
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from protocol.algos.scorers.registry import register_scorer

__all__ = ["CLIP_CHARS", "INVALID", "normalize_final_answer", "extract_answer", "compute_score", "dapo_score"]

CLIP_CHARS = 300
INVALID = "[INVALID]"
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# literal replacements, then literal removals, applied in this order (Minerva's quantitative-reasoning normaliser)
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_REGEX_STEPS = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep only the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrta -> \sqrt{a}
)


def normalize_final_answer(answer: str) -> str:
    """The comparable form of a final answer: right of the last ``=``, units/TeX noise removed, ``1,000`` -> ``1000``."""
    answer = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    for pattern, repl in _REGEX_STEPS:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(solution_str: str) -> str:
    """The text after the last ``Answer:`` in the last :data:`CLIP_CHARS` characters, or :data:`INVALID`."""
    found = _ANSWER.findall(solution_str[-CLIP_CHARS:])
    return found[-1] if found else INVALID


def compute_score(solution_str: str, ground_truth: Any) -> dict[str, Any]:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": normalised prediction}``."""
    pred = normalize_final_answer(extract_answer(solution_str))
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    correct = isinstance(ground_truth, str) and pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


@register_scorer("aime", prefix=True)
@register_scorer("math_dapo_reasoning")
@register_scorer("math")
@register_scorer("math_dapo")
def dapo_score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DAPO scorer (``Answer:`` format; score +-1 with ``acc`` and ``pred``)."""
    return compute_score(solution_str, ground_truth)
