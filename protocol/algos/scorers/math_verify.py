"""Equivalence by the math-verify package (an optional extra): ``reward.math_verify=true`` for the MATH sources.

The ground truth is read as ``\\boxed{<ground truth>}``; the response may give its answer as LaTeX or as a plain
expression (``0.5`` equals ``\\frac{1}{2}``). A parse that times out scores ``timeout_score``; one that fails scores
0.0 and is logged.
"""
from __future__ import annotations

import logging
from typing import Any

__all__ = ["available", "compute_score"]

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether the math-verify package can be imported."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def compute_score(model_output: str, ground_truth: Any, timeout_score: float = 0.0) -> float:
    """1.0 when math-verify finds the response's answer equal to the ground truth, else 0.0."""
    try:
        from math_verify.errors import TimeoutException
        from math_verify.metric import math_metric
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    except ImportError as exc:
        raise ImportError("reward.math_verify=true needs the math-verify package (pip install math-verify)") from exc
    verify = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                         pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    try:
        score, _ = verify(["\\boxed{" + str(ground_truth) + "}"], [model_output])
    except TimeoutException:
        return float(timeout_score)
    except Exception as exc:  # math-verify raises many parser errors; an unparseable answer is a wrong one
        logger.warning("math-verify could not compare %r with %r: %s: %s", model_output[-80:], ground_truth,
                       type(exc).__name__, exc)
        return 0.0
    return float(score)
