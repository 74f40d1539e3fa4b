"""Reward: scorer / manager registries, built-in scorers, and rm_scores placement at the last policy token."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import protocol.algos.reward as reward_module
from protocol.algos.reward import (NaiveRewardManager, OverlongRewardManager, RewardError, RewardInput, compute_rm_scores,
                             exact_match_score, get_scorer, gsm8k_score, known_reward_managers, known_scorers,
                             last_policy_index, make_reward_manager, register_reward_manager, register_scorer)
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


def test_builtin_scorers():
    assert gsm8k_score("so the answer is #### 1,234.", "1234") == 1.0
    assert gsm8k_score("#### 5 then #### 6", "6") == 1.0
    assert gsm8k_score("#### 5 then #### 6", "5") == 0.0
    assert gsm8k_score("no answer", "5") == 0.0
    assert exact_match_score(" abc\n", "abc") == 1.0
    assert exact_match_score("abd", "abc") == 0.0
    # tasks registered in protocol.rollout.tasks are scorers too
    assert {"gsm8k", "exact_match", "copy", "reverse"} <= set(known_scorers())
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
        reward_module._SCORERS.unregister("test_len")


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
        reward_module._SCORERS.unregister("test_bad")


def test_overlong_manager_penalty():
    mgr = make_reward_manager("overlong", decode=TOK.decode, max_response_len=10, buffer_len=4, penalty_factor=1.0)
    items = [RewardInput(TOK.encode("a" * k), "exact_match", "a" * k) for k in (6, 8, 10, 12)]
    res = mgr(items)
    assert res.scores.tolist() == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert res.extras["overlong_penalty"] == pytest.approx([0.0, -0.5, -1.0, -1.0])
    # the policy length (mask sum) is what counts
    masked = RewardInput(TOK.encode("a" * 10), "exact_match", "a" * 10, response_mask=[1] * 6 + [0] * 4)
    assert mgr([masked]).scores.tolist() == [1.0]
    with pytest.raises(RewardError, match="buffer_len"):
        OverlongRewardManager(TOK.decode, max_response_len=4, buffer_len=8)


def test_manager_registry():
    assert {"naive", "overlong"} <= set(known_reward_managers())
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
