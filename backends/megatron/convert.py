"""Weights both ways between the project's decoder layout and megatron-core's GPTModel (QKV groups, TP shards, PP stages).

Project layout (``backends.model.llama``): ``embed_tokens.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k,v}_proj.bias`` (Qwen2), ``layers.{i}.self_attn.{q,k}_norm.weight`` (Qwen3),
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``norm.weight``, ``lm_head.weight`` (absent when tied).

megatron-core layout, per TP rank and pipeline chunk (``{l}`` = the chunk's local layer index):

* ``decoder.layers.{l}.self_attention.linear_qkv.weight`` – for each kv group of this rank, its ``g`` query heads,
  then its key head, then its value head (``g = num_heads / num_kv_heads``); rank ``r`` holds groups
  ``[r·G/tp, (r+1)·G/tp)``; ``linear_qkv.bias`` is grouped and split the same way;
* ``self_attention.{q,k}_layernorm.weight`` (per-head norms over ``head_dim``) replicated;
* ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) split along the input dimension;
* ``decoder.layers.{l}.mlp.linear_fc1.weight`` = ``[gate shard r; up shard r]``;
* ``embedding.word_embeddings.weight`` / ``output_layer.weight`` split along the vocabulary;
* norms replicated.

LoRA adapters (``layers.{i}.{self_attn,mlp}.{proj}.lora_A`` [r, in] / ``lora_B`` [out, r]) sit on the megatron
linear that holds their projection, one pair per original projection (``linear_qkv.lora_A.q_proj``, ...): on a
column-parallel linear (qkv, fc1) A is replicated and B split along its output like the projection's rows; on a
row-parallel one (proj, fc2) A is split along its input like the weight's columns and B replicated.

Global layer ``i`` lives on the chunk whose layers carry ``layer_number = i + 1``; the engine passes that map.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from backends.model.config import ModelConfig
from backends.model.llama import parameter_shapes
from backends.model.lora import LoraSpec, adapter_shapes

__all__ = [
    "ConversionError", "qkv_to_megatron", "qkv_from_megatron", "to_megatron_shard", "from_megatron_shards",
    "expected_project_names", "ADAPTER_SPLIT", "adapter_param_names",
]

_LAYER_PREFIX = "decoder.layers."

#: projection -> (its project module, the megatron linear holding it, the adapter matrix split over TP, its dim);
#: the other matrix of the pair is replicated
ADAPTER_SPLIT: dict[str, tuple[str, str, str, int]] = {
    "q_proj": ("self_attn", "self_attention.linear_qkv", "lora_B", 0),
    "k_proj": ("self_attn", "self_attention.linear_qkv", "lora_B", 0),
    "v_proj": ("self_attn", "self_attention.linear_qkv", "lora_B", 0),
    "o_proj": ("self_attn", "self_attention.linear_proj", "lora_A", 1),
    "gate_proj": ("mlp", "mlp.linear_fc1", "lora_B", 0),
    "up_proj": ("mlp", "mlp.linear_fc1", "lora_B", 0),
    "down_proj": ("mlp", "mlp.linear_fc2", "lora_A", 1),
}


def adapter_param_names(proj: str) -> dict[str, str]:
    """``lora_A`` / ``lora_B`` of ``proj`` -> its megatron parameter name within a layer (``...lora_A.q_proj``)."""
    _, linear, _, _ = ADAPTER_SPLIT[proj]
    return {ab: f"{linear}.{ab}.{proj}" for ab in ("lora_A", "lora_B")}


class ConversionError(KeyError):
    """A weight is missing, unexpected or of the wrong shape; the message names it."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


def _shapes(cfg: ModelConfig, lora: LoraSpec | None) -> dict[str, tuple[int, ...]]:
    shapes = dict(parameter_shapes(cfg))
    if lora is not None:
        shapes.update(adapter_shapes(cfg, lora))
    return shapes


def expected_project_names(cfg: ModelConfig, lora: LoraSpec | None = None) -> list[str]:
    """Every parameter name of the project's decoder for ``cfg`` (with ``lora``: and its adapters)."""
    return list(_shapes(cfg, lora))


