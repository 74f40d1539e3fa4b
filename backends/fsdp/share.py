"""Read and validate an engine share: per-sample token fields, lengths, padding flags and the token budget."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.fields import IMAGE_GRID_THW, INFER_INPUT_FIELDS, PIXEL_VALUES, TRAIN_INPUT_FIELDS

from backends.base import Share

__all__ = ["ShareView", "read_share", "ShareError", "PIXELS", "GRIDS"]

TRAIN_FIELDS = TRAIN_INPUT_FIELDS
INFER_FIELDS = INFER_INPUT_FIELDS


class ShareError(ValueError):
    """A share whose fields, lengths or micro-batches cannot be computed on; the message names the field."""


@dataclass
class ShareView:
    """Per-sample 1-D tensors of a share (positions as in ``share.data``) and their lengths."""

    n: int
    input_ids: list[torch.Tensor]
    response_mask: list[torch.Tensor]
    seq_lens: list[int]
    response_lens: list[int]
    old_log_probs: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None
    ref_log_prob: list[torch.Tensor] | None = None
    rollout_is_weights: list[torch.Tensor] | None = None
    is_padding: torch.Tensor | None = None
    extra: dict[str, list[torch.Tensor]] | None = None  # the per-response fields asked for by name (``fields=``)
    # a vision-language share: each sample's patches [N_i, patch_dim] and image grids [k_i, 3] (k_i may be 0)
    pixel_values: list[torch.Tensor] | None = None
    image_grid_thw: list[torch.Tensor] | None = None


def _rows(data, name: str, n: int) -> list[torch.Tensor]:
    t = data.get(name)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"share field {name!r} must be a tensor (jagged nested or dense [n, L]), got {type(t).__name__}")
    if t.is_nested:
        if t.layout != torch.jagged:
            raise TypeError(f"share field {name!r} must use the torch.jagged nested layout, got {t.layout}")
        rows = list(t.unbind())
    elif t.dim() == 2:
        rows = list(t.unbind(0))
    else:
        raise ShareError(f"share field {name!r} must be per-sample 1-D (jagged [n, *] or dense [n, L]), "
                         f"got shape {tuple(t.shape)}")
    if len(rows) != n:
        raise ShareError(f"share field {name!r} has {len(rows)} samples, the share has {n}")
    for i, r in enumerate(rows):
        if r.dim() != 1:
            raise ShareError(f"share field {name!r} sample {i} must be 1-D, got shape {tuple(r.shape)}")
    return rows


#: a vision-language share's fields: per sample, its images' patches flattened ([N_i * patch_dim]) and their grids
#: flattened ([k_i * 3], t, h, w per image), the processor's ``pixel_values`` / ``image_grid_thw`` cut by sample
PIXELS, GRIDS = PIXEL_VALUES, IMAGE_GRID_THW


def _read_images(view: ShareView, data, n: int) -> None:
    if PIXELS not in data.keys() or GRIDS not in data.keys():
        raise ShareError(f"a share with images needs both {PIXELS!r} and {GRIDS!r}")
    pixels, grids = _rows(data, PIXELS, n), _rows(data, GRIDS, n)
    view.pixel_values, view.image_grid_thw = [], []
    for i, (p, g) in enumerate(zip(pixels, grids)):
        if g.numel() % 3 or g.is_floating_point():
            raise ShareError(f"{GRIDS} sample {i} must hold integer (t, h, w) triples, got {g.numel()} values "
                             f"of {g.dtype}")
        g = g.view(-1, 3).long()
        patches = int(g.prod(-1).sum())
        if (patches == 0) != (p.numel() == 0) or (patches and p.numel() % patches):
            raise ShareError(f"{PIXELS} sample {i} has {p.numel()} values for {patches} patches "
                             f"(image_grid_thw {g.tolist()})")
        view.pixel_values.append(p.view(patches, -1) if patches else p.view(0, 0))
        view.image_grid_thw.append(g)


def read_share(share: Share, *, train: bool, use_kl_loss: bool = False, max_tokens: int | None = None,
               fields: tuple[str, ...] = ()) -> ShareView:
    """Unpack ``share`` into per-sample rows, checking every field, length and the micro-batch token budget.

    ``fields``: further per-response fields (each of length ``response_len``) to read into ``view.extra``, such as
    the critic's ``values`` and ``returns``."""
    if not isinstance(share, Share):
        raise TypeError(f"expected a backends.base.Share, got {type(share).__name__}")
    data = share.data
    n = int(data.batch_size[0]) if len(data.batch_size) else 0
    need = list(TRAIN_FIELDS if train else INFER_FIELDS) + (["ref_log_prob"] if train and use_kl_loss else []) \
        + list(fields)
    present = set(data.keys())
    missing = [f for f in need if f not in present]
    if missing:
        why = " (actor.loss.use_kl_loss is on)" if "ref_log_prob" in missing else ""
        raise KeyError(f"share is missing field(s) {missing}{why}; it has {sorted(map(str, present))}")
    ids = _rows(data, "input_ids", n)
    rmask = _rows(data, "response_mask", n)
    seq_lens = [int(r.shape[0]) for r in ids]
    rlens = [int(r.shape[0]) for r in rmask]
    for i, (s, r) in enumerate(zip(seq_lens, rlens)):
        if r > s - 1:
            raise ShareError(f"sample {i}: response_len={r} (from response_mask) needs prompt_len = seq_len - "
                             f"response_len >= 1, but seq_len={s} (from input_ids)")
    for i, x in enumerate(ids):
        if x.is_floating_point():
            raise TypeError(f"share field 'input_ids' must hold integer token ids, sample {i} has dtype {x.dtype}")
    view = ShareView(n=n, input_ids=ids, response_mask=rmask, seq_lens=seq_lens, response_lens=rlens)
    weighted = ("rollout_is_weights",) if train and "rollout_is_weights" in present else ()
    per_response = (("old_log_probs", "advantages") + (("ref_log_prob",) if use_kl_loss else ()) + weighted
                    if train else ()) + tuple(fields)
    for name in per_response:
        rows = _rows(data, name, n)
        for i, (x, r) in enumerate(zip(rows, rlens)):
            if x.shape[0] != r:
                raise ShareError(f"share field {name!r} sample {i} has length {x.shape[0]}, expected "
                                 f"response_len={r} (the length of its response_mask)")
        if name in fields:
            view.extra = {**(view.extra or {}), name: rows}
        else:
            setattr(view, name, rows)
    if PIXELS in present or GRIDS in present:
        _read_images(view, data, n)
    if "is_padding" in present:
        pad = data.get("is_padding")
        if not isinstance(pad, torch.Tensor) or pad.is_nested or tuple(pad.shape) != (n,):
            raise ShareError(f"share field 'is_padding' must be a dense [n]=[{n}] bool tensor, got "
                             f"{tuple(pad.shape) if isinstance(pad, torch.Tensor) else type(pad).__name__}")
        view.is_padding = pad.bool()
    empty = [k for k, mb in enumerate(share.micro_batches) if not mb]
    if empty:
        raise ShareError(f"micro-batches {empty} are empty; every micro-batch needs a sample (all ranks of the FSDP "
                         f"mesh run the same forwards), e.g. a padding sample")
    if max_tokens is not None:
        for k, mb in enumerate(share.micro_batches):
            total = sum(seq_lens[i] for i in mb)
            if total > max_tokens:
                big = max(mb, key=lambda i: seq_lens[i])
                raise ShareError(f"micro-batch {k} holds {total} tokens over {len(mb)} samples, more than "
                                 f"max_token_len_per_gpu={max_tokens} (its longest, sample {big}, has seq_len="
                                 f"{seq_lens[big]}); re-plan micro-batches with this budget or raise it")
    return view
