"""The critic's clipped value loss: the reference system's ``compute_value_loss`` formula in float64, every
aggregation mode, split invariance over micro-batches and DP ranks, and padding rows that move nothing."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.algos.losses import LOSS_AGG_MODES, global_counts, value_loss

HORIZON = 7.0


def _batch(seed: int, n: int, L: int, p_pad: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None, :] < lens[:, None]) & (torch.rand(n, L, generator=g) > 0.2)
    is_padding = torch.rand(n, generator=g) < p_pad
    mask &= ~is_padding[:, None]
    if not mask.any():
        mask[0, 0], is_padding[0] = True, False
    values = torch.randn(n, L, generator=g, dtype=torch.float64)
    # predictions near and far from the old values, so both sides of the clip are exercised
    vpreds = values + torch.randn(n, L, generator=g, dtype=torch.float64) * 0.8
    returns = torch.randn(n, L, generator=g, dtype=torch.float64)
    # garbage at masked positions must not matter, in value or in gradient
    vpreds = torch.where(mask, vpreds, torch.full_like(vpreds, 1e30))
    values = torch.where(mask, values, torch.full_like(values, math.nan))
    returns = torch.where(mask, returns, torch.full_like(returns, -math.inf))
    return mask, is_padding, vpreds, values, returns


def _reference(vpreds, values, returns, mask, is_padding, clip, mode):
    """The reference system's formula, written out in float64 on the non-padding rows of one full batch."""
    keep = ~is_padding
    vp, v, r, m = vpreds[keep], values[keep], returns[keep], mask[keep].double()
    vp, v, r = (torch.where(m.bool(), x, torch.zeros_like(x)) for x in (vp, v, r))
    vpredclipped = torch.min(torch.max(vp, v - clip), v + clip)  # clip_by_value(vpreds, values -/+ clip)
    l1, l2 = (vp - r) ** 2, (vpredclipped - r) ** 2
    mat = torch.max(l1, l2)
    if mode == "token-mean":
        agg = (mat * m).sum() / m.sum()
    elif mode == "seq-mean-token-sum":
        agg = (mat * m).sum(-1).mean()
    elif mode == "seq-mean-token-mean":
        agg = ((mat * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    else:  # seq-mean-token-sum-norm: token sums over a fixed horizon, averaged over sequences
        agg = (mat * m).sum(-1).sum() / HORIZON / m.shape[0]
    clipfrac = ((l2 > l1).double() * m).sum() / m.sum()
    return 0.5 * agg, clipfrac, (vp * m).sum() / m.sum()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 8), L=st.integers(1, 7), mode=st.sampled_from(LOSS_AGG_MODES),
       clip=st.sampled_from([0.05, 0.2, 0.5, 10.0]))
def test_value_loss_matches_reference_formula(seed, n, L, mode, clip):
    mask, is_padding, vpreds, values, returns = _batch(seed, n, L)
    T, S = global_counts(mask, is_padding)
    pred = vpreds.clone().requires_grad_(True)
    loss, metrics = value_loss(pred, values, returns, mask, cliprange_value=clip, loss_agg_mode=mode,
                               global_tokens=T, global_seqs=S, horizon=HORIZON)
    ref_pred = vpreds.clone().requires_grad_(True)
    ref_loss, ref_clipfrac, ref_vpred = _reference(ref_pred, values, returns, mask, is_padding, clip, mode)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["vf_clipfrac"].double(), ref_clipfrac, rtol=1e-6, atol=1e-7)  # float32 sums
    torch.testing.assert_close(metrics["vpred_mean"].double(), ref_vpred.detach(), rtol=1e-6, atol=1e-6)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(pred.grad, ref_pred.grad, rtol=1e-12, atol=1e-12)
    assert not pred.grad[~mask].any(), "a masked or padding position moved the critic"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 9), L=st.integers(1, 7), ranks=st.integers(1, 3),
       micro=st.integers(1, 3), mode=st.sampled_from(LOSS_AGG_MODES))
