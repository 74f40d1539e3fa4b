"""A GGUF file to a plain Hugging Face folder: fp32 safetensors, config.json, tokenizer, generation_config.json.

transformers reads GGUF (dequantising every tensor to float) but marks the model quantised and refuses to save it;
the folder here is rebuilt from the same config without ``quantization_config`` and loaded with the dequantised
state dict, so the project (and transformers) load it as an ordinary checkpoint. Needs the ``gguf`` and ``accelerate``
packages (the ``models`` extra). Only architectures ``backends.model.LlamaModel`` represents are converted.
"""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import torch

from backends.model.hf import HF_ARCHITECTURES, HFCheckpointError, config_from_hf

__all__ = ["GGUFError", "GGUF_ARCHITECTURES", "gguf_architecture", "require_gguf_packages", "convert_gguf"]

# general.architecture of a GGUF file -> the Hugging Face model_type transformers gives it (Mistral GGUFs say llama)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
_PACKAGES = ("gguf", "accelerate")


class GGUFError(ValueError):
    """A GGUF file that cannot be converted, or a missing package; the message names what is missing."""


def require_gguf_packages() -> None:
    """Refuse, naming them, when the packages transformers needs to read GGUF are not installed."""
    missing = [p for p in _PACKAGES if importlib.util.find_spec(p) is None]
    if importlib.util.find_spec("transformers") is None:
        missing.insert(0, "transformers")
    if missing:
        raise GGUFError(f"reading GGUF needs the packages {missing}, not installed: pip install 'rldispatch[models]'")


def gguf_architecture(path: str) -> str:
    """The ``general.architecture`` a GGUF file declares (read from its header only)."""
    require_gguf_packages()
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields.get("general.architecture")
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from exc
    if field is None:
        raise GGUFError(f"{path} declares no general.architecture")
    return str(field.contents())


def _plain_config(config: Any) -> Any:
    """The transformers config without the GGUF quantisation marker, checked against what the project represents."""
    config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    try:
        config_from_hf(config.to_dict())
    except HFCheckpointError as exc:
        raise GGUFError(str(exc)) from exc
    return config


def convert_gguf(gguf_path: str, out: str) -> list[str]:
    """Write the Hugging Face folder ``out`` (created; must not hold files) from ``gguf_path``; the files written."""
    arch = gguf_architecture(gguf_path)
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"{gguf_path}: GGUF architecture {arch!r} is not representable by backends.model.LlamaModel "
                        f"(convertible: {sorted(GGUF_ARCHITECTURES)})")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    config = _plain_config(AutoConfig.from_pretrained(folder, gguf_file=name))
    if config.model_type not in HF_ARCHITECTURES:
        raise GGUFError(f"{gguf_path}: transformers reads it as model_type={config.model_type!r}, which the project "
                        f"does not load (supported: {sorted(HF_ARCHITECTURES)})")
    read = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in read.state_dict().items()}
    generation = read.generation_config
    del read
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise GGUFError(f"{gguf_path}: the dequantised weights do not fit {type(model).__name__}: missing "
                        f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()
    os.makedirs(out, exist_ok=True)
    before = set(os.listdir(out))
    model.save_pretrained(out)
    generation.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as fh:
        saved = json.load(fh)
    if "quantization_config" in saved:  # the folder must load as an ordinary fp32 checkpoint
        raise GGUFError(f"{out}/config.json still carries quantization_config")
    return sorted(set(os.listdir(out)) - before)
