"""A Qwen2-VL / Qwen2.5-VL policy: the vision tower (patch embedding, 2-D rotary transformer blocks, 2x2 patch merger),
its image features placed at the image tokens of the decoder's input, and the decoder's multimodal rotary
positions (M-RoPE: temporal / height / width sections of the rotary frequencies).

* :class:`VisionTower` maps an image's flattened patches (``pixel_values`` rows of ``C * T * P * P`` values, as
  transformers' image processor writes them, in merge-block order) to one feature per ``merge x merge`` block.
  Attention is bidirectional within each frame of each image.
* :func:`mrope_positions` gives a sequence's ``[3, T]`` positions: a text token advances all three by one; an
  image's tokens take ``(start + t, start + row, start + col)`` of its merged grid, and the text after it starts at
  ``start + max(rows, cols)``.
* :class:`VLModel` is the decoder (:class:`~backends.model.llama.LlamaModel`, the Qwen2 layout) plus ``visual``;
  its forward takes the packed batch's ``pixel_values`` and ``image_grid_thw`` besides the token ids.

Weight names follow the project's decoder (``embed_tokens``, ``layers.*``, ``norm``, ``lm_head``) plus transformers'
own vision names under ``visual.*`` (``visual.blocks.{i}.attn.qkv``, ``visual.merger.mlp.0`` ...).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from backends.model.config import ModelConfig
from backends.model.hf import HFCheckpointError, check_weights, config_from_hf, read_weight_files
from backends.model.llama import AttentionFn, LlamaModel, RMSNorm, apply_rotary, rope_inv_freq

__all__ = ["VisionConfig", "VLConfig", "VisionTower", "VLModel", "patch_positions", "frame_cu_seqlens",
           "window_order", "mrope_positions", "packed_vl_inputs", "mrope_cos_sin", "read_vl_config", "vl_name",
           "vl_state_dict", "load_vl_checkpoint", "attention_spans", "is_vl_folder", "VL_FAMILIES",
           "PLACEHOLDER_LOGIT"]

#: the logit of a placeholder token (finite, so entropies stay finite; exp of it is 0 in float32 and bfloat16)
PLACEHOLDER_LOGIT = -1e9

#: the ``model_type`` of the vision-language folders the policy reads
VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a Qwen2-VL or Qwen2.5-VL checkpoint (``vision_config`` of its config.json).

    ``family`` qwen2_vl: LayerNorm blocks with a quick-GELU MLP of ``mlp_ratio`` x width, every block attending
    over whole frames. qwen2_5_vl: RMSNorm blocks with a SwiGLU MLP (biases) of ``intermediate_size``; the blocks
    in ``fullatt_blocks`` attend over whole frames, the others within windows of ``window_size`` pixels."""

    depth: int = 2
    embed_dim: int = 16
    num_heads: int = 2
    mlp_ratio: float = 4.0
    out_hidden_size: int = 64  # the decoder's hidden size (the merger's output)
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    family: str = "qwen2_vl"  # qwen2_vl | qwen2_5_vl
    intermediate_size: int = 0  # qwen2_5_vl: the SwiGLU MLP's width
    window_size: int = 112  # qwen2_5_vl: the attention window's side, in pixels
    fullatt_blocks: tuple[int, ...] = ()  # qwen2_5_vl: the blocks that attend over whole frames

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise HFCheckpointError(f"vision_config: embed_dim={self.embed_dim} / num_heads={self.num_heads} must be "
                                    f"a head size divisible by 4 (2-D rotary halves)")
        if self.family not in ("qwen2_vl", "qwen2_5_vl"):
            raise HFCheckpointError(f"vision family {self.family!r}: qwen2_vl or qwen2_5_vl")
        if self.family == "qwen2_5_vl" and (self.intermediate_size < 1 or self.window_units < 1):
            raise HFCheckpointError(f"vision_config: intermediate_size={self.intermediate_size} and window_size="
                                    f"{self.window_size} (at least patch_size x spatial_merge_size) are needed")

    @property
    def window_units(self) -> int:
        """A window's side in merged units (qwen2_5_vl)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (a ``pixel_values`` row)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def mlp_width(self) -> int:
        """A block's MLP width: ``mlp_ratio`` x width (qwen2_vl) or ``intermediate_size`` (qwen2_5_vl's SwiGLU)."""
        return self.intermediate_size if self.family == "qwen2_5_vl" else int(self.embed_dim * self.mlp_ratio)

    @property
    def mlp_matrices(self) -> int:
        """A block's MLP matrices of width x mlp_width: 2, or 3 for the SwiGLU."""
        return 3 if self.family == "qwen2_5_vl" else 2


