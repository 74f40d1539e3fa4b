"""Sharded checkpoints with torch.distributed.checkpoint (model, optimizer) plus scheduler, RNG, step and extras."""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from backends.checkpoint_dir import prepare_checkpoint_dir
from backends.fsdp.rows import local_rows

__all__ = ["save", "load", "full_weights", "reshard", "load_full_weights", "load_hf_shards", "local_rows",
           "read_model_weights", "CheckpointError"]

ENGINE_STATE = "engine_state.pt"


class CheckpointError(ValueError):
    """A checkpoint directory or weight dict that does not fit the engine."""


def _rng_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rng_rank{rank}.pt")


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(path: str, model, optimizer, lr_scheduler, step: int, extra_state: dict | None) -> None:
    """Write the sharded model/optimizer (DCP), then scheduler, step and extras (rank 0) and each rank's RNG."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    prepare_checkpoint_dir(path)  # one folder never mixes two saves' shard and RNG files
    dcp.save(state, checkpoint_id=path)
    rank = dist.get_rank()
    if rank == 0:
        torch.save({"lr_scheduler": lr_scheduler.state_dict(), "step": int(step), "extra_state": extra_state or {},
                    "world_size": dist.get_world_size()}, os.path.join(path, ENGINE_STATE))
    torch.save(_rng_state(), _rng_file(path, rank))
    dist.barrier()


def load(path: str, model, optimizer, lr_scheduler) -> tuple[int, dict]:
    """Restore what :func:`save` wrote, resharding onto this world size; returns (step, extra_state)."""
    meta = os.path.join(path, ENGINE_STATE)
    if not os.path.isfile(meta):
        raise CheckpointError(f"{path!r} is not an engine checkpoint: {ENGINE_STATE} is missing")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    engine_state = torch.load(meta, weights_only=False)
    lr_scheduler.load_state_dict(engine_state["lr_scheduler"])
    rank = dist.get_rank()
    rng_path = _rng_file(path, rank) if os.path.isfile(_rng_file(path, rank)) else _rng_file(path, 0)
    rng = torch.load(rng_path, weights_only=False)  # a rank absent from the saving world takes rank 0's streams
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    dist.barrier()
    return int(engine_state["step"]), engine_state["extra_state"]


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter unsharded, fp32 or its storage dtype, on CPU, on every rank (one all-gather each).

    The model is resharded first: after a no-grad forward FSDP2 leaves the root's parameters unsharded (plain
    tensors whose storage it frees at the next reshard). Every tensor returned is a copy the caller owns.
    """
    reshard(model)
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        if t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            t = t.clone()  # a one-rank mesh gathers nothing and hands back the parameter's own storage
        out[name] = t.detach().cpu()
    return out


def reshard(model) -> None:
    """Put every FSDP2 module of ``model`` back into its sharded state (a no-op for modules already sharded)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def load_full_weights(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Load full (unsharded) weights given in the model's own names; missing/extra names or shapes are errors."""
    own = {n: p for n, p in model.named_parameters()}
    missing = sorted(set(own) - set(state_dict))
    extra = sorted(set(state_dict) - set(own))
    if missing or extra:
        raise KeyError(f"set_weights: missing parameters {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                       f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}")
    for n, p in own.items():
        if tuple(state_dict[n].shape) != tuple(p.shape):
            raise CheckpointError(f"set_weights: {n} has shape {tuple(state_dict[n].shape)}, the model expects "
                                  f"{tuple(p.shape)}")
    set_model_state_dict(model, {n: t for n, t in state_dict.items()},
                         options=StateDictOptions(full_state_dict=True))


@torch.no_grad()
def load_hf_shards(model, path: str, skip: tuple[str, ...] = (), *, convert=None, rename=None) -> int:
    """Fill ``model`` (fully sharded, materialised with ``to_empty``) from the Hugging Face checkpoint ``path``.

    Each rank reads only its own rows of each parameter from the safetensors files (one file or a sharded
    ``model.safetensors.index.json``), so no rank ever holds the full model. Names, shapes and missing or unexpected
    weights are checked against the config from the file headers before any data is read (``convert``: the checker
    and name map of the folder's kind, default :func:`backends.model.hf.convert_hf_state_dict` of a causal LM;
    ``rename``: a folder name to the model's, when it is not the causal LM's).
    Returns the number of bytes this rank read. ``skip``: parameters of ``model`` that no checkpoint holds (a
    critic's value head), left for the caller to fill.
    """
    from backends.model.hf import convert_hf_state_dict
    from backends.model.hf_files import SafetensorsFolder
    from backends.model.lora import is_adapter_name

    cfg = model.cfg
    folder = SafetensorsFolder(path)
    headers = {n: torch.empty(folder.shape(n), device="meta") for n in folder.names()}
    (convert or convert_hf_state_dict)(headers, cfg)  # missing / unexpected / misshapen, named, before any data
    # adapters start from the seed; a critic's head is filled by its caller (skip)
    params = {n: p for n, p in model.named_parameters() if n not in skip and not is_adapter_name(n)}
    # project name -> the folder's name (``rename``; default: the decoder under "model.", heads at the top level)
    rename = rename or (lambda h: h[len("model."):] if h.startswith("model.") else h)
    hf_names = {rename(h): h for h in folder.names()}
    unknown = sorted(set(params) - set(hf_names))
    if unknown:
        raise CheckpointError(f"parameters {unknown[:6]} have no weight in a Hugging Face checkpoint; pass them as "
                              f"skip= and fill them otherwise")
    read = 0
    for name, p in params.items():
        start, stop = local_rows(p)
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.shape[0] != stop - start:
            raise CheckpointError(f"{name}: this rank holds {local.shape[0]} rows, the shard layout implies rows "
                                  f"[{start}, {stop})")
        if stop > start:
            rows = folder.read_rows(hf_names[name], start, stop)
            local.copy_(rows.to(local.dtype))
            read += rows.numel() * rows.element_size()
    return read


def read_model_weights(path: str) -> dict[str, torch.Tensor]:
    """The full model weights (project names) of a checkpoint written by :func:`save`, read in this process alone.

    No process group is needed and any saving world size works: DCP stores each parameter as a global tensor.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isfile(os.path.join(path, ENGINE_STATE)):
        raise CheckpointError(f"{path!r} is not an FSDP engine checkpoint: {ENGINE_STATE} is missing")
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    prefix = "model."
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(f"{path!r} holds no model weights (no '{prefix}*' entries in its DCP metadata)")
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}
