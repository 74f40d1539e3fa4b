"""Batched autoregressive sampling for rollout: temperature, top-p, EOS, with the sampling log-probs."""
from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F

from backends.model.attention import packed_attention
from backends.model.llama import LlamaModel

__all__ = ["generate", "sample_next", "KVCache"]


def _categorical(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of non-negative ``weights`` [B, V] (any scale), drawn with probability weight / row sum.

    ``torch.multinomial``: its per-entry exponential race moves a draw only where two candidates nearly tie, so two
    backends whose logits differ by float rounding sample the same tokens far more often than an inverted CDF does
    (there every earlier entry's rounding shifts the boundaries). The weights stay in vocabulary order, so each
    token meets the same noise whatever its rank among near-equal ones."""
    total = weights.sum(-1, keepdim=True)
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # nan / inf logits: no distribution to draw from
        bad = (~torch.isfinite(total) | (total <= 0)).flatten().nonzero().flatten().tolist()
        raise RuntimeError(f"sampling probabilities of rows {bad[:8]} are nan, inf or all zero (non-finite logits)")
    return torch.multinomial(weights, 1, generator=generator).squeeze(-1)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None):
    """Sample one token per row of logits [B, V]; return (tokens [B], log-probs [B]) at ``temperature``.

    temperature == 0 is greedy. The log-prob is log_softmax(logits / temperature) of the chosen token (before
    top-p truncation), i.e. what a recompute of the same tokens at that temperature gives. A row whose logits hold
    nan or +inf, or are all -inf, has no distribution: an error names it.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        nucleus = (sp.cumsum(-1) - sp) < top_p  # the smallest prefix whose mass reaches top_p
        nucleus[:, 0] = True
        keep = torch.zeros_like(nucleus).scatter(-1, si, nucleus)  # back in vocabulary order
        tokens = _categorical(probs * keep, generator)
    else:
        tokens = _categorical(probs, generator)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class KVCache:
    """Per-layer keys/values [B, kv_heads, capacity, head_dim] (after rotary) and each row's filled length.

    Heads before positions: a decode step attends over the filled prefix ``[:, :, :longest]`` as a strided view,
    with no copy of the cache."""

    def __init__(self, model: LlamaModel, batch: int, capacity: int, device, dtype) -> None:
        cfg = model.cfg
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        # a row's rotary position minus its cache slot: 0 for text, the images' M-RoPE offset for a
        # vision-language prompt (an image of h x w merged units takes max(h, w) positions for its h * w tokens)
        self.delta = torch.zeros(batch, dtype=torch.long, device=device)


def _prefill(model: LlamaModel, prompts: list[list[int]], cache: KVCache, device,
             images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
    """Run the packed prompts, filling the cache; return the logits at each prompt's last position [B, V].
    ``images`` (a vision-language model): each prompt's ``(pixel_values, image_grid_thw)``, or None."""
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    rows = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    if hasattr(model, "visual"):  # multimodal positions [3, T]; the images' features at their tokens
        from backends.model.vision import packed_vl_inputs

        rope, extra = packed_vl_inputs(model.vl, [torch.tensor(p) for p in prompts], images or [None] * len(prompts),
                                       device)
        x = model.embed(ids, **extra)
        cache.delta = torch.stack([rope[:, a:b].max() + 1 - (b - a) for a, b in zip(cu[:-1].tolist(),
                                                                                      cu[1:].tolist())])
        cos, sin = model.rotary(rope, x.dtype)
    else:
        if images is not None and any(im is not None for im in images):
            raise ValueError("images given to a model without a vision tower")
        x = model.embed_tokens(ids)
        cos, sin = model.rotary(pos, x.dtype)
    for li, layer in enumerate(model.layers):
        att = layer.self_attn
        q, k, v = att.project(layer.input_layernorm(x), cos, sin)
        cache.k[li][rows, :, pos] = k
        cache.v[li][rows, :, pos] = v
        x = x + att.o_proj(packed_attention(q, k, v, cu, max(lens)).reshape(len(ids), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.lengths = torch.tensor(lens, dtype=torch.long, device=device)
    last = cu[1:].long() - 1
    return model.logits(model.norm(x[last]))


def _decode(model: LlamaModel, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Append one token per row at position ``cache.lengths``; return the next-token logits [B, V]."""
    cfg = model.cfg
    B = tokens.shape[0]
    pos = cache.lengths
    rows = torch.arange(B, device=tokens.device)
    x = model.embed_tokens(tokens)
    rope = pos + cache.delta
    cos, sin = model.rotary(rope.expand(3, -1) if hasattr(model, "visual") else rope, x.dtype)
    # only the filled prefix: the positions past the longest row are masked for every row anyway
    width = int(pos.max()) + 1
    visible = (torch.arange(width, device=tokens.device)[None, :] <= pos[:, None])[:, None, None, :]  # [B,1,1,W]
    gqa = cfg.num_heads != cfg.num_kv_heads
    for li, layer in enumerate(model.layers):
        att = layer.self_attn
        q, k, v = att.project(layer.input_layernorm(x), cos, sin)
        cache.k[li][rows, :, pos], cache.v[li][rows, :, pos] = k, v
        keys, vals = cache.k[li][:, :, :width], cache.v[li][:, :, :width]  # [B, Hkv, W, D], views
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, vals, attn_mask=visible,
                                             enable_gqa=gqa)  # [B, H, 1, D]
        x = x + att.o_proj(out.reshape(B, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.lengths = pos + 1
    return model.logits(model.norm(x))


@torch.no_grad()
def generate(model: LlamaModel, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, eos_token_id: int | Collection[int] | None = None, seed: int | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True,
             images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
             ) -> tuple[list[list[int]], list[list[float]]]:
    """Sample continuations for every prompt at once: a KV-cached decode (or, with ``use_cache=False``, a packed
    forward over everything each step). ``images``: a vision-language model's ``(pixel_values, image_grid_thw)``
    per prompt (None for a prompt without images); cached decoding only.

    Returns (response token lists, log-prob lists); a response stops after any of ``eos_token_id`` (one id or
    several, e.g. ``<|im_end|>`` and ``<|endoftext|>``; the stop token is kept) or at ``max_new_tokens``.
    Sampling is reproducible from ``seed`` or ``generator``.
    """
    stops = _stop_set(eos_token_id)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    device = next(model.parameters()).device
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else int(seed))
    was_training = model.training
    model.eval()
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    if images is not None and not use_cache:
        raise ValueError("generation with images runs the KV-cached decode (use_cache=True)")
    if use_cache and prompts and max_new_tokens > 0:
        try:
            return _generate_cached(model, prompts, max_new_tokens, temperature, top_p, stops, generator, device,
                                    images)
        finally:
            model.train(was_training)
    try:
        for _ in range(max_new_tokens):
            if not active:
                break
            lens = [len(seqs[i]) for i in active]
            ids = torch.tensor([t for i in active for t in seqs[i]], dtype=torch.long, device=device)
            pos = torch.cat([torch.arange(n, device=device) for n in lens])
            cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
            logits = model(ids, pos, cu)[cu[1:].long() - 1]
            tok, lp = sample_next(logits, temperature, top_p, generator)
            still = []
            for j, i in enumerate(active):
                t = int(tok[j])
                seqs[i].append(t)
                outs[i].append(t)
                lps[i].append(float(lp[j]))
                if t not in stops:
                    still.append(i)
            active = still
    finally:
        model.train(was_training)
    return outs, lps


def _stop_set(eos_token_id: int | Collection[int] | None) -> frozenset[int]:
    """The stop ids as a set; an id that is not a non-negative int is an error naming it."""
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise ValueError(f"eos_token_id must be an int >= 0 or a collection of them, got {eos_token_id!r}")
    return frozenset(ids)


def _generate_cached(model, prompts, max_new_tokens, temperature, top_p, stops, generator, device, images=None):
    dtype = next(model.parameters()).dtype
    cap = max(len(p) for p in prompts) + max_new_tokens
    cache = KVCache(model, len(prompts), cap, device, dtype)
    logits = _prefill(model, prompts, cache, device, images)
    outs: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        tok, lp = sample_next(logits, temperature, top_p, generator)
        for i, (t, l) in enumerate(zip(tok.tolist(), lp.tolist())):
            if done[i]:
                continue
            outs[i].append(t)
            lps[i].append(l)
            if t in stops:
                done[i] = True
        if all(done) or step == max_new_tokens - 1:
            break
        logits = _decode(model, tok, cache)  # finished rows keep decoding; their tokens are dropped
    return outs, lps
