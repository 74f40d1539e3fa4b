"""The engine interface both backends implement, the share format they consume, and the backend registry."""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import TensorDict

from protocol.registry import Registry

__all__ = ["Share", "Engine", "register_engine", "get_engine_class", "known_engines"]


@dataclass
class Share:
    """What one DP replica computes on in one engine call.

    ``data`` holds the replica's samples (batch dim 0). Per-sample token fields are jagged (nested,
    ``torch.jagged`` layout):

    * ``input_ids`` – prompt ⧺ response, length ``seq_len``;
    * ``response_mask`` – length ``response_len`` (1 = policy token, 0 = observation / padding);
    * for training also ``old_log_probs`` and ``advantages`` (length ``response_len``) and, with a KL loss,
      ``ref_log_prob``; optional dense bool ``is_padding`` (padding samples count zero everywhere).

    ``prompt_len = seq_len - response_len``; positions restart at 0 for every sequence.
    ``micro_batches`` lists positions into ``data``; together they cover every position exactly once.
    For ``train_batch`` one share is one optimizer step (one mini-batch) of this replica.
    """

    data: TensorDict
    micro_batches: list[list[int]]

    def __post_init__(self) -> None:
        n = self.data.batch_size[0] if len(self.data.batch_size) else 0
        seen = sorted(i for mb in self.micro_batches for i in mb)
        if seen != list(range(n)):
            raise ValueError(
                f"Share.micro_batches must cover positions 0..{n - 1} exactly once; got {len(seen)} positions "
                f"over {len(self.micro_batches)} micro-batches"
            )


class Engine(abc.ABC):
    """Runs forward/backward/optimizer on per-rank shares. Collectives and parallel state live inside."""

    name: str = "abstract"

    @property
    @abc.abstractmethod
    def dp_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def dp_rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def dp_group(self) -> Any: ...

    @property
    @abc.abstractmethod
    def is_reporting_rank(self) -> bool:
        """True on the one rank per DP replica whose outputs are kept (TP 0, last PP stage, CP/SP 0)."""

    @abc.abstractmethod
    def train_batch(self, share: Share) -> dict[str, float]:
        """One optimizer step: zero grad, forward/backward over micro-batches, clip, step, LR step.

        Returns metrics (loss, grad_norm, lr, clip fraction, approx KL, entropy, tokens, time, skipped) that are
        identical on every rank.
        """

    @abc.abstractmethod
    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False) -> TensorDict | None:
        """Per-token ``log_probs`` (and ``entropy``) of each response token, jagged, in share order; no grad.

        Returns the TensorDict on the reporting rank of each replica and ``None`` elsewhere.
        """

    @abc.abstractmethod
    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights in the project's model layout (backends.model), on every rank, on CPU.

        With LoRA adapters the adapters are merged in: these are the weights the policy samples with."""

    @property
    def has_adapters(self) -> bool:
        """Whether the model carries LoRA adapters (its base weights frozen): ``config.lora`` is on."""
        lora = getattr(getattr(self, "config", None), "lora", None)
        return bool(lora is not None and lora.enabled)

    def _adapted_modules(self) -> list[torch.nn.Module]:
        """The modules holding this engine's adapted layers (an engine with LoRA support names them)."""
        raise NotImplementedError(f"the {self.name} engine has no LoRA adapters to disable")

    def adapters_disabled(self) -> contextlib.AbstractContextManager:
        """A context in which forward passes use the frozen base weights alone (bit-identical to the base model):
        the reference policy of a LoRA actor."""
        from backends.model.lora import adapters_disabled

        if not self.has_adapters:
            raise RuntimeError("adapters_disabled() needs actor.lora.rank > 0: this actor has no adapters")
        return adapters_disabled(*self._adapted_modules())

    @abc.abstractmethod
    def set_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full weights given in the project's model layout (same on every rank)."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str, extra_state: dict | None = None) -> None: ...

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> dict:
        """Restore model, optimizer, LR scheduler, RNG and step; return the ``extra_state`` saved with it."""


_REGISTRY: Registry[Callable[..., Engine]] = Registry("backend", key="actor.backend")


def register_engine(name: str):
    """Class decorator: make an engine selectable by ``actor.backend = name``."""
    register = _REGISTRY.register(name)

    def deco(cls):
        register(cls)
        cls.name = name
        return cls

    return deco


def known_engines() -> list[str]:
    _import_builtin_engines()
    return _REGISTRY.names()


def get_engine_class(name: str) -> Callable[..., Engine]:
    """The engine class registered under ``name``; an unknown name lists the known ones."""
    _import_builtin_engines()
    return _REGISTRY.get(name)


def _import_builtin_engines() -> None:
    import importlib

    for mod in ("backends.fsdp.engine", "backends.megatron.engine"):
        try:
            importlib.import_module(mod)
        except ImportError as exc:  # an optional backend whose dependency is absent stays unregistered
            if getattr(exc, "name", "") and not str(exc.name).startswith(("megatron", "transformer_engine")):
                raise