@dataclass(frozen=True)
class VLConfig:
    """A vision-language policy: the decoder's :class:`ModelConfig` (Qwen2 layout), the vision tower, the image
    placeholder token and the M-RoPE sections (frequencies per temporal / height / width, summing to head_dim / 2)."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    mrope_section: tuple[int, int, int]
    video_token_id: int | None = None  # the video placeholder (a placeholder the policy never samples, as the image's)

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The tokens that stand for pixels: prompt-only, never sampled (:meth:`VLModel.forward`)."""
        return (self.image_token_id,) + (() if self.video_token_id is None else (self.video_token_id,))

    def __post_init__(self) -> None:
        if sum(self.mrope_section) != self.text.head_dim // 2:
            raise HFCheckpointError(f"rope_parameters.mrope_section={list(self.mrope_section)} must sum to "
                                    f"head_dim / 2 = {self.text.head_dim // 2}")
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise HFCheckpointError(f"vision_config.hidden_size={self.vision.out_hidden_size} must equal the "
                                    f"decoder's hidden_size={self.text.hidden_size}")
        for key in ("image_token_id", "video_token_id"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.text.vocab_size:
                raise HFCheckpointError(f"{key}={value} is outside the vocabulary ({self.text.vocab_size})")


# ----------------------------------------------------------------------------------------------------- positions
def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) [N, 2] of every patch, images in order, each frame's patches in merge-block order (the blocks
    row by row, the ``merge x merge`` patches of a block row by row), repeated for each frame."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        block = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], dim=-1)
        out.append(block.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """Offsets [frames + 1] (int32) of the frames: the vision tower attends within each."""
    sizes = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
    return torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def window_order(grid_thw: torch.Tensor, merge: int, units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's windows: the merged units of each frame in window order (windows of ``units x units`` merged
    units, row by row, the units of a window row by row; windows at the right and bottom edges smaller), as a
    permutation of the merged units [M], and the windows' offsets in patches (int32, empty windows dropped)."""
    order, sizes, base = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        for f in range(t):
            for r0 in range(0, gh, units):
                for c0 in range(0, gw, units):
                    rows = torch.arange(r0, min(r0 + units, gh))
                    cols = torch.arange(c0, min(c0 + units, gw))
                    order.append((base + f * gh * gw + rows[:, None] * gw + cols[None, :]).reshape(-1))
                    sizes.append(len(rows) * len(cols) * merge * merge)
        base += t * gh * gw
    perm = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    return perm, torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def attention_spans(cfg: VisionConfig, grid_thw: torch.Tensor) -> list[int]:
    """The patch counts of the spans the tower's attention runs over, images in order: each frame (Qwen2-VL), each
    window (Qwen2.5-VL, whose blocks but ``fullatt_blocks`` use windows); the dispatch's ``vision_spans`` tag."""
    if cfg.family == "qwen2_vl":
        return [int(x) for x in frame_cu_seqlens(grid_thw).diff().tolist()]
    return [int(x) for x in window_order(grid_thw, cfg.spatial_merge_size, cfg.window_units)[1].diff().tolist()]


def mrope_positions(input_ids: torch.Tensor, image_token_id: int, grid_thw: torch.Tensor, merge: int
                    ) -> torch.Tensor:
    """[3, T] positions of one sequence whose images (rows of ``grid_thw``, in order) each fill a run of
    ``t * h * w / merge²`` image tokens. A run whose length is not its images' is an error."""
    ids = input_ids.tolist()
    grids = grid_thw.tolist()
    out = torch.empty(3, len(ids), dtype=torch.long)
    pos = i = g = 0
    while i < len(ids):
        if ids[i] != image_token_id:  # a text run: one position per token, the same on the three rows
            try:
                j = ids.index(image_token_id, i)
            except ValueError:
                j = len(ids)
            out[:, i:j] = torch.arange(pos, pos + j - i)
            pos, i = pos + j - i, j
            continue
        if g >= len(grids):
            raise ValueError(f"image token at position {i} beyond the {len(grids)} image(s) of the sequence")
        t, h, w = grids[g]
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if ids[i:i + n] != [image_token_id] * n:
            raise ValueError(f"image {g} (grid {t}x{h}x{w}) needs {n} image tokens from position {i}; the sequence "
                             f"has {sum(1 for x in ids[i:i + n] if x == image_token_id)}")
        tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw).reshape(-1)
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).reshape(-1)
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).reshape(-1)
        out[:, i:i + n] = torch.stack([tt, hh, ww]) + pos
        pos, i, g = pos + max(gh, gw), i + n, g + 1
    if g != len(grids):
        raise ValueError(f"the sequence has image tokens for {g} of its {len(grids)} images")
    return out


