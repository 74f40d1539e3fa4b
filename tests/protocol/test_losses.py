"""Policy losses: aggregation modes, split invariance over micro-batches and ranks, PPO dual clip, metrics."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.algos.kl import kl_penalty
from protocol.algos.losses import (LOG_RATIO_BOUND, LOSS_AGG_MODES, agg_loss, entropy_bonus, global_counts, kl_loss,
                             policy_loss)

HORIZON = 16.0


def _batch(seed: int, n: int, L: int, p_pad: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None, :] < lens[:, None]) & (torch.rand(n, L, generator=g) > 0.2)
    is_padding = torch.rand(n, generator=g) < p_pad
    mask &= ~is_padding[:, None]
    old = -torch.rand(n, L, generator=g, dtype=torch.float64) * 3
    new = old + 0.5 * torch.randn(n, L, generator=g, dtype=torch.float64)
    adv = torch.randn(n, L, generator=g, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(n, L, generator=g, dtype=torch.float64)
    # garbage at masked positions must not matter
    new = torch.where(mask, new, torch.full_like(new, 50.0))
    old = torch.where(mask, old, torch.full_like(old, -math.inf))
    return mask.long(), is_padding, old, new, adv, ref


def _losses(parts_mask, old, new, adv, ref, ent, mode, T, S):
    pl, metrics = policy_loss(old, new, adv, parts_mask, loss_agg_mode=mode, global_tokens=T, global_seqs=S,
                              clip_ratio_low=0.2, clip_ratio_high=0.28, horizon=HORIZON)
    e = entropy_bonus(ent, parts_mask, mode, T, S, horizon=HORIZON)
    k = kl_loss(new, ref, parts_mask, "low_var_kl", mode, T, S, horizon=HORIZON)
    return pl - 0.01 * e + 0.1 * k, metrics


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 9), L=st.integers(1, 7), ranks=st.integers(1, 3),
       micro=st.integers(1, 3), mode=st.sampled_from(LOSS_AGG_MODES))
def test_sum_over_any_split_equals_full_batch(seed, n, L, ranks, micro, mode):
    mask, is_padding, old, new, adv, ref = _batch(seed, n, L)
    ent = torch.rand(n, L, dtype=torch.float64)
    T, S = global_counts(mask, is_padding)
    if T == 0:
        mask[0, 0] = 1
        is_padding[0] = False
        T, S = global_counts(mask, is_padding)

    new_full = new.clone().requires_grad_(True)
    full, full_metrics = _losses(mask, old, new_full, adv, ref, ent, mode, T, S)
    full.backward()

    # random assignment of rows to (rank, micro-batch); each part trimmed to its own padded width
    g = torch.Generator().manual_seed(seed + 1)
    owner = torch.randint(0, ranks * micro, (n,), generator=g)
    counts = [global_counts(mask[owner == p], is_padding[owner == p]) for p in range(ranks * micro)]
    assert sum(c[0] for c in counts) == T and sum(c[1] for c in counts) == S
    new_split = new.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    metric_sums = {k: torch.zeros((), dtype=torch.float64) for k in full_metrics}
    for p in range(ranks * micro):
        rows = (owner == p).nonzero().flatten()
        if rows.numel() == 0:
            continue
        width = max(1, int(mask[rows].sum(0).nonzero().max()) + 1) if mask[rows].any() else 1
        sl = (rows[:, None], torch.arange(width)[None, :])
        part, metrics = _losses(mask[sl], old[sl], new_split[sl], adv[sl], ref[sl], ent[sl], mode, T, S)
        total = total + part
        for k in metric_sums:
            metric_sums[k] += metrics[k].double()
    total.backward()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(new_split.grad, new_full.grad)
    for k in metric_sums:
        torch.testing.assert_close(metric_sums[k], full_metrics[k].double())
    assert torch.isfinite(new_full.grad).all()
    assert (new_full.grad[mask == 0] == 0).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6), L=st.integers(1, 6))
def test_agg_modes_match_direct_formula(seed, n, L):
    mask, is_padding, _, _, _, _ = _batch(seed, n, L, p_pad=0.0)
    loss = torch.randn(n, L, dtype=torch.float64)
    T, S = max(1, int(mask.sum())), n
    m = mask.double()
    assert torch.allclose(agg_loss(loss, mask, "token-mean", global_tokens=T, global_seqs=S), (loss * m).sum() / T)
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum", global_tokens=T, global_seqs=S),
                          (loss * m).sum(-1).sum() / S)
    per_seq = [((loss[i] * m[i]).sum() / m[i].sum()) if m[i].sum() > 0 else torch.tensor(0.0, dtype=torch.float64)
               for i in range(n)]
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-mean", global_tokens=T, global_seqs=S),
                          torch.stack(per_seq).sum() / S)
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm", global_tokens=T, global_seqs=S,
                                   horizon=HORIZON), (loss * m).sum() / (S * HORIZON))


def test_agg_loss_errors():
    loss, mask = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(loss, mask, "mean", global_tokens=6, global_seqs=2)
    with pytest.raises(ValueError, match="global_tokens"):
        agg_loss(loss, mask, "token-mean", global_tokens=0, global_seqs=2)
    with pytest.raises(ValueError, match="global_seqs"):
        agg_loss(loss, mask, "seq-mean-token-sum", global_tokens=6, global_seqs=0)
    with pytest.raises(ValueError, match="horizon"):
        agg_loss(loss, mask, "seq-mean-token-sum-norm", global_tokens=6, global_seqs=2)
    with pytest.raises(ValueError, match="shape"):
        agg_loss(loss, mask[:, :2], "token-mean", global_tokens=6, global_seqs=2)
    with pytest.raises(TypeError, match="global_tokens"):
        agg_loss(loss, mask, "token-mean", global_tokens="6", global_seqs=2)
    # an all-padding micro-batch with zero counts is a graph-keeping zero, not an error
    x = torch.ones(2, 3, requires_grad=True)
    out = agg_loss(x, torch.zeros(2, 3), "token-mean", global_tokens=0, global_seqs=0)
    out.backward()
    assert out.item() == 0.0 and (x.grad == 0).all()
    # tensor counts (after all-reduce) are accepted
    assert agg_loss(loss, mask, "token-mean", global_tokens=torch.tensor(3), global_seqs=2).item() == 2.0


def test_global_counts():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert global_counts(mask) == (3, 3)
    assert global_counts(mask, torch.tensor([False, True, False])) == (3, 2)
    assert global_counts(mask, torch.tensor([False, False, True])) == (2, 2)
    with pytest.raises(ValueError, match="is_padding"):
        global_counts(mask, torch.tensor([False]))
    with pytest.raises(ValueError, match="response_mask"):
        global_counts(torch.ones(3))


def test_policy_loss_clip_and_dual_clip_values():
    # one token each: (log ratio, advantage) -> expected per-token loss, clipped?, dual?
    cases = [
        (0.0, 1.0, -1.0, False, False),                              # ratio 1
        (math.log(1.5), 1.0, -(1 + 0.28), True, False),             # A>0, ratio above 1+high: clipped
        (math.log(0.5), 1.0, -0.5, False, False),                    # A>0, ratio below 1-low: unclipped (min)
        (math.log(0.5), -1.0, 0.8, True, False),                     # A<0, ratio below 1-low: clipped to 0.8
        (math.log(5.0), -1.0, 3.0, False, True),                     # A<0, ratio 5 > c=3: dual clip caps at 3
        (math.log(2.0), -1.0, 2.0, False, False),                    # A<0, ratio 2 < c: unclipped 2
    ]
    lr = torch.tensor([[c[0]] for c in cases], dtype=torch.float64)
    adv = torch.tensor([[c[1]] for c in cases], dtype=torch.float64)
    old = torch.zeros_like(lr)
    mask = torch.ones_like(lr, dtype=torch.long)
    new = lr.clone().requires_grad_(True)
    n = len(cases)
    loss, metrics = policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                global_tokens=n, global_seqs=n)
    expected = sum(c[2] for c in cases) / n
    assert loss.item() == pytest.approx(expected)
    assert metrics["clipfrac"].item() == pytest.approx(sum(c[3] for c in cases) / n)
    assert metrics["clipfrac_lower"].item() == pytest.approx(sum(c[4] for c in cases) / n)
    assert metrics["approx_kl"].item() == pytest.approx(-float(lr.sum()) / n)
    loss.backward()
    g = new.grad.flatten()
    # clipped and dual-clipped tokens get no gradient; unclipped get -A * ratio / n
    assert g[1] == 0 and g[3] == 0 and g[4] == 0
    assert g[0].item() == pytest.approx(-1.0 / n) and g[5].item() == pytest.approx(2.0 / n)
    assert not any(m.requires_grad for m in metrics.values())


def test_policy_loss_log_ratio_clamp_keeps_finite():
    old = torch.tensor([[-100.0, 0.0]])
    new = torch.tensor([[0.0, -100.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]])
    loss, metrics = policy_loss(old, new, adv, torch.ones(1, 2), global_tokens=2, global_seqs=1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert metrics["approx_kl"].item() == pytest.approx(0.0, abs=1e-6)  # +-LOG_RATIO_BOUND cancel
    assert LOG_RATIO_BOUND == 20.0


def test_policy_loss_errors():
    t = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(t, t, t, t, clip_ratio_c=1.0, global_tokens=1, global_seqs=1)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        policy_loss(t, t, t, t, clip_ratio_low=1.0, global_tokens=1, global_seqs=1)
    with pytest.raises(ValueError, match="advantages shape"):
        policy_loss(t, t, t[:, :2], t, global_tokens=1, global_seqs=1)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(t, t, t, torch.ones(2, 3), loss_agg_mode="sum", global_tokens=1, global_seqs=1)


def test_entropy_bonus_and_kl_loss():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ent = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    assert entropy_bonus(ent, mask, "token-mean", 3, 2).item() == pytest.approx(2.0)
    assert entropy_bonus(ent, mask, "seq-mean-token-mean", 3, 2).item() == pytest.approx((1.5 + 3.0) / 2)
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -math.inf], [-0.5, -math.inf, -math.inf]])
    k = kl_loss(lp, ref, mask, "mse", "token-mean", 3, 2)
    expected = (0.5 * 0.25 + 0.5 * 1.0 + 0.0) / 3
    assert k.item() == pytest.approx(expected)
    k.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 2] == 0
    direct = (kl_penalty(lp.detach()[0, :2], ref[0, :2], "low_var_kl").sum() + 0) / 3
    assert kl_loss(lp.detach(), ref, mask, "k3", "token-mean", 3, 2).item() == pytest.approx(direct.item())


@pytest.mark.dist
@pytest.mark.slow
def test_dp_training_with_global_counts_matches_full_batch(torchrun):
    """Real gloo DDP over 2 ranks x 3 micro-batches: same loss and gradients as the single-process step."""
    out = torchrun("protocol_losses_worker.py", 2)
    assert [line for line in out.splitlines() if line.startswith("OK")] == [f"OK {m}" for m in LOSS_AGG_MODES]
