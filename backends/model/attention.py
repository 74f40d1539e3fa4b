"""Exact causal attention over packed (varlen) sequences: no token attends across a sequence boundary."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

__all__ = ["packed_attention", "check_cu_seqlens"]


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> None:
    """Raise ValueError unless ``cu_seqlens`` is a 1-D non-decreasing offset vector from 0 to ``total``."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with n+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {total}; got {c[:8]}{'...' if len(c) > 8 else ''}")


def _varlen_available(q: torch.Tensor) -> bool:
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _varlen_has_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over k, v [T, Hkv, D] within each segment of ``cu_seqlens``.

    Grouped-query: kv head j serves q heads [j*g, (j+1)*g), g = Hq / Hkv. Scale 1/sqrt(D).
    Uses the fused varlen kernel on CUDA (bf16/fp16) and one SDPA call per sequence elsewhere.
    """
    T, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if _varlen_available(q):
        from torch.nn.attention.varlen import varlen_attn

        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
        kf, vf = k, v
        if hq != hkv and not _varlen_has_gqa():
            kf, vf = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        extra = {"enable_gqa": True} if hq != hkv and _varlen_has_gqa() else {}
        try:
            return varlen_attn(q, kf, vf, cu, cu, max_seqlen, max_seqlen, window_size=(-1, 0), **extra)
        except (RuntimeError, NotImplementedError, TypeError):  # kernel missing on this build/GPU: exact fallback
            pass
    g = hq // hkv
    if g > 1:
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    outs = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        qi, ki, vi = (x[s:e].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D]
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).squeeze(0).transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=0)
