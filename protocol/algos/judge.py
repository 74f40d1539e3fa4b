"""The generative judge's text side: its configuration (``reward.judge``), the prompt it is shown and the parser
that turns its answer into a score. Pure functions; the engine that generates the answers is
:mod:`rldispatch.judge`.

A judge prompt is ``reward.judge.template`` with ``{prompt}`` (the trajectory's prompt text), ``{response}`` (the
decoded response) and ``{ground_truth}`` replaced; no other ``{name}`` may appear (a typo would otherwise reach the
judge as text). The answer's score is the last (``last_number``) or first (``first_number``) decimal number in it,
or group 1 of ``reward.judge.pattern`` (``regex``). An answer without a score, or with one outside
``[min_score, max_score]``, is a *failure*: an error (``on_failure=error``) or scored ``failure_score``
(``on_failure=score``; default ``min_score``), and counted either way.

Example::

    >>> parse_score("I'd say 7/10. Final: 8", "last_number")
    8.0
    >>> judge_outcome("no idea", JudgeConfig(enable=True, max_score=10))
    (0.0, 'no_score')
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from protocol.algos.scorers import RewardError

__all__ = ["JudgeConfig", "JudgeError", "DEFAULT_TEMPLATE", "PLACEHOLDERS", "NUMBER", "judge_folder",
           "judge_tokenizer_source", "prompt_text", "render_judge_prompt", "parse_score", "judge_outcome"]


class JudgeError(RewardError):
    """A judge setting that cannot work, or (``on_failure=error``) an answer without a usable score."""


#: what a template may name
PLACEHOLDERS = ("prompt", "response", "ground_truth")
DEFAULT_TEMPLATE = ("Rate how well the response answers the question, from 0 (wrong or useless) to 10 (fully "
                    "correct and clear). Reply with the number only.\n\nQuestion:\n{prompt}\n\nResponse:\n"
                    "{response}\n\nScore:")
#: a decimal number as the parsers read it (sign, digits with an optional fraction, optional exponent)
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(NUMBER)
_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")

Parser = Literal["last_number", "first_number", "regex"]


@dataclass
class JudgeConfig:
    """``reward.judge``: a generative judge (a causal LM) scoring each trajectory from a prompt built by
    ``template``; its score enters the trajectory score with ``weight`` (``reward.rule_weight`` keeps the
    rule-based one). It runs on the ranks holding the trajectories, in an engine of ``rollout.engine``'s kind."""

    enable: bool = False  # score every training trajectory with a generative judge
    hf_path: str | None = None  # the judge's causal-LM folder (None: the policy's starting checkpoint, model.hf_path)
    template: str = DEFAULT_TEMPLATE  # with {prompt}, {response}, {ground_truth}; no other {name}
    chat_template: bool = True  # wrap the text as one user message in the judge tokenizer's chat template
    parser: Parser = "last_number"  # which number of the answer is the score
    pattern: str | None = None  # parser=regex: a regular expression whose group 1 is the score
    min_score: float = 0.0  # the scores a judge may give; a parsed one outside is a failure
    max_score: float = 10.0  # the highest score a judge may give
    on_failure: Literal["error", "score"] = "score"  # an answer without a usable score: stop, or score it
    failure_score: float | None = None  # on_failure=score: the score of a failure (None: min_score)
    weight: float = 1.0  # the judge score's weight in the trajectory score
    max_tokens: int = 16  # the longest answer
    temperature: float = 0.0  # 0: greedy (the same answer for the same prompt)

    def __post_init__(self) -> None:
        if self.hf_path == "":
            self.hf_path = None
        for key in ("min_score", "max_score", "weight", "temperature") + \
                (("failure_score",) if self.failure_score is not None else ()):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise JudgeError(f"reward.judge.{key} must be a finite number, got {value!r}")
        if self.min_score > self.max_score:
            raise JudgeError(f"reward.judge.min_score={self.min_score} exceeds reward.judge.max_score={self.max_score}")
        if self.temperature < 0:
            raise JudgeError(f"reward.judge.temperature must be >= 0, got {self.temperature}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise JudgeError(f"reward.judge.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.parser not in ("last_number", "first_number", "regex"):
            raise JudgeError(f"reward.judge.parser must be last_number, first_number or regex, got {self.parser!r}")
        if self.on_failure not in ("error", "score"):
            raise JudgeError(f"reward.judge.on_failure must be 'error' or 'score', got {self.on_failure!r}")
        if self.enable and (self.parser == "regex") != (self.pattern is not None):
            raise JudgeError("reward.judge.pattern is read with reward.judge.parser=regex only (and it needs one); "
                             f"got parser={self.parser!r}, pattern={self.pattern!r}")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as exc:
                raise JudgeError(f"reward.judge.pattern={self.pattern!r} is not a regular expression: {exc}") from exc
            if groups < 1:
                raise JudgeError(f"reward.judge.pattern={self.pattern!r} needs a group: group 1 is the score")
        if not isinstance(self.template, str):
            raise JudgeError(f"reward.judge.template must be a string, got {type(self.template).__name__}")
        unknown = sorted(set(_FIELD.findall(self.template)) - set(PLACEHOLDERS))
        if unknown:
            raise JudgeError(f"reward.judge.template names {['{' + u + '}' for u in unknown]}; a template may name "
                             f"{['{' + p + '}' for p in PLACEHOLDERS]} only")
        if "{response}" not in self.template:
            raise JudgeError("reward.judge.template has no {response}: the judge would not see what it scores")
        if self.failure_score is not None and not self.min_score <= self.failure_score <= self.max_score:
            raise JudgeError(f"reward.judge.failure_score={self.failure_score} is outside [min_score, max_score] = "
                             f"[{self.min_score}, {self.max_score}]")

    @property
    def uses_ground_truth(self) -> bool:
        return "{ground_truth}" in self.template

    @property
    def score_of_failure(self) -> float:
        return float(self.min_score if self.failure_score is None else self.failure_score)


def judge_folder(cfg: JudgeConfig, policy_hf_path: str | None) -> str:
    """The judge's checkpoint folder: ``reward.judge.hf_path``, else the policy's starting ``model.hf_path``."""
    path = cfg.hf_path or policy_hf_path
    if not path:
        raise JudgeError("reward.judge.enable=true needs a causal-LM folder: set reward.judge.hf_path (or "
                         "model.hf_path, whose starting checkpoint then judges)")
    return path


def judge_tokenizer_source(folder: str, policy_tokenizer: str | None, policy_hf_path: str | None) -> str:
    """The judge folder when it holds tokenizer files, else the policy's tokenizer (``data.tokenizer``)."""
    from protocol.rollout.tokenizer import has_tokenizer_files, resolve_tokenizer

    if has_tokenizer_files(folder):
        return folder
    return resolve_tokenizer(policy_tokenizer, policy_hf_path)


def prompt_text(raw_prompt: Any) -> str:
    """The text of a dataset row's prompt: a string as it is; chat messages as their contents, one per line."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    if isinstance(raw_prompt, Sequence) and all(isinstance(m, Mapping) and "content" in m for m in raw_prompt):
        return "\n".join(str(m["content"]) for m in raw_prompt)
    raise JudgeError(f"a judge prompt needs the row's raw_prompt as a string or chat messages with 'content', got "
                     f"{type(raw_prompt).__name__}")


def render_judge_prompt(template: str, prompt: str, response: str, ground_truth: Any = None) -> str:
    """``template`` with its placeholders replaced in one pass (a response that contains ``{prompt}`` stays as
    written). A template naming ``{ground_truth}`` needs one."""
    values = {"prompt": prompt, "response": response}
    if "{ground_truth}" in template:
        if ground_truth is None:
            raise JudgeError("reward.judge.template names {ground_truth}, but this row has no ground truth "
                             "(reward_model.ground_truth)")
        values["ground_truth"] = str(ground_truth)
    return _FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def parse_score(text: str, parser: Parser, pattern: str | None = None) -> float | None:
    """The score in a judge's answer, or None when it has none."""
    if parser == "regex":
        found = re.search(pattern or "", text)
        if found is None or found.group(1) is None:
            return None
        try:
            return float(found.group(1))
        except ValueError:
            return None
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return float(numbers[-1] if parser == "last_number" else numbers[0])


def judge_outcome(text: str, cfg: JudgeConfig) -> tuple[float, str | None]:
    """``(score, failure)`` of one answer: failure is None, ``"no_score"`` or ``"out_of_range"`` (then the score
    is the failure score); with ``on_failure=error`` a failure raises, quoting the answer."""
    value = parse_score(text, cfg.parser, cfg.pattern)
    failure = "no_score" if value is None else \
        "out_of_range" if not (math.isfinite(value) and cfg.min_score <= value <= cfg.max_score) else None
    if failure is None:
        return float(value), None
    if cfg.on_failure == "error":
        what = "has no score" if failure == "no_score" else \
            f"scores {value}, outside [{cfg.min_score}, {cfg.max_score}]"
        raise JudgeError(f"the judge's answer {text!r} {what} (reward.judge.parser={cfg.parser}); set "
                         "reward.judge.on_failure=score to score such answers reward.judge.failure_score")
    return cfg.score_of_failure, failure
