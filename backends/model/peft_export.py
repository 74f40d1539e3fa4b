"""Write a LoRA actor's adapters as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

``peft.PeftModel.from_pretrained(base, folder)`` puts them back onto the Hugging Face base model: PEFT's LoRA computes
``base(x) + (lora_alpha / r) * lora_B(lora_A(dropout(x)))``, the same update as :class:`backends.model.lora.LoraLinear`,
and its weight names are the base's module path plus ``lora_A.weight`` / ``lora_B.weight`` under
``base_model.model.``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch

from backends.model.lora import LoraSpec, is_adapter_name

__all__ = ["save_peft_adapter", "peft_adapter_config"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_adapter_config(spec: LoraSpec, base_model: str = "") -> dict[str, Any]:
    """adapter_config.json of a plain LoRA (no rsLoRA, no DoRA, no bias training) on ``spec.targets``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(spec.rank), "lora_alpha": float(spec.alpha),
            "lora_dropout": float(spec.dropout), "target_modules": list(spec.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base_model or None}


def save_peft_adapter(out: str, weights: Mapping[str, torch.Tensor], spec: LoraSpec, *, base_model: str = "",
                      dtype: torch.dtype = torch.float32) -> list[str]:
    """Write the ``lora_A`` / ``lora_B`` entries of ``weights`` (project names) as a PEFT folder; return file names."""
    from safetensors.torch import save_file

    adapters = {n: t for n, t in weights.items() if is_adapter_name(n)}
    if not adapters:
        raise ValueError("the weights hold no LoRA adapters (no '*.lora_A' / '*.lora_B' entries)")
    # project ``layers.0.self_attn.q_proj.lora_A`` -> HF module ``model.layers.0.self_attn.q_proj`` -> PEFT's key
    hf = {f"base_model.model.model.{n}.weight": t.detach().to("cpu", dtype).contiguous().clone()
          for n, t in adapters.items()}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as fh:
        json.dump(peft_adapter_config(spec, base_model), fh, indent=2, sort_keys=True)
    save_file(hf, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