def packed_vl_inputs(cfg: VLConfig, rows: list[torch.Tensor],
                     images: list[tuple[torch.Tensor, torch.Tensor] | None], device: torch.device | str = "cpu"
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A packed batch's [3, T] positions (each sequence's :func:`mrope_positions`) and the keywords that give
    :class:`VLModel` its images (``pixel_values``, ``image_grid_thw``: the sequences' images in order; none when no
    sequence has one). ``images[i]``: sequence i's ``(pixel_values [N, patch_dim], image_grid_thw [k, 3])``, or
    None."""
    none = torch.zeros(0, 3, dtype=torch.long)
    pos = torch.cat([mrope_positions(ids, cfg.image_token_id, im[1] if im is not None else none,
                                     cfg.vision.spatial_merge_size) for ids, im in zip(rows, images)], dim=1)
    present = [im for im in images if im is not None and im[1].numel()]
    if not present:
        return pos.to(device), {}
    return pos.to(device), {"pixel_values": torch.cat([im[0] for im in present]).to(device),
                            "image_grid_thw": torch.cat([im[1] for im in present])}


def mrope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, int, int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] of multimodal rotary positions ``[3, T]``: frequency j rotates by the temporal,
    height or width position as j falls in the first, second or third ``section`` (fp32, then ``dtype``)."""
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section)).to(position_ids.device)
    pos = position_ids.to(torch.float32).index_select(0, axis)  # [d/2, T]: each frequency's own position row
    freqs = pos.t() * inv_freq.to(position_ids.device, torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# -------------------------------------------------------------------------------------------------- vision tower
class _VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: list[int]) -> torch.Tensor:
        n, h, d = x.shape[0], self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).view(n, 3, h, d).unbind(1)
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)  # rotated in fp32, as the reference does
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = torch.empty_like(q)
        for a, b in zip(cu, cu[1:]):  # bidirectional within each frame
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1)).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class _VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_width
        self.fc1 = nn.Linear(cfg.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, cfg.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))  # quick GELU


