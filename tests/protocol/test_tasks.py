"""Learnable tasks: seeded generation, the rule-based scorer, and the parquet rows (the reference system's format)."""
from __future__ import annotations

import random

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from protocol.algos.reward import default_compute_score
from protocol.rollout.dataset import RLHFDataset
from protocol.rollout.tasks import (
    ArithmeticTask, CopyTask, RepeatTask, ReverseTask, TaskError, char_match_score, get_task, known_tasks, make_rows,
    normalize_response, register_task, score, warmup_token_pairs, write_task_data,
)
from protocol.rollout.tasks.strings import length_match_score, string_score
from protocol.rollout.tokenizer import CharTokenizer

words = st.text(alphabet="abcdxyz", max_size=12)


@settings(max_examples=200, deadline=None)
@given(r=words, t=words)
def test_char_match_score_formula(r, t):
    expected = 1.0 if not r and not t else sum(a == b for a, b in zip(r, t)) / max(len(r), len(t))
    s = char_match_score(r, t)
    assert s == pytest.approx(expected)
    assert 0.0 <= s <= 1.0
    assert (s == 1.0) == (r == t)


@settings(max_examples=200, deadline=None)
@given(r=words, t=words, w=st.floats(0.0, 0.99))
def test_string_score_formula(r, t, w):
    longest = max(len(r), len(t))
    length = 1.0 if longest == 0 else min(len(r), len(t)) / longest
    assert length_match_score(r, t) == pytest.approx(length)
    s = string_score(r, t, w)
    assert s == pytest.approx((1 - w) * char_match_score(r, t) + w * length)
    assert 0.0 <= s <= 1.0 and (s == pytest.approx(1.0)) == (r == t)
    assert get_task("copy", length_weight=w).score(r, t) == pytest.approx(s)
    assert get_task("copy").score(r, t, {"length_weight": w}) == pytest.approx(s)  # the row's weight wins


@settings(max_examples=100, deadline=None)
@given(t=st.text(alphabet="abcd", min_size=1, max_size=8), extra=st.text(alphabet="abcd", min_size=1, max_size=4))
def test_extra_or_missing_characters_lower_the_score(t, extra):
    for fn in (char_match_score, string_score):
        assert fn(t + extra, t) < 1.0
        assert fn(t[:-1], t) < 1.0
        assert fn(t, t) == 1.0
    assert string_score(t + extra, t) > string_score(t + extra + extra, t)  # stopping earlier is better


def test_known_tasks_and_transforms():
    assert {"copy", "reverse", "repeat"} <= set(known_tasks())
    rng = random.Random(0)
    for name, check in (("copy", lambda w, g: g == w), ("reverse", lambda w, g: g == w[::-1])):
        for _ in range(20):
            ex = get_task(name).sample(rng)
            word = ex.params["word"]
            assert ex.prompt == f"{name}: {word}"
            assert check(word, ex.ground_truth)
            assert 3 <= len(word) <= 6 and set(word) <= set("abcd")
    ex = get_task("repeat").sample(rng)
    assert ex.ground_truth == ex.params["word"] * ex.params["count"]
    assert isinstance(get_task("copy"), CopyTask) and isinstance(get_task("reverse"), ReverseTask)
    assert isinstance(get_task("repeat"), RepeatTask)


def test_score_dispatches_by_data_source_and_counts_every_character():
    assert score("copy", "abc", "abc") == 1.0
    assert score("copy", "abc ", "abc") == 0.75  # filler whitespace is not free
    assert score("reverse", "abd", "abc") == pytest.approx(0.5 * 2 / 3 + 0.5)
    assert normalize_response("\tab ") == "\tab "


def test_special_tokens_cannot_hide_filler():
    tok = CharTokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    exact = tok.decode(tok.encode("ccc") + [eos], skip_special=False)
    assert score("repeat", exact, "ccc") == 1.0
    assert score("repeat", tok.decode(tok.encode("ccc"), skip_special=False), "ccc") == 1.0  # cut at max_tokens
    hidden = tok.decode([tok.encode("c")[0], pad, tok.encode("c")[0], 120, tok.encode("c")[0]], skip_special=False)
    assert normalize_response(hidden) == "c\ufffdc\ufffdc"
    assert score("repeat", hidden, "ccc") == pytest.approx(0.5 * 2 / 5 + 0.5 * 3 / 5)
    assert score("repeat", "ccc<|eos|><|eos|>", "ccc") == 0.75
    with pytest.raises(TaskError, match="response_text must be a str"):
        normalize_response(None)
    with pytest.raises(TaskError, match="ground_truth must be a str"):
        get_task("copy").score("a", 3)


