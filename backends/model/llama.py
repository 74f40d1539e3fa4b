"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch over packed 1-D batches, HF parameter names."""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from backends.model.attention import check_cu_seqlens, packed_attention
from backends.model.config import ModelConfig

__all__ = ["LlamaModel", "DecoderLayer", "RMSNorm", "init_weights", "rope_inv_freq", "rotary_cos_sin", "apply_rotary",
           "AttentionFn", "parameter_shapes"]

# (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens [n+1]) -> [T, Hq, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) computed in fp32, cast back, times ``weight``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2] (fp32) of ``cfg.rope_type``, as Hugging Face defines them.

    default: ``theta^(-2i/d)``; linear: that / factor; llama3: wavelengths ``2π/f`` longer than
    ``original_max / low_freq_factor`` are divided by the factor, those shorter than ``original_max /
    high_freq_factor`` kept, and the band between interpolated with ``s = (original_max / wavelen - low) / (high - low)``:
    ``(1 - s) f / factor + s f``.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    if cfg.rope_type == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_type == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    return inv


@functools.lru_cache(maxsize=8)
def _cached_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    # fp32 on the CPU, never a module buffer: ``model.to(bfloat16)`` would round the frequencies
    return rope_inv_freq(cfg)


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin [T, head_dim] of the rotate-half rotary embedding, computed in fp32 then cast to ``dtype``."""
    freqs = position_ids.to(torch.float32)[:, None] * inv_freq.to(position_ids.device, torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by position: x*cos + rotate_half(x)*sin (non-interleaved halves)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions over a packed batch (optional q/k/v bias, q/k norm)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) of x [T, hidden]: projection, per-head norm, rotary."""
        T, d = x.shape[0], self.cfg.head_dim
        q = self.q_proj(x).view(T, -1, d)
        k = self.k_proj(x).view(T, -1, d)
        v = self.v_proj(x).view(T, -1, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, cu_seqlens, attention: AttentionFn) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = attention(q, k, v, cu_seqlens)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cu_seqlens, attention: AttentionFn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder-only LM over a packed 1-D batch: ``forward(input_ids[T], position_ids[T], cu_seqlens[n+1]) -> [T, V]``.

    Example::

        model = LlamaModel.from_seed(ModelConfig(), seed=0)
        ids = torch.tensor([5, 6, 7, 8, 9]); pos = torch.tensor([0, 1, 2, 0, 1])
        logits = model(ids, pos, torch.tensor([0, 3, 5], dtype=torch.int32))  # two sequences, [5, vocab]
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.activation_checkpointing = False

    @classmethod
    def from_seed(cls, cfg: ModelConfig, seed: int, device: torch.device | str | None = None) -> "LlamaModel":
        """A model with deterministic weights: normal(0, init_std) matrices, unit norms, same for any device."""
        model = cls(cfg)
        init_weights(model, seed)
        return model.to(device) if device is not None else model

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] at ``position_ids`` for this model's rope type."""
        return rotary_cos_sin(position_ids, _cached_inv_freq(self.cfg), dtype)

    def output_weight(self) -> torch.Tensor:
        """The [V, hidden] output projection (the embedding when tied)."""
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      attention: AttentionFn | None = None) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the packed batch."""
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids and position_ids must both be 1-D [T] (packed); got "
                             f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}")
        return self.run_layers(self.embed_tokens(input_ids), position_ids, cu_seqlens, attention)

    def run_layers(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                   attention: AttentionFn | None = None) -> torch.Tensor:
        """The decoder layers and final norm over input embeddings x [T, hidden]."""
        if attention is None:  # the longest sequence, read once per forward instead of once per layer
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
            attention = functools.partial(packed_attention, max_seqlen=longest)
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, cu_seqlens, attention, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cu_seqlens, attention)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                attention: AttentionFn | None = None, logits_positions: torch.Tensor | None = None,
                **inputs: torch.Tensor) -> torch.Tensor:
        """Logits [T, V], or [len(logits_positions), V] at just those packed positions (saves the output
        projection where no log-prob is needed); ``attention`` replaces the packed attention (sequence parallel).
        ``inputs``: what a subclass's :meth:`hidden_states` reads besides the tokens (a vision model's images)."""
        if attention is None and input_ids.dim() == 1:
            check_cu_seqlens(cu_seqlens, input_ids.shape[0])
        h = self.hidden_states(input_ids, position_ids, cu_seqlens, attention, **inputs)
        if logits_positions is not None:
            h = h.index_select(0, logits_positions.to(h.device))
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits of final-norm hidden states (the forward pass and the KV-cached sampler both end here)."""
        if self.cfg.tie_word_embeddings:
            return F.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the decoder for ``cfg`` with its shape, in construction order (nothing allocated)."""
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in LlamaModel(cfg).named_parameters()}


@torch.no_grad()
def init_weights(model: LlamaModel, seed: int) -> None:
    """Deterministic init independent of device and global RNG: matrices ~ normal(0, init_std), norms = 1, biases = 0."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    std = model.cfg.init_std
    for name, p in model.named_parameters():  # named_parameters order is fixed by construction
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
