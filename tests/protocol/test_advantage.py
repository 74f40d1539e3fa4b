"""Advantage estimators: differential tests against direct float64 formulas, padding, sessions, registry errors."""
from __future__ import annotations

import inspect
import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import protocol.algos.advantage as advantage_module
from protocol.algos.advantage import (compute_advantage, gae_advantage, get_advantage_fn, grpo_advantage, known_advantages,
                                masked_whiten, register_advantage, session_inputs_from_keys, reinforce_pp_advantage,
                                reinforce_pp_baseline_advantage, rloo_advantage, trajectory_scores)


def _random_batch(seed: int, n: int, L: int, n_groups: int, p_pad: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None, :] < lens[:, None]) & (torch.rand(n, L, generator=g) > 0.25)
    is_padding = torch.rand(n, generator=g) < p_pad
    mask &= ~is_padding[:, None]
    rewards = torch.randn(n, L, generator=g, dtype=torch.float64)
    rewards = torch.where(torch.rand(n, L, generator=g) < 0.5, rewards, torch.zeros_like(rewards))
    groups = torch.randint(0, n_groups, (n,), generator=g).tolist()
    index = np.array([f"u{k}" if not is_padding[i] else f"pad{i}" for i, k in enumerate(groups)], dtype=object)
    return rewards, mask.long(), index, is_padding


def _direct_scores(rewards, mask, is_padding):
    return {i: sum(float(rewards[i, t]) for t in range(rewards.shape[1]) if mask[i, t]) for i in range(len(mask))
            if not is_padding[i]}


def _groups(index, scores):
    out = {}
    for i in scores:
        out.setdefault(index[i], []).append(i)
    return out


def _expect_rowwise(adv, mask, per_row, row_tol=None):
    """``adv`` equals ``per_row[i]`` on row i's mask; row i may carry its own absolute rounding bound."""
    expect = torch.zeros_like(adv)
    tol = torch.full_like(adv, 1e-9)
    for i, a in per_row.items():
        expect[i] = a * mask[i].double()
        if row_tol is not None:
            tol[i] = max(1e-9, row_tol[i])
    err = (adv - expect).abs()
    over = (err > tol).any(1).nonzero().flatten().tolist()
    assert not over, f"rows {over} miss their rounding bound; max error {float(err.max())}"


U64 = float(torch.finfo(torch.float64).eps) / 2  # unit roundoff of float64, the estimators' arithmetic
GRPO_EPS = inspect.signature(grpo_advantage).parameters["epsilon"].default
RPP_EPS = inspect.signature(reinforce_pp_baseline_advantage).parameters["epsilon"].default
WHITEN_EPS = inspect.signature(masked_whiten).parameters["eps"].default
batch_args = dict(seed=st.integers(0, 100_000), n=st.integers(1, 12), L=st.integers(1, 6),
                  n_groups=st.integers(1, 4))


@settings(max_examples=40, deadline=None)
@given(norm=st.booleans(), **batch_args)
def test_grpo_matches_direct_formula(seed, n, L, n_groups, norm):
    rewards, mask, index, is_padding = _random_batch(seed, n, L, n_groups)
    adv, ret = grpo_advantage(rewards, mask, index, norm_adv_by_std=norm, is_padding=is_padding)
    scores = _direct_scores(rewards, mask, is_padding)
    per_row, row_tol = {}, {}
    for rows in _groups(index, scores).values():
        vals = [scores[i] for i in rows]
        # centring errs by ~(len + L) u max|s| (the scores are sums of L terms); dividing by std + eps scales it
        centring = 16 * (len(rows) + L + 2) * U64 * max(abs(v) for v in vals)
        for i in rows:
            if len(rows) == 1:
                per_row[i], row_tol[i] = 0.0, 0.0
            elif norm:
                d, sd = scores[i] - statistics.fmean(vals), statistics.stdev(vals)
                per_row[i] = d / (sd + GRPO_EPS)
                row_tol[i] = centring / (sd + GRPO_EPS) * (1 + abs(d) / (sd + GRPO_EPS))
            else:
                per_row[i], row_tol[i] = scores[i] - statistics.fmean(vals), centring
    _expect_rowwise(adv, mask, per_row, row_tol)
    torch.testing.assert_close(ret, adv)
    assert (adv[is_padding] == 0).all()


