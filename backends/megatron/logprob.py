"""Token log-probs and entropy from vocabulary-sharded logits, without gathering the full vocabulary on one rank.

Each TP rank holds logits ``z[:, lo:hi]`` for its slice of the vocabulary. The forward all-reduces three numbers
per token (max, sum of exp, sum of p·z) and the target logit; the backward is local:

* ``d log p_t / d z_i = 1[i = t] - p_i``
* ``d H / d z_i = -p_i (log p_i + H)``  with ``H = -Σ p log p``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs_entropy"]


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group, need_entropy: bool):
        z = logits.float()
        vocab_local = z.shape[-1]
        zmax = z.max(dim=-1).values
        if group is not None:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        shifted = z - zmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_t = target - vocab_start
        owned = (local_t >= 0) & (local_t < vocab_local)
        idx = local_t.clamp(0, vocab_local - 1)
        t_logit = torch.where(owned, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(zmax))
        if group is not None:
            stacked = torch.stack([sum_exp, t_logit])
            dist.all_reduce(stacked, group=group)
            sum_exp, t_logit = stacked[0], stacked[1]
        lse = sum_exp.log()
        logp = t_logit - lse
        p = exp / sum_exp.unsqueeze(-1)
        if need_entropy:
            pz = (p * shifted).sum(dim=-1)
            if group is not None:
                dist.all_reduce(pz, group=group)
            entropy = lse - pz
        else:
            entropy = torch.zeros_like(logp)
        ctx.save_for_backward(p, shifted, lse, entropy, idx, owned)
        ctx.need_entropy = need_entropy
        ctx.in_dtype = logits.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_ent: torch.Tensor):
        p, shifted, lse, entropy, idx, owned = ctx.saved_tensors
        grad = -p * g_logp.unsqueeze(-1)
        onehot = torch.zeros_like(p).scatter_(-1, idx.unsqueeze(-1), owned.to(p.dtype).unsqueeze(-1))
        grad = grad + onehot * g_logp.unsqueeze(-1)
        if ctx.need_entropy and g_ent is not None:
            logp_all = shifted - lse.unsqueeze(-1)
            grad = grad - g_ent.unsqueeze(-1) * p * (logp_all + entropy.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    group=None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p(target), entropy)`` per row of ``logits [N, V/tp]`` (this rank's vocabulary slice from vocab_start).

    ``target`` holds global token ids; ``group`` is the TP group (``None`` = unsharded). Differentiable in the
    logits; the entropy is ``None`` unless ``with_entropy``.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V_local] and target [N]; got {tuple(logits.shape)} and "
                         f"{tuple(target.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature != 1.0:
        logits = logits / temperature
    logp, ent = _VocabParallelLogProbEntropy.apply(logits, target.long(), int(vocab_start), group, bool(with_entropy))
    return logp, (ent if with_entropy else None)
