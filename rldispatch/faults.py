"""Deterministic fault injection for end-to-end tests of the failure policy (``debug.inject_rollout_failures``)."""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

from protocol.rollout.agent_loop import AgentLoop

__all__ = ["InjectedRolloutError", "FaultInjectingLoop", "fails"]


class InjectedRolloutError(RuntimeError):
    """The session failure injected on purpose by ``debug.inject_rollout_failures``."""


def fails(uid: str, fraction: float) -> bool:
    """Whether group ``uid`` gets an injected failure: a stable hash of the uid below ``fraction``."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(uid.encode()).digest()[:8], "little") / 2**64
    return h < fraction


class FaultInjectingLoop(AgentLoop):
    """Wraps an agent loop; session 0 of a group run with ``inject_failure=True`` raises before generating."""

    name = "fault_injecting"

    def __init__(self, inner: AgentLoop):
        super().__init__(inner.generate, inner.tokenizer, inner.max_response_length)
        self.inner = inner

    async def run(self, prompt: Any, sampling_params: Mapping[str, Any] | None = None, **kwargs: Any):
        if kwargs.pop("inject_failure", False) and kwargs.get("session_id") == 0:
            raise InjectedRolloutError("injected rollout failure (debug.inject_rollout_failures)")
        return await self.inner.run(prompt, sampling_params, **kwargs)
