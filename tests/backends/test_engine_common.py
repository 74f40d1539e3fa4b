"""Engine helpers shared by both backends: optimizer, LR schedule, gradient clipping, count all-reduce."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from backends.config import OptimConfig
from backends.comm import allreduce_counts
from backends.optim import build_lr_scheduler, build_optimizer, clip_grad_norm, lr_factor


@settings(max_examples=60, deadline=None)
@given(warm=st.integers(0, 10), total=st.integers(1, 50), min_ratio=st.floats(0.0, 1.0),
       sched=st.sampled_from(["constant", "cosine"]), step=st.integers(0, 80))
def test_lr_factor_formula(warm, total, min_ratio, sched, step):
    cfg = OptimConfig(warmup_steps=warm, total_steps=total, min_lr_ratio=min_ratio, lr_schedule=sched)
    f = lr_factor(step, cfg)
    if step < warm:
        assert f == pytest.approx((step + 1) / warm)
    elif sched == "constant":
        assert f == 1.0
    else:
        progress = min(1.0, (step - warm) / max(1, total - warm))
        assert f == pytest.approx(min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert min(min_ratio, 1.0) - 1e-12 <= f <= 1.0 + 1e-12
        if step >= warm + max(1, total - warm):
            assert f == pytest.approx(min_ratio)
    assert 0.0 <= f <= 1.0 + 1e-12


def test_lr_factor_rejects_negative_step():
    with pytest.raises(ValueError, match="step"):
        lr_factor(-1, OptimConfig())


def test_scheduler_follows_lr_factor_and_round_trips():
    cfg = OptimConfig(lr=0.1, warmup_steps=2, lr_schedule="cosine", total_steps=5, min_lr_ratio=0.2)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], cfg)
    sched = build_lr_scheduler(opt, cfg)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1 * lr_factor(s, cfg) for s in range(6)])
    state = sched.state_dict()
    opt2 = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    sched2 = build_lr_scheduler(opt2, cfg)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr() and sched2.last_epoch == 6


def test_build_optimizer_kinds_and_hyperparameters():
    p = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    adam = build_optimizer([p, frozen], OptimConfig(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1))
    assert isinstance(adam, torch.optim.AdamW) and len(adam.param_groups[0]["params"]) == 1
    g = adam.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.01, (0.8, 0.9), 1e-6, 0.1)
    sgd = build_optimizer([p], OptimConfig(name="sgd", lr=0.5))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    sgd.step()
    assert torch.equal(p.detach(), torch.tensor([0.5, 0.0, -0.5]))
    with pytest.raises(ValueError, match="actor.optim.name"):
        OptimConfig(name="lion")


@settings(max_examples=30, deadline=None)
@given(vals=st.lists(st.floats(-10, 10), min_size=1, max_size=8), max_norm=st.floats(0.01, 20))
def test_clip_grad_norm_formula(vals, max_norm):
    p = torch.nn.Parameter(torch.zeros(len(vals), dtype=torch.float64))
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    g = torch.tensor(vals, dtype=torch.float64)
    p.grad, q.grad = g.clone(), torch.tensor([3.0, 4.0], dtype=torch.float64)
    norm, finite = clip_grad_norm([p, q, torch.nn.Parameter(torch.zeros(1))], max_norm)
    want = math.sqrt(sum(v * v for v in vals) + 25.0)
    assert finite and norm == pytest.approx(want)
    coef = min(1.0, max_norm / (want + 1e-6))
    torch.testing.assert_close(p.grad, g * coef)


def test_clip_grad_norm_non_finite_leaves_gradients():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    norm, finite = clip_grad_norm([p], 1.0)
    assert not finite and math.isinf(norm) and p.grad[1] == 1.0
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0) == (0.0, True)


def test_allreduce_counts_without_a_process_group_is_identity():
    assert allreduce_counts([3, 2.5]) == [3.0, 2.5]
