"""Hugging Face checkpoints in and out: config.json <-> ModelConfig and HF weight names <-> the project's model.

Local folders only, nothing is downloaded. config.json is read through ``transformers.AutoConfig`` when transformers
is importable (it fills each family's defaults and turns the transformers-4 ``rope_theta`` / ``rope_scaling`` pair into
transformers-5 ``rope_parameters``); without it the same reader understands both spellings. A field the model cannot
represent exactly is refused with a message naming the architecture and the field; nothing is dropped or defaulted
beyond what transformers itself defaults.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from backends.model.config import MODEL_TYPES, ModelConfig
from backends.model.llama import LlamaModel, parameter_shapes

__all__ = ["HFCheckpointError", "config_from_hf", "hf_config_dict", "read_hf_config", "convert_hf_state_dict",
           "to_hf_state_dict", "check_weights", "read_weight_files", "load_hf_checkpoint", "initial_model", "check_hf_config",
           "HF_ARCHITECTURES"]

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}
# what transformers' config classes default to when config.json leaves a key out
_FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768},
}
_DEFAULT_THETA = 10000.0
_ROPE_KEYS = {"default": set(), "linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor"}}
_ROPE_OPTIONAL = {"llama3": {"original_max_position_embeddings"}}
_ROPE_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint this model cannot represent exactly; the message names the field."""


