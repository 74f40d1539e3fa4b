"""The decoder's architecture, shared by both backends so their results can be compared."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from protocol.config import ConfigError

__all__ = ["ModelConfig", "ModelConfigError", "MODEL_TYPES", "ROPE_TYPES", "RopeType"]


class ModelConfigError(ConfigError):
    """An architecture value that cannot build a model; the message names the ``model.*`` key to change."""


# model_type -> (q/k/v projections carry a bias, per-head q/k RMSNorm): what each Hugging Face family hard-wires
MODEL_TYPES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
RopeType = Literal["default", "linear", "llama3"]
ROPE_TYPES: tuple[str, ...] = get_args(RopeType)
_LLAMA3_DEFAULTS = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                    "rope_original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

    Covers Llama 2/3 (``rope_type`` default / linear / llama3), Mistral without sliding window, Qwen2/2.5
    (``qkv_bias``) and Qwen3 (``qk_norm``, explicit ``head_dim``). Parameter names follow the Hugging Face layout
    (``embed_tokens``, ``layers.{i}.self_attn.q_proj``, ``layers.{i}.self_attn.q_norm``, ``layers.{i}.mlp.gate_proj``,
    ``norm``, ``lm_head``) so weights convert to and from other layouts by name.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 = hidden_size / num_heads (resolved at construction); Qwen3 sets it explicitly
    model_type: str = "llama"  # the Hugging Face family: llama, mistral, qwen2, qwen3
    qkv_bias: bool = False  # q/k/v projections with bias (Qwen2); the output projection never has one
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before rotary (Qwen3)
    rope_theta: float = 10000.0
    rope_type: RopeType = "default"  # default | linear (positions / rope_factor) | llama3 (frequency-banded scaling)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position_embeddings: int = 8192  # llama3 only
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    init_std: float = 0.02
    hf_path: str = ""  # a local Hugging Face checkpoint folder to start from (else random init from the seed)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"model.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim < 0:
            raise ModelConfigError(f"model.head_dim must be positive (or 0 for hidden_size / num_heads), got {self.head_dim}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ModelConfigError(f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads "
                                 f"({self.num_heads}), or set model.head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ModelConfigError(f"model.head_dim must be even for rotary positions, got {self.head_dim}")
        self._check_family()
        self._check_rope()

    def _check_family(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ModelConfigError(f"model.model_type={self.model_type!r} is not one of {sorted(MODEL_TYPES)}")
        for idx, key in enumerate(("qkv_bias", "qk_norm")):
            got, want = bool(getattr(self, key)), MODEL_TYPES[self.model_type][idx]
            if got != want:
                having = sorted(t for t, flags in MODEL_TYPES.items() if flags[idx] == got)
                raise ModelConfigError(f"model.{key}={got} does not match model.model_type={self.model_type!r}, whose "
                                 f"checkpoints have {key}={want}; set model.{key}={str(want).lower()} or "
                                 f"model.model_type to one of {having}")

    def _check_rope(self) -> None:
        if self.rope_theta <= 0:
            raise ModelConfigError(f"model.rope_theta must be positive, got {self.rope_theta}")
        if self.rope_type not in ROPE_TYPES:
            raise ModelConfigError(f"model.rope_type={self.rope_type!r} is not one of {list(ROPE_TYPES)}")
        if self.rope_type == "default" and self.rope_factor != 1.0:
            raise ModelConfigError(f"model.rope_factor={self.rope_factor} has no effect with model.rope_type='default'; "
                             f"set model.rope_type to 'linear' or 'llama3', or model.rope_factor=1.0")
        if self.rope_factor <= 0:
            raise ModelConfigError(f"model.rope_factor must be positive, got {self.rope_factor}")
        if self.rope_type != "llama3":
            changed = [f"model.{k}={getattr(self, k)}" for k, v in _LLAMA3_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ModelConfigError(f"{', '.join(changed)} only apply to model.rope_type='llama3' (got "
                                 f"{self.rope_type!r}); remove them or set the rope type")
            return
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ModelConfigError(f"llama3 rope needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, got "
                             f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
        if self.rope_original_max_position_embeddings <= 0:
            raise ModelConfigError(f"model.rope_original_max_position_embeddings must be positive, got "
                             f"{self.rope_original_max_position_embeddings}")
