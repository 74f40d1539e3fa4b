"""The reference policy: a frozen copy of the initial weights that scores log-probs for the KL terms.

A LoRA actor's base weights never change, so its reference is the actor itself with the adapters switched off:
no second model is built.
"""
from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from backends.base import Engine, Share

__all__ = ["SwappedReference", "AdapterFreeReference", "build_reference"]

# Backends whose engine owns process-global state (megatron-core's parallel state) and so cannot be built twice.
_SINGLE_INSTANCE = {"megatron"}


class SwappedReference:
    """Scores with the actor engine itself after loading the frozen weights, then restores the actor's.

    Used where a second engine cannot be built in one process. The restore is exact (same dtype, same values),
    so the optimizer's own copy of the parameters and the actor's next step are untouched.
    """

    def __init__(self, actor: Engine, frozen: dict[str, torch.Tensor]):
        self.actor = actor
        self.frozen = {k: v.detach().clone() for k, v in frozen.items()}

    @property
    def is_reporting_rank(self) -> bool:
        return self.actor.is_reporting_rank

    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False) -> TensorDict | None:
        current = {k: v.detach().clone() for k, v in self.actor.get_weights().items()}
        self.actor.set_weights(self.frozen)
        try:
            return self.actor.infer_batch(share, temperature=temperature, with_entropy=with_entropy)
        finally:
            self.actor.set_weights(current)


class AdapterFreeReference:
    """Scores with the LoRA actor's frozen base: the actor's own forward with its adapters disabled."""

    def __init__(self, actor: Engine):
        if not actor.has_adapters:
            raise ValueError("AdapterFreeReference needs an actor with LoRA adapters (actor.lora.rank > 0)")
        self.actor = actor

    @property
    def is_reporting_rank(self) -> bool:
        return self.actor.is_reporting_rank

    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False) -> TensorDict | None:
        with self.actor.adapters_disabled():
            return self.actor.infer_batch(share, temperature=temperature, with_entropy=with_entropy)


def build_reference(backend: str, engine_cls: Any, config: Any, topology: Any, actor: Engine) -> Any:
    """The LoRA actor with adapters off; else a second, frozen engine where the backend allows it; otherwise the
    actor with swapped-in frozen weights."""
    if actor.has_adapters:
        return AdapterFreeReference(actor)
    if backend in _SINGLE_INSTANCE:
        return SwappedReference(actor, actor.get_weights())
    return engine_cls(config, topology)
