"""Checkpoints of the megatron engine: model and optimizer through megatron-core's distributed checkpointing,
plus the engine step, every rank's RNG state and the caller's ``extra_state`` in small side files.

Layout of ``path``: the dist-checkpoint files (model chunks ``model`` / ``model0..`` and ``optimizer``),
``engine_state.pt`` (step, parallel degrees, extra_state; written by global rank 0) and ``rng/rank{r}.pt`` (the
rank's RNG states and its Adam step counts, which megatron-core's distributed optimizer does not restore).
The LR schedule is a pure function of the step (:func:`backends.optim.lr_factor`), so restoring the step
restores it.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from backends.checkpoint_dir import prepare_checkpoint_dir

__all__ = ["CheckpointError", "save", "load", "read_model_weights"]

_STATE_FILE = "engine_state.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this engine; the message says what differs."""


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _model_keys(engine) -> list[str]:
    return ["model"] if len(engine.chunks) == 1 else [f"model{i}" for i in range(len(engine.chunks))]


# optimizer state saved per DP shard (the format that needs no device-side gather); resume needs the same degrees
_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded_state_dict(engine, is_loading: bool) -> dict[str, Any]:
    sharded: dict[str, Any] = {}
    for key, chunk in zip(_model_keys(engine), engine.chunks):
        sharded[key] = _unwrap(chunk).sharded_state_dict(metadata=dict(_METADATA))
    sharded["optimizer"] = engine.optimizer.sharded_state_dict(sharded, is_loading=is_loading,
                                                               metadata=dict(_METADATA))
    return sharded


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _degrees(engine) -> dict[str, int]:
    par = engine.config.megatron
    return {"tp": par.tp, "pp": par.pp, "vpp": par.vpp, "cp": par.cp, "ep": par.ep,
            "world_size": dist.get_world_size()}


def _in_process_results_queue() -> None:
    """Collect writer results in a plain queue: saves here are synchronous, and the default (a queue served by a
    spawned manager process) re-imports the launching script in that process, which hangs under torchrun."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save(engine, path: str, extra_state: dict) -> None:
    """Write model, optimizer, step, RNG and ``extra_state`` of every rank under ``path`` (a directory)."""
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    _fresh_adam_state(engine)
    rank = dist.get_rank()
    prepare_checkpoint_dir(path)  # megatron-core expects an empty folder (else: "Overwriting old incomplete ...")
    dist_checkpointing.save(_sharded_state_dict(engine, is_loading=False), path)
    if rank == 0:
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    dist.barrier()
    torch.save({**_rng_state(), _STEPS: _adam_steps(engine)}, os.path.join(path, "rng", f"rank{rank}.pt"))
    if rank == 0:
        torch.save({"step": engine.step, "degrees": _degrees(engine), "extra_state": dict(extra_state)},
                   os.path.join(path, _STATE_FILE))
    dist.barrier()


_STEPS = "adam_steps"


def _fresh_adam_state(engine) -> None:
    """Give an Adam that has not stepped yet the state torch would create at its first step (step 0, zero moments),
    which changes no update: megatron-core's distributed optimizer cannot write a checkpoint without one (an actor
    saved during the critic's warm-up has never stepped)."""
    for opt in engine._sub_optimizers:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or inner.state:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def _step_states(engine) -> list[list[dict | None]]:
    """Per sub-optimizer, the torch optimizer state of each of its parameters in param-group order (None: none)."""
    out = []
    for opt in engine._sub_optimizers:
        inner = getattr(opt, "optimizer", None)
        state = getattr(inner, "state", {})
        out.append([state.get(p) for g in getattr(inner, "param_groups", []) for p in g["params"]])
    return out


def _adam_steps(engine) -> list[list[float | None]]:
    return [[float(s["step"]) if s is not None and "step" in s else None for s in states]
            for states in _step_states(engine)]