def test_value_loss_split_over_micro_batches_and_ranks_equals_full_batch(seed, n, L, ranks, micro, mode):
    """Each part's share, normalised by the step's counts, sums to the full-batch loss, gradient and metrics."""
    mask, is_padding, vpreds, values, returns = _batch(seed, n, L)
    T, S = global_counts(mask, is_padding)
    full_pred = vpreds.clone().requires_grad_(True)
    full, full_metrics = value_loss(full_pred, values, returns, mask, cliprange_value=0.2, loss_agg_mode=mode,
                                    global_tokens=T, global_seqs=S, horizon=HORIZON)
    full.backward()
    g = torch.Generator().manual_seed(seed + 1)
    owner = torch.randint(0, ranks * micro, (n,), generator=g)  # row -> (rank, micro-batch)
    split_pred = vpreds.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    sums = {k: torch.zeros((), dtype=torch.float64) for k in full_metrics}
    for p in range(ranks * micro):
        rows = (owner == p).nonzero().flatten()
        if rows.numel() == 0:
            continue
        width = int(mask[rows].sum(0).nonzero().max()) + 1 if mask[rows].any() else 1  # the part's own padding
        sl = (rows[:, None], torch.arange(width)[None, :])
        part, metrics = value_loss(split_pred[sl], values[sl], returns[sl], mask[sl], cliprange_value=0.2,
                                   loss_agg_mode=mode, global_tokens=T, global_seqs=S, horizon=HORIZON)
        total = total + part
        for k in sums:
            sums[k] += metrics[k].double()
    total.backward()
    torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_pred.grad, full_pred.grad, rtol=1e-12, atol=1e-12)
    for k in sums:
        torch.testing.assert_close(sums[k], full_metrics[k].double(), rtol=1e-5, atol=1e-6)


def test_value_loss_clip_values():
    """Hand-made tokens: inside the clip, clipped and chosen, clipped but not chosen."""
    values = torch.tensor([[0.0, 0.0, 0.0]])
    vpreds = torch.tensor([[0.1, 1.0, 1.0]])
    returns = torch.tensor([[0.0, 2.0, 0.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = value_loss(vpreds, values, returns, mask, cliprange_value=0.5, global_tokens=3, global_seqs=1)
    # token 0: both 0.01; token 1: max(1, (0.5-2)^2=2.25) = 2.25 (clipped); token 2: max(1, 0.25) = 1
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.01 + 2.25 + 1.0) / 3))
    torch.testing.assert_close(m["vf_clipfrac"], torch.tensor(1 / 3))
    torch.testing.assert_close(m["vpred_mean"], torch.tensor(2.1 / 3))


def test_value_loss_clipfrac_counts_no_token_inside_the_clip():
    """A prediction inside the clip is not clipped, even where ``old + (pred - old)`` rounds away from ``pred`` in
    float32 (signs differ): the clipped value is ``pred`` itself, as the reference's clip_by_value gives it."""
    old = torch.tensor([[-0.05629199370741844]])
    pred = torch.tensor([[0.021211033686995506]])
    assert (old + (pred - old)).item() != pred.item()  # the rounding the loss must not depend on
    for ret in (0.01, 0.03):  # near the prediction, where the squares resolve a rounding of the clipped value
        loss, m = value_loss(pred, old, torch.tensor([[ret]]), torch.ones(1, 1, dtype=torch.bool),
                             cliprange_value=0.5, global_tokens=1, global_seqs=1)
        assert m["vf_clipfrac"].item() == 0.0, ret
        assert loss.item() == 0.5 * ((pred - ret) ** 2).item()


def test_value_loss_errors():
    mask = torch.ones(2, 3)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(x, x, x, mask, cliprange_value=0.0, global_tokens=6, global_seqs=2)
    with pytest.raises(ValueError, match="values shape"):
        value_loss(x, torch.zeros(2, 2), x, mask, global_tokens=6, global_seqs=2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        value_loss(x, x, x, mask, loss_agg_mode="mean", global_tokens=6, global_seqs=2)
    # an all-padding micro-batch gives a zero that keeps the graph
    pred = torch.ones(2, 3, requires_grad=True)
    loss, _ = value_loss(pred, x, x, torch.zeros(2, 3), global_tokens=0, global_seqs=0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not pred.grad.any()
