"""Reward: managers (naive, dapo, batch), custom reward functions, finite scores, config, rm_scores placement."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import protocol.algos.reward as reward_module
import protocol.algos.scorers.registry as scorer_registry
from protocol.algos.reward import (BatchRewardManager, CustomRewardFunctionConfig, DAPORewardManager,
                                   NaiveRewardManager, OverlongBufferConfig, RewardConfig, RewardError, RewardInput,
                                   RewardResult, build_reward_manager, compute_rm_scores, exact_match_score,
                                   get_scorer, known_reward_managers, known_scorers, last_policy_index,
                                   load_reward_function, make_reward_manager, numeric_extras,
                                   register_reward_manager, register_scorer)
from protocol.rollout.tokenizer import CharTokenizer

TOK = CharTokenizer()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(0, 8), L=st.integers(0, 6), jagged=st.booleans())
def test_rm_scores_only_at_last_policy_token(seed, n, L, jagged):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, L + 1, (n,), generator=g)
    mask = (torch.rand(n, L, generator=g) < 0.5) & (torch.arange(L)[None, :] < lengths[:, None])
    is_padding = torch.rand(n, generator=g) < 0.2
    mask &= ~is_padding[:, None]
    scores = torch.where(is_padding, torch.zeros(n), torch.randn(n, generator=g) + 3.0)  # never 0 on real rows
    if jagged and n > 0:
        m_in = torch.nested.as_nested_tensor([mask[i, :int(lengths[i])].long() for i in range(n)],
                                             layout=torch.jagged)
        out, dropped = compute_rm_scores(scores, m_in, is_padding=is_padding, with_dropped=True)
        assert [t.shape[0] for t in out.unbind()] == lengths.tolist()
        out = torch.stack([torch.nn.functional.pad(t, (0, L - t.shape[0])) for t in out.unbind()]) \
            if L else torch.zeros(n, 0)
    else:
        out, dropped = compute_rm_scores(scores, mask.long(), is_padding=is_padding, with_dropped=True)
    assert out.shape == (n, L) and out.dtype == torch.float32
    n_dropped = 0
    for i in range(n):
        pos = [t for t in range(L) if mask[i, t]]
        if is_padding[i]:
            assert (out[i] == 0).all()
        elif pos:
            expect = torch.zeros(L)
            expect[pos[-1]] = scores[i]
            assert torch.equal(out[i], expect)
        else:
            n_dropped += 1
            assert (out[i] == 0).all()
    assert dropped == n_dropped
    # no reward sits where the mask is 0
    assert (out[~mask] == 0).all()


def test_rm_scores_examples_and_errors():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
    out = compute_rm_scores(torch.tensor([1.0, 2.0, 3.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0, 1.0, 0, 0], [0, 0, 0, 0], [0, 0, 3.0, 0]]))
    assert last_policy_index(mask).tolist() == [1, -1, 2]
    assert last_policy_index(torch.zeros(2, 0)).tolist() == [-1, -1]
    # integer scores become float32
    assert compute_rm_scores(torch.tensor([1, 2, 3]), mask).dtype == torch.float32
    with pytest.raises(RewardError, match="padding samples must score 0"):
        compute_rm_scores(torch.tensor([1.0, 2.0, 3.0]), mask, is_padding=torch.tensor([False, True, False]))
    with pytest.raises(RewardError, match="scores"):
        compute_rm_scores(torch.tensor([1.0, 2.0]), mask)
    with pytest.raises(RewardError, match="is_padding"):
        compute_rm_scores(torch.tensor([1.0, 2.0, 3.0]), mask, is_padding=torch.tensor([False]))
    with pytest.raises(RewardError, match="response_mask"):
        last_policy_index(torch.ones(3))


def test_builtin_scorer_registry():
    assert exact_match_score(" abc\n", "abc") == 1.0
    assert exact_match_score("abd", "abc") == 0.0
    # tasks registered in protocol.rollout.tasks are scorers too
    assert {"openai/gsm8k", "exact_match", "copy", "reverse"} <= set(known_scorers())
    assert get_scorer("exact_match") is exact_match_score
    with pytest.raises(RewardError, match="known data sources"):
        get_scorer("no_such_source")


def test_naive_manager_scores_by_data_source_and_keeps_order():
    @register_scorer("test_len")
    def by_len(text, ground_truth, extra_info=None):
        return {"score": float(len(text)), "acc": len(text) == int(ground_truth)}

    try:
        mgr = make_reward_manager("naive", decode=TOK.decode)
        ids = TOK.encode("ab") + TOK.encode("cde")
        items = [
            RewardInput(TOK.encode("hello"), "exact_match", "hello"),
            RewardInput(torch.tensor(ids), "test_len", "5"),
            RewardInput(ids, "test_len", "3", response_mask=[1, 1, 0, 0, 0]),
            RewardInput([], "no_such_source", is_padding=True),
            RewardInput(TOK.encode("x"), "exact_match", "y", reward_score=0.25),
        ]
        res = mgr(items)
        assert res.scores.dtype == torch.float32
        assert res.scores.tolist() == [1.0, 5.0, 5.0, 0.0, 0.25]
        assert res.extras == {"acc": [None, True, False, None, None]}
        # decoding only the policy tokens drops the observation "cde"
        strict = NaiveRewardManager(TOK.decode, policy_tokens_only=True, use_rollout_score=False)
        assert strict(items[2:3]).scores.tolist() == [2.0]
        assert NaiveRewardManager(TOK.decode, use_rollout_score=False)(items[4:5]).scores.tolist() == [0.0]
        with pytest.raises(RewardError, match="response_mask"):
            strict(items[1:2])
        with pytest.raises(RewardError, match="no_such_source"):
            mgr([RewardInput([8], "no_such_source")])
    finally:
        scorer_registry._SCORERS.unregister("test_len")


def test_scorer_result_errors():
    @register_scorer("test_bad")
    def bad(text, ground_truth, extra_info=None):
        return ground_truth

    try:
        mgr = NaiveRewardManager(TOK.decode)
        with pytest.raises(RewardError, match="without 'score'"):
            mgr([RewardInput([8], "test_bad", {"acc": 1})])
        with pytest.raises(RewardError, match="expected a number"):
            mgr([RewardInput([8], "test_bad", "1.0")])
        with pytest.raises(RewardError, match="finite"):
            mgr([RewardInput([8], "test_bad", math.nan)])
        with pytest.raises(RewardError, match="already registered"):
            register_scorer("test_bad")(exact_match_score)
        with pytest.raises(RewardError, match="RewardInput"):
            mgr([("not", "an input")])
    finally:
        scorer_registry._SCORERS.unregister("test_bad")


def test_dapo_manager_overlong_penalty():
    mgr = make_reward_manager("dapo", decode=TOK.decode, max_response_len=10, buffer_len=4, penalty_factor=1.0)
    items = [RewardInput(TOK.encode("a" * k), "exact_match", "a" * k) for k in (6, 8, 10, 12)]
    res = mgr(items)
    # -min(1, (len - (L - B)) / B) for len > L - B = 6
    assert res.scores.tolist() == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert res.extras["overlong_reward"] == pytest.approx([0.0, -0.5, -1.0, -1.0])
    assert res.extras["overlong"] == [False, True, True, True]
    # the policy length (mask sum) is what counts
    masked = RewardInput(TOK.encode("a" * 10), "exact_match", "a" * 10, response_mask=[1] * 6 + [0] * 4)
    assert mgr([masked]).scores.tolist() == [1.0]
    # no buffer: the naive scores, no extra values
    plain = DAPORewardManager(TOK.decode, max_response_len=10)
    assert plain(items).scores.tolist() == [1.0] * 4 and plain(items).extras == {}
    with pytest.raises(RewardError, match="overlong_buffer.len"):
        DAPORewardManager(TOK.decode, max_response_len=4, buffer_len=8)
    with pytest.raises(RewardError, match="penalty_factor"):
        DAPORewardManager(TOK.decode, max_response_len=4, buffer_len=2, penalty_factor=-1)


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 40), data=st.data())
def test_dapo_penalty_formula(L, data):
    B = data.draw(st.integers(1, L))
    factor = data.draw(st.floats(0, 4))
    n = data.draw(st.integers(0, L))
    mgr = DAPORewardManager(TOK.decode, max_response_len=L, buffer_len=B, penalty_factor=factor)
    expected = min(-(n - (L - B)) / B * factor, 0.0)  # the reference system's form, for len <= L
    assert mgr.overlong_reward(n) == pytest.approx(expected, abs=1e-12)
    assert -factor - 1e-12 <= mgr.overlong_reward(n) <= 0.0


def test_manager_registry():
    assert known_reward_managers() == ["batch", "dapo", "naive"]
    with pytest.raises(RewardError, match="known"):
        make_reward_manager("prm", decode=TOK.decode)
    with pytest.raises(RewardError, match="decode"):
        NaiveRewardManager(decode=None)

    @register_reward_manager("test_const")
    class Const(reward_module.RewardManager):
        def score_one(self, item):
            return 7.0, {}

    try:
        assert make_reward_manager("test_const")([RewardInput([], "x")]).scores.tolist() == [7.0]
    finally:
        reward_module._MANAGERS.unregister("test_const")


def test_non_finite_scores_are_refused_after_the_float32_cast():
    @register_scorer("test_value")
    def value(text, ground_truth, extra_info=None):
        return ground_truth

    try:
        mgr = NaiveRewardManager(TOK.decode)
        assert mgr([RewardInput([8], "test_value", 3e38)]).scores.tolist() == [pytest.approx(3e38, rel=1e-6)]
        for bad in (1e39, -1e39, math.inf, math.nan, 10 ** 400):
            with pytest.raises(RewardError, match=r"trajectory uid7_0_0 \(data_source 'test_value'\).*finite"):
                mgr([RewardInput([8], "test_value", 1.0, key="uid7_0_0"), RewardInput([8], "test_value", bad,
                                                                                     key="uid7_0_0")])
        # a score the rollout produced is held to the same rule
        with pytest.raises(RewardError, match="uid3_1_0.*finite"):
            mgr([RewardInput([8], "exact_match", "x", reward_score=1e39, key="uid3_1_0")])
    finally:
        scorer_registry._SCORERS.unregister("test_value")


def _write(tmp_path, text, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CUSTOM = """
def float_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth) + extra_info.get("bonus", 0.0)