def test_scorer_on_decoded_tokens_ignores_the_final_eos():
    tok = CharTokenizer()
    ids = tok.encode("abca") + [tok.eos_token_id]
    assert score("copy", tok.decode(ids), "abca") == 1.0
    assert score("copy", tok.decode(ids, skip_special=False), "abca") == 1.0


def test_bad_task_names_and_parameters():
    with pytest.raises(TaskError, match="unknown task 'nope'.*copy"):
        get_task("nope")
    with pytest.raises(TaskError, match="min_len <= max_len"):
        get_task("copy", min_len=5, max_len=2)
    with pytest.raises(TaskError, match="alphabet"):
        get_task("copy", alphabet="aa")
    with pytest.raises(TaskError, match="alphabet may hold only"):
        get_task("copy", alphabet="a_")
    with pytest.raises(TaskError, match="bad parameters"):
        get_task("copy", colour="red")
    with pytest.raises(TaskError, match="already registered"):
        register_task("copy")(ReverseTask)
    with pytest.raises(TaskError, match="length_weight must be in"):
        get_task("copy", length_weight=1.0)
    with pytest.raises(TaskError, match="length_weight must be in"):
        string_score("a", "b", -0.1)
    with pytest.raises(TaskError, match="n must be >= 0"):
        get_task("copy").warmup_pairs(-1, 0)


def test_rows_are_seeded_and_splits_independent():
    a = make_rows("copy", 30, seed=3)
    assert a == make_rows("copy", 30, seed=3)
    assert a != make_rows("copy", 30, seed=4)
    assert make_rows("copy", 10, 3, "val") == make_rows("copy", 20, 3, "val")[:10]
    row = a[0]
    assert set(row) == {"prompt", "data_source", "extra_info", "reward_model"}
    assert row["data_source"] == "copy"
    assert row["prompt"] == [{"role": "user", "content": f"copy: {row['extra_info']['word']}"}]
    assert row["extra_info"]["index"] == 0 and row["extra_info"]["split"] == "train"
    assert row["extra_info"]["length_weight"] == 0.5
    assert row["extra_info"]["ground_truth"] == row["reward_model"]["ground_truth"]
    assert [r["extra_info"]["index"] for r in a] == list(range(30))
    with pytest.raises(TaskError, match="integer >= 0"):
        make_rows("copy", -1, 0)


def test_every_answer_scores_one_and_fits_the_tokenizer():
    tok = CharTokenizer()
    for name in ("copy", "reverse", "repeat"):
        for row in make_rows(name, 50, seed=1):
            gt = row["reward_model"]["ground_truth"]
            assert score(name, gt, gt, row["extra_info"]) == 1.0
            ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True)
            assert tok.unk_token_id not in ids
            assert tok.decode(tok.encode(gt)) == gt


def test_warmup_pairs_come_from_the_generator():
    pairs = get_task("reverse").warmup_pairs(5, seed=2)
    assert len(pairs) == 5 and pairs == get_task("reverse").warmup_pairs(5, seed=2)
    for messages, target in pairs:
        word = messages[0]["content"].split(": ", 1)[1]
        assert target == word[::-1]


def test_warmup_token_pairs_score_one_when_decoded():
    tok = CharTokenizer()
    pairs = warmup_token_pairs("copy", 6, seed=0, tokenizer=tok, max_len=4)
    assert len(pairs) == 6
    for (messages, target), (prompt_ids, response_ids) in zip(get_task("copy", max_len=4).warmup_pairs(6, 0), pairs):
        assert prompt_ids == tok.apply_chat_template(messages, add_generation_prompt=True)
        assert response_ids[-1] == tok.eos_token_id and tok.decode(response_ids) == target
        assert score("copy", tok.decode(response_ids, skip_special=False), target) == 1.0


def test_write_task_data_parquet(tmp_path):
    paths = write_task_data(tmp_path / "copy", "copy", train=12, val=4, seed=0, max_len=4)
    train = pq.read_table(paths["train"]).to_pylist()
    val = pq.read_table(paths["val"]).to_pylist()
    assert len(train) == 12 and len(val) == 4
    assert train == make_rows("copy", 12, 0, "train", max_len=4)
    assert all(len(r["reward_model"]["ground_truth"]) <= 4 for r in train)
    assert all(r["extra_info"]["split"] == "val" for r in val)
    with pytest.raises(TaskError, match="--val must be >= 1"):
        write_task_data(tmp_path / "x", "copy", train=2, val=0)


# ------------------------------------------------------------------------------------------------ arithmetic

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
FIRST_THREE_ANSWERS = ["11", "6", "9"]  # make_rows("arithmetic", 3, seed=0) before the steps option existed


