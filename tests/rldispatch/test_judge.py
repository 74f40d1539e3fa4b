"""The generative judge: its parser against Python's float reading, its template, its failure policy, its config
errors, and its answers against transformers' greedy ``generate`` on the same folder."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import hf_tiny  # noqa: E402

from protocol.algos.judge import (JudgeConfig, JudgeError, judge_outcome, parse_score, prompt_text,  # noqa: E402
                                  render_judge_prompt)
from protocol.algos.reward import RewardInput  # noqa: E402
from protocol.config import ConfigError  # noqa: E402
from protocol.rollout.tokenizer import CharTokenizer, decode_response  # noqa: E402
from rldispatch.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# text around a number that cannot extend it: no digits, signs, points or exponent letters
_FILLER = st.text(st.sampled_from("abcdfghijklmnopqrstuvwxyz :;!?/()\n"), max_size=12)


@given(x=st.floats(allow_nan=False, allow_infinity=False), before=_FILLER, after=_FILLER, other=st.integers(0, 99))
def test_last_and_first_number_read_what_python_wrote(x, before, after, other):
    """``repr`` of any finite float, between text that cannot extend it, reads back exactly; with another number
    before it, ``last_number`` reads x and ``first_number`` the other."""
    assert parse_score(f"{before}{x!r}{after}", "last_number") == x
    text = f"{other} {before}{x!r}{after}"
    assert parse_score(text, "last_number") == x
    assert parse_score(text, "first_number") == float(other)


@given(before=_FILLER)
def test_text_without_digits_has_no_score(before):
    assert parse_score(before, "last_number") is None and parse_score(before, "first_number") is None


def test_regex_parser_reads_group_one():
    pattern = r"Score:\s*(\S+)"
    assert parse_score("ok. Score: 7.5 because", "regex", pattern) == 7.5
    assert parse_score("Score: high", "regex", pattern) is None  # group 1 is not a number
    assert parse_score("no score here", "regex", pattern) is None


def test_outcomes_and_the_failure_policy():
    cfg = JudgeConfig(enable=True, min_score=0, max_score=10)
    assert judge_outcome("7", cfg) == (7.0, None)
    assert judge_outcome("it is 12", cfg) == (0.0, "out_of_range")
    assert judge_outcome("none", cfg) == (0.0, "no_score")
    assert judge_outcome("none", JudgeConfig(enable=True, failure_score=5))[0] == 5.0
    strict = JudgeConfig(enable=True, on_failure="error")
    with pytest.raises(JudgeError, match=r"'none' has no score .*on_failure=score"):
        judge_outcome("none", strict)
    with pytest.raises(JudgeError, match=r"scores 12.0, outside \[0.0, 10.0\]"):
        judge_outcome("12", strict)


def test_template_placeholders_are_replaced_once():
    out = render_judge_prompt("Q {prompt} A {response} T {ground_truth} {}", "what {response}?", "a {prompt} b", 3)
    assert out == "Q what {response}? A a {prompt} b T 3 {}"
    with pytest.raises(JudgeError, match="no ground truth"):
        render_judge_prompt("{response} vs {ground_truth}", "p", "r", None)
    assert prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == "s\nu"


@pytest.mark.parametrize("kwargs, match", [
    ({"template": "rate {answer}: {response}"}, r"names \['\{answer\}'\]"),
    ({"template": "rate {prompt}"}, "has no {response}"),
    ({"parser": "regex"}, "needs one"),
    ({"pattern": "(x)"}, "with reward.judge.parser=regex only"),
    ({"parser": "regex", "pattern": "x"}, "needs a group"),
    ({"min_score": 3, "max_score": 1}, "exceeds reward.judge.max_score"),
    ({"failure_score": 11}, "outside"),
])
def test_bad_judge_settings_name_their_key(kwargs, match):
    with pytest.raises(JudgeError, match=match):
        JudgeConfig(enable=True, **kwargs)


def _cfg(tmp_path, *extra):
    return load_config(str(REPO / "configs" / "grpo_tiny.yaml"), [
        f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/val.parquet]",
        "data.train_size=64", "data.val_size=8", "reward.judge.enable=true", *extra])


def test_judge_folder_errors_are_one_config_line(tmp_path):
    with pytest.raises(ConfigError, match="needs a causal-LM folder: set reward.judge.hf_path"):
        _cfg(tmp_path)
    with pytest.raises(ConfigError, match=r"reward.judge.hf_path='.*missing' is not a folder"):
        _cfg(tmp_path, f"reward.judge.hf_path={tmp_path / 'missing'}")
    clf = hf_tiny.make_checkpoint(tmp_path / "clf", "llama", classifier=True, tokenizer=False, vocab_size=128)
    with pytest.raises(ConfigError, match="LlamaForSequenceClassification; the judge generates text"):
        _cfg(tmp_path, f"reward.judge.hf_path={clf}")
    small = hf_tiny.make_checkpoint(tmp_path / "small", "llama", tokenizer=False, vocab_size=64)
    with pytest.raises(ConfigError, match="judge's vocabulary"):
        _cfg(tmp_path, f"reward.judge.hf_path={small}")  # the policy's char tokenizer (128 ids) does not fit


def test_judge_answers_equal_transformers_greedy_generate(tmp_path):
    """The judge's engine answers each trajectory's prompt as transformers' greedy ``generate`` does on the same
    folder (fp32; the answer read without special tokens), and each score is what Python's float reading of the answer's last number gives, within
    [min_score, max_score], else the failure score, with the failure named; padding samples score 0 unasked."""
    from transformers import AutoModelForCausalLM

    from rldispatch.judge import JudgeRole

    folder = hf_tiny.make_checkpoint(tmp_path / "judge", "llama", tokenizer=False, vocab_size=128, seed=3)
    cfg = _cfg(tmp_path, f"reward.judge.hf_path={folder}", "reward.judge.template='Q:{prompt} A:{response} Score:'",
               "reward.judge.max_tokens=12", "reward.judge.chat_template=false", "reward.judge.max_score=4",
               "reward.judge.failure_score=1")
    tok = CharTokenizer()
    role = JudgeRole(cfg, lambda ids: decode_response(tok, ids, stop_ids={tok.eos_token_id}), device="cpu", rank=0)
    responses = ["aabb", "7", "zz", "ccdd", "", "q"]
    rows = {f"u{i}": {"raw_prompt": [{"role": "user", "content": f"repeat: w{i}"}]} for i in range(len(responses))}
    items = [RewardInput(response_ids=tok.encode(r), data_source="repeat", key=f"u{i}_0_0", is_padding=(i == 4))
             for i, r in enumerate(responses)]
    result = role.judge(items, rows, step=0)
    role.close()

    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    numbers = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
    kinds = set()
    for i, (item, response) in enumerate(zip(items, responses)):
        if item.is_padding:
            assert result.scores[i] == 0 and result.answers[i] is None and result.failures[i] is None
            continue
        prompt = tok.encode(f"Q:repeat: w{i} A:{response} Score:")
        with torch.no_grad():
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        ids = out[0, len(prompt):].tolist()
        want = tok.decode(ids, skip_special=True)  # special tokens (the stop token among them) are not text
        assert result.answers[i] == want, (i, result.answers[i], want)
        found = numbers.findall(want)
        value = float(found[-1]) if found else None
        kind = None if value is not None and 0 <= value <= 4 else ("no_score" if value is None else "out_of_range")
        kinds.add(kind)
        assert result.failures[i] == kind
        assert result.scores[i].item() == pytest.approx(1.0 if kind else value, rel=1e-6)
    assert kinds == {None, "no_score", "out_of_range"}, f"the fixed seed gives answers of every kind, got {kinds}"