@settings(max_examples=40, deadline=None)
@given(**batch_args)
def test_rloo_matches_direct_formula(seed, n, L, n_groups):
    rewards, mask, index, is_padding = _random_batch(seed, n, L, n_groups)
    adv, ret = compute_advantage("rloo", token_level_rewards=rewards, response_mask=mask, index=list(index),
                                 is_padding=is_padding)
    scores = _direct_scores(rewards, mask, is_padding)
    per_row = {}
    for rows in _groups(index, scores).values():
        for i in rows:
            others = [scores[j] for j in rows if j != i]
            per_row[i] = scores[i] - statistics.fmean(others) if others else 0.0
    _expect_rowwise(adv, mask, per_row)
    torch.testing.assert_close(ret, adv)


@settings(max_examples=30, deadline=None)
@given(**batch_args)
def test_reinforce_pp_baseline_matches_direct_formula(seed, n, L, n_groups):
    rewards, mask, index, is_padding = _random_batch(seed, n, L, n_groups)
    adv, _ = reinforce_pp_baseline_advantage(rewards, mask, index, is_padding=is_padding)
    scores = _direct_scores(rewards, mask, is_padding)
    centred = {}
    for rows in _groups(index, scores).values():
        m = statistics.fmean(scores[i] for i in rows)
        for i in rows:
            centred[i] = scores[i] - m if len(rows) > 1 else 0.0
    tokens = [centred[i] for i in centred for t in range(L) if mask[i, t]]
    expect = torch.zeros_like(adv)
    if tokens:
        mu = statistics.fmean(tokens)
        var = statistics.variance(tokens) if len(tokens) > 1 else 0.0
        for i in centred:
            expect[i] = (centred[i] - mu) / math.sqrt(var + RPP_EPS) * mask[i].double()
    torch.testing.assert_close(adv, expect, rtol=1e-7, atol=1e-7)


def _direct_gae(r, v, gamma, lam):
    """GAE on one row's policy positions only (compacted)."""
    T = len(r)
    adv = [0.0] * T
    nxt_a, nxt_v = 0.0, 0.0
    for t in reversed(range(T)):
        delta = r[t] + gamma * nxt_v - v[t]
        nxt_a = delta + gamma * lam * nxt_a
        nxt_v = v[t]
        adv[t] = nxt_a
    return adv


@settings(max_examples=30, deadline=None)
@given(gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0), **batch_args)
def test_gae_matches_direct_recursion_over_policy_positions(seed, n, L, n_groups, gamma, lam):
    rewards, mask, index, is_padding = _random_batch(seed, n, L, n_groups)
    values = torch.randn(n, L, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7))
    adv, ret = gae_advantage(rewards, mask, values, gamma=gamma, lam=lam, whiten=False, is_padding=is_padding)
    expect = torch.zeros_like(adv)
    for i in range(n):
        pos = [t for t in range(L) if mask[i, t]]
        a = _direct_gae([float(rewards[i, t]) for t in pos], [float(values[i, t]) for t in pos], gamma, lam)
        for t, x in zip(pos, a):
            expect[i, t] = x
    torch.testing.assert_close(adv, expect, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret, torch.where(mask.bool(), expect + values, torch.zeros_like(values)))
    white, ret2 = gae_advantage(rewards, mask, values, gamma=gamma, lam=lam, is_padding=is_padding)
    torch.testing.assert_close(white, masked_whiten(expect, mask))
    torch.testing.assert_close(ret2, ret)


def test_reinforce_pp_discounted_returns():
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])
    adv, ret = reinforce_pp_advantage(r, m, gamma=0.5)
    # row 0: policy positions 0 and 2 (position 1 is an observation and is skipped): returns 0.5, 1.0
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(adv, masked_whiten(ret, m))
    assert adv[m == 0].abs().sum() == 0
    with pytest.raises(ValueError, match="gamma"):
        reinforce_pp_advantage(r, m, gamma=1.5)