class _VisionSwiGLU(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.embed_dim, cfg.mlp_width)
        self.up_proj = nn.Linear(cfg.embed_dim, cfg.mlp_width)
        self.down_proj = nn.Linear(cfg.mlp_width, cfg.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _vision_norm(cfg: VisionConfig) -> nn.Module:
    return nn.LayerNorm(cfg.embed_dim, eps=1e-6) if cfg.family == "qwen2_vl" else RMSNorm(cfg.embed_dim, 1e-6)


class _VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _vision_norm(cfg)
        self.norm2 = _vision_norm(cfg)
        self.attn = _VisionAttention(cfg)
        self.mlp = _VisionMLP(cfg) if cfg.family == "qwen2_vl" else _VisionSwiGLU(cfg)

    def forward(self, x, cos, sin, cu):
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel_size=k, stride=k, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # a kernel-sized stride over exactly one patch: the convolution is one matrix product per patch
        return F.linear(pixels.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class _PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size ** 2
        self.ln_q = _vision_norm(cfg)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width,
                                                                                          cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTower(nn.Module):
    """``forward(pixel_values [N, patch_dim], grid_thw [images, 3]) -> [N / merge², out_hidden_size]``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = _PatchEmbed(cfg)
        self.blocks = nn.ModuleList(_VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = _PatchMerger(cfg)

    def rotary(self, grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim] (fp32): a quarter of the head's frequencies for the row, a quarter for the column,
        the rotate-half layout doubling them."""
        quarter = self.cfg.head_dim // 2
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        pos = patch_positions(grid_thw, self.cfg.spatial_merge_size).to(device, torch.float32)
        freqs = (pos[:, :, None] * inv.to(device)[None, None, :]).flatten(1)  # [N, (row freqs, col freqs)]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        n = int(sum(t * h * w for t, h, w in grid_thw.tolist()))
        m = self.cfg.spatial_merge_size
        if pixel_values.dim() != 2 or pixel_values.shape != (n, self.cfg.patch_dim):
            raise ValueError(f"pixel_values must be [{n}, {self.cfg.patch_dim}] for image_grid_thw "
                             f"{grid_thw.tolist()}, got {tuple(pixel_values.shape)}")
        if any(h % m or w % m for _, h, w in grid_thw.tolist()):
            raise ValueError(f"image_grid_thw {grid_thw.tolist()}: heights and widths must be multiples of the "
                             f"spatial merge size {m}")
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grid_thw, x.device)
        frames = frame_cu_seqlens(grid_thw).tolist()
        if self.cfg.family == "qwen2_vl":
            for block in self.blocks:
                x = block(x, cos, sin, frames)
            return self.merger(x)
        # Qwen2.5-VL: tokens in window order (merged units kept whole; a frame's windows stay within it), windowed
        # attention except in the full-attention blocks, the merged features put back in image order
        perm, windows = window_order(grid_thw, m, self.cfg.window_units)
        unit = m * m
        by_unit = (perm[:, None] * unit + torch.arange(unit)[None, :]).reshape(-1).to(x.device)
        x, cos, sin = x.index_select(0, by_unit), cos.index_select(0, by_unit), sin.index_select(0, by_unit)
        windows = windows.tolist()
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.cfg.fullatt_blocks else windows)
        return self.merger(x).index_select(0, torch.argsort(perm).to(x.device))


# ---------------------------------------------------------------------------------------------------- the policy
class VLModel(LlamaModel):
    """The decoder with a vision tower: ``forward(input_ids [T], position_ids [3, T], cu_seqlens, pixel_values=None,
    image_grid_thw=None)`` (:meth:`LlamaModel.forward`, the images handed to :meth:`hidden_states`); the images'
    features (in the order of their image tokens in the packed batch) replace the image tokens' embeddings."""

    def __init__(self, cfg: VLConfig) -> None:
        super().__init__(cfg.text)
        self.vl = cfg
        self.visual = VisionTower(cfg.vision)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """:meth:`LlamaModel.logits` with the placeholder tokens' logits at :data:`PLACEHOLDER_LOGIT`: they stand
        for pixels a response cannot carry, so the policy never samples them (a sampled one would meet no image in
        every later model call: the mismatch of image tokens and features seen with unmasked samplers). Sampler
        and trainer both end here, so their log-probs agree."""
        ids = torch.tensor(self.vl.placeholder_ids, device=h.device)
        return super().logits(h).index_fill(-1, ids, PLACEHOLDER_LOGIT)

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() != 2 or position_ids.shape[0] != 3:
            raise ValueError(f"a vision-language model takes [3, T] positions (mrope_positions), got "
                             f"{tuple(position_ids.shape)}")
        return mrope_cos_sin(position_ids, rope_inv_freq(self.cfg), self.vl.mrope_section, dtype)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        image = input_ids == self.vl.image_token_id
        if pixel_values is None:
            if bool(image.any()):
                raise ValueError(f"{int(image.sum())} image tokens without pixel_values")
            return x
        features = self.visual(pixel_values, image_grid_thw).to(x.dtype)
        if features.shape[0] != int(image.sum()):
            raise ValueError(f"the images give {features.shape[0]} features for {int(image.sum())} image tokens")
        return x.masked_scatter(image[:, None], features)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      attention: AttentionFn | None = None, pixel_values: torch.Tensor | None = None,
                      image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 1 or position_ids.shape != (3, input_ids.shape[0]):
            raise ValueError(f"input_ids must be [T] and position_ids [3, T]; got {tuple(input_ids.shape)} and "
                             f"{tuple(position_ids.shape)}")
        x = self.embed(input_ids, pixel_values, image_grid_thw)
        return self.run_layers(x, position_ids, cu_seqlens, attention)


