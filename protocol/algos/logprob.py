"""Token log-probs and entropy from packed logits: the loss inputs both engines compute the same way."""
from __future__ import annotations

import torch

__all__ = ["response_logit_positions", "token_logprobs_and_entropy", "logprobs_of_targets", "entropy_from_logits"]


def response_logit_positions(cu_seqlens: torch.Tensor, response_lens: torch.Tensor | list[int]):
    """(logit_pos, target_pos) [R] for every response token of a packed batch, samples in order.

    Response token j of a sample starting at s with prompt_len P sits at s + P + j and is predicted by the logits
    at s + P + j - 1. Raises ValueError when a response is longer than seq_len - 1 (prompt_len must be >= 1).
    """
    cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    rl = [int(r) for r in (response_lens.tolist() if torch.is_tensor(response_lens) else response_lens)]
    if len(rl) != len(cu) - 1:
        raise ValueError(f"response_lens has {len(rl)} entries but cu_seqlens describes {len(cu) - 1} sequences")
    targets = []
    for i, (s, e, r) in enumerate(zip(cu[:-1], cu[1:], rl)):
        seq_len = e - s
        if r < 0 or r > seq_len - 1:
            raise ValueError(f"sample {i}: response_len={r} needs 0 <= response_len <= seq_len - 1 = {seq_len - 1} "
                             f"(prompt_len >= 1 so the first response token has a predicting position)")
        targets.append(torch.arange(e - r, e))
    tgt = torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long)
    return tgt - 1, tgt


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, in fp32: logsumexp(z) - sum(softmax(z) * z)."""
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                               response_lens: torch.Tensor | list[int], temperature: float = 1.0,
                               with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and entropy) of each response token from packed logits [T, V], at ``temperature``.

    Returns flat fp32 tensors [sum(response_lens)], samples concatenated in order (split by response_lens to
    get per-sample values); entropy is None unless ``with_entropy``. Differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if logits.dim() != 2 or input_ids.dim() != 1 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(f"expected logits [T, V] and input_ids [T]; got {tuple(logits.shape)} and "
                         f"{tuple(input_ids.shape)}")
    lpos, tpos = response_logit_positions(cu_seqlens, response_lens)
    lpos, tpos = lpos.to(logits.device), tpos.to(logits.device)
    return logprobs_of_targets(logits.index_select(0, lpos), input_ids.index_select(0, tpos), temperature,
                               with_entropy)


def logprobs_of_targets(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] per row of logits [R, V] (fp32), and the entropy if asked."""
    z = logits.float() / temperature
    logp = z.log_softmax(-1).gather(-1, targets.long()[:, None]).squeeze(-1)
    return logp, (entropy_from_logits(z) if with_entropy else None)

