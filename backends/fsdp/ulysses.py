"""Ulysses sequence parallelism: each SP rank holds a slice of the packed sequence; attention all-to-alls heads."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from backends.model.attention import packed_attention
from backends.model.llama import AttentionFn

__all__ = ["check_sp_heads", "seq_to_head_shard", "head_to_seq_shard", "ulysses_attention", "pad_to_multiple",
           "gather_seq"]


def check_sp_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    """Raise ValueError unless the SP size divides the attention heads (kv heads are repeated if needed)."""
    if sp < 1:
        raise ValueError(f"actor.fsdp.ulysses_sp must be >= 1, got {sp}")
    if num_heads % sp:
        raise ValueError(f"actor.fsdp.ulysses_sp={sp} must divide model.num_heads={num_heads} "
                         f"(each SP rank attends with num_heads / ulysses_sp heads)")


def seq_to_head_shard(x: torch.Tensor, group) -> torch.Tensor:
    """[T/sp, H, D] (my sequence slice, all heads) -> [T, H/sp, D] (whole sequence, my heads); differentiable."""
    sp = dist.get_world_size(group)
    t, h, d = x.shape
    send = x.reshape(t, sp, h // sp, d).transpose(0, 1).contiguous()  # [sp (dest head group), t, h/sp, d]
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # [sp (source seq slice), t, h/sp, d]
    return recv.reshape(sp * t, h // sp, d)


def head_to_seq_shard(x: torch.Tensor, group) -> torch.Tensor:
    """[T, H/sp, D] -> [T/sp, H, D]: the inverse of :func:`seq_to_head_shard`; differentiable."""
    sp = dist.get_world_size(group)
    t, hl, d = x.shape
    send = x.reshape(sp, t // sp, hl, d).contiguous()  # [sp (dest seq slice), t/sp, h/sp, d]
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # [sp (source head group), t/sp, h/sp, d]
    return recv.transpose(0, 1).reshape(t // sp, sp * hl, d)


def ulysses_attention(group, inner: AttentionFn = packed_attention) -> AttentionFn:
    """Attention over a sequence-sharded packed batch: all-to-all to head shards, exact attention, all-to-all back.

    ``cu_seqlens`` passed to the returned function describes the whole (SP-padded) packed sequence.
    """
    sp = dist.get_world_size(group)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        hq, hkv = q.shape[1], k.shape[1]
        if hkv % sp:  # too few kv heads to split: repeat them so kv head j still serves q heads [j*g, (j+1)*g)
            g = hq // hkv
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        q, k, v = (seq_to_head_shard(x, group) for x in (q, k, v))
        return head_to_seq_shard(inner(q, k, v, cu_seqlens), group)

    return attend


def pad_to_multiple(ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, multiple: int):
    """Append one padding segment so the packed length is a multiple of ``multiple``; returns (ids, pos, cu, pad)."""
    total = ids.shape[0]
    pad = (-total) % multiple
    if pad == 0:
        return ids, pos, cu, 0
    ids = torch.cat([ids, ids.new_zeros(pad)])
    pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)])
    cu = torch.cat([cu, cu.new_tensor([total + pad])])
    return ids, pos, cu, pad


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0; backward sums every rank's gradient of the whole and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        sp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(sp, dim=0)[rank], None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every SP rank's slice [T/sp, ...] into [T, ...]; the gradient flows back to each slice."""
    return _GatherSeq.apply(x, group)
