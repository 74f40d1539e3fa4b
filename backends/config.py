"""Typed configuration of an engine: model, optimizer, policy loss and the backend-specific parallel sections."""
from __future__ import annotations

from dataclasses import dataclass, field

from backends.model.config import ModelConfig

__all__ = ["OptimConfig", "PolicyLossConfig", "FSDPConfig", "MegatronConfig", "EngineConfig"]

LR_SCHEDULES = ("constant", "cosine")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class OptimConfig:
    """AdamW (or SGD, for exact parity tests) with linear warm-up then a constant or cosine schedule."""

    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int | None = None  # optimizer steps of the whole run (cosine decay length); None = the trainer's
    min_lr_ratio: float = 0.0
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"actor.optim.name must be 'adamw' or 'sgd', got {self.name!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"actor.optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.lr < 0 or self.warmup_steps < 0 or self.clip_grad <= 0:
            raise ValueError("actor.optim: lr and warmup_steps must be >= 0 and clip_grad > 0, got "
                             f"lr={self.lr}, warmup_steps={self.warmup_steps}, clip_grad={self.clip_grad}")


@dataclass
class PolicyLossConfig:
    """PPO-clip policy loss with dual clip, entropy bonus and an optional KL loss against the reference."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    horizon: int | None = None  # fixed token horizon of seq-mean-token-sum-norm (normally the max response length)
    temperature: float = 1.0  # logits are divided by it in training, as in the rollout that sampled the tokens

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"actor.loss.loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.temperature <= 0:
            raise ValueError(f"actor.loss.temperature must be > 0, got {self.temperature}")
        if self.horizon is not None and self.horizon <= 0:
            raise ValueError(f"actor.loss.horizon must be a positive integer, got {self.horizon}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.loss.clip_ratio_c must be > 1 (dual clip), got {self.clip_ratio_c}")


@dataclass
class FSDPConfig:
    """FSDP2: fsdp_size = -1 shards over all ranks; a smaller value makes a replicate x shard (HSDP) mesh."""

    fsdp_size: int = -1
    ulysses_sp: int = 1
    activation_checkpointing: bool = False
    param_dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    reduce_dtype: str = "float32"


@dataclass
class MegatronConfig:
    """Megatron-core parallel degrees. vpp = virtual pipeline stages per rank (1 = off)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dynamic_cp: bool = False
    use_distributed_optimizer: bool = True
    sequence_parallel: bool = False


@dataclass
class EngineConfig:
    """Everything an engine needs besides its topology."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    seed: int = 0
    max_token_len_per_gpu: int | None = None  # token budget per micro-batch, checked again by the engine