def dict_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    right = solution_str == ground_truth
    return {"score": scale * right, "acc": right, "length": len(solution_str), "pred": solution_str}

def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
    return [{"score": float(s == g), "n": len(solution_strs)} for s, g in zip(solution_strs, ground_truths)]

def wrong_signature(text, truth):
    return 1.0

NOT_A_FUNCTION = 3
"""


def test_custom_reward_function_float_and_dict(tmp_path):
    path = _write(tmp_path, CUSTOM)
    items = [RewardInput(TOK.encode("ab"), "anything/at_all", "ab", extra_info={"bonus": 0.5}),
             RewardInput(TOK.encode("ax"), "anything/at_all", "ab", extra_info={"bonus": 0.0}),
             RewardInput([], "pad", is_padding=True)]
    fn = CustomRewardFunctionConfig(path=path, name="float_score").load()
    res = NaiveRewardManager(TOK.decode, compute_score=fn)(items)
    assert res.scores.tolist() == [1.5, 0.0, 0.0] and res.extras == {}
    cfg = CustomRewardFunctionConfig(path=path, name="dict_score", reward_kwargs={"scale": 2.0})
    res = build_reward_manager(RewardConfig(), cfg, TOK.decode, max_response_len=8)(items)
    assert res.scores.tolist() == [2.0, 0.0, 0.0]
    assert res.extras == {"acc": [True, False, None], "length": [2, 2, None], "pred": ["ab", "ax", None]}
    nums = numeric_extras(res)
    assert sorted(nums) == ["acc", "length"]  # a prediction string has no mean
    assert nums["acc"][0].tolist() == [1.0, 0.0, 0.0] and nums["acc"][1].tolist() == [False, False, True]


def test_batch_manager(tmp_path):
    path = _write(tmp_path, CUSTOM)
    cfg = CustomRewardFunctionConfig(path=path, name="batch_score")
    mgr = build_reward_manager(RewardConfig(manager="batch"), cfg, TOK.decode, max_response_len=8)
    assert isinstance(mgr, BatchRewardManager)
    items = [RewardInput(TOK.encode("ab"), "s", "ab"), RewardInput([], "s", is_padding=True),
             RewardInput(TOK.encode("b"), "s", "ab"), RewardInput(TOK.encode("q"), "s", "q", reward_score=0.25)]
    res = mgr(items)
    assert res.scores.tolist() == [1.0, 0.0, 0.0, 0.25]
    assert res.extras == {"n": [2, None, 2, None]}  # one call over the two trajectories left to score
    with pytest.raises(RewardError, match="batch scoring function"):
        make_reward_manager("batch", decode=TOK.decode)
    short = BatchRewardManager(TOK.decode, compute_score=lambda **kw: [1.0])
    with pytest.raises(RewardError, match="returned 1 results for 2"):
        short(items[:3])


def test_custom_reward_function_errors(tmp_path):
    path = _write(tmp_path, CUSTOM)
    with pytest.raises(RewardError, match="custom_reward_function.path='/no/such.py': no such file"):
        load_reward_function("/no/such.py", "f")
    with pytest.raises(RewardError, match=r"custom_reward_function.name='missing'.*batch_score"):
        load_reward_function(path, "missing")
    with pytest.raises(RewardError, match="not a function"):
        load_reward_function(path, "NOT_A_FUNCTION")
    with pytest.raises(RewardError, match=r"does not take \['data_source', 'solution_str'"):
        load_reward_function(path, "wrong_signature")
    with pytest.raises(RewardError, match="plural names"):
        load_reward_function(path, "float_score", batch=True)
    broken = _write(tmp_path, "raise RuntimeError('boom')\n", "broken.py")
    with pytest.raises(RewardError, match="importing it failed: RuntimeError: boom"):
        load_reward_function(broken, "f")
    assert CustomRewardFunctionConfig().load() is None


def test_reward_config_errors():
    with pytest.raises(RewardError, match=r"reward.manager='prime' is not a known reward manager; known: "
                                          r"\['batch', 'dapo', 'naive'\]"):
        RewardConfig(manager="prime")
    with pytest.raises(RewardError, match="overlong_buffer.len > 0"):
        OverlongBufferConfig(enable=True)
    with pytest.raises(RewardError, match="needs reward.manager=dapo"):
        RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=4))
    with pytest.raises(RewardError, match="custom_reward_function.name"):
        CustomRewardFunctionConfig(path="x.py", name="")
    mgr = build_reward_manager(RewardConfig(manager="dapo", overlong_buffer=OverlongBufferConfig(True, 2, 0.5)),
                               CustomRewardFunctionConfig(), TOK.decode, max_response_len=4)
    assert (mgr.max_response_len, mgr.buffer_len, mgr.penalty_factor) == (4, 2, 0.5)
    assert isinstance(RewardResult(torch.zeros(0)).extras, dict)


def test_gsm8k_training_reward_is_shaped_and_validation_stays_strict():
    """reward.gsm8k_train applies the reference system's gsm8k scorer parameters to training only."""
    from protocol.algos.reward import GSM8KTrainConfig
    from protocol.algos.scorers.gsm8k import compute_score

    texts = ["so 3 + 4 = 7 #### 7", "so 3 + 4 = 8 #### 8", "so 3 + 4 = 7", "no number"]
    items = [RewardInput(TOK.encode(t), "openai/gsm8k", "7") for t in texts] + \
        [RewardInput(TOK.encode("ab"), "exact_match", "ab")]
    custom = CustomRewardFunctionConfig()
    for method, fmt in (("strict", 0.1), ("flexible", 0.0), ("flexible", 0.2)):
        reward = RewardConfig(gsm8k_train=GSM8KTrainConfig(method=method, format_score=fmt))
        train = build_reward_manager(reward, custom, TOK.decode, max_response_len=32)(items).scores.tolist()
        val = build_reward_manager(reward, custom, TOK.decode, max_response_len=32, train=False)(items).scores
        # scores are float32 tensors: the formula's values rounded once to float32
        assert train[:4] == torch.tensor([compute_score(t, "7", method=method, format_score=fmt)
                                          for t in texts]).tolist()
        assert val.tolist()[:4] == [compute_score(t, "7") for t in texts] == [1.0, 0.0, 0.0, 0.0]
        assert train[4] == val.tolist()[4] == 1.0  # other data sources: their own scorer
    assert build_reward_manager(RewardConfig(gsm8k_train=GSM8KTrainConfig("strict", 0.1)), custom, TOK.decode,
                                max_response_len=32)(items[1:2]).scores.tolist() == torch.tensor([0.1]).tolist()
    with pytest.raises(RewardError, match="reward.gsm8k_train.method must be"):
        GSM8KTrainConfig(method="loose")
    with pytest.raises(RewardError, match=r"reward.gsm8k_train.format_score must be in \[0, 1\)"):
        GSM8KTrainConfig(format_score=1.0)
