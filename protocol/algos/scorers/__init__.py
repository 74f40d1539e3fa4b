"""Rule-based scorers by ``data_source``, with the reference system's results, and a user's function by path.

Built in: ``openai/gsm8k`` (:mod:`.gsm8k`), ``lighteval/MATH`` / ``DigitalLearningGmbH/MATH-lighteval`` /
``HuggingFaceH4/MATH-500`` (:mod:`.math_reward`), ``math_dapo`` / ``math`` / ``math_dapo_reasoning`` / ``aime*``
(:mod:`.dapo`), ``exact_match``, the learnable tasks of :mod:`protocol.rollout.tasks`; math-verify equivalence for
the MATH sources as an option (:mod:`.math_verify`). :func:`default_compute_score` is the common entry point.
"""
from typing import Any, Mapping

from protocol.algos.scorers import dapo, gsm8k, math_reward, math_verify
from protocol.algos.scorers.custom import BATCH_SCORE_PARAMS, SCORE_PARAMS, load_reward_function
from protocol.algos.scorers.registry import (
    RewardError,
    Scorer,
    ScorerSpec,
    UnknownDataSourceError,
    get_scorer,
    known_scorers,
    needs_ground_truth,
    register_scorer,
    scorer_spec,
)

__all__ = [
    "RewardError", "UnknownDataSourceError", "Scorer", "ScorerSpec", "register_scorer", "get_scorer", "scorer_spec",
    "needs_ground_truth", "known_scorers", "default_compute_score", "load_reward_function", "SCORE_PARAMS",
    "BATCH_SCORE_PARAMS", "exact_match_score", "dapo", "gsm8k", "math_reward", "math_verify",
]


@register_scorer("exact_match")
def exact_match_score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when the stripped response equals the stripped ground truth, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None,
                          *, use_math_verify: bool = False) -> float | dict[str, Any]:
    """The reference system's scoring entry point: the scorer of ``data_source`` applied to one decoded response.

    Returns a float, or the scorer's dict (``"score"`` plus extra values) as it is. ``use_math_verify=True`` scores
    the MATH data sources with the math-verify package's equivalence instead of string normalisation.

    >>> default_compute_score("openai/gsm8k", "3 + 4 = 7 #### 7", "7")
    1.0
    """
    if use_math_verify and data_source in math_reward.MATH_SOURCES:
        return float(math_verify.compute_score(solution_str, ground_truth))
    result = get_scorer(data_source)(solution_str, ground_truth, extra_info)
    if isinstance(result, Mapping):
        return dict(result)
    if isinstance(result, (bool, int, float)):
        try:
            return float(result)
        except OverflowError:  # an int beyond float range: the reward manager refuses it as not finite
            return result
    return result  # left for the reward manager to refuse, naming the data source
