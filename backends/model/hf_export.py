"""Write the project's weights as a Hugging Face checkpoint folder that ``transformers`` loads as is.

The folder holds ``config.json`` (the source checkpoint's own when there was one, else the family's config built from
:class:`ModelConfig`), the weights as ``model.safetensors`` (or shards listed by ``model.safetensors.index.json``)
and ``generation_config.json``. Weight names come from :func:`backends.model.hf.to_hf_state_dict`, the one
mapping between the two layouts.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import torch

from backends.model.config import ModelConfig
from backends.model.hf import HFCheckpointError, hf_config_dict, read_hf_config, to_hf_state_dict
from backends.model.hf_files import INDEX_FILE

__all__ = ["save_hf_checkpoint", "export_config_dict", "DTYPE_NAMES"]

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DEFAULT_SHARD_BYTES = 5 * 1024**3


def export_config_dict(cfg: ModelConfig, dtype: torch.dtype, source: str | None = None) -> dict[str, Any]:
    """config.json for ``cfg``: the source checkpoint's own (checked to describe ``cfg``) or one built from ``cfg``.

    The stored dtype is set to what the weights are written in (``torch_dtype`` for transformers 4, ``dtype`` 5).
    """
    raw: dict[str, Any] | None = None
    if source and os.path.isfile(os.path.join(source, "config.json")):
        with open(os.path.join(source, "config.json")) as fh:
            raw = json.load(fh)
        found = dataclasses.replace(read_hf_config(source), hf_path="", init_std=cfg.init_std)
        if found != dataclasses.replace(cfg, hf_path=""):
            diff = [f.name for f in dataclasses.fields(ModelConfig) if getattr(found, f.name) != getattr(cfg, f.name)
                    and f.name != "hf_path"]
            raise HFCheckpointError(f"{source}/config.json no longer describes the trained model (fields {diff}); "
                                    f"was the source folder changed after training?")
    out = dict(raw) if raw is not None else hf_config_dict(cfg)
    out["torch_dtype"] = out["dtype"] = DTYPE_NAMES[dtype]
    return out


def _shards(sd: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(sd):
        n = sd[name].numel() * sd[name].element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = sd[name]
        size += n
    return groups


def save_hf_checkpoint(out: str, state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, *,
                       dtype: torch.dtype = torch.float32, source: str | None = None,
                       generation_config: Mapping[str, Any] | None = None,
                       max_shard_bytes: int = _DEFAULT_SHARD_BYTES) -> list[str]:
    """Write ``state_dict`` (project names, full tensors) as a Hugging Face folder ``out``; return the file names.

    ``source`` is the checkpoint folder training started from (its config.json is kept); ``generation_config``
    is written as ``generation_config.json`` when given.
    """
    from safetensors.torch import save_file

    if dtype not in DTYPE_NAMES:
        raise ValueError(f"export dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    hf_sd = {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in to_hf_state_dict(state_dict, cfg).items()}
    os.makedirs(out, exist_ok=True)
    written = ["config.json"]
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(export_config_dict(cfg, dtype, source), fh, indent=2, sort_keys=True)
    groups = _shards(hf_sd, max_shard_bytes)
    if len(groups) == 1:
        save_file(groups[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        written.append("model.safetensors")
    else:
        weight_map = {}
        for i, group in enumerate(groups, start=1):
            name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            save_file(group, os.path.join(out, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in group})
            written.append(name)
        total = sum(t.numel() * t.element_size() for t in hf_sd.values())
        with open(os.path.join(out, INDEX_FILE), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2, sort_keys=True)
        written.append(INDEX_FILE)
    if generation_config is not None:
        with open(os.path.join(out, "generation_config.json"), "w") as fh:
            json.dump(dict(generation_config), fh, indent=2, sort_keys=True)
        written.append("generation_config.json")
    return written
