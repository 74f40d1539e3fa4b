"""Checks that globally normalised losses make DP training independent of the split, on a real gloo world.

Each rank takes its share of one optimizer step (rows assigned round-robin after a seeded shuffle), cuts it
into micro-batches, all-reduces (tokens, seqs) once, and backpropagates every micro-batch loss through a DDP
model (gradients summed by scaling the loss with the world size, since DDP averages). The resulting gradient
must equal the single-process full-batch gradient, for every loss_agg_mode and with entropy and KL terms.
Prints one "OK <mode>" line per mode on rank 0. Each mode's DDP model lives in :func:`check_mode` only, so it is
freed before the process group is destroyed (see worker_exit.py for the deadlock that order avoids).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from protocol.algos.losses import LOSS_AGG_MODES, entropy_bonus, global_counts, kl_loss, policy_loss

V, H, N, L, HORIZON = 11, 8, 13, 6, 6.0


def check(cond: bool, msg: str) -> None:
    if not cond:
        print(f"FAIL rank {dist.get_rank()}: {msg}", flush=True)
        sys.exit(1)


def make_data(seed: int):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(N, L, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (N, L), generator=g)
    lens = torch.randint(0, L + 1, (N,), generator=g)
    mask = (torch.arange(L)[None] < lens[:, None]) & (torch.rand(N, L, generator=g) > 0.2)
    is_padding = torch.zeros(N, dtype=torch.bool)
    is_padding[-2:] = True  # dispatch padding samples
    mask &= ~is_padding[:, None]
    old = -torch.rand(N, L, generator=g, dtype=torch.float64) * 2 - 1
    adv = torch.randn(N, L, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(N, L, generator=g, dtype=torch.float64)
    return feats, targets, mask.long(), is_padding, old, adv, ref


def step_loss(model, feats, targets, mask, old, adv, ref, mode, T, S):
    logits = model(feats)
    logp_all = torch.log_softmax(logits, -1)
    log_prob = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pg, _ = policy_loss(old, log_prob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode,
                        global_tokens=T, global_seqs=S, horizon=HORIZON)
    ent = entropy_bonus(entropy, mask, mode, T, S, horizon=HORIZON)
    kl = kl_loss(log_prob, ref, mask, "low_var_kl", mode, T, S, horizon=HORIZON)
    return pg - 0.01 * ent + 0.1 * kl


def check_mode(mode: str, rank: int, world: int) -> None:
    """One loss_agg_mode: the split DDP step must reproduce the full-batch loss and gradients."""
    feats, targets, mask, is_padding, old, adv, ref = make_data(7)
    base = torch.nn.Linear(H, V).double()
    # single-process reference: the whole step at once
    ref_model = torch.nn.Linear(H, V).double()
    ref_model.load_state_dict(base.state_dict())
    T_full, S_full = global_counts(mask, is_padding)
    step_loss(ref_model, feats, targets, mask, old, adv, ref, mode, T_full, S_full).backward()

    model = DDP(base)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    mine = perm[rank::world]
    micro = [mine[i::2] for i in range(2)] + [mine[:0]]  # two micro-batches and an empty one
    local = [global_counts(mask[mb], is_padding[mb]) for mb in micro]
    counts = torch.tensor([sum(c[0] for c in local), sum(c[1] for c in local)], dtype=torch.float64)
    dist.all_reduce(counts)
    T, S = float(counts[0]), float(counts[1])
    check((T, S) == (T_full, S_full), f"{mode}: all-reduced counts {(T, S)} != full batch {(T_full, S_full)}")
    total = torch.zeros((), dtype=torch.float64)
    for j, mb in enumerate(micro):
        width = int(mask[mb].sum(0).nonzero().max()) + 1 if mask[mb].any() else 1  # per-micro-batch padding
        sl = (mb[:, None], torch.arange(width)[None])
        if j < len(micro) - 1:
            with model.no_sync():
                loss = step_loss(model, feats[sl], targets[sl], mask[sl], old[sl], adv[sl], ref[sl], mode, T, S)
                (loss * world).backward()  # DDP averages over ranks; the loss is already a global share
        else:
            loss = step_loss(model, feats[sl], targets[sl], mask[sl], old[sl], adv[sl], ref[sl], mode, T, S)
            (loss * world).backward()
        total += loss.detach()
    dist.all_reduce(total)
    with torch.no_grad():
        full = step_loss(ref_model, feats, targets, mask, old, adv, ref, mode, T_full, S_full)
    check(torch.allclose(total, full, rtol=1e-10, atol=1e-12), f"{mode}: loss {float(total)} != {float(full)}")
    for (name, p), q in zip(model.module.named_parameters(), ref_model.parameters()):
        check(torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12),
              f"{mode}: grad of {name} differs by {float((p.grad - q.grad).abs().max())}")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    for mode in LOSS_AGG_MODES:
        check_mode(mode, rank, world)
        if rank == 0:
            print(f"OK {mode}", flush=True)


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