def _rope(hf: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """ModelConfig rope fields from either spelling (``rope_parameters``, or ``rope_theta`` + ``rope_scaling``)."""
    bad: list[str] = []
    params = hf.get("rope_parameters")
    legacy = hf.get("rope_scaling")
    if params is not None and not isinstance(params, Mapping):
        return {}, [f"rope_parameters={params!r} (expected a mapping)"]
    if params is not None and any(isinstance(v, Mapping) for v in params.values()):
        return {}, [f"rope_parameters per layer type ({sorted(params)}) (one rotary embedding for all layers only)"]
    if params is not None and legacy:
        clash = sorted(k for k in set(params) & set(legacy) if params[k] != legacy[k])
        if clash:
            bad.append(f"rope_parameters and rope_scaling disagree on {clash}")
    rope = dict(params if params is not None else (legacy or {}))
    top_theta = hf.get("rope_theta")
    if "rope_theta" in rope and top_theta is not None and float(top_theta) != float(rope["rope_theta"]):
        bad.append(f"rope_theta={top_theta} vs rope_parameters.rope_theta={rope['rope_theta']}")
    theta = float(rope.get("rope_theta", top_theta if top_theta is not None else _DEFAULT_THETA))
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("type") not in (None, rtype):
        bad.append(f"rope type given twice: rope_type={rtype!r}, type={rope['type']!r}")
    if rtype not in _ROPE_KEYS:
        return {}, bad + [f"rope_type={rtype!r} (supported: {sorted(_ROPE_KEYS)})"]
    for value in (rope.get("partial_rotary_factor"), hf.get("partial_rotary_factor")):
        if value is not None and float(value) != 1.0:
            bad.append(f"partial_rotary_factor={value} (rotary over the whole head only)")
    extra = sorted(set(rope) - _ROPE_COMMON - _ROPE_KEYS[rtype] - _ROPE_OPTIONAL.get(rtype, set()))
    if extra:
        bad.append(f"rope keys {extra} with rope_type={rtype!r} (not used by this rope type here)")
    missing = sorted(_ROPE_KEYS[rtype] - set(rope))
    if missing:
        bad.append(f"rope_type={rtype!r} without {missing}")
    if bad:
        return {}, bad
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": rtype}
    if rtype in ("linear", "llama3"):
        out["rope_factor"] = float(rope["factor"])
    if rtype == "llama3":
        out["rope_low_freq_factor"] = float(rope["low_freq_factor"])
        out["rope_high_freq_factor"] = float(rope["high_freq_factor"])
        # transformers falls back to max_position_embeddings when the original context length is not given
        orig = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        out["rope_original_max_position_embeddings"] = int(orig)
    return out, []


def _sliding(hf: Mapping[str, Any], model_type: str, layers: int) -> list[str]:
    """Sliding-window attention in use, described for the refusal message (empty when every layer is full)."""
    if model_type == "mistral":
        window = hf.get("sliding_window", _FAMILY_DEFAULTS["mistral"]["sliding_window"])
        return [f"sliding_window={window} (set it to null: full attention only)"] if window is not None else []
    types = hf.get("layer_types")
    if types is not None:
        sliding = [i for i, t in enumerate(types) if t != "full_attention"]
        return [f"layer_types={sorted(set(types))} on layers {sliding[:6]} (full attention only)"] if sliding else []
    if hf.get("use_sliding_window") and hf.get("sliding_window", 4096) is not None:
        first = int(hf.get("max_window_layers", 28))
        if first < layers:
            return [f"use_sliding_window=true with max_window_layers={first} < num_hidden_layers={layers}"]
    return []


def _family(hf: Mapping[str, Any]) -> tuple[str, str]:
    """(model_type, the architecture as messages name it); an unsupported model_type is refused here."""
    model_type = hf.get("model_type")
    where = f"Hugging Face config (model_type={model_type!r}, architectures={hf.get('architectures')})"
    if model_type not in MODEL_TYPES:
        raise HFCheckpointError(f"{where}: model_type={model_type!r} is not supported; supported model types: "
                                f"{sorted(MODEL_TYPES)}")
    return model_type, where


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face config dict (transformers 4 or 5 spelling); what the model lacks is refused."""
    model_type, where = _family(hf)
    try:
        layers = int(hf["num_hidden_layers"])
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        sizes = dict(vocab_size=int(hf["vocab_size"]), intermediate_size=int(hf["intermediate_size"]))
    except KeyError as exc:
        raise HFCheckpointError(f"{where}: config.json lacks {exc.args[0]!r}") from exc
    bad: list[str] = []
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("attention_bias"):
        bad.append("attention_bias=true (biases on q/k/v/o; only qwen2's q/k/v biases are represented)")
    if hf.get("mlp_bias"):
        bad.append("mlp_bias=true (the MLP has no biases)")
    if float(hf.get("attention_dropout") or 0.0) != 0.0:
        bad.append(f"attention_dropout={hf['attention_dropout']} (no dropout)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            bad.append(f"{key}={hf[key]} (mixture of experts)")
    if hf.get("quantization_config"):
        bad.append("quantization_config (quantised weights)")
    bad += _sliding(hf, model_type, layers)
    rope, rope_bad = _rope(hf)
    bad += rope_bad
    if bad:
        raise HFCheckpointError(f"{where} is not representable by backends.model.LlamaModel: " + "; ".join(bad))
    qkv_bias, qk_norm = MODEL_TYPES[model_type]
    defaults = _FAMILY_DEFAULTS[model_type]
    try:
        return ModelConfig(
            **sizes, hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or 0), model_type=model_type, qkv_bias=qkv_bias, qk_norm=qk_norm,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or defaults["max_position_embeddings"]),
            **rope)
    except ValueError as exc:
        raise HFCheckpointError(f"{where}: {exc}") from exc


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of ``cfg``'s Hugging Face family, readable by transformers 4 and 5 (rope in both spellings)."""
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position_embeddings)
    out: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[cfg.model_type]], "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_type != "default" else None,
    }
    if cfg.model_type in ("llama", "mistral", "qwen3"):
        out["attention_bias"] = False
    if cfg.model_type == "llama":
        out["mlp_bias"] = False
    if cfg.model_type in ("mistral", "qwen2", "qwen3"):
        out["sliding_window"] = None
    if cfg.model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, layer_types=["full_attention"] * cfg.num_layers)
    return out