@pytest.mark.parametrize("steps", [1, 2])
def test_arithmetic_rows_are_the_reference_gsm8k_format(steps):
    rows = make_rows("arithmetic", 200, seed=0, steps=steps)
    assert rows == make_rows("arithmetic", 200, seed=0, steps=steps)
    assert rows != make_rows("arithmetic", 200, seed=1, steps=steps)
    tok = CharTokenizer()
    for i, row in enumerate(rows):
        assert list(row) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        extra = row["extra_info"]
        assert set(extra) == {"split", "index", "answer", "question"} and extra["index"] == i
        assert row["prompt"] == [{"role": "user", "content": f"{extra['question']} {INSTRUCTION}"}]
        truth = row["reward_model"]["ground_truth"]
        assert row["reward_model"]["style"] == "rule" and truth.isdigit()
        # the worked solution ends in "#### <answer>" and its steps compute the answer
        *lines, last = extra["answer"].split("\n")
        assert last == f"#### {truth}" and len(lines) == steps
        for line in lines:
            lhs, rhs = line.split(" = ")
            assert eval(lhs.replace("/", "//")) == int(rhs)  # noqa: S307 (generated integer arithmetic)
            assert int(rhs) >= 0
        assert lines[-1].endswith(f"= {truth}")
        # the strict GSM8K scorer marks the solution right and near misses wrong
        assert default_compute_score("openai/gsm8k", extra["answer"], truth, extra) == 1.0
        assert default_compute_score("openai/gsm8k", f"#### {int(truth) + 1}", truth) == 0.0
        assert default_compute_score("openai/gsm8k", f"####{truth}", truth) == 0.0
        assert tok.unk_token_id not in tok.apply_chat_template(row["prompt"])
    assert len({r["extra_info"]["question"] for r in rows}) > 190  # varied problems
    assert {line.split(" ")[1] for r in rows for line in r["extra_info"]["answer"].split("\n")[:-1]} == set("+-*/")


def test_arithmetic_parquet_loads_and_checks(tmp_path):
    paths = write_task_data(tmp_path, "arithmetic", train=20, val=5, seed=0)
    table = pq.read_table(paths["train"])
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    from protocol.algos.reward import needs_ground_truth

    ds = RLHFDataset(str(paths["train"]), CharTokenizer(), 256, needs_ground_truth=needs_ground_truth)
    assert len(ds) == 20 and ds[0]["raw_prompt"] == table.to_pylist()[0]["prompt"]
    task = get_task("arithmetic")
    assert isinstance(task, ArithmeticTask)
    ex = task.sample(random.Random(4))
    assert task.score(ex.params["solution"], ex.ground_truth) == 1.0
    # a warm-up trains on the worked solution, not on the bare number
    assert task.warmup_pairs(1, 7) == [(task.messages(task.sample(random.Random(7))),
                                        task.sample(random.Random(7)).params["solution"])]
    with pytest.raises(TaskError, match="max_operand"):
        get_task("arithmetic", max_operand=1)
    with pytest.raises(TaskError, match="steps must be 1 or 2"):
        get_task("arithmetic", steps=3)


def test_arithmetic_two_step_rows_are_unchanged_by_the_steps_option():
    """The shipped two-step files (and every run's val set) stay what they were before one-step problems existed."""
    rows = make_rows("arithmetic", 3, seed=0)
    assert rows == make_rows("arithmetic", 3, seed=0, steps=2)
    assert [r["reward_model"]["ground_truth"] for r in rows] == FIRST_THREE_ANSWERS


def test_a_task_registers_its_scorer_and_a_scorer_name_is_refused():
    import protocol.algos.scorers.registry as scorer_registry

    assert {"repeat", "copy", "reverse", "arithmetic"} <= set(scorer_registry.known_scorers())
    assert default_compute_score("reverse", "cba", "cba") == 1.0
    with pytest.raises(TaskError, match="task 'math_dapo' cannot be registered.*already registered"):
        register_task("math_dapo")(ReverseTask)
    assert "math_dapo" not in known_tasks()  # refused whole: no task without its scorer
    assert ReverseTask.name == "reverse"  # and the class keeps its own data_source


def test_data_command_writes_one_step_arithmetic_and_refuses_other_step_counts(tmp_path, capsys):
    import pyarrow.parquet as pq

    from rldispatch.commands.data import main

    assert main(["--task", "arithmetic", "--steps", "1", "--out-dir", str(tmp_path), "--train", "8", "--val", "2"]) == 0
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert rows == make_rows("arithmetic", 8, seed=0, steps=1)
    assert all(len(r["extra_info"]["answer"].split("\n")) == 2 for r in rows)  # one step, then "#### <n>"
    assert main(["--task", "arithmetic", "--steps", "3", "--out-dir", str(tmp_path / "x")]) == 2
    assert "steps must be 1 or 2, got 3" in capsys.readouterr().err
