"""KL estimators (values, clamps, straight-through gradients), controllers and the KL reward penalty."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.algos.kl import (K3_CLAMP, KL_KINDS, LOG_RATIO_CLAMP, AdaptiveKLController, FixedKLController,
                               apply_kl_penalty, kl_penalty, make_kl_controller)

floats = st.floats(-30.0, 30.0, allow_nan=False)
U64 = float(torch.finfo(torch.float64).eps) / 2  # float64 unit roundoff


@settings(max_examples=60, deadline=None)
@given(lp=floats, ref=floats)
def test_estimators_match_formulas(lp, ref):
    a, b = torch.tensor([lp], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64)
    d = lp - ref
    assert kl_penalty(a, b, "kl").item() == pytest.approx(d)
    assert kl_penalty(a, b, "k1").item() == pytest.approx(d)
    assert kl_penalty(a, b, "abs").item() == pytest.approx(abs(d))
    assert kl_penalty(a, b, "mse").item() == pytest.approx(0.5 * d * d)
    nd = min(max(-d, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    # exp(x) - x - 1 written as expm1(x) - x: the direct form cancels to ~1e-16 noise when x is near 0, where k3 ~ x^2/2
    raw = math.expm1(nd) - nd
    k3 = min(max(raw, 0.0), K3_CLAMP)
    tol = 8 * U64 * (min(abs(raw), K3_CLAMP) + abs(nd))  # a few ulps of the two terms (exact once clamped)
    assert kl_penalty(a, b, "low_var_kl").item() == pytest.approx(k3, rel=0, abs=tol)
    assert kl_penalty(a, b, "k3").item() == pytest.approx(k3, rel=0, abs=tol)
    assert 0.0 <= kl_penalty(a, b, "k3").item() <= K3_CLAMP
    assert kl_penalty(a, b, "k1+").item() == pytest.approx(d)
    assert kl_penalty(a, b, "k3+").item() == pytest.approx(k3, rel=0, abs=tol)


@settings(max_examples=30, deadline=None)
@given(lp=st.floats(-5, 5), ref=st.floats(-5, 5))
def test_straight_through_gradient_is_k2(lp, ref):
    for kind in ("k1+", "k3+", "low_var_kl+"):
        a = torch.tensor([lp], dtype=torch.float64, requires_grad=True)
        kl_penalty(a, torch.tensor([ref], dtype=torch.float64), kind).sum().backward()
        assert a.grad.item() == pytest.approx(lp - ref)  # d/d lp of 0.5 (lp - ref)^2


def test_k3_gradient_and_finiteness_at_extremes():
    a = torch.tensor([-1000.0, 1000.0, 0.0], requires_grad=True)
    out = kl_penalty(a, torch.zeros(3), "low_var_kl")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(a.grad).all()
    assert out[0].item() == K3_CLAMP


def test_kl_penalty_errors():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "full")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "kl")
    with pytest.raises(TypeError):
        kl_penalty([0.0], torch.zeros(1), "kl")
    assert set(KL_KINDS) >= {"kl", "abs", "mse", "low_var_kl", "k1+", "k3+"}


def test_controllers():
    f = FixedKLController(0.1)
    f.update(100.0, 10)
    assert f.value == 0.1
    a = AdaptiveKLController(0.1, target_kl=0.5, horizon=100)
    a.update(1.0, 10)  # err = clip(1.0/0.5 - 1) = 0.2 -> *1.02
    assert a.value == pytest.approx(0.1 * 1.02)
    a.update(0.25, 10)  # err = -0.5 -> -0.2 -> *0.98
    assert a.value == pytest.approx(0.1 * 1.02 * 0.98)
    a.update(0.5, 10)  # on target: unchanged
    assert a.value == pytest.approx(0.1 * 1.02 * 0.98)
    assert isinstance(make_kl_controller("fixed", 0.2), FixedKLController)
    assert make_kl_controller("adaptive", 0.2, 1.0, 10).value == 0.2
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        make_kl_controller("pid")
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, 0)
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1.0)


def test_apply_kl_penalty():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.5, -math.inf], [-1.0, -math.inf, 0.0], [-3.0, -3.0, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    is_padding = torch.tensor([False, False, True])
    ctrl = AdaptiveKLController(0.5, target_kl=1.0, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl", is_padding=is_padding)
    assert ctrl.value == 0.5  # not updated by default
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl", is_padding=is_padding,
                                        update_controller=True)
    expected = torch.tensor([[-0.5, 1.0 - 0.25, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    torch.testing.assert_close(rewards, expected)
    # per-seq means: row0 (1 + 0.5)/2 = 0.75, row1 0; padding row excluded -> 0.375
    assert metrics["kl_penalty"] == pytest.approx(0.375)
    assert metrics["kl_coef"] == 0.5
    assert ctrl.value == pytest.approx(0.5 * (1 + (-0.2) * 2 / 10))
    fixed = FixedKLController(0.0)
    same, _ = apply_kl_penalty(scores, old, ref, mask, fixed, "low_var_kl")
    torch.testing.assert_close(same, scores)
    with pytest.raises(ValueError, match="same"):
        apply_kl_penalty(scores[:, :2], old, ref, mask, fixed)


@settings(max_examples=40, deadline=None)
@given(init=st.floats(0.0, 1.0), target=st.floats(1e-3, 10.0), horizon=st.floats(1.0, 1e5),
       kls=st.lists(st.tuples(st.floats(0.0, 100.0), st.integers(0, 512)), max_size=6))
def test_adaptive_controller_formula(init, target, horizon, kls):
    ctrl = AdaptiveKLController(init, target, horizon)
    expect = init
    for kl, steps in kls:
        if 0.2 * steps >= horizon:
            with pytest.raises(ValueError, match="kl_ctrl.horizon"):
                ctrl.update(kl, steps)
            continue
        ctrl.update(kl, steps)
        expect *= 1 + min(max(kl / target - 1, -0.2), 0.2) * steps / horizon
    assert ctrl.value == pytest.approx(expect)
    assert ctrl.value >= 0