def _restore_adam_steps(engine, saved: list[list[float | None]] | None, path: str) -> None:
    """Give every parameter its own Adam ``step`` tensor again, with the count it had when saved.

    megatron-core's distributed optimizer restores one shared ``step`` tensor for all parameters when it wraps
    torch's Adam, and with the count of the first step rather than the saved one; torch increments it in place
    once per parameter. Either would skew the bias correction of every later step."""
    if saved is None:
        raise CheckpointError(f"{path!r} holds no Adam step counts (written before they were saved), so its optimizer "
                              f"cannot be resumed exactly; export its weights (rldispatch export) and start a new run "
                              f"from them with model.hf_path")
    states = _step_states(engine)
    if [len(s) for s in saved] != [len(s) for s in states]:
        raise CheckpointError(f"{path!r}: its per-rank file holds Adam step counts for "
                              f"{[len(s) for s in saved]} parameters, this rank's optimizer has "
                              f"{[len(s) for s in states]}")
    for group, counts in zip(states, saved):
        for state, count in zip(group, counts):
            if state is not None and torch.is_tensor(state.get("step")):
                if count is None:
                    raise CheckpointError(f"{path!r}: a parameter with Adam state was saved without a step count")
                old = state["step"]
                state["step"] = torch.tensor(count, dtype=old.dtype, device=old.device)


def load(engine, path: str) -> dict:
    """Restore what :func:`save` wrote into ``engine`` (same parallel degrees); return the saved ``extra_state``."""
    from megatron.core import dist_checkpointing

    state_file = os.path.join(path, _STATE_FILE)
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{path!r} is not a megatron engine checkpoint: {_STATE_FILE} is missing")
    meta = torch.load(state_file, weights_only=False)
    if meta["degrees"] != _degrees(engine):
        raise CheckpointError(f"checkpoint {path!r} was written with parallel degrees {meta['degrees']}, this engine "
                              f"runs {_degrees(engine)}; load it with the same megatron section and world size")
    for opt in engine._sub_optimizers:
        # a fresh distributed optimizer has no Adam state to load into; create it (overwritten by the load)
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    loaded = dist_checkpointing.load(_sharded_state_dict(engine, is_loading=True), path)
    for key, chunk in zip(_model_keys(engine), engine.chunks):
        _unwrap(chunk).load_state_dict(loaded[key], strict=True)
    with torch.no_grad():  # the distributed optimizer copies into views of fp32 parameters
        engine.optimizer.load_state_dict(loaded["optimizer"])
    rng_file = os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")
    if not os.path.isfile(rng_file):
        raise CheckpointError(f"{path!r} lacks this rank's rng/rank{dist.get_rank()}.pt (RNG and Adam step counts)")
    rank_state = torch.load(rng_file, weights_only=False)
    _restore_adam_steps(engine, rank_state.pop(_STEPS, None), path)
    _set_rng_state(rank_state)
    engine.step = int(meta["step"])
    dist.barrier()
    return dict(meta["extra_state"])


_LAYERS = "decoder.layers."


def read_model_weights(path: str, cfg) -> dict[str, torch.Tensor]:
    """The full model weights (project names) of a checkpoint written by :func:`save`, read in this process alone.

    megatron-core's ``torch_dist`` format stores every weight as one global tensor whatever the TP/PP/VPP degrees
    (TP shards concatenated, per-layer weights stacked along a leading global-layer axis), so no process group and
    no megatron parallel state are needed: the stacked layers are split and converted with tp = 1.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    import torch.distributed.checkpoint as dcp
    import warnings

    from backends.megatron.convert import from_megatron_shards
    from backends.megatron.model import TE_RENAMES

    if not os.path.isfile(os.path.join(path, _STATE_FILE)):
        raise CheckpointError(f"{path!r} is not a megatron engine checkpoint: {_STATE_FILE} is missing")
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.") and "_extra_state" not in k}
    if not any(k.startswith(_LAYERS) for k in state):
        raise CheckpointError(f"{path!r} holds no decoder layers ({_LAYERS}*) in its dist-checkpoint metadata")
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    canonical = {te: local for local, te in TE_RENAMES.items()}  # TE specs fuse the pre-norms into the linears
    flat: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if not key.startswith(_LAYERS):
            flat[key] = t
            continue
        suffix = canonical.get(key[len(_LAYERS):], key[len(_LAYERS):])
        if t.shape[0] != cfg.num_layers:
            raise CheckpointError(f"{key} stacks {t.shape[0]} layers, the model config has num_layers="
                                  f"{cfg.num_layers}")
        for i in range(cfg.num_layers):
            flat[f"{_LAYERS}{i}.{suffix}"] = t[i]
    return from_megatron_shards([flat], cfg, layers=list(range(cfg.num_layers)))