def test_grpo_examples_and_edge_cases():
    r = torch.tensor([[0.0, 1.0, 7.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    # 7.0 at a masked position is not part of the score
    assert trajectory_scores(r, m).tolist() == [1.0, 0.0, 3.0, 5.0]
    adv, _ = grpo_advantage(r, m, ["a", "a", "b", "c"])
    s = 1 / (math.sqrt(0.5) + 1e-6) * 0.5
    torch.testing.assert_close(adv, torch.tensor([[s, s, 0], [-s, -s, -s], [0, 0, 0], [0, 0, 0.0]]))
    # identical scores: std 0 -> advantage 0 (epsilon keeps it finite)
    adv, _ = grpo_advantage(torch.ones(3, 2), torch.ones(3, 2), ["a"] * 3)
    assert (adv == 0).all()
    # Dr.GRPO = unnormalised
    adv, _ = compute_advantage("grpo_no_std", token_level_rewards=r, response_mask=m, index=["a", "a", "b", "c"])
    assert adv[0, 0].item() == pytest.approx(0.5)
    # float32 in, float32 out; empty batch
    assert grpo_advantage(r, m, ["a", "a", "b", "c"])[0].dtype == torch.float32
    e, _ = grpo_advantage(torch.zeros(0, 3), torch.zeros(0, 3), [])
    assert e.shape == (0, 3)


def test_padding_rows_never_enter_group_statistics():
    r = torch.tensor([[1.0], [0.0], [100.0]])
    m = torch.tensor([[1], [1], [0]])
    pad = torch.tensor([False, False, True])
    base, _ = grpo_advantage(r[:2], m[:2], ["a", "a"])
    # the padding row shares the uid on purpose: it must still be ignored
    adv, _ = grpo_advantage(r, m, ["a", "a", "a"], is_padding=pad)
    torch.testing.assert_close(adv[:2], base)
    assert adv[2].item() == 0.0
    # a padding row with a non-zero mask still gets 0 everywhere
    adv, _ = grpo_advantage(r, torch.ones(3, 1), ["a", "a", "a"], is_padding=pad)
    torch.testing.assert_close(adv[:2], base)
    assert adv[2].item() == 0.0


def test_multi_output_sessions_use_final_output_and_broadcast():
    # uid a: session 0 has two outputs (row 1 final, score 1), session 1 one output (score 0); uid b: one session
    r = torch.tensor([[9.0, 0.0], [0.0, 1.0], [0.0, 0.0], [4.0, 0.0]])
    m = torch.tensor([[1, 0], [1, 1], [1, 1], [1, 0]])
    index = ["a", "a", "a", "b"]
    sessions = [("a", 0), ("a", 0), ("a", 1), ("b", 0)]
    final = [False, True, True, True]
    adv, _ = grpo_advantage(r, m, index, session_index=sessions, is_final_output=final)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[s, 0.0], [s, s], [-s, -s], [0.0, 0.0]]))
    adv_r, _ = rloo_advantage(r, m, index, session_index=sessions, is_final_output=final)
    torch.testing.assert_close(adv_r, torch.tensor([[1.0, 0.0], [1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="is_final_output"):
        grpo_advantage(r, m, index, session_index=sessions)
    with pytest.raises(ValueError, match="exactly 1"):
        grpo_advantage(r, m, index, session_index=sessions, is_final_output=[True, True, True, True])
    with pytest.raises(ValueError, match="index uid"):
        grpo_advantage(r, m, index, session_index=[("a", 0), ("a", 0), ("b", 1), ("b", 0)], is_final_output=final)
    with pytest.raises(ValueError, match="session_index"):
        grpo_advantage(r, m, index, is_final_output=final)


def test_registry_and_input_errors():
    assert {"grpo", "grpo_no_std", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
            "gae"} <= set(known_advantages())
    with pytest.raises(ValueError, match="known"):
        get_advantage_fn("ppo2")
    with pytest.raises(TypeError, match="gamma"):
        compute_advantage("grpo", token_level_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1),
                          index=["a"], gamma=0.9)
    with pytest.raises(ValueError, match="index has 1 entries"):
        grpo_advantage(torch.zeros(2, 1), torch.ones(2, 1), ["a"])
    with pytest.raises(ValueError, match="response_mask"):
        grpo_advantage(torch.zeros(2, 1), torch.ones(2, 2), ["a", "b"])
    with pytest.raises(ValueError, match="is_padding"):
        grpo_advantage(torch.zeros(2, 1), torch.ones(2, 1), ["a", "b"], is_padding=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="values"):
        gae_advantage(torch.zeros(2, 1), torch.ones(2, 1), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="lam"):
        gae_advantage(torch.zeros(2, 1), torch.ones(2, 1), torch.zeros(2, 1), lam=2.0)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda **kw: None)

    @register_advantage("test_zero")
    def zero(token_level_rewards, response_mask):
        return torch.zeros_like(token_level_rewards), torch.zeros_like(token_level_rewards)

    try:
        assert "test_zero" in known_advantages()
        assert compute_advantage("test_zero", token_level_rewards=torch.ones(1, 2),
                                 response_mask=torch.ones(1, 2))[0].sum() == 0
    finally:
        advantage_module._REGISTRY.unregister("test_zero")


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 50.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w = masked_whiten(x, m)
    vals = w[m.bool()]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert vals.std().item() == pytest.approx(1.0, rel=1e-6)
    assert w[0, 2] == 0 and w[1, 1] == 0
    assert (masked_whiten(x, torch.zeros_like(m)) == 0).all()
    assert masked_whiten(x, m, shift_mean=False)[m.bool()].mean().item() == pytest.approx(2.0)


def _whiten_tol(x: torch.Tensor, count: int, var: float, eps: float) -> float:
    """Absolute rounding bound for whitened values: centring errs by ~(count + 2) u max|x|, scaled by 1/sqrt(var+eps)."""
    return 16 * (count + 4) * U64 * (float(x.abs().max()) / math.sqrt(var + eps) + 1.0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 6), L=st.integers(1, 6), scale=st.floats(1e-2, 1e3),
       eps=st.sampled_from([WHITEN_EPS, 1e-2]))
