"""The built-in scorers against tables of responses, with the reference system's results for each data source."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from protocol.algos.reward import default_compute_score, known_scorers, needs_ground_truth
from protocol.algos.scorers import RewardError, UnknownDataSourceError, dapo, gsm8k, math_reward, math_verify

LONG = "Let me think about this carefully. " * 40  # 1360 characters of preamble

# (response, ground truth, score) for openai/gsm8k: strict "#### <number>" in the last 300 characters
GSM8K = [
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 7", "7", 1.0),
    ("####7", "7", 0.0),  # no space after ####
    ("#### 7.", "7", 0.0),  # the trailing period is part of the answer
    ("#### 7.0", "7", 0.0),
    ("#### 1,234", "1234", 1.0),  # commas stripped
    ("#### 1,234,567", "1234567", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### - 5", "-5", 0.0),
    ("#### 0.5", "0.5", 1.0),
    ("#### 3/4", "3/4", 0.0),  # a fraction is not a GSM8K number: only "3" is read
    ("#### $7", "7", 0.0),
    ("#### 5 and then #### 7", "7", 1.0),  # the last answer counts
    ("#### 7 and then #### 5", "7", 0.0),
    ("the answer is 7", "7", 0.0),
    ("", "7", 0.0),
    (LONG + "#### 7", "7", 1.0),  # a long preamble is fine: the answer is at the end
    ("#### 7" + " and that is all." * 20, "7", 0.0),  # the answer lies before the last 300 characters
    ("#### 7<|eos|>", "7", 1.0),
    ("#### 7", 7, 1.0),  # an integer ground truth compares as its decimal string
]

# (response, ground truth, score) for the MATH sources: last \boxed{}, Hendrycks string normalisation
MATH = [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("so $x = \\boxed{\\dfrac12}$", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("the answer is 3", "3", 0.0),  # no box
    ("\\boxed{2} no wait \\boxed{3}", "3", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("\\boxed{1,000}", "1000", 0.0),  # commas are not normalised for MATH
    ("so \\boxed 5$ done", "5", 1.0),  # the "\boxed 5" form
    ("\\fbox{5}", "5", 0.0),  # found, but not a boxed answer
    ("\\boxed{5", "5", 0.0),  # unbalanced
    ("\\boxed{\\sqrt}", "\\sqrt", 1.0),  # cannot be normalised: compared as it is
    ("\\boxed{\\sqrt}", "\\sqrt{}", 0.0),
    (LONG + "\\boxed{7}", "7", 1.0),
]

# (response, ground truth, score, acc) for math_dapo / aime*: last "Answer: ..." line of the last 300 characters
DAPO = [
    ("Answer: 42", "42", 1.0, True),
    ("answer : 42", "42", 1.0, True),
    ("The answer is 42", "42", -1.0, False),
    ("Answer: 1,234", "1234", 1.0, True),
    ("Answer: -3", "-3", 1.0, True),
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", 1.0, True),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0, True),
    ("Answer: 5 dollars", "5", 1.0, True),
    ("Answer: x = 7", "7", 1.0, True),
    ("Answer: \\boxed{7}", "7", 1.0, True),
    ("Answer: 3\nAnswer: 4", "4", 1.0, True),
    ("Answer: 4\nAnswer: 3", "4", -1.0, False),
    ("Answer: 8", "7", -1.0, False),
    (LONG + "Answer: 7", "7", 1.0, True),
    ("Answer: 7\n" + "and so on. " * 30, "7", -1.0, False),  # beyond the last 300 characters
]


# (response, ground truth, score, pred) for math_dapo / aime* without an "Answer:" line: the strict box rule, the last
# \boxed{} in the last 100 characters compared exactly with the ground truth (the reference system's fallback)
DAPO_BOX = [
    ("The answer is \\boxed{3105}", "3105", 1.0, "3105"),
    ("The answer is \\boxed{3105}.", "3105", 1.0, "3105"),
    ("The answer is \\boxed{3105}", 3105, 1.0, "3105"),  # an integer ground truth compares as its decimal string
    ("\\boxed{3104}", "3105", -1.0, "3104"),
    ("\\boxed{1,234}", "1234", -1.0, "1,234"),  # the box's content is not normalised
    ("\\boxed{\\frac12}", "\\frac{1}{2}", -1.0, "\\frac12"),
    ("\\boxed{ 7 }", "7", -1.0, " 7 "),
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),  # nested braces balance
    ("\\boxed{\\text{(A)}}", "\\text{(A)}", 1.0, "\\text{(A)}"),
    ("\\boxed{2} then \\boxed{3}", "3", 1.0, "3"),  # the last box counts
    ("\\boxed{3}" + "." * 91, "3", 1.0, "3"),  # the box ends the last 100 characters' window
    ("\\boxed{3}" + "." * 92, "3", -1.0, dapo.INVALID),  # one character more: its backslash falls out of it
    (LONG + "\\boxed{3}", "3", 1.0, "3"),
    ("\\boxed{3", "3", -1.0, dapo.INVALID),  # unclosed
    ("\\fbox{3}", "3", -1.0, dapo.INVALID),  # only \boxed{...} is read
    ("\\boxed 3$", "3", -1.0, dapo.INVALID),
    ("no answer at all", "3", -1.0, dapo.INVALID),
    ("Answer: 4\n\\boxed{3}", "3", -1.0, "4"),  # an "Answer:" line wins, right or wrong
    ("answer: \\boxed{3}", "3", 1.0, "3"),  # ... and is normalised (its box removed)
]


@pytest.mark.parametrize("response,truth,score", GSM8K)
def test_gsm8k_table(response, truth, score):
    assert default_compute_score("openai/gsm8k", response, truth) == score
    assert gsm8k.compute_score(response, truth) == score


def test_gsm8k_options():
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1  # right format, wrong answer
    assert gsm8k.compute_score("no answer", "7", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 7", "7", score=2.0) == 2.0
    assert gsm8k.extract_solution("the answer is 7 .", "flexible") == "7"  # the lone "." is skipped
    assert gsm8k.extract_solution("the answer is 7.", "flexible") == "7."
    assert gsm8k.extract_solution("no digits", "flexible") is None
    with pytest.raises(RewardError, match="strict"):
        gsm8k.extract_solution("#### 7", "loose")
    with pytest.raises(RewardError, match="ground_truth must be a str"):
        gsm8k.compute_score("#### 7", None)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(-10**9, 10**9), pad=st.integers(0, 2000))
def test_gsm8k_any_integer_after_any_preamble(n, pad):
    """The formatted answer at the end scores 1, with or without thousands separators, after any preamble."""
    assert gsm8k.compute_score("x" * pad + f"#### {n}", str(n)) == 1.0
    assert gsm8k.compute_score("x" * pad + f"#### {n:,}", str(n)) == 1.0
    assert gsm8k.compute_score("x" * pad + f"#### {n + 1}", str(n)) == 0.0


@pytest.mark.parametrize("source", math_reward.MATH_SOURCES)
@pytest.mark.parametrize("response,truth,score", MATH)
def test_math_table(source, response, truth, score):
    assert default_compute_score(source, response, truth) == score


def test_math_normalisation_pieces():
    assert math_reward.last_boxed_only_string("a \\boxed{x{y}} b") == "\\boxed{x{y}}"
    assert math_reward.last_boxed_only_string("none") is None
    assert math_reward.strip_string("\\dfrac{3}{4}") == "\\frac{3}{4}"
    assert math_reward.strip_string("k = 3") == "3"
    assert math_reward.strip_string("10/4") == "\\frac{10}{4}"
    assert math_reward.is_equiv(None, None) and not math_reward.is_equiv("1", None)
    with pytest.raises(ValueError, match="not a boxed answer"):
        math_reward.remove_boxed("\\fbox{3}")


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime_2025"])
@pytest.mark.parametrize("response,truth,score,acc", DAPO)
def test_dapo_table(source, response, truth, score, acc):
    result = default_compute_score(source, response, truth)
    assert result["score"] == score and result["acc"] is acc
    assert result["pred"] == dapo.normalize_final_answer(dapo.extract_answer(response))


@pytest.mark.parametrize("source", ["math_dapo", "aime2024"])
@pytest.mark.parametrize("response,truth,score,pred", DAPO_BOX)
def test_dapo_falls_back_to_the_last_box(source, response, truth, score, pred):
    assert default_compute_score(source, response, truth) == {"score": score, "acc": score == 1.0, "pred": pred}


def test_dapo_strict_box_verify_reads_only_the_box():
    assert dapo.compute_score("Answer: 4\n\\boxed{3}", "3", strict_box_verify=True) == {
        "score": 1.0, "acc": True, "pred": "3"}
    assert dapo.compute_score("Answer: 3", "3", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": None}


def test_dapo_invalid_prediction():
    assert dapo.compute_score("no final line", "3") == {"score": -1.0, "acc": False, "pred": dapo.INVALID}
    assert dapo.normalize_final_answer("12 points") == "12"


@pytest.mark.skipif(not math_verify.available(), reason="math-verify is not installed")
def test_math_verify_option():
    src = "HuggingFaceH4/MATH-500"
    assert default_compute_score(src, "so it is $\\frac{1}{2}$", "0.5", use_math_verify=True) == 1.0
    assert default_compute_score(src, "\\boxed{0.50}", "\\frac{1}{2}", use_math_verify=True) == 1.0
    assert default_compute_score(src, "\\boxed{3}", "4", use_math_verify=True) == 0.0
    # string normalisation cannot see 0.50 = 1/2; math-verify can
    assert default_compute_score(src, "\\boxed{0.50}", "\\frac{1}{2}") == 0.0
    # the option applies to the MATH sources only
    assert default_compute_score("openai/gsm8k", "#### 7", "7", use_math_verify=True) == 1.0


def test_registry_and_requirements():
    names = set(known_scorers())
    assert {"openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
            "math_dapo", "aime*", "exact_match", "repeat", "arithmetic"} <= names
    assert "gsm8k" not in names  # the lax scorer is gone: openai/gsm8k is the GSM8K rule
    assert needs_ground_truth("openai/gsm8k") and needs_ground_truth("aime24")
    with pytest.raises(UnknownDataSourceError, match="custom_reward_function") as info:
        default_compute_score("no/such_source", "x", "y")
    assert isinstance(info.value, NotImplementedError)  # as the reference system raises
    with pytest.raises(RewardError, match="data_source must be a str"):
        needs_ground_truth(None)
    assert default_compute_score("repeat", "bbb", "bbb") == 1.0  # tasks are scorers too


def test_scorer_lookup_is_resolved_again_after_any_registry_change():
    """scorer_spec remembers each data_source's scorer, but a scorer registered or removed later is seen at once."""
    from protocol.algos.scorers import registry as scorer_registry
    from protocol.registry import Registry

    with pytest.raises(UnknownDataSourceError):
        scorer_registry.scorer_spec("cachetest/abc")
    assert scorer_registry.scorer_spec("openai/gsm8k") is scorer_registry.scorer_spec("openai/gsm8k")
    before = Registry.generation
    scorer_registry.register_scorer("cachetest/", prefix=True, needs_ground_truth=False)(lambda s, g, e=None: 0.25)
    try:
        assert Registry.generation == before + 1
        assert default_compute_score("cachetest/abc", "x", None) == 0.25
        exact = scorer_registry.register_scorer("cachetest/abc", needs_ground_truth=False)(lambda s, g, e=None: 0.5)
        assert default_compute_score("cachetest/abc", "x", None) == 0.5  # the exact name now wins over the prefix
        scorer_registry._SCORERS.unregister("cachetest/abc")
        assert default_compute_score("cachetest/abc", "x", None) == 0.25 and exact
    finally:
        scorer_registry._SCORERS.unregister("cachetest/")
    with pytest.raises(UnknownDataSourceError):
        scorer_registry.scorer_spec("cachetest/abc")
