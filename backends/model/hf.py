"""Load a local Hugging Face Llama-layout checkpoint (config.json + weights) into the project's model; no download."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import torch

from backends.model.config import MODEL_TYPES, ModelConfig
from backends.model.llama import LlamaModel, parameter_shapes

__all__ = ["HFCheckpointError", "config_from_hf", "hf_config_dict", "read_hf_config", "convert_hf_state_dict",
           "to_hf_state_dict", "load_hf_checkpoint", "initial_model", "check_hf_config", "HF_ARCHITECTURES"]

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


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face ``config.json`` dict; features the model lacks are refused, not dropped."""
    unsupported = []
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            unsupported.append(f"{key}=true (the model has no biases)")
    if hf.get("rope_scaling"):
        unsupported.append(f"rope_scaling={hf['rope_scaling']!r} (plain rotary only)")
    if hf.get("use_sliding_window") or (hf.get("sliding_window") and hf.get("model_type") == "mistral"):
        unsupported.append("sliding-window attention")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    if hf.get("head_dim") not in (None, hidden // heads):
        unsupported.append(f"head_dim={hf['head_dim']} != hidden_size / num_attention_heads = {hidden // heads}")
    if unsupported:
        raise HFCheckpointError("Hugging Face config not representable by backends.model.LlamaModel: "
                                + "; ".join(unsupported))
    try:
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), hidden_size=hidden, intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            rope_theta=float(hf.get("rope_theta", 10000.0)), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)))
    except KeyError as exc:
        raise HFCheckpointError(f"Hugging Face config.json lacks {exc.args[0]!r}") from exc


def convert_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename ``model.*`` weights to the project's names; a missing or unexpected weight is an error."""
    out = {}
    for name, t in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from rope_theta
        key = name[len("model."):] if name.startswith("model.") else name
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out[key] = t
    want = {n: p.shape for n, p in LlamaModel(cfg).to("meta").named_parameters()}
    missing, extra = sorted(set(want) - set(out)), sorted(set(out) - set(want))
    if missing or extra:
        raise HFCheckpointError(f"checkpoint weights do not match the config: missing {missing[:5]}, "
                                f"unexpected {extra[:5]}")
    for n, shape in want.items():
        if tuple(out[n].shape) != tuple(shape):
            raise HFCheckpointError(f"weight {n} has shape {tuple(out[n].shape)}, the config implies {tuple(shape)}")
    return out


def _read_weights(path: str) -> dict[str, torch.Tensor]:
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


def read_hf_config(path: str) -> ModelConfig:
    """The architecture in ``path/config.json`` (with ``hf_path`` set to ``path``)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise HFCheckpointError(f"model.hf_path={path!r} has no config.json (a local checkpoint directory is needed; "
                                f"nothing is downloaded)")
    with open(cfg_file) as fh:
        return dataclasses.replace(config_from_hf(json.load(fh)), hf_path=path)


def load_hf_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """A LlamaModel holding the weights of the local Hugging Face Llama-layout checkpoint in directory ``path``."""
    cfg = read_hf_config(path)
    sd = convert_hf_state_dict(_read_weights(path), cfg)
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
    return load_hf_checkpoint(cfg.hf_path)
