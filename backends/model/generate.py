"""Batched autoregressive sampling for rollout: temperature, top-p, EOS, with the sampling log-probs."""
from __future__ import annotations

import torch

from backends.model.llama import LlamaModel

__all__ = ["generate", "sample_next"]


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None):
    """Sample one token per row of logits [B, V]; return (tokens [B], log-probs [B]) at ``temperature``.

    temperature == 0 is greedy. The log-prob is log_softmax(logits / temperature) of the chosen token (before
    top-p truncation), i.e. what a recompute of the same tokens at that temperature gives.
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
        keep = (sp.cumsum(-1) - sp) < top_p  # keep the smallest prefix whose mass reaches top_p
        keep[:, 0] = True
        sp = sp * keep
        choice = torch.multinomial(sp / sp.sum(-1, keepdim=True), 1, generator=generator)
        tokens = si.gather(-1, choice).squeeze(-1)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def generate(model: LlamaModel, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, eos_token_id: int | None = None, seed: int | None = None,
             generator: torch.Generator | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Sample continuations for every prompt at once (packed forward each step, no KV cache).

    Returns (response token lists, log-prob lists); a response stops after ``eos_token_id`` (kept) or at
    ``max_new_tokens``. Sampling is reproducible from ``seed`` or ``generator``.
    """
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
                if eos_token_id is None or t != eos_token_id:
                    still.append(i)
            active = still
    finally:
        model.train(was_training)
    return outs, lps