def test_masked_whiten_normalises_masked_values_only(seed, n, L, scale, eps):
    """w = (x - mean) / sqrt(var + eps): mean 0 and std sqrt(var / (var + eps)) (below 1 when var is near eps)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, L, generator=g, dtype=torch.float64) * scale
    m = torch.rand(n, L, generator=g) < 0.6
    w = masked_whiten(x, m, eps=eps)
    assert (w[~m] == 0).all()
    vals, raw = w[m], x[m]
    count = raw.numel()
    if count == 0:
        return
    if count == 1:  # var is 0 and the single value is its own mean
        assert vals.item() == 0.0
        return
    var = float(raw.var())  # unbiased, as masked_whiten uses
    tol = _whiten_tol(raw, count, var, eps)
    assert vals.mean().item() == pytest.approx(0.0, abs=tol)
    assert vals.std().item() == pytest.approx(math.sqrt(var / (var + eps)), rel=0, abs=4 * tol)
    # without the shift the mean is added back
    shifted = masked_whiten(x, m, eps=eps, shift_mean=False)[m]
    torch.testing.assert_close(shifted, vals + raw.mean(), rtol=0, atol=tol + 4 * U64 * float(raw.abs().max()))
    # an affine change a x + b scales the whitened values by a sqrt(var + eps) / sqrt(a^2 var + eps)
    a, b = 3.0, 5.0
    factor = a * math.sqrt(var + eps) / math.sqrt(a * a * var + eps)
    tol_ab = _whiten_tol(a * raw + b, count, a * a * var, eps)
    torch.testing.assert_close(masked_whiten(a * x + b, m, eps=eps)[m], vals * factor, rtol=0,
                               atol=tol_ab + factor * tol)


def test_session_inputs_from_keys_drive_multi_output_grpo():
    keys = ["aa_0_0", "aa_0_1", "aa_1_0", "bb_0_0", "bb_1_0"]
    kw = session_inputs_from_keys(keys)
    assert kw["index"] == ["aa", "aa", "aa", "bb", "bb"]
    assert kw["session_index"] == [("aa", 0), ("aa", 0), ("aa", 1), ("bb", 0), ("bb", 1)]
    assert kw["is_final_output"] == [False, True, True, True, True]
    r = torch.tensor([[5.0], [1.0], [0.0], [2.0], [2.0]])
    adv, _ = compute_advantage("grpo", token_level_rewards=r, response_mask=torch.ones(5, 1), **kw)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv.flatten(), torch.tensor([s, s, -s, 0.0, 0.0]))
    with pytest.raises(ValueError, match="trajectory key"):
        session_inputs_from_keys(["not-a-key"])


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), seed=st.integers(0, 10_000),
       finals=st.sampled_from(["none", "all", "one_not"]), estimator=st.sampled_from(["grpo", "rloo"]))
def test_one_row_sessions_score_like_rows(sizes, seed, finals, estimator):
    """When every session is one row (single-turn), the session-level estimate is the row-level one; a session
    whose only row is not marked final is still refused by the general path."""
    g = torch.Generator().manual_seed(seed)
    index = [f"u{j}" for j, k in enumerate(sizes) for _ in range(k)]
    n = len(index)
    rewards, mask = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.ones(n, 5)
    pad = torch.rand(n, generator=g) < 0.2
    sessions = [(uid, i) for i, uid in enumerate(index)]
    flags = None if finals == "none" else [True] * n
    real = [i for i in range(n) if not pad[i]]
    if finals == "one_not" and real:
        flags[real[0]] = False
        with pytest.raises(ValueError, match="expected exactly 1"):
            compute_advantage(estimator, token_level_rewards=rewards, response_mask=mask, index=index,
                              is_padding=pad, session_index=sessions, is_final_output=flags)
        return
    by_row = compute_advantage(estimator, token_level_rewards=rewards, response_mask=mask, index=index,
                               is_padding=pad)
    by_session = compute_advantage(estimator, token_level_rewards=rewards, response_mask=mask, index=index,
                                   is_padding=pad, session_index=sessions, is_final_output=flags)
    assert all(torch.equal(a, b) for a, b in zip(by_row, by_session))


@settings(max_examples=30, deadline=None)
@given(parts=st.integers(1, 4), gamma=st.sampled_from([1.0, 0.99]), lam=st.sampled_from([1.0, 0.95]), **batch_args)
def test_gae_over_parts_with_summed_moments_equals_whole_batch(seed, n, L, n_groups, parts, gamma, lam):
    """Each holder runs GAE on its own rows (values read back from the store's jagged rows, float32), then whitens
    with the batch's summed moments: the whole batch's padded GAE, whitened at once, in float64."""
    from protocol.algos.advantage import whiten_by_moments, whiten_moments
    from protocol.batch.nested import jagged_to_padded, padded_to_jagged_many

    rewards, mask, _, is_padding = _random_batch(seed, n, L, n_groups)
    values = torch.randn(n, L, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 3)).float()
    rewards = rewards.float()
    full_adv, full_ret = gae_advantage(rewards.double(), mask, values.double(), gamma=gamma, lam=lam,
                                       is_padding=is_padding)
    lengths = [L] * n  # every row stored at its full response length
    stored = jagged_to_padded(padded_to_jagged_many((values,), lengths)[0])
    owner = torch.randint(0, parts, (n,), generator=torch.Generator().manual_seed(seed + 5))
    pieces, moments = [], [0.0, 0.0, 0.0]
    for p in range(parts):
        rows = (owner == p).nonzero().flatten()
        adv, ret = gae_advantage(rewards[rows], mask[rows], stored[rows], gamma=gamma, lam=lam, whiten=False,
                                 is_padding=is_padding[rows])
        moments = [a + b for a, b in zip(moments, whiten_moments(adv, mask[rows] & ~is_padding[rows, None]))]
        pieces.append((rows, adv, ret))
    for rows, adv, ret in pieces:
        white = whiten_by_moments(adv, mask[rows] & ~is_padding[rows, None], moments)
        # float32 GAE sums at most L terms of |x| < ~10: a few ulps of float32, amplified by 1 / std of the batch
        torch.testing.assert_close(white.double(), full_adv[rows], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ret.double(), full_ret[rows], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(parts=st.integers(1, 4), **batch_args)
def test_whiten_by_summed_moments_equals_masked_whiten(seed, n, L, n_groups, parts):
    from protocol.algos.advantage import whiten_by_moments, whiten_moments

    x, mask, _, _ = _random_batch(seed, n, L, n_groups)
    owner = torch.randint(0, parts, (n,), generator=torch.Generator().manual_seed(seed))
    sums = [0.0, 0.0, 0.0]
    for p in range(parts):
        sums = [a + b for a, b in zip(sums, whiten_moments(x[owner == p], mask[owner == p]))]
    whole = masked_whiten(x, mask)
    for p in range(parts):
        torch.testing.assert_close(whiten_by_moments(x[owner == p], mask[owner == p], sums), whole[owner == p],
                                   rtol=1e-9, atol=1e-9)
