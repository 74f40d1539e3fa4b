"""Checkpoints of the megatron engine via megatron-core's distributed checkpointing (written next)."""
from __future__ import annotations

__all__ = ["save", "load"]


def save(engine, path: str, extra_state: dict) -> None:
    raise NotImplementedError


def load(engine, path: str) -> dict:
    raise NotImplementedError
