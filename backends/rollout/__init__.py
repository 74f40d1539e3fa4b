"""Rollout engines behind one interface (:class:`RolloutEngine`): the embedded sampler, and partial rollout over
any engine; :func:`build_rollout_engine` builds the one ``rollout.engine`` names."""
from __future__ import annotations

from typing import Any

import torch

from backends.rollout.chunked import VersionedGenerate
from backends.rollout.embedded import EmbeddedEngine
from backends.rollout.vllm import VllmConfig, VllmEngine
from backends.rollout.engine import ENGINES, RolloutEngine, RolloutError, SamplingParams, register_rollout_engine

__all__ = ["RolloutEngine", "RolloutError", "SamplingParams", "EmbeddedEngine", "VllmEngine", "VllmConfig",
           "VersionedGenerate",
           "build_rollout_engine", "register_rollout_engine", "rollout_engines"]


def rollout_engines() -> list[str]:
    """The registered ``rollout.engine`` names."""
    return sorted(ENGINES)


def build_rollout_engine(name: str, model_cfg: Any, tokenizer: Any, *, device: str | torch.device = "cpu",
                         seed: int = 0, rank: int = 0, generates: bool = True, options: Any = None) -> RolloutEngine:
    """The ``rollout.engine`` named ``name``, holding a model of ``model_cfg``; it must implement every verb.
    ``generates``: whether this rank generates (else the engine only follows weight versions); ``options``: the
    run's ``rollout`` config section."""
    if name not in ENGINES:
        raise RolloutError(f"rollout.engine={name!r} is not a registered rollout engine; known: {rollout_engines()}")
    engine = ENGINES[name](model_cfg, tokenizer, device=device, seed=seed, rank=rank, generates=generates,
                           options=options)
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"rollout engine {name!r} built a {type(engine).__name__}, which lacks verbs of "
                        "backends.rollout.RolloutEngine")
    return engine
