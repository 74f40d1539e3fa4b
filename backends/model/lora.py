"""Low-rank adapters (LoRA) on the decoder's projections: ``y = x W^T + b + (alpha / r) (x A^T) B^T``.

``A`` [r, in] starts random and ``B`` [out, r] at zero, so an adapted model starts as exactly its base. The base
weight keeps its name and module (``layers.0.self_attn.q_proj.weight``), the adapters sit beside it
(``...q_proj.lora_A`` / ``...q_proj.lora_B``), so Hugging Face weight names, sharded loading and FSDP2 wrapping
of the decoder blocks are unchanged. :func:`adapters_disabled` makes the forward the base model's, bit for bit.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LORA_TARGETS", "LoraSpec", "LoraLinear", "apply_lora", "init_adapters", "adapter_shapes", "seeded_adapters",
           "adapters_disabled", "is_adapter_name", "adapter_names", "merge_adapters", "base_name", "resolve_targets"]

#: the decoder's projection names that can carry adapters (attention, then MLP), as Hugging Face names them
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ADAPTER = re.compile(r"\.lora_[AB]$")


def resolve_targets(target_modules: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The projection names of ``target_modules`` (``all-linear`` = every one), in :data:`LORA_TARGETS` order."""
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return LORA_TARGETS
        target_modules = [target_modules]
    return tuple(t for t in LORA_TARGETS if t in set(target_modules))


@dataclass(frozen=True)
class LoraSpec:
    """What the model needs of a LoRA config: rank, scale numerator, targets, dropout."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update; ``adapters_enabled = False`` gives ``F.linear(x, W, b)`` exactly."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter

    @classmethod
    def adapt(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> "LoraLinear":
        """Turn ``linear`` into a LoraLinear in place (its weight and bias stay the same tensors); A, B empty / zero."""
        w = linear.weight
        linear.__class__ = cls
        linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=w.device, dtype=w.dtype))
        linear.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=w.device, dtype=w.dtype))
        linear.lora_scale = float(alpha) / int(rank)
        linear.lora_dropout = float(dropout)
        linear.adapters_enabled = True
        return linear  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return y
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return y + self.lora_scale * F.linear(F.linear(h, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.lora_scale:g}"


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Adapt every target projection of ``model`` (any device, meta included) and freeze everything else.

    Returns the adapted module names. Only ``lora_A`` / ``lora_B`` keep ``requires_grad``.
    """
    if spec.rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {spec.rank}")
    targets = set(spec.targets)
    adapted = []
    for name, mod in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in targets and type(mod) is nn.Linear:
            LoraLinear.adapt(mod, spec.rank, spec.alpha, spec.dropout)
            adapted.append(name)
    if not adapted:
        raise ValueError(f"no projection named {sorted(targets)} in the model")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    return adapted


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...q_proj.lora_A`` / ``...lora_B``)."""
    return bool(_ADAPTER.search(name))


def base_name(adapter: str) -> str:
    """The weight an adapter belongs to: ``l.q_proj.lora_A`` -> ``l.q_proj.weight``."""
    return _ADAPTER.sub(".weight", adapter)


def adapter_names(names) -> list[str]:
    """The adapted weights' names (``...q_proj.weight``) among parameter ``names``, in order."""
    return [base_name(n) for n in names if n.endswith(".lora_A")]


def _drawn(named_shapes: Iterable[tuple[str, tuple[int, ...]]], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Full-size fp32 values of the adapters among ``named_shapes``, drawn in that order from one CPU generator:
    A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a = sqrt(5), as ``nn.Linear`` and peft do), B = 0."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + 7_340_033)
    for name, shape in named_shapes:
        if not is_adapter_name(name):
            continue
        if name.endswith(".lora_B"):
            yield name, torch.zeros(shape)
            continue
        bound = 1.0 / math.sqrt(shape[1])
        yield name, torch.rand(shape, generator=gen, dtype=torch.float32).mul_(2 * bound).sub_(bound)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Give every adapter of ``model`` its seeded value (see :func:`seeded_adapters`), each rank its own rows.

    The same adapters for every world size and device, whether the parameters are FSDP2 shards or whole tensors.
    """
    from backends.fsdp.rows import local_rows

    params = dict(model.named_parameters())
    for name, full in _drawn(((n, tuple(p.shape)) for n, p in params.items()), seed):
        p = params[name]
        local = p.to_local() if hasattr(p, "to_local") else p
        start, stop = local_rows(p)
        local.copy_(full[start:stop].to(local.device, local.dtype))


def adapter_shapes(cfg, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """Project name -> shape of every adapter of the decoder ``cfg`` adapted by ``spec``, in parameter order."""
    from backends.model.llama import LlamaModel

    with torch.device("meta"):
        model = LlamaModel(cfg)
    apply_lora(model, spec)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if is_adapter_name(n)}


def seeded_adapters(cfg, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """The initial adapters of the decoder ``cfg`` adapted by ``spec``, full size in project names (fp32).

    One definition for every backend: drawn in the decoder's parameter order, so an engine that holds the model
    in another layout (megatron-core's fused, tensor-parallel linears) starts from the very adapters FSDP does.
    """
    return dict(_drawn(adapter_shapes(cfg, spec).items(), seed))


@contextlib.contextmanager
def adapters_disabled(*models: nn.Module) -> Iterator[None]:
    """Within the block every adapted layer of ``models`` (any module with an ``adapters_enabled`` flag: the
    :class:`LoraLinear` here, megatron-core's adapted linears) computes its base projection only."""
    mods = [m for model in models for m in model.modules() if hasattr(m, "adapters_enabled")]
    before = [m.adapters_enabled for m in mods]
    for m in mods:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m, was in zip(mods, before):
            m.adapters_enabled = was


@torch.no_grad()
def merge_adapters(weights: Mapping[str, torch.Tensor], scale: float, *, inplace: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Base-layout weights with every adapter folded in: ``W + scale * B @ A`` (computed in fp32, cast back).

    Every other tensor is returned as is (the same object), and the ``lora_*`` entries are dropped. ``inplace``:
    fp32 base weights are updated in their own storage (for a dict of fresh copies: no second copy of each matrix).
    """
    out = {n: t for n, t in weights.items() if not is_adapter_name(n)}
    for w in adapter_names(weights):
        stem = w[: -len(".weight")]
        a, b = weights[f"{stem}.lora_A"].float(), weights[f"{stem}.lora_B"].float()
        if w not in out:
            raise KeyError(f"adapter {stem}.lora_A has no base weight {w}")
        base = out[w]
        if inplace and base.dtype == torch.float32:
            base.addmm_(b, a, alpha=scale)
        else:
            out[w] = (base.float() + scale * (b @ a)).to(base.dtype)
    return out
