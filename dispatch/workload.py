"""Per-sample compute cost as a function of sequence length: what the balancer equalises across DP ranks.

For a decoder layer of hidden size ``h``, a forward pass over one sequence of ``s`` tokens costs about
``24·h²·s`` FLOPs in the dense matmuls (QKV and output projections 8·h², MLP 16·h², per token, counting a
multiply-add as 2) plus ``4·h·s²`` FLOPs in attention (scores ``QKᵀ`` and ``softmax·V``, ``2·h·s²`` each).
So ``workload(s) = a·s + b·s²`` with ``a = 24·h²`` and ``b = 4·h``; the number of layers and the backward
pass scale both terms alike and drop out of any balance ratio. Short sequences are linear-dominated, and
the attention term takes over beyond ``s ≈ 6·h``.

Example::

    >>> model = WorkloadModel.from_hidden_size(64)
    >>> model.linear, model.quadratic, float(model([10])[0])
    (98304.0, 256.0, 1008640.0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["WorkloadModel", "WorkloadError", "DEFAULT_HIDDEN_SIZE"]

DEFAULT_HIDDEN_SIZE = 4096


class WorkloadError(ValueError):
    """Bad workload coefficients or sequence lengths."""


@dataclass(frozen=True)
class WorkloadModel:
    """``workload(seq_len) = linear·seq_len + quadratic·seq_len²``; defaults are those of hidden size 4096.

    A vision-language policy adds its vision tower's cost per image: ``vision_linear·p + vision_quadratic·p²`` for
    each attention span of ``p`` patches (a frame, or a Qwen2.5-VL window), in the same units as the decoder's
    terms (already scaled by the ratio of vision blocks to decoder layers; see :meth:`with_vision`). Image tokens
    are part of ``seq_len``: the decoder's cost of them is in the first two terms."""

    linear: float = 24.0 * DEFAULT_HIDDEN_SIZE ** 2
    quadratic: float = 4.0 * DEFAULT_HIDDEN_SIZE
    vision_linear: float = 0.0
    vision_quadratic: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vision_linear", "vision_quadratic"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise WorkloadError(f"workload.{name} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        for name in ("linear", "quadratic"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise WorkloadError(f"workload.{name} must be a finite number >= 0, got {v!r}")
        if self.linear == 0 and self.quadratic == 0:
            raise WorkloadError("workload.linear and workload.quadratic are both 0; every sample would weigh nothing")
        object.__setattr__(self, "linear", float(self.linear))
        object.__setattr__(self, "quadratic", float(self.quadratic))

    @classmethod
    def from_hidden_size(cls, hidden_size: int) -> "WorkloadModel":
        """Coefficients ``a = 24·h²``, ``b = 4·h`` of a transformer with hidden size ``h``."""
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise WorkloadError(f"hidden_size must be a positive int, got {hidden_size!r}")
        return cls(linear=24.0 * hidden_size ** 2, quadratic=4.0 * hidden_size)

    @classmethod
    def from_config(cls, cfg: object | None) -> "WorkloadModel":
        """From ``None`` (defaults), a model with ``hidden_size``, or a mapping with ``hidden_size`` or ``linear``/``quadratic``."""
        if cfg is None:
            return cls()
        if isinstance(cfg, WorkloadModel):
            return cfg
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        if get("linear") is not None or get("quadratic") is not None:
            return cls(linear=get("linear", 0.0), quadratic=get("quadratic", 0.0))
        if get("hidden_size") is not None:
            return cls.from_hidden_size(get("hidden_size"))
        raise WorkloadError(f"workload config needs hidden_size or linear/quadratic, got {cfg!r}")

    def with_vision(self, *, width: int, mlp_matrices: int, mlp_width: int, blocks: int, decoder_layers: int
                    ) -> "WorkloadModel":
        """This model plus a vision tower of ``blocks`` blocks of ``width`` (``mlp_matrices`` MLP matrices of
        ``width x mlp_width``: 2 for Qwen2-VL's, 3 for a SwiGLU) beside ``decoder_layers`` decoder layers: per
        patch ``2·(4·width² + mlp_matrices·width·mlp_width)`` FLOPs, per span of p patches ``4·width·p²``, both
        scaled by ``blocks / decoder_layers`` (the decoder's terms count one layer)."""
        for name, v in (("width", width), ("mlp_matrices", mlp_matrices), ("mlp_width", mlp_width),
                        ("blocks", blocks), ("decoder_layers", decoder_layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise WorkloadError(f"with_vision: {name} must be a positive int, got {v!r}")
        ratio = blocks / decoder_layers
        return WorkloadModel(self.linear, self.quadratic,
                             vision_linear=ratio * 2.0 * (4 * width ** 2 + mlp_matrices * width * mlp_width),
                             vision_quadratic=ratio * 4.0 * width)

    def vision(self, spans: Sequence[Sequence[int]]) -> np.ndarray:
        """The vision tower's cost of each sample (float64 [n]): ``spans[i]`` are the patch counts of sample i's
        attention spans (empty: no images)."""
        out = np.zeros(len(spans), dtype=np.float64)
        for i, ps in enumerate(spans):
            if len(ps):
                p = np.asarray(ps, dtype=np.float64)
                if not np.all(np.isfinite(p)) or p.min() < 0:
                    raise WorkloadError(f"sample {i}: patch counts must be finite and >= 0, got {list(ps)}")
                out[i] = float(np.sum(self.vision_linear * p + self.vision_quadratic * p * p))
        return out

    def __call__(self, seq_lens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Workload of each sequence length (float64 array)."""
        s = np.asarray(seq_lens, dtype=np.float64)
        if s.size and (not np.all(np.isfinite(s)) or s.min() < 0):
            raise WorkloadError(f"sequence lengths must be finite and >= 0, got min {s.min()!r}")
        return self.linear * s + self.quadratic * s * s