def _project_name(hf_name: str) -> str:
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def convert_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weight names (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``) to the project's.

    Rotary ``inv_freq`` buffers are recomputed from the config; a tied checkpoint's ``lm_head`` copy is the
    embedding. A missing, unexpected or misshapen weight is an error naming it.
    """
    out = {}
    for name, t in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        key = _project_name(name)
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out[key] = t
    check_weights(out, parameter_shapes(cfg), f"the {cfg.model_type} config")
    return out


def check_weights(weights: Mapping[str, torch.Tensor], want: Mapping[str, tuple[int, ...]], what: str,
                  error: type[Exception] = HFCheckpointError) -> None:
    """Refuse ``weights`` whose names are not exactly ``want``'s or whose shapes differ, naming them and ``what``
    they were checked against."""
    missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or extra:
        raise error(f"checkpoint weights do not match {what}: missing {missing[:5]}, unexpected {extra[:5]}")
    for n, shape in want.items():
        if tuple(weights[n].shape) != tuple(shape):
            raise error(f"weight {n} has shape {tuple(weights[n].shape)}, {what} implies {tuple(shape)}")


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The project's weights under Hugging Face names (inverse of :func:`convert_hf_state_dict`)."""
    want = set(parameter_shapes(cfg))
    missing, extra = sorted(want - set(sd)), sorted(set(sd) - want)
    if missing or extra:
        raise HFCheckpointError(f"weights do not match the {cfg.model_type} config: missing {missing[:5]}, "
                                f"unexpected {extra[:5]}")
    return {(n if n == "lm_head.weight" else f"model.{n}"): t for n, t in sd.items()}


def read_weight_files(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` (else ``pytorch_model*.bin``) files, Hugging Face names."""
    files = sorted(os.listdir(path))
    st = [f for f in files if f.endswith(".safetensors")]
    bins = [f for f in files if f.endswith(".bin") and f.startswith("pytorch_model")]
    sd: dict[str, torch.Tensor] = {}
    if st:
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ImportError(f"{path} holds .safetensors weights; install the 'safetensors' package to read them") from exc
        for f in st:
            sd.update(load_file(os.path.join(path, f)))
    elif bins:
        for f in bins:
            sd.update(torch.load(os.path.join(path, f), map_location="cpu", weights_only=True))
    else:
        raise HFCheckpointError(f"{path} has no *.safetensors or pytorch_model*.bin weight files")
    return sd


def _normalised_config(path: str, raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers reads it (family defaults filled, rope in one spelling), else as written."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return raw
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True).to_dict()
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise HFCheckpointError(f"{path}/config.json (model_type={raw.get('model_type')!r}): transformers cannot "
                                f"read it: {exc}") from exc


def read_hf_config(path: str) -> ModelConfig:
    """The architecture in ``path/config.json`` (with ``hf_path`` set to ``path``)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise HFCheckpointError(f"model.hf_path={path!r} has no config.json (a local checkpoint directory is needed; "
                                f"nothing is downloaded)")
    with open(cfg_file) as fh:
        raw = json.load(fh)
    _family(raw)  # an unsupported model_type is refused before transformers reports it its own way
    return dataclasses.replace(config_from_hf(_normalised_config(path, raw)), hf_path=path)


def load_hf_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """A LlamaModel holding the weights of the local Hugging Face checkpoint in directory ``path``."""
    cfg = read_hf_config(path)
    sd = convert_hf_state_dict(read_weight_files(path), cfg)
    model = LlamaModel(cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model.to(dtype)


def initial_model(cfg: ModelConfig, seed: int) -> LlamaModel:
    """The weights every engine starts from: the ``model.hf_path`` checkpoint, else a seeded random init.

    A checkpoint whose config.json disagrees with ``cfg`` is refused, naming the fields.
    """
    if not cfg.hf_path:
        return LlamaModel.from_seed(cfg, seed)
    check_hf_config(cfg)
    return load_hf_checkpoint(cfg.hf_path)


def check_hf_config(cfg: ModelConfig) -> None:
    """Refuse a ``cfg`` whose fields disagree with its ``model.hf_path`` config.json, naming the fields."""
    found = read_hf_config(cfg.hf_path)
    diff = [f"{f.name}: config {getattr(cfg, f.name)!r} vs checkpoint {getattr(found, f.name)!r}"
            for f in dataclasses.fields(ModelConfig) if f.name not in ("hf_path", "init_std")
            and getattr(cfg, f.name) != getattr(found, f.name)]
    if diff:
        raise HFCheckpointError(f"model.* disagrees with {cfg.hf_path}/config.json: {'; '.join(diff)}")
