"""Rollout correction against float64 formulas of the reference system's semantics (truncated IS, rejection)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.algos.losses import policy_loss
from protocol.algos.rollout_correction import (
    RolloutCorrectionConfig, RolloutCorrectionError, correction_metrics, correction_sums, is_weights, rejection_mask,
    rollout_correction,
)


@st.composite
def batches(draw, max_n=5, max_len=7, scale=3.0):
    n = draw(st.integers(1, max_n))
    length = draw(st.integers(1, max_len))
    lens = [draw(st.integers(0, length)) for _ in range(n)]
    vals = draw(st.lists(st.floats(-scale, scale, allow_nan=False, width=32), min_size=2 * n * length,
                         max_size=2 * n * length))
    old = torch.tensor(vals[:n * length], dtype=torch.float32).reshape(n, length) - 1.0
    rollout = torch.tensor(vals[n * length:], dtype=torch.float32).reshape(n, length) - 1.0
    mask = torch.zeros(n, length, dtype=torch.bool)
    for i, k in enumerate(lens):
        mask[i, :k] = True
    return old, rollout, mask


@settings(max_examples=150, deadline=None)
@given(b=batches(scale=15.0), level=st.sampled_from(["token", "sequence"]), cap=st.floats(0.5, 10.0))
def test_is_weights_formula_cap_and_shape(b, level, cap):
    old, rollout, mask = b
    lr = old - rollout
    w, raw = is_weights(lr, mask, level, cap)
    assert (w <= cap).all() and (w >= 0).all() and (w[~mask] == 0).all() and (raw[~mask] == 0).all()
    lr64 = lr.double()
    for i in range(lr.shape[0]):
        m = mask[i]
        if level == "token":
            want = torch.exp(lr64[i].clamp(-20, 20))
        else:
            want = torch.exp(lr64[i][m].sum().clamp(-20, 20)).expand_as(lr64[i])
            if m.any():  # constant along the sequence
                assert torch.unique(w[i][m]).numel() == 1
        # float32 exp of a value clamped to |x| <= 20 (the sum in float32 adds n ulps of the summands)
        tol = 1e-5 * want.abs() + (1e-5 * float(lr64[i].abs().sum()) * want.abs() if level == "sequence" else 0)
        assert torch.all((raw[i][m].double() - want[m]).abs() <= tol[m] + 1e-30)
        assert torch.allclose(w[i][m].double(), want[m].clamp(max=cap), rtol=1e-4, atol=1e-30)


def test_log_ratio_clamped_at_20():
    lr = torch.tensor([[100.0, -100.0]])
    _, raw = is_weights(lr, torch.ones(1, 2, dtype=torch.bool), "token", 1e12)
    assert raw[0, 0] == pytest.approx(math.exp(20), rel=1e-6) and raw[0, 1] == pytest.approx(math.exp(-20), rel=1e-6)
    _, raw = is_weights(torch.tensor([[15.0, 15.0]]), torch.ones(1, 2, dtype=torch.bool), "sequence", 1e12)
    assert torch.allclose(raw, torch.full((1, 2), math.exp(20)), rtol=1e-6)


@settings(max_examples=100, deadline=None)
@given(b=batches(), option=st.sampled_from(["token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2",
                                            "seq_mean_k3", "seq_max_k2", "seq_max_k3"]),
       upper=st.floats(0.01, 5.0))
def test_rejection_mask_against_float64(b, option, upper):
    old, rollout, mask = b
    lr = (old - rollout).double()
    kept = rejection_mask(old - rollout, mask, option, str(upper)).bool()
    assert not (kept & ~mask).any()
    k = 0.5 * lr * lr if option.endswith("k2") else torch.exp(lr) - 1 - lr
    for i in range(lr.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        vals = k[i][m]
        if option.startswith("token"):
            want = vals <= upper
            margin = (vals - upper).abs() > 1e-4 * (1 + upper)
            assert torch.equal(kept[i][m][margin], want[margin])
            continue
        stat = {"seq_sum": vals.sum(), "seq_mean": vals.mean(), "seq_max": vals.max()}[option.rsplit("_", 1)[0]]
        if abs(float(stat) - upper) > 1e-4 * (1 + upper) * m.sum():
            assert bool(kept[i][m].all()) == bool(stat <= upper) and bool(kept[i][m].any()) == bool(stat <= upper)


def test_k1_bounds_are_ratio_bounds_and_options_combine():
    mask = torch.ones(2, 2, dtype=torch.bool)
    lr = torch.tensor([[0.0, 0.0], [math.log(4.0), 0.0]])  # k1 = -lr; ratio bounds [0.5, 2] -> log in [-0.69, 0.69]
    kept = rejection_mask(lr, mask, "token_k1", "0.5_2.0").bool()
    assert kept.tolist() == [[True, True], [False, True]]
    kept = rejection_mask(lr, mask, "token_k1,seq_sum_k1", "0.5_2.0,0.5_2.0").bool()
    assert kept.tolist() == [[True, True], [False, False]]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(rollout_rs="token_k9", rollout_rs_threshold="1"), "unknown option"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2.0"), "lower_upper"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=None), "threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_2"), "one upper bound"),
    (dict(rollout_rs_threshold="1.0"), "rollout_rs is null"),
    (dict(rollout_is_threshold=0.0), "rollout_is_threshold"),
])
def test_config_errors_name_the_key(kwargs, fragment):
    with pytest.raises(RolloutCorrectionError, match=fragment):
        RolloutCorrectionConfig(**kwargs)


@settings(max_examples=100, deadline=None)
@given(b=batches(), level=st.sampled_from(["token", "sequence"]), cap=st.floats(0.5, 4.0), split=st.integers(0, 5))
def test_metrics_from_summed_shares(b, level, cap, split):
    """Shares summed over any split of the rows give the whole batch's metrics (float64 formulas)."""
    old, rollout, mask = b
    if not mask.any():
        return
    w, raw = is_weights(old - rollout, mask, level, cap)
    parts = [slice(0, split), slice(split, None)]
    total: dict[str, float] = {}
    for p in parts:
        for key, v in correction_sums(old[p], rollout[p], mask[p], w[p], raw[p], level, cap, None).items():
            total[key] = total.get(key, 0.0) + v
    m = correction_metrics(total)
    wm = w.double().clamp(max=cap)[mask]  # the float32 cap rounds; the sums clamp at the float64 one
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(float(wm.mean()), rel=1e-9)
    ess = float(wm.mean() ** 2 / (wm ** 2).mean()) if (wm ** 2).mean() > 0 else 0.0
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-9)
    assert 0.0 <= m["rollout_corr/rollout_is_eff_sample_size"] <= 1.0 + 1e-12
    assert m["rollout_corr/kl"] == pytest.approx(float((rollout - old).double()[mask].mean()), rel=1e-9, abs=1e-12)
    if level == "token":
        want = float((raw[mask] > cap).double().mean())
    else:
        seqs = mask.any(-1)
        sums = torch.where(mask, (old - rollout), torch.zeros(())).double().sum(-1)
        want = float((sums[seqs] > math.log(cap)).double().mean())
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(want, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(b=batches(), cap=st.floats(0.5, 4.0), adv_sign=st.sampled_from([-1.0, 1.0]))
def test_policy_loss_multiplies_each_token_by_its_weight(b, cap, adv_sign):
    old, rollout, mask = b
    if not mask.any():
        return
    logp = (old + 0.1 * rollout).clone().requires_grad_(False)
    adv = torch.full_like(old, adv_sign)
    w, _ = is_weights(old - rollout, mask, "token", cap)
    n = int(mask.sum())
    kw = dict(global_tokens=n, global_seqs=mask.shape[0], loss_agg_mode="token-mean")
    plain, _ = policy_loss(old, logp, adv, mask, **kw)
    ones, _ = policy_loss(old, logp, adv, mask, rollout_is_weights=torch.ones_like(old), **kw)
    weighted, _ = policy_loss(old, logp, adv, mask, rollout_is_weights=w, **kw)
    assert torch.equal(plain, ones)
    r = torch.exp((logp - old).double())
    a = adv.double()
    clipped = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    per = torch.where(a < 0, torch.minimum(clipped, -a * 3.0), clipped)
    want = float((per * w.double())[mask].sum() / n)
    assert float(weighted) == pytest.approx(want, rel=1e-5, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(b=batches(), level=st.sampled_from([None, "token", "sequence"]), rs=st.sampled_from([None, "seq_mean_k3"]))
def test_rollout_correction_composes_the_parts(b, level, rs):
    old, rollout, mask = b
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_rs=rs, rollout_rs_threshold=0.5 if rs else None)
    weights, kept, sums = rollout_correction(cfg, old, rollout, mask)
    assert (weights is None) == (level is None) and (kept is None) == (rs is None)
    if weights is not None:
        assert torch.equal(weights, is_weights(old - rollout, mask, level, 2.0)[0])
    if kept is not None:
        assert torch.equal(kept, rejection_mask(old - rollout, mask, rs, 0.5).bool())
    assert sums["tokens"] == float(mask.sum()) and ("w" in sums) == (level is not None)