# ------------------------------------------------------------------------------------------ Hugging Face folders
def read_vl_config(path: str) -> VLConfig:
    """The :class:`VLConfig` of a ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
    folder (what it cannot represent is refused)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise HFCheckpointError(f"model.hf_path={path!r} has no config.json")
    with open(cfg_file) as fh:
        raw = json.load(fh)
    family = raw.get("model_type")
    if family not in VL_FAMILIES:
        raise HFCheckpointError(f"{path}: model_type={family!r}; the vision-language policy reads qwen2_vl and "
                                f"qwen2_5_vl folders")
    text, vision = dict(raw.get("text_config") or raw), dict(raw.get("vision_config") or {})
    rope = dict(text.get("rope_parameters") or {})
    section = tuple(int(s) for s in rope.pop("mrope_section", ()) or ())
    if len(section) != 3:
        raise HFCheckpointError(f"{path}: rope_parameters.mrope_section must have 3 entries, got {list(section)}")
    text.update(model_type="qwen2", rope_parameters=rope, tie_word_embeddings=raw.get("tie_word_embeddings", False))
    act = vision.get("hidden_act", "quick_gelu" if family == "qwen2_vl" else "silu")
    if act != ("quick_gelu" if family == "qwen2_vl" else "silu"):
        raise HFCheckpointError(f"{path}: vision_config.hidden_act={act!r} is not {family}'s")
    vrope = vision.get("rope_parameters") or {}
    # Qwen2-VL names the tower's width embed_dim and the decoder's hidden_size; Qwen2.5-VL hidden_size and
    # out_hidden_size
    widths = (vision["embed_dim"], vision["hidden_size"]) if family == "qwen2_vl" else \
        (vision["hidden_size"], vision["out_hidden_size"])
    vcfg = VisionConfig(depth=int(vision["depth"]), embed_dim=int(widths[0]),
                        num_heads=int(vision["num_heads"]), mlp_ratio=float(vision.get("mlp_ratio", 4)),
                        out_hidden_size=int(widths[1]), in_channels=int(vision.get("in_channels", 3)),
                        family=family, intermediate_size=int(vision.get("intermediate_size") or 0),
                        window_size=int(vision.get("window_size", 112)),
                        fullatt_blocks=tuple(int(i) for i in vision.get("fullatt_block_indexes") or ()),
                        patch_size=int(vision.get("patch_size", 14)),
                        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                        rope_theta=float(vrope.get("rope_theta", 10000.0)))
    tcfg = dataclasses.replace(config_from_hf(text), hf_path=path)
    video = raw.get("video_token_id")
    return VLConfig(text=tcfg, vision=vcfg, image_token_id=int(raw["image_token_id"]), mrope_section=section,
                    video_token_id=None if video is None or int(video) >= tcfg.vocab_size else int(video))


def is_vl_folder(path: str) -> bool:
    """Whether ``path/config.json`` names a vision-language family (:data:`VL_FAMILIES`)."""
    try:
        with open(os.path.join(path, "config.json")) as fh:
            return json.load(fh).get("model_type") in VL_FAMILIES
    except (OSError, ValueError):
        return False


def vl_name(name: str) -> str:
    """transformers' weight name (``model.language_model.*``, ``model.visual.*``, ``lm_head``; or the older
    ``model.*`` / ``visual.*``) as :class:`VLModel` names it."""
    for old, new in (("model.language_model.", ""), ("model.visual.", "visual."), ("visual.", "visual."),
                     ("model.", "")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def vl_state_dict(sd: Mapping[str, torch.Tensor], cfg: VLConfig) -> dict[str, torch.Tensor]:
    """A vision-language folder's weights in :class:`VLModel`'s names (:func:`vl_name`), every weight checked."""
    out = {vl_name(name): t for name, t in sd.items()}
    with torch.device("meta"):
        want = {n: tuple(p.shape) for n, p in VLModel(cfg).named_parameters()}
    check_weights(out, want, f"the qwen2_vl checkpoint {cfg.text.hf_path}", HFCheckpointError)
    return out


def load_vl_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> VLModel:
    """A :class:`VLModel` holding the weights of a ``Qwen2VLForConditionalGeneration`` folder (one process)."""
    cfg = read_vl_config(path)
    model = VLModel(cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in vl_state_dict(read_weight_files(path), cfg).items()},
                          strict=True)
    return model.to(dtype).eval()

