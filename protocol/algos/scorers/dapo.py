"""DAPO's rule (``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``): the last ``Answer: ...`` line, else
the last ``\\boxed{...}``.

Only the response's last 300 characters are read. There the last match of ``Answer\\s*:\\s*(.+)`` (any case, to
the end of its line) is the prediction (the Minerva form); prediction and ground truth are both normalised
(:func:`normalize_final_answer`) and compared exactly. A response without that form falls back to the strict box
rule, as the reference system's scorer does: the last balanced ``\\boxed{...}`` in the last 100 characters, its
content compared with the ground truth exactly, unnormalised. The result is the reference system's dict: ``score``
1.0 right / -1.0 wrong, ``acc`` (bool) and ``pred`` (the normalised Minerva prediction, or the box's content).

>>> compute_score("... so Answer: 1,234", "1234")["score"], compute_score("the answer is 12", "12")["acc"]
(1.0, False)
>>> compute_score("The answer is \\\\boxed{3105}", "3105")
{'score': 1.0, 'acc': True, 'pred': '3105'}
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from protocol.algos.scorers.math_reward import closing_brace
from protocol.algos.scorers.registry import register_scorer

__all__ = [
    "CLIP_CHARS", "BOX_CLIP_CHARS", "INVALID", "normalize_final_answer", "extract_answer", "last_boxed", "compute_score",
    "dapo_score",
]

CLIP_CHARS = 300  # the response tail that is read at all
BOX_CLIP_CHARS = 100  # the tail of that tail where the strict box rule looks
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


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` whose braces balance, or None (no box, or unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start + len("\\boxed{"):end]


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False) -> dict[str, Any]:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}``: the Minerva form, else the strict box rule.

    ``strict_box_verify=True`` uses the box rule alone (``pred`` is None where there is no box).
    """
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    tail = solution_str[-CLIP_CHARS:]
    pred: str | None = None
    if not strict_box_verify:
        pred = normalize_final_answer(extract_answer(tail))
        if pred != INVALID:
            correct = isinstance(ground_truth, str) and pred == normalize_final_answer(ground_truth)
            return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
    boxed = last_boxed(tail[-BOX_CLIP_CHARS:])
    if boxed is None:
        return {"score": -1.0, "acc": False, "pred": pred}
    correct = boxed == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": boxed}


@register_scorer("aime", prefix=True)
@register_scorer("math_dapo_reasoning")
@register_scorer("math")
@register_scorer("math_dapo")
def dapo_score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DAPO scorer (``Answer:`` line, else ``\\boxed{}``; score +-1 with ``acc`` and ``pred``)."""
    return compute_score(solution_str, ground_truth)
