"""The decoder's architecture, shared by both backends so their results can be compared."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

    Parameter names follow the Hugging Face Llama layout (``embed_tokens``, ``layers.{i}.self_attn.q_proj``,
    ``layers.{i}.mlp.gate_proj``, ``norm``, ``lm_head``) so weights convert to and from other layouts by name.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    init_std: float = 0.02
    hf_path: str = ""  # a local Hugging Face Llama checkpoint to start from (else random init from the seed)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.num_kv_heads})"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim = hidden_size / num_heads must be even for rotary positions, got "
                             f"{self.hidden_size // self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
