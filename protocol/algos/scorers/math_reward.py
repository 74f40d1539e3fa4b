"""MATH's rule: the last ``\\boxed{...}`` answer, compared with the ground truth after string normalisation.

The normalisation is the Hendrycks MATH one the reference system uses for ``lighteval/MATH``,
``DigitalLearningGmbH/MATH-lighteval`` and ``HuggingFaceH4/MATH-500``: line breaks, ``\\!``, ``\\left``/``\\right``,
degrees, ``\\$``, a trailing ``\\text{ unit}``, ``\\%`` and spaces go; ``tfrac``/``dfrac`` become ``frac``; a short
``k = `` prefix is dropped; ``\\sqrt3`` -> ``\\sqrt{3}``, ``\\frac12`` -> ``\\frac{1}{2}``, ``0.5`` and ``1/2`` ->
``\\frac{1}{2}``. When a step cannot apply (a malformed string) the two answers are compared as they are.

>>> compute_score("so $x = \\\\boxed{\\\\dfrac{1}{2}}$", "\\\\frac12"), compute_score("\\\\boxed{3}", "4")
(1.0, 0.0)
"""
from __future__ import annotations

from typing import Any, Mapping

from protocol.algos.scorers.registry import register_scorer

__all__ = [
    "MATH_SOURCES", "last_boxed_only_string", "closing_brace", "remove_boxed", "strip_string", "is_equiv",
    "compute_score", "math_score",
]

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


class _Malformed(Exception):
    """A string a normalisation step cannot handle (the answers are then compared unnormalised)."""


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` (braces balanced) or ``\\fbox{...}``, or ``\\boxed <text up to $>``; None if none."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = closing_brace(text, start)
    return None if end is None else text[start:end + 1]


def closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` that closes the first ``{`` at or after ``start`` (braces counted), or None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def remove_boxed(boxed: str) -> str:
    """The content of ``\\boxed{...}`` / ``\\boxed ...``; anything else (``\\fbox``) raises ValueError."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a boxed answer: {boxed!r}")
        return boxed[len("\\boxed "):]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a boxed answer: {boxed!r}")
    return boxed[len("\\boxed{"):-1]


def _drop_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _Malformed(s)
    return parts[0]


def _brace_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    first, *rest = s.split("\\sqrt")
    out = [first]
    for part in rest:
        if not part:
            raise _Malformed(s)
        out.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(out)


def _brace_fracs(s: str) -> str:
    first, *rest = s.split("\\frac")
    out = [first]
    for part in rest:
        if not part:
            raise _Malformed(s)
        if part[0] == "{":
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return s  # "\frac1": left as it is
        a, b, tail = part[0], part[1], part[2:]
        out.append("\\frac{" + a + "}{" + b + "}" + tail if b != "{" else "\\frac{" + a + "}" + b + tail)
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def strip_string(s: str) -> str:
    """The normalised form of a MATH answer (see the module docstring); raises ``_Malformed`` where a step fails."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = _drop_right_units(s)
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _brace_sqrt(s).replace(" ", "")
    s = _brace_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    """Equal after :func:`strip_string` (compared as they are when one cannot be normalised); None only equals None."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return strip_string(a) == strip_string(b)
    except _Malformed:
        return a == b


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last boxed answer of ``solution_str`` is equivalent to ``ground_truth``, else 0.0."""
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str):
        return 0.0
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = remove_boxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0


def math_score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """The MATH scorer (boxed answer, normalised string equality)."""
    return compute_score(solution_str, ground_truth)


for _source in MATH_SOURCES:
    register_scorer(_source)(math_score)
