"""Shared by the vision-language tests and their 2-rank worker: token ids of a tiny Qwen2-VL's vision tokens,
sequences with image runs, a batch of them with random pixels, and each sequence's log-probs by the model alone."""
from __future__ import annotations

import torch

__all__ = ["IMAGE", "VIDEO", "START", "END", "sequence", "vl_rows", "reference_logprobs", "without_placeholders"]

IMAGE, VIDEO, START, END = 150, 151, 152, 153
RESPONSE = [20, 21, 22]  # the response tokens every sequence of vl_rows ends with


def sequence(text: list[int], grids: list[tuple[int, int, int]], merge: int = 2) -> list[int]:
    """``text`` with each image's <vision_start> image tokens <vision_end> run inserted after its first token."""
    ids = text[:1]
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // merge ** 2) + [END]
    return ids + text[1:]


def vl_rows(patch_dim: int, cases, seed: int = 2):
    """Per case (text, grids): the sequence + RESPONSE, its response mask, its pixels (flattened, random) and its
    grids (flattened)."""
    gen = torch.Generator().manual_seed(seed)
    ids, masks, pixels, grids = [], [], [], []
    for text, g in cases:
        ids.append(torch.tensor(sequence(text, g) + RESPONSE))
        masks.append(torch.ones(len(RESPONSE), dtype=torch.long))
        pixels.append(torch.randn(int(sum(t * h * w for t, h, w in g)) * patch_dim, generator=gen))
        grids.append(torch.tensor(g, dtype=torch.long).reshape(-1))
    return ids, masks, pixels, grids


@torch.no_grad()
def reference_logprobs(model, ids, pixels, grids) -> list[torch.Tensor]:
    """Each sequence's log-probs of its RESPONSE tokens, the model run on that sequence alone (fp32)."""
    from backends.model.vision import mrope_positions

    out = []
    n = len(RESPONSE)
    for seq, p, g in zip(ids, pixels, grids):
        g = g.view(-1, 3)
        images = dict(pixel_values=p.view(-1, model.vl.vision.patch_dim), image_grid_thw=g) if g.numel() else {}
        logits = model(seq, mrope_positions(seq, IMAGE, g, 2), torch.tensor([0, len(seq)], dtype=torch.int32),
                       **images)
        out.append(torch.log_softmax(logits[-n - 1:-1].double(), -1).gather(1, seq[-n:, None]).squeeze(1).float())
    return out


def without_placeholders(logits: torch.Tensor, ids=(IMAGE, VIDEO)) -> torch.Tensor:
    """transformers' logits as the project's policy defines them: the image and video placeholders (``ids``) never
    sampled (their logits -inf; the project's VLModel sets them to -1e9, which exp() also takes to 0)."""
    return logits.index_fill(-1, torch.tensor(list(ids)), float("-inf"))
