"""Optimizer, learning-rate schedule and gradient clipping shared by both engines."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from backends.config import OptimConfig

__all__ = ["build_optimizer", "lr_factor", "build_lr_scheduler", "clip_grad_norm", "StepSnapshot", "all_finite"]


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (lr, betas, eps, weight_decay) or plain SGD (lr, weight_decay; no momentum) from ``cfg``."""
    params = [p for p in params if p.requires_grad]
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, foreach=False)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    raise ValueError(f"actor.optim.name must be 'adamw' or 'sgd', got {cfg.name!r}")


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` for the optimizer step with 0-based index ``step``.

    Linear warm-up ``(step + 1) / warmup_steps`` for ``step < warmup_steps``; then 1 (constant) or a cosine from 1
    down to ``min_lr_ratio`` over ``max(1, total_steps - warmup_steps)`` steps, held after.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    w = cfg.warmup_steps
    if step < w:
        return (step + 1) / w
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.total_steps is None:
        raise ValueError("actor.optim.total_steps is needed by the cosine schedule (the trainer sets it from "
                         "trainer.total_steps; set it when building an engine directly)")
    span = max(1, cfg.total_steps - w)
    progress = min(1.0, (step - w) / span)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """A LambdaLR following :func:`lr_factor`; call ``step()`` once after every optimizer step."""
    return LambdaLR(optimizer, lambda s: lr_factor(s, cfg))


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> tuple[float, bool]:
    """Clip gradients to a global L2 norm of ``max_norm`` (sharded DTensor gradients included).

    Returns (pre-clip norm, finite). A non-finite norm leaves the gradients untouched so the caller can skip.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0, True
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
    value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(value):
        return value, False
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return value, True


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard, a view, so writes land in the parameter)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _clone_state(value):
    return value.detach().clone() if torch.is_tensor(value) else value


class StepSnapshot:
    """This rank's parameters and optimizer state before an update, to restore when the update is not finite.

    Costs one copy of the local parameter shards and optimizer state; :meth:`restore` writes the parameters back
    in place (so views such as megatron-core's parameter buffer stay valid) and puts the old state back. A state the
    rolled-back step created (its first step) is zeroed rather than dropped: for Adam/AdamW zero moments and step
    are exactly the lazy initial state, and megatron-core cannot save an optimizer with no state.
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizers: Sequence[torch.optim.Optimizer]):
        self._params = list({id(p): p for p in params}.values())
        with torch.no_grad():
            self._values = [_local(p).detach().clone() for p in self._params]
        self._optimizers = list(optimizers)
        self._states = [{p: {k: _clone_state(v) for k, v in st.items()} for p, st in opt.state.items()}
                        for opt in self._optimizers]

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in zip(self._params, self._values):
            _local(p).copy_(saved)
        for opt, saved in zip(self._optimizers, self._states):
            created = {p: {k: torch.zeros_like(v) if torch.is_tensor(v) else v for k, v in st.items()}
                       for p, st in opt.state.items() if p not in saved}
            opt.state.clear()
            for p, st in saved.items():
                opt.state[p] = {k: _clone_state(v) for k, v in st.items()}
            opt.state.update(created)


def all_finite(tensors: Iterable[torch.Tensor], *scalars: float, device=None, group=None) -> bool:
    """Whether every local tensor and scalar is finite on every rank of ``group`` (one MIN all-reduce)."""
    ok = all(math.isfinite(float(x)) for x in scalars)
    if ok:
        with torch.no_grad():
            ok = all(bool(torch.isfinite(_local(t)).all()) for t in tensors)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
