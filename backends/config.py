"""Typed configuration of an engine: model, optimizer, policy loss and the backend-specific parallel sections."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from backends.model.config import ModelConfig
from backends.model.lora import LORA_TARGETS, LoraSpec, resolve_targets
from dispatch.topology import FSDPParallel, MegatronParallel
from protocol.algos.kl import KL_KINDS
from protocol.algos.losses import LossAggMode
from protocol.config import ConfigError, check_choices

__all__ = ["EngineConfigError", "OptimConfig", "PolicyLossConfig", "ValueLossConfig", "FSDPConfig", "MegatronConfig",
           "LoraConfig", "EngineConfig", "DtypeName"]

# dtype names of the FSDP mixed-precision policy; auto = bf16 on GPU, fp32 on CPU
DtypeName = Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]


class EngineConfigError(ConfigError):
    """An engine section value that cannot be used; the message names the ``actor.*`` key to change."""


_FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class OptimConfig:
    """AdamW (or SGD, for exact parity tests) with linear warm-up then a constant or cosine schedule."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int | None = None  # optimizer steps of the whole run (cosine decay length); None = the trainer's
    min_lr_ratio: float = 0.0
    clip_grad: float = 1.0
    section: ClassVar[str] = "actor.optim"  # the dotted key its errors name (a critic's optimizer says critic.optim)

    def __post_init__(self) -> None:
        check_choices(self, self.section, EngineConfigError)
        # each bound keeps the first update finite: eps=0 divides 0 by 0 for a parameter whose gradient is 0,
        # beta >= 1 never forgets (and its bias correction divides by zero), a negative decay grows the weights
        # the optimizer keeps lr as a float32 scalar: beyond float32's range it overflows inside torch
        checks = [("lr", self.lr, math.isfinite(self.lr) and 0 <= self.lr <= _FLOAT32_MAX,
                   f"a finite number in [0, {_FLOAT32_MAX:.4g}] (float32)"),
                  ("eps", self.eps, math.isfinite(self.eps) and self.eps > 0, "> 0 (1e-8 is usual)"),
                  ("weight_decay", self.weight_decay, math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                   "a finite number >= 0"),
                  ("warmup_steps", self.warmup_steps, self.warmup_steps >= 0, ">= 0"),
                  ("clip_grad", self.clip_grad, self.clip_grad > 0, "> 0"),
                  ("min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "in [0, 1]")]
        if self.total_steps is not None:
            checks.append(("total_steps", self.total_steps, self.total_steps > 0, "a positive integer or null"))
        for name, value, ok, expected in checks:
            if not ok:
                raise EngineConfigError(f"{self.section}.{name} must be {expected}, got {value!r}")
        if len(self.betas) != 2:
            raise EngineConfigError(f"{self.section}.betas must be two numbers [beta1, beta2], got {list(self.betas)}")
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise EngineConfigError(f"{self.section}.betas[{i}] must be in [0, 1), got {beta!r}")


@dataclass
class PolicyLossConfig:
    """PPO-clip policy loss with dual clip, entropy bonus and an optional KL loss against the reference."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # a KL estimator of protocol.algos.kl (KL_KINDS)
    horizon: int | None = None  # fixed token horizon of seq-mean-token-sum-norm (normally the max response length)
    temperature: float = 1.0  # logits are divided by it in training, as in the rollout that sampled the tokens

    def __post_init__(self) -> None:
        check_choices(self, "actor.loss", EngineConfigError)
        if self.kl_loss_type not in KL_KINDS:
            raise EngineConfigError(f"actor.loss.kl_loss_type must be one of {list(KL_KINDS)}, got "
                                    f"{self.kl_loss_type!r}")
        if self.temperature <= 0:
            raise EngineConfigError(f"actor.loss.temperature must be > 0, got {self.temperature}")
        if self.horizon is not None and self.horizon <= 0:
            raise EngineConfigError(f"actor.loss.horizon must be a positive integer, got {self.horizon}")
        if self.clip_ratio_c <= 1.0:
            raise EngineConfigError(f"actor.loss.clip_ratio_c must be > 1 (dual clip), got {self.clip_ratio_c}")
        if not 0.0 <= self.clip_ratio_low < 1.0:  # the ratio is clipped below at 1 - clip_ratio_low > 0
            raise EngineConfigError(f"actor.loss.clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if not self.clip_ratio_high >= 0.0:
            raise EngineConfigError(f"actor.loss.clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if not self.kl_loss_coef >= 0.0:
            raise EngineConfigError(f"actor.loss.kl_loss_coef must be >= 0, got {self.kl_loss_coef}")


@dataclass
class ValueLossConfig:
    """The critic's clipped value loss (:func:`protocol.algos.losses.value_loss`); the run fills ``loss_agg_mode``
    and ``horizon`` from the actor's loss, so both models aggregate their tokens alike."""

    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    horizon: int | None = None

    def __post_init__(self) -> None:
        check_choices(self, "critic", EngineConfigError)
        if not (math.isfinite(self.cliprange_value) and self.cliprange_value > 0):
            raise EngineConfigError(f"critic.cliprange_value must be a finite number > 0, got {self.cliprange_value!r}")
        if self.horizon is not None and self.horizon <= 0:
            raise EngineConfigError(f"the value loss's horizon must be a positive integer, got {self.horizon}")


@dataclass
class FSDPConfig(FSDPParallel):
    """FSDP2 section: the parallel degrees (``fsdp_size`` = -1 shards over all ranks; a smaller value makes a
    replicate x shard (HSDP) mesh; ``ulysses_sp``) plus the engine's own keys."""

    activation_checkpointing: bool = False
    param_dtype: DtypeName = "auto"
    reduce_dtype: DtypeName = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self, "actor.fsdp", EngineConfigError)


@dataclass
class MegatronConfig(MegatronParallel):
    """Megatron-core section: the parallel degrees (``vpp`` = virtual pipeline stages per rank, 1 = off) plus the
    engine's own keys."""

    use_distributed_optimizer: bool = True
    sequence_parallel: bool = False


@dataclass
class LoraConfig:
    """Low-rank adapters on the decoder's projections (``rank`` 0 = off: every weight trains).

    With ``rank`` > 0 the base weights are frozen and only the adapters train; the update of a target projection is
    ``(alpha / rank) * B @ A``.
    """

    rank: int = 0
    alpha: float = 16.0
    target_modules: str | list[str] = "all-linear"  # all-linear, or a list of the decoder's projection names
    dropout: float = 0.0  # dropout on the adapters' input during training

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise EngineConfigError(f"actor.lora.rank must be >= 0 (0 = off), got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise EngineConfigError(f"actor.lora.alpha must be a finite number > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise EngineConfigError(f"actor.lora.dropout must be in [0, 1), got {self.dropout!r}")
        given = [self.target_modules] if isinstance(self.target_modules, str) else list(self.target_modules)
        if given != ["all-linear"]:
            unknown = [t for t in given if t not in LORA_TARGETS]
            if unknown or not given:
                raise EngineConfigError(f"actor.lora.target_modules: {unknown or given} not among the decoder's "
                                        f"projections {list(LORA_TARGETS)} (or 'all-linear')")
            if len(set(given)) != len(given):
                raise EngineConfigError(f"actor.lora.target_modules lists a projection twice: {given}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def spec(self) -> LoraSpec:
        """What the model needs to adapt itself."""
        return LoraSpec(rank=self.rank, alpha=self.alpha, targets=resolve_targets(self.target_modules),
                        dropout=self.dropout)


@dataclass
class EngineConfig:
    """Everything an engine needs besides its topology."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig)  # read by a critic engine only
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    vision: Any = None  # a backends.model.vision.VLConfig: a vision-language policy (model is then its decoder)
    freeze_vision_tower: bool = False  # a vision-language policy: train the decoder only (the tower is frozen)
    seed: int = 0
    max_token_len_per_gpu: int | None = None  # token budget per micro-batch, checked again by the engine
    dist_timeout_s: float | None = None  # timeout of every process group the engine creates; None = torch's default
    rollback_nonfinite: bool = True  # keep a pre-step copy to restore when an update leaves a non-finite weight