def _check_project(sd: Mapping[str, torch.Tensor], cfg: ModelConfig, lora: LoraSpec | None) -> None:
    shapes = _shapes(cfg, lora)
    missing = sorted(set(shapes) - set(sd))
    extra = sorted(set(sd) - set(shapes))
    if missing or extra:
        raise ConversionError(
            f"weights do not match the {cfg.model_type} model config: missing {missing[:6]}"
            f"{'...' if len(missing) > 6 else ''}, unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}")
    for name, shape in shapes.items():
        if tuple(sd[name].shape) != shape:
            raise ConversionError(f"weight {name!r} has shape {tuple(sd[name].shape)}, expected {shape}")


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Full (unsharded) megatron ``linear_qkv`` weight (or bias) from separate q/k/v projections, grouped per kv head."""
    hd, groups = cfg.head_dim, cfg.num_kv_heads
    g = cfg.num_heads // groups
    rest = tuple(q.shape[1:])  # (hidden,) for weights, () for biases
    qg = q.reshape(groups, g * hd, *rest)
    kg = k.reshape(groups, hd, *rest)
    vg = v.reshape(groups, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(groups * (g + 2) * hd, *rest)


def qkv_from_megatron(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_to_megatron`: (q, k, v) projections from a full grouped ``linear_qkv`` weight or bias."""
    hd, groups = cfg.head_dim, cfg.num_kv_heads
    g = cfg.num_heads // groups
    rest = tuple(qkv.shape[1:])
    if qkv.shape[0] != groups * (g + 2) * hd:
        raise ConversionError(f"linear_qkv has {qkv.shape[0]} rows, expected {groups * (g + 2) * hd}")
    grouped = qkv.reshape(groups, (g + 2) * hd, *rest)
    q = grouped[:, : g * hd].reshape(groups * g * hd, *rest)
    k = grouped[:, g * hd: (g + 1) * hd].reshape(groups * hd, *rest)
    v = grouped[:, (g + 1) * hd:].reshape(groups * hd, *rest)
    return q, k, v


def _chunk(t: torch.Tensor, tp: int, rank: int, dim: int) -> torch.Tensor:
    return torch.chunk(t, tp, dim=dim)[rank].clone()


def to_megatron_shard(
    sd: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    tp_rank: int,
    tp_size: int,
    layers: Sequence[int],
    pre_process: bool,
    post_process: bool,
    lora: LoraSpec | None = None,
) -> dict[str, torch.Tensor]:
    """The megatron-core weights of one pipeline chunk on one TP rank.

    ``layers[l]`` is the global index of the chunk's local layer ``l``; ``pre_process`` / ``post_process`` say
    whether the chunk holds the embedding / the final norm and output layer; ``lora``: ``sd`` also holds the
    adapters of those targets.
    """
    _check_project(sd, cfg, lora)
    out: dict[str, torch.Tensor] = {}
    for local, i in enumerate(layers):
        if not 0 <= i < cfg.num_layers:
            raise ConversionError(f"layer index {i} is outside 0..{cfg.num_layers - 1}")
        p, m = f"layers.{i}.", f"{_LAYER_PREFIX}{local}."
        qkv = qkv_to_megatron(sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"],
                              sd[p + "self_attn.v_proj.weight"], cfg)
        out[m + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"].clone()
        out[m + "self_attention.linear_qkv.weight"] = _chunk(qkv, tp_size, tp_rank, 0)
        if cfg.qkv_bias:
            bias = qkv_to_megatron(sd[p + "self_attn.q_proj.bias"], sd[p + "self_attn.k_proj.bias"],
                                   sd[p + "self_attn.v_proj.bias"], cfg)
            out[m + "self_attention.linear_qkv.bias"] = _chunk(bias, tp_size, tp_rank, 0)
        if cfg.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = sd[p + "self_attn.q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = sd[p + "self_attn.k_norm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = _chunk(sd[p + "self_attn.o_proj.weight"], tp_size, tp_rank, 1)
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"].clone()
        out[m + "mlp.linear_fc1.weight"] = torch.cat([
            _chunk(sd[p + "mlp.gate_proj.weight"], tp_size, tp_rank, 0),
            _chunk(sd[p + "mlp.up_proj.weight"], tp_size, tp_rank, 0),
        ])
        out[m + "mlp.linear_fc2.weight"] = _chunk(sd[p + "mlp.down_proj.weight"], tp_size, tp_rank, 1)
        for proj in (lora.targets if lora is not None else ()):
            module, _, split, dim = ADAPTER_SPLIT[proj]
            for ab, name in adapter_param_names(proj).items():
                t = sd[f"{p}{module}.{proj}.{ab}"]
                out[m + name] = _chunk(t, tp_size, tp_rank, dim) if ab == split else t.clone()
    if pre_process:
        out["embedding.word_embeddings.weight"] = _chunk(sd["embed_tokens.weight"], tp_size, tp_rank, 0)
    if post_process:
        out["decoder.final_layernorm.weight"] = sd["norm.weight"].clone()
        head = sd["embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
        if not (cfg.tie_word_embeddings and pre_process):  # tied on one stage: the embedding serves as output
            out["output_layer.weight"] = _chunk(head, tp_size, tp_rank, 0)
    return out


def from_megatron_shards(
    shards: Sequence[Mapping[str, torch.Tensor]],
    cfg: ModelConfig,
    *,
    layers: Sequence[int],
) -> dict[str, torch.Tensor]:
    """Project-layout weights of one pipeline chunk from its ``tp`` shards (index = TP rank).

    Returns only what the chunk holds (its layers, and embedding / norm / head where present, and the adapters
    the shards carry); the union over all chunks is the full model. With tied embeddings the output layer copy is
    dropped.
    """
    tp = len(shards)
    if tp == 0:
        raise ConversionError("from_megatron_shards needs at least one TP shard")
    first = shards[0]
    for r, s in enumerate(shards[1:], start=1):
        if set(s) != set(first):
            raise ConversionError(f"TP shard {r} has names {sorted(set(s) ^ set(first))[:6]} that shard 0 lacks "
                                  "or has extra")

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    out: dict[str, torch.Tensor] = {}
    local_idx = sorted({int(n[len(_LAYER_PREFIX):].split(".")[0]) for n in first if n.startswith(_LAYER_PREFIX)})
    if local_idx != list(range(len(layers))):
        raise ConversionError(f"chunk holds local layers {local_idx}, expected 0..{len(layers) - 1} for global "
                              f"layers {list(layers)}")
    for local, i in enumerate(layers):
        p, m = f"layers.{i}.", f"{_LAYER_PREFIX}{local}."
        q, k, v = qkv_from_megatron(cat(m + "self_attention.linear_qkv.weight", 0), cfg)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
        out[p + "self_attn.v_proj.weight"] = v
        if cfg.qkv_bias:
            qb, kb, vb = qkv_from_megatron(cat(m + "self_attention.linear_qkv.bias", 0), cfg)
            out[p + "self_attn.q_proj.bias"], out[p + "self_attn.k_proj.bias"], out[p + "self_attn.v_proj.bias"] = (
                qb, kb, vb)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"].clone()
            out[p + "self_attn.k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"].clone()
        out[p + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        out[p + "input_layernorm.weight"] = first[m + "input_layernorm.weight"].clone()
        out[p + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"].clone()
        gates, ups = zip(*(torch.chunk(s[m + "mlp.linear_fc1.weight"], 2, dim=0) for s in shards))
        out[p + "mlp.gate_proj.weight"] = torch.cat(gates, 0)
        out[p + "mlp.up_proj.weight"] = torch.cat(ups, 0)
        out[p + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
        for proj, (module, _, split, dim) in ADAPTER_SPLIT.items():
            for ab, name in adapter_param_names(proj).items():
                if m + name in first:
                    out[f"{p}{module}.{proj}.{ab}"] = cat(m + name, dim) if ab == split else first[m + name].clone()
    if "embedding.word_embeddings.weight" in first:
        out["embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)
    if "decoder.final_layernorm.weight" in first:
        out["norm.weight"] = first["decoder.final_layernorm.weight"].clone()
    if "output_layer.weight" in first and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = cat("output_layer.weight", 0)
    return out
