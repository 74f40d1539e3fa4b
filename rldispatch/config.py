"""The run's typed configuration: YAML + dot-list overrides, validated once at start-up.

Each section is a dataclass defined once, at its owner: ``model`` (backends.model.config.ModelConfig),
``actor.optim`` / ``actor.loss`` (backends.config), ``actor.fsdp`` / ``actor.megatron`` (backends.config,
extending dispatch.topology's FSDPParallel / MegatronParallel with the engine-only keys); the run's own
sections live here. :func:`load_config` builds them with :func:`protocol.config.build_dataclass`, which refuses
unknown keys, wrong types and values outside a ``Literal`` naming the dotted key; :func:`validate` then checks
what needs several sections and the choices named by a registry (advantage estimators, KL estimators, agent
loops). Every error is a :class:`ConfigError` (topology and batch-settings errors subclass it too).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from backends.config import (EngineConfig, FSDPConfig, LoraConfig, MegatronConfig, OptimConfig, PolicyLossConfig,
                             ValueLossConfig)
from backends.model.config import ModelConfig
from backends.rollout.engine import RolloutError
from backends.rollout.vllm import VllmConfig, require_engine_python
from protocol.algos.reward import CustomRewardFunctionConfig, RewardConfig
from protocol.algos.rollout_correction import RolloutCorrectionConfig
from dispatch.topology import BackendName, ParallelSection, Topology
from protocol.config import ConfigError, build_dataclass, coerce_field

__all__ = ["RunConfig", "load_config", "check_environment", "ConfigError"]

logger = logging.getLogger(__name__)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/repeat/train.parquet"])
    val_files: list[str] = field(default_factory=lambda: ["data/repeat/val.parquet"])
    prompt_key: str = "prompt"  # the column holding the message list (a file without it may use raw_prompt)
    task: str = "repeat"  # generated on first use when the files are missing (scripts/make_task_data.py)
    train_size: int = 2048
    val_size: int = 64
    tokenizer: str = ""  # "" = the model.hf_path folder's own tokenizer, else "char"; or a tokenizer folder
    max_prompt_length: int = 64
    filter_overlong_prompts: bool = True  # false: an over-long prompt is an error instead of being dropped
    max_response_length: int = 8
    train_batch_size: int = 16  # prompts per step
    val_batch_size: int = 16
    shuffle: bool = True


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # a registered rollout engine (backends.rollout): embedded | vllm
    n: int = 8  # sessions per prompt (GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    agent_loop: str = "single_turn"  # a registered agent loop (protocol.rollout.agent_loop): single_turn | tool
    max_turns: int = 4
    log_prob_mode: Literal["recompute", "bypass"] = "recompute"  # recompute (engine) | bypass (the rollout's own)
    # async modes: a session still generating at a weight sync resumes with the new weights, keeping its tokens and
    # log-probs (None = true in colocate_async, false in sync); it pauses every partial_rollout_chunk tokens
    partial_rollout: bool | None = None
    partial_rollout_chunk: int = 4
    vllm: VllmConfig = field(default_factory=VllmConfig)  # read with engine=vllm

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"rollout.max_turns must be a positive integer, got {self.max_turns}")


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self) -> None:
        if not 0 <= self.kl_coef < float("inf"):
            raise ConfigError(f"algorithm.kl_ctrl.kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if self.type == "adaptive" and not (self.target_kl > 0 and self.horizon > 0):
            key, value = ("target_kl", self.target_kl) if not self.target_kl > 0 else ("horizon", self.horizon)
            raise ConfigError(f"algorithm.kl_ctrl.{key} must be > 0 for the adaptive controller, got {value}")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # a registered estimator of protocol.algos.advantage (gae turns the critic on)
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # a KL estimator of protocol.algos.kl (KL_KINDS)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class BalanceConfig:
    enabled: bool = True
    group_level: bool = False  # keep each GRPO group on one DP rank
    hidden_size: int | None = None  # workload coefficients derive from it; None = model.hidden_size


@dataclass
class ActorConfig:
    backend: BackendName = "fsdp"
    ppo_mini_batch_size: int = 8  # prompts per optimizer step
    ppo_epochs: int = 1
    shuffle: bool = False
    micro_batch_size_per_gpu: int = 8
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 2048
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    freeze_vision_tower: bool = False  # a vision-language policy: train the decoder (and merger) only

    @property
    def parallel(self) -> ParallelSection:
        """The active backend's section (``fsdp`` or ``megatron``): its parallel degrees build the topology."""
        return self.fsdp if self.backend == "fsdp" else self.megatron


@dataclass
class CriticOptimConfig(OptimConfig):
    """The critic's own optimizer (same keys and defaults as ``actor.optim``)."""

    section: ClassVar[str] = "critic.optim"


@dataclass
class CriticFSDPConfig(FSDPConfig):
    """The critic's own FSDP section (mesh, dtypes, activation checkpointing); its logical DP must be the actor's."""


@dataclass
class CriticConfig:
    """A value model trained beside the actor (PPO with ``algorithm.adv_estimator=gae``), on the actor's backend; a
    Megatron critic has the actor's ``actor.megatron`` degrees (it joins the actor's parallel state)."""

    enabled: bool | None = None  # None = on exactly when algorithm.adv_estimator reads values (gae)
    hf_path: str = ""  # "" = the actor's starting weights (model.hf_path, or the seeded init); the head is new
    cliprange_value: float = 0.5
    warmup_steps: int = 0  # first steps that train only the critic (the reference system's trainer.critic_warmup)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    fsdp: CriticFSDPConfig = field(default_factory=CriticFSDPConfig)  # FSDP actors only


@dataclass
class RefConfig:
    enabled: bool = True  # a frozen copy of the initial policy (with actor.lora.rank > 0: the actor, adapters off)


@dataclass
class ReplayConfig:
    failure_policy: Literal["drop", "keep_successful"] = "drop"
    off_policy_strategy: Literal["drop", "wait"] = "drop"
    max_off_policy_threshold: int = 8  # global steps from a prompt's dispatch to its training (span), async modes
    sample_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for key in ("max_off_policy_threshold", "sample_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"replay.{key} must be > 0, got {getattr(self, key)}")


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: int = 1  # batches of prompts submitted ahead of the first step


@dataclass
class SeparateAsyncConfig:
    rollout_ranks: int = 1  # ranks of the torchrun world that only generate (the last ones); the others only train
    num_warmup_batches: int = 1  # batches of prompts submitted ahead of the first step (each step submits one more)


@dataclass
class TrainerSection:
    total_steps: int = 300
    run_dir: str = "runs/grpo_tiny"
    save_freq: int = 0  # 0 = only at the end
    resume: str = "never"  # never | auto | a checkpoint folder
    val_freq: int = 0  # 0 = before the first and after the last step only
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress_bar: bool = True
    tensorboard: bool | None = None  # None = when torch.utils.tensorboard imports (said once when it does not)
    dist_timeout_s: float = 300.0  # a collective waiting longer (stuck or dead peer) ends the job
    save_on_signal: bool = True  # SIGTERM/SIGINT: checkpoint at the next step boundary, then exit 143 / 130
    on_nonfinite: Literal["skip", "stop"] = "skip"  # a non-finite update: roll back to the pre-step weights | stop
    run_dir_exists: Literal["refuse", "overwrite"] = "refuse"  # a run dir holding another run's metrics/checkpoints
    gc_interval: int = 1  # steps between garbage collections, automatic GC off meanwhile; 0 = Python's automatic GC
    # sync: generate the step's prompts, then train on them; colocate_async: the training ranks also generate, and
    # generation outlives the step; separate_async: rollout ranks generate apart from the training ranks
    # (docs/async.md)
    mode: Literal["sync", "colocate_async", "separate_async"] = "sync"
    colocate_async: ColocateAsyncConfig = field(default_factory=ColocateAsyncConfig)
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)


@dataclass
class TraceConfig:
    enabled: bool = False
    path: str = ""  # default: {run_dir}/trace.jsonl


@dataclass
class DebugConfig:
    check_invariants: bool = False  # run protocol.invariants after every stage (slow; for debugging)
    inject_rollout_failures: float = 0.0  # fraction of prompt groups whose session 0 raises (tests the failure policy)
    # separate_async: write a checksum of the weights each side holds after every sync to run_dir/weight_sync.jsonl
    weight_checksums: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.inject_rollout_failures <= 1.0:
            raise ConfigError(f"debug.inject_rollout_failures is a fraction of the prompt groups, in [0, 1]; got "
                              f"{self.inject_rollout_failures}")


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    trace: TraceConfig = field(default_factory=TraceConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)

    def engine_config(self) -> EngineConfig:
        """The engine's view of this run."""
        loss = self.actor.loss
        if loss.horizon is None:  # seq-mean-token-sum-norm divides by a fixed horizon: the longest response
            loss = dataclasses.replace(loss, horizon=self.data.max_response_length)
        # the update scores tokens at the temperature they were sampled (and their old log-probs computed) with
        loss = dataclasses.replace(loss, temperature=self.rollout.temperature)
        optim = self.actor.optim
        if optim.total_steps is None:  # every step makes train_batch_size / ppo_mini_batch_size updates per epoch
            per_step = self.data.train_batch_size // self.actor.ppo_mini_batch_size * self.actor.ppo_epochs
            optim = dataclasses.replace(optim, total_steps=self.trainer.total_steps * per_step)
        return EngineConfig(
            model=self.model, optim=optim, loss=loss, fsdp=self.actor.fsdp,
            megatron=self.actor.megatron, lora=self.actor.lora, seed=self.trainer.seed,
            max_token_len_per_gpu=self.actor.max_token_len_per_gpu if self.actor.use_dynamic_bsz else None,
            dist_timeout_s=self.trainer.dist_timeout_s, rollback_nonfinite=self.trainer.on_nonfinite == "skip",
            vision=vision_config(self), freeze_vision_tower=self.actor.freeze_vision_tower,
        )

    def critic_engine_config(self) -> EngineConfig:
        """The critic engine's view: the actor's architecture (``critic.hf_path`` as its start when given), the
        critic's optimizer and FSDP section, the actor's loss aggregation with ``critic.cliprange_value``; no adapters."""
        actor = self.engine_config()
        c = self.critic
        model = dataclasses.replace(self.model, hf_path=c.hf_path) if c.hf_path else self.model
        optim = c.optim
        if optim.total_steps is None:
            optim = dataclasses.replace(optim, total_steps=actor.optim.total_steps)
        value_loss = ValueLossConfig(cliprange_value=c.cliprange_value, loss_agg_mode=actor.loss.loss_agg_mode,
                                     horizon=actor.loss.horizon)
        # the critic trains all its weights: actor.lora adapts the policy only
        return dataclasses.replace(actor, model=model, optim=optim, fsdp=c.fsdp, value_loss=value_loss,
                                   lora=LoraConfig())

    def topology_config(self) -> ParallelSection:
        """The active backend's parallel section, for ``dispatch.Topology.from_config`` (same as ``actor.parallel``)."""
        return self.actor.parallel


def vision_config(cfg: RunConfig) -> Any:
    """The policy's :class:`~backends.model.vision.VLConfig` when ``model.hf_path`` is a vision-language folder
    (Qwen2-VL or Qwen2.5-VL), else None."""
    return _vision_of(cfg.model.hf_path) if cfg.model.hf_path else None


@functools.lru_cache(maxsize=8)
def _vision_of(path: str) -> Any:
    from backends.model.vision import is_vl_folder, read_vl_config

    return read_vl_config(path) if is_vl_folder(path) else None


def _check_vision(cfg: RunConfig) -> None:
    """A vision-language policy runs where its images reach every model call; elsewhere it is refused by key."""
    if vision_config(cfg) is None:
        if cfg.actor.freeze_vision_tower:
            raise ConfigError(f"actor.freeze_vision_tower=true but model.hf_path={cfg.model.hf_path!r} is not a "
                              f"vision-language folder (qwen2_vl / qwen2_5_vl); remove the key")
        return
    refused = [(cfg.actor.backend != "fsdp", f"actor.backend={cfg.actor.backend} (the Megatron engine has no vision "
                                             f"tower; set actor.backend=fsdp)"),
               (cfg.rollout.engine != "embedded", f"rollout.engine={cfg.rollout.engine} (images reach the embedded "
                                                  f"engine only; set rollout.engine=embedded)"),
               (cfg.actor.lora.rank > 0, "actor.lora.rank > 0 (set actor.lora.rank=0)"),
               (cfg.actor.fsdp.ulysses_sp > 1, "actor.fsdp.ulysses_sp > 1 (set it to 1)"),
               (bool(cfg.critic.enabled), "a critic (algorithm.adv_estimator=gae / critic.enabled; use grpo)"),
               (cfg.reward.model.enabled, "reward.model (a text reward model would score without the images)"),
               (cfg.reward.judge.enable, "reward.judge (a text judge would answer without the images)")]
    bad = [what for cond, what in refused if cond]
    if bad:
        raise ConfigError(f"model.hf_path={cfg.model.hf_path!r} is a vision-language policy, which is not built "
                          f"with: {'; '.join(bad)} (docs/multimodal.md)")


def _get(cfg: RunConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig) -> RunConfig:
    """Cross-field checks that no single section can make, and the choices named by a registry; each error names
    the keys to change. (Choices spelled as a ``Literal`` are refused while the sections are built.)"""
    _check_registered(cfg)
    _check_reward(cfg)
    _check_data_section(cfg.data)
    _check_critic(cfg)
    _check_vision(cfg)
    if cfg.actor.backend == "megatron":
        from backends.megatron.engine import check_engine_config

        check_engine_config(cfg.engine_config())
    positive = ["data.train_batch_size", "data.train_size", "data.val_size", "data.max_prompt_length",
                "data.max_response_length", "rollout.n",
                "actor.ppo_mini_batch_size", "actor.ppo_epochs", "actor.micro_batch_size_per_gpu",
                "actor.max_token_len_per_gpu", "trainer.total_steps"]
    for key in positive:
        value = _get(cfg, key)
        if value <= 0:
            raise ConfigError(f"{key} must be a positive integer, got {value}")
    for key in ["data.val_batch_size"]:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be a positive integer, got {_get(cfg, key)}")
    for key in ["trainer.save_freq", "trainer.val_freq"]:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (0 = only at the end), got {_get(cfg, key)}")
    if cfg.trainer.seed < 0:
        raise ConfigError(f"trainer.seed must be an integer >= 0, got {cfg.trainer.seed}")
    if cfg.actor.balance.hidden_size is not None and cfg.actor.balance.hidden_size <= 0:
        raise ConfigError(f"actor.balance.hidden_size must be a positive integer (or null: model.hidden_size), got "
                          f"{cfg.actor.balance.hidden_size}")
    if cfg.trainer.gc_interval < 0:
        raise ConfigError(f"trainer.gc_interval must be >= 0 steps (0 = Python's automatic garbage collection), "
                          f"got {cfg.trainer.gc_interval}")
    if cfg.trainer.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("trainer.tensorboard=true but the tensorboard package is not installed; pip install "
                              "tensorboard, or leave trainer.tensorboard unset (on when installed)")
    if not cfg.trainer.dist_timeout_s > 0:
        raise ConfigError(f"trainer.dist_timeout_s must be > 0 seconds, got {cfg.trainer.dist_timeout_s}")
    a, d = cfg.actor, cfg.data
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size ({d.train_batch_size}) must be a multiple of actor.ppo_mini_batch_size "
            f"({a.ppo_mini_batch_size}) prompts: each step makes train_batch_size / ppo_mini_batch_size optimizer steps"
        )
    if cfg.actor.loss.temperature not in (1.0, cfg.rollout.temperature):
        raise ConfigError(
            f"actor.loss.temperature ({cfg.actor.loss.temperature}) differs from rollout.temperature "
            f"({cfg.rollout.temperature}); the update always scores tokens at the rollout's temperature, so leave "
            f"actor.loss.temperature unset")
    _check_async(cfg)
    if cfg.algorithm.use_kl_in_reward and not cfg.ref.enabled:
        raise ConfigError("algorithm.use_kl_in_reward=true needs the reference policy: set ref.enabled=true")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature must be > 0, got {cfg.rollout.temperature}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    seq_budget = d.max_prompt_length + d.max_response_length
    if a.use_dynamic_bsz and a.max_token_len_per_gpu < seq_budget:
        raise ConfigError(
            f"actor.max_token_len_per_gpu ({a.max_token_len_per_gpu}) is smaller than one full sequence "
            f"(data.max_prompt_length + data.max_response_length = {seq_budget}); raise it"
        )
    if seq_budget > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {seq_budget} exceeds "
            f"model.max_position_embeddings ({cfg.model.max_position_embeddings})"
        )
    return cfg


def _check_async(cfg: RunConfig) -> None:
    """The schedule, staleness and rollout-correction keys against each other."""
    t, r, rc = cfg.trainer, cfg.rollout, cfg.algorithm.rollout_correction
    if t.mode == "separate_async":
        _check_separate(cfg)
    if cfg.replay.max_off_policy_threshold < 1:
        raise ConfigError(f"replay.max_off_policy_threshold must be a positive number of global steps, got "
                          f"{cfg.replay.max_off_policy_threshold}")
    if t.colocate_async.num_warmup_batches < 0:
        raise ConfigError(f"trainer.colocate_async.num_warmup_batches must be >= 0, got "
                          f"{t.colocate_async.num_warmup_batches}")
    if r.partial_rollout and t.mode == "sync":
        raise ConfigError("rollout.partial_rollout=true needs an async trainer.mode: in sync mode no session is "
                          "in flight at a weight sync")
    if r.partial_rollout_chunk < 1:
        raise ConfigError(f"rollout.partial_rollout_chunk must be a positive number of tokens, got "
                          f"{r.partial_rollout_chunk}")
    if rc.bypass_mode and r.log_prob_mode != "bypass":
        raise ConfigError("algorithm.rollout_correction.bypass_mode=true takes the rollout's log-probs as the old "
                          "ones: set rollout.log_prob_mode=bypass as well")
    if rc.enabled and r.log_prob_mode == "bypass":
        raise ConfigError("algorithm.rollout_correction.rollout_is / rollout_rs compare the recomputed (proximal) "
                          "log-probs with the rollout's; in bypass mode they are the same (every weight 1): set "
                          "rollout.log_prob_mode=recompute or leave rollout_is and rollout_rs null")


def _check_separate(cfg: RunConfig) -> None:
    """trainer.separate_async: at least one rollout rank; warm-up batches >= 0."""
    sa = cfg.trainer.separate_async
    for key, least in (("rollout_ranks", 1), ("num_warmup_batches", 0)):
        value = getattr(sa, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"trainer.separate_async.{key} must be an integer >= {least}, got {value!r}")


def _check_registered(cfg: RunConfig) -> None:
    """Keys whose valid names come from a registry, checked at load time rather than at first use."""
    from protocol.algos.advantage import known_advantages
    from protocol.algos.kl import KL_KINDS
    from protocol.rollout.agent_loop import known_agent_loops

    if cfg.algorithm.adv_estimator not in known_advantages():
        raise ConfigError(f"algorithm.adv_estimator must be one of {known_advantages()}, got "
                          f"{cfg.algorithm.adv_estimator!r}")
    if cfg.algorithm.kl_penalty not in KL_KINDS:
        raise ConfigError(f"algorithm.kl_penalty must be one of {list(KL_KINDS)}, got {cfg.algorithm.kl_penalty!r}")
    loops = known_agent_loops()
    if cfg.rollout.agent_loop not in loops:
        raise ConfigError(f"rollout.agent_loop must be one of {loops}, got {cfg.rollout.agent_loop!r}")
    from backends.rollout import rollout_engines

    if cfg.rollout.engine not in rollout_engines():
        raise ConfigError(f"rollout.engine must be one of {rollout_engines()}, got {cfg.rollout.engine!r}")
    if cfg.rollout.engine == "vllm":
        _check_vllm(cfg)


def _check_vllm(cfg: RunConfig) -> None:
    """What the vLLM engine cannot honour exactly, refused by name; its environment must exist."""
    if cfg.rollout.top_p < 1.0:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} with rollout.engine=vllm: vLLM returns the log-prob of "
                          "the top-p-truncated distribution, the trainer recomputes the untruncated one; use "
                          "rollout.top_p=1.0 or rollout.engine=embedded")
    if cfg.debug.weight_checksums:
        raise ConfigError("debug.weight_checksums=true with rollout.engine=vllm: the engine's repacked weights "
                          "cannot be read back; turn one of them off")
    try:
        require_engine_python(cfg.rollout.vllm)
    except RolloutError as exc:
        raise ConfigError(str(exc)) from None


def _check_data_section(d: DataConfig) -> None:
    from protocol.rollout.tasks import known_tasks

    if d.task not in known_tasks():
        raise ConfigError(f"data.task={d.task!r} is not a known task (it generates missing data files); known: "
                          f"{known_tasks()}")
    for key in ("train_files", "val_files"):
        if not getattr(d, key):
            raise ConfigError(f"data.{key} is empty: give at least one parquet / json / jsonl file")


def check_environment(cfg: RunConfig) -> None:
    """What a run needs of this machine, checked by every rank before it joins the others: the device asked for,
    parallel degrees that divide the launched world (``WORLD_SIZE``), and data files that exist or can be generated
    from ``data.task`` where they are missing (a file named train.parquet / val.parquet in a folder this process can
    write)."""
    import os

    import torch

    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, else a world of one
    try:
        Topology.from_config(cfg.actor.parallel, world)
    except ConfigError as exc:
        raise ConfigError(f"actor.{cfg.actor.backend} on {world} rank(s): {exc}") from exc
    d = cfg.data
    for key in ("train_files", "val_files"):
        for f in getattr(d, key):
            path = Path(f)
            if path.exists():  # a file, or a datasets save_to_disk folder: read (and checked) by the dataset
                continue
            if path.name not in ("train.parquet", "val.parquet"):
                raise ConfigError(f"data.{key}: {f} does not exist (a missing file is generated from data.task only "
                                  f"when it is named train.parquet or val.parquet)")
            folder = path.absolute().parent
            while not folder.exists():
                folder = folder.parent
            if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
                raise ConfigError(f"data.{key}: {f} does not exist, and data.task={d.task!r} cannot generate it: "
                                  f"{folder} is not a folder this process can write")


#: estimators that read a critic's values
CRITIC_ESTIMATORS = ("gae",)


def _check_critic(cfg: RunConfig) -> None:
    """A critic exactly when the estimator reads values; with the actor's logical DP (one plan serves both); a
    ``critic.hf_path`` of the actor's architecture."""
    est, c = cfg.algorithm.adv_estimator, cfg.critic
    if c.enabled is None:  # as the reference system does: the estimator decides unless critic.enabled is given
        c.enabled = est in CRITIC_ESTIMATORS
    if est in CRITIC_ESTIMATORS and not c.enabled:
        raise ConfigError(f"algorithm.adv_estimator={est} needs a critic's values, and critic.enabled=false turns "
                          f"the critic off: drop critic.enabled=false (gae turns it on), or choose an estimator "
                          f"without a critic")
    if not c.enabled:
        return
    if c.warmup_steps < 0:
        raise ConfigError(f"critic.warmup_steps must be >= 0, got {c.warmup_steps}")
    if not (math.isfinite(c.cliprange_value) and c.cliprange_value > 0):
        raise ConfigError(f"critic.cliprange_value must be a finite number > 0, got {c.cliprange_value!r}")
    if est not in CRITIC_ESTIMATORS:
        raise ConfigError(f"critic.enabled=true but algorithm.adv_estimator={est} reads no values (only "
                          f"{list(CRITIC_ESTIMATORS)} do): set algorithm.adv_estimator=gae or critic.enabled=false")
    if cfg.actor.backend == "megatron":
        _check_megatron_critic(cfg)
    elif c.fsdp.ulysses_sp != cfg.actor.fsdp.ulysses_sp:
        raise ConfigError(f"critic.fsdp.ulysses_sp ({c.fsdp.ulysses_sp}) must equal actor.fsdp.ulysses_sp "
                          f"({cfg.actor.fsdp.ulysses_sp}): the critic's logical DP (world / ulysses_sp) must be the "
                          f"actor's, since one dispatch plan serves both")
    if c.hf_path:
        from backends.model.hf import HFCheckpointError, read_hf_config

        try:
            found = read_hf_config(c.hf_path)
        except HFCheckpointError as exc:
            raise ConfigError(f"critic.hf_path: {exc}") from exc
        diff = sorted(f.name for f in dataclasses.fields(found) if f.name not in ("hf_path", "init_std")
                      and getattr(found, f.name) != getattr(cfg.model, f.name))
        if diff:
            raise ConfigError(f"critic.hf_path={c.hf_path!r}: its architecture differs from the actor's in "
                              + ", ".join(f"{k} ({getattr(found, k)!r} vs model.{k}={getattr(cfg.model, k)!r})"
                                          for k in diff)
                              + "; the critic shares the actor's architecture")


def _check_megatron_critic(cfg: RunConfig) -> None:
    """A Megatron critic joins the actor's megatron-core parallel state (``actor.megatron``'s degrees, hence the
    actor's logical DP): a critic.fsdp section would not be read, and its optimizer must suit that section."""
    c = cfg.critic
    changed = [f.name for f in dataclasses.fields(c.fsdp) if getattr(c.fsdp, f.name) != getattr(CriticFSDPConfig(),
                                                                                                 f.name)]
    if changed:
        raise ConfigError(f"critic.fsdp.{changed[0]} is set but actor.backend=megatron: the Megatron critic runs with "
                          f"the actor's actor.megatron degrees and has no FSDP section; remove critic.fsdp.*")
    if cfg.actor.megatron.use_distributed_optimizer and c.optim.name != "adamw":
        raise ConfigError(f"critic.optim.name={c.optim.name!r} with actor.megatron.use_distributed_optimizer=true: "
                          f"megatron-core's distributed optimizer supports Adam only; set critic.optim.name=adamw")


def _check_reward(cfg: RunConfig) -> None:
    """The reward manager's settings against the data section; the user's reward function is loaded here so that a
    bad path or name stops the run at start-up."""
    from protocol.algos.reward import RewardError

    r = cfg.reward
    if r.overlong_buffer.enable and r.overlong_buffer.len > cfg.data.max_response_length:
        raise ConfigError(f"reward.overlong_buffer.len ({r.overlong_buffer.len}) exceeds data.max_response_length "
                          f"({cfg.data.max_response_length})")
    if r.manager == "batch" and cfg.custom_reward_function.path is None:
        raise ConfigError("reward.manager=batch needs custom_reward_function.path and .name: a function taking "
                          "data_sources, solution_strs, ground_truths, extra_infos")
    try:
        cfg.custom_reward_function.load(batch=r.manager == "batch")
    except (RewardError, ImportError) as exc:
        raise ConfigError(str(exc)) from exc
    if r.model.enabled:
        _check_reward_model(cfg)
    if r.judge.enable:
        _check_judge(cfg)


def _check_tokenizer(source: str, vocab_size: int, what: str, vocab_of: str, messages: list[dict],
                     generation_prompt: bool) -> None:
    """A tokenizer a reward model or judge reads with: loadable, inside the vocabulary of ``vocab_of``'s model, and
    (``messages`` not empty) able to render them with its chat template. ``what`` names it in the error."""
    from protocol.rollout.tokenizer import TokenizerError, VocabularyError, check_vocab_fits, load_tokenizer

    try:
        tok = load_tokenizer(source)
        check_vocab_fits(tok, vocab_size, where=f"{vocab_of}'s vocabulary")
    except (TokenizerError, VocabularyError) as exc:
        raise ConfigError(f"{what}: {exc}") from exc
    if messages:
        try:
            tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        except Exception as exc:  # a tokenizer without a template says so its own way
            raise ConfigError(f"{what} ({source}) cannot apply a chat template ({exc})") from exc


def _check_judge(cfg: RunConfig) -> None:
    """``reward.judge``: a causal-LM folder whose tokenizer (its own, else the policy's) fits its vocabulary and,
    with ``chat_template``, renders a user message; all before any collective."""
    import json
    import os

    from backends.model.hf import HFCheckpointError, read_hf_config
    from protocol.algos.judge import JudgeError, judge_folder, judge_tokenizer_source

    key = "reward.judge.hf_path" if cfg.reward.judge.hf_path else \
        "model.hf_path (the judge, reward.judge.hf_path unset)"
    try:
        path = judge_folder(cfg.reward.judge, cfg.model.hf_path)
        if not os.path.isdir(path):
            raise ConfigError(f"{key}={path!r} is not a folder")
        found = read_hf_config(path)
        with open(os.path.join(path, "config.json")) as fh:
            archs = json.load(fh).get("architectures") or []
        if archs and not any(a.endswith("ForCausalLM") for a in archs):
            raise ConfigError(f"{key}={path!r} holds a {archs[0]}; the judge generates text, so it needs a "
                              f"*ForCausalLM checkpoint (a sequence classifier goes to reward.model.hf_path)")
        _check_tokenizer(judge_tokenizer_source(path, cfg.data.tokenizer, cfg.model.hf_path), found.vocab_size,
                         f"the judge's tokenizer ({key}; without a template set reward.judge.chat_template=false)",
                         "the judge", [{"role": "user", "content": "x"}] if cfg.reward.judge.chat_template else [],
                         True)
    except (JudgeError, HFCheckpointError) as exc:
        raise ConfigError(f"{exc}" if key.split(" ")[0] in str(exc) else f"{key}: {exc}") from exc


def _check_reward_model(cfg: RunConfig) -> None:
    """``reward.model``: a one-label sequence-classification folder that reads the policy's token ids (same
    vocabulary), on a backend that runs it; everything here happens before any collective."""
    from backends.model.hf import HFCheckpointError
    from backends.model.reward_model import read_reward_config
    from protocol.rollout.tokenizer import has_tokenizer_files

    rm = cfg.reward.model
    if cfg.actor.backend != "fsdp":
        raise ConfigError(f"reward.model.hf_path with actor.backend={cfg.actor.backend}: the reward model runs on "
                          f"the FSDP engine only; set actor.backend=fsdp or remove reward.model.hf_path")
    try:
        found = read_reward_config(rm.hf_path)
    except HFCheckpointError as exc:
        raise ConfigError(str(exc)) from exc
    if rm.retokenize:
        if not has_tokenizer_files(rm.hf_path):
            raise ConfigError(f"reward.model.retokenize=true reads the reward model's own tokenizer, but "
                              f"reward.model.hf_path={rm.hf_path!r} has no tokenizer files")
        _check_tokenizer(rm.hf_path, found.vocab_size, "reward.model.retokenize=true: the reward model's tokenizer",
                         f"reward.model.hf_path={rm.hf_path!r}",
                         [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)
    elif found.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"reward.model.hf_path={rm.hf_path!r} has vocab_size={found.vocab_size}, the policy "
                          f"(model.vocab_size) {cfg.model.vocab_size}: the reward model reads the policy's token "
                          f"ids, so their vocabularies must be the same, or set reward.model.retokenize=true to "
                          f"read each trajectory in the reward model's own chat template and tokenizer")
    policy_tok = cfg.data.tokenizer if cfg.data.tokenizer not in ("", "char") else cfg.model.hf_path
    if not rm.retokenize and policy_tok and has_tokenizer_files(rm.hf_path) and has_tokenizer_files(policy_tok):
        from transformers import AutoTokenizer

        mine, theirs = (AutoTokenizer.from_pretrained(p, local_files_only=True).get_vocab()
                        for p in (rm.hf_path, policy_tok))
        if mine != theirs:
            differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            raise ConfigError(f"reward.model.hf_path={rm.hf_path!r}: its tokenizer's vocabulary differs from the "
                              f"policy's ({policy_tok}), e.g. {differ}; the reward model reads the policy's token ids "
                              f"(or set reward.model.retokenize=true)")
    if rm.max_length is not None and rm.max_length > found.max_position_embeddings:
        raise ConfigError(f"reward.model.max_length={rm.max_length} exceeds the reward model's "
                          f"max_position_embeddings={found.max_position_embeddings}")


SHIPPED_CONFIGS = Path(__file__).parent / "configs"


def resolve_config_path(path: str | Path) -> Path:
    """A YAML path, or the name of a shipped config (``grpo_tiny``): package data, usable from any folder."""
    p = Path(path)
    if p.exists() or p.suffix in (".yaml", ".yml") or "/" in str(path):
        return p
    shipped = SHIPPED_CONFIGS / f"{p.name}.yaml"
    if shipped.exists():
        return shipped
    known = sorted(f.stem for f in SHIPPED_CONFIGS.glob("*.yaml"))
    raise ConfigError(f"--config {path}: no such file, and no shipped config of that name (shipped: {known})")


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read YAML (optional), apply ``key=value`` overrides, and return the validated typed config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = resolve_config_path(path) if path else None
    import yaml

    try:
        base = OmegaConf.load(str(path)) if path else OmegaConf.create({})
    except FileNotFoundError as exc:
        raise ConfigError(f"--config {path}: no such file") from exc
    except yaml.YAMLError as exc:  # one line: where, and what the parser found
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x) \
            or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. actor.backend=megatron)")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot read the configuration: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    model_data = data.get("model")
    checkpoint = None
    if isinstance(model_data, dict) and model_data.get("hf_path"):
        command_line = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides))).get("model")
        checkpoint = _checkpoint_architecture(model_data, set(command_line or ()), path)
        data = {**data, "model": {k: v for k, v in model_data.items() if k not in _ARCHITECTURE_KEYS}}
    if "parameter_sync_step" in ((data.get("trainer") or {}).get("separate_async") or {}):
        raise ConfigError("trainer.separate_async.parameter_sync_step is not a key: a global step (one weight sync) "
                          "is data.train_batch_size / actor.ppo_mini_batch_size mini-batch updates in every mode; "
                          "for the reference system's trigger_parameter_sync_step=N set data.train_batch_size = N x "
                          "actor.ppo_mini_batch_size")
    cfg = build_dataclass(RunConfig, data)
    if checkpoint is not None:
        cfg.model = dataclasses.replace(checkpoint, init_std=cfg.model.init_std)
    from protocol.rollout.tokenizer import resolve_tokenizer

    cfg.data.tokenizer = resolve_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)  # recorded in checkpoints
    return validate(cfg)


# what a checkpoint's config.json defines (init_std only seeds a random init; hf_path names the checkpoint)
_ARCHITECTURE_KEYS = frozenset(f.name for f in dataclasses.fields(ModelConfig)) - {"hf_path", "init_std"}


def _checkpoint_architecture(model: dict[str, Any], command_line: set[str], path: Path | None) -> ModelConfig:
    """With ``model.hf_path`` the checkpoint's config.json defines the architecture. An architecture key given on the
    command line must agree with it; one from the config file yields to it, said in one log line."""
    from backends.model.hf import HFCheckpointError, read_hf_config

    hf_path = coerce_field(ModelConfig, "hf_path", model["hf_path"], "model")
    given = {f.name: coerce_field(ModelConfig, f.name, model[f.name], "model") for f in dataclasses.fields(ModelConfig)
             if f.name in _ARCHITECTURE_KEYS and f.name in model}
    try:  # a vision-language folder: its decoder is the model section
        vl = _vision_of(hf_path)
        found = vl.text if vl is not None else read_hf_config(hf_path)
    except HFCheckpointError as exc:
        raise ConfigError(str(exc)) from exc

    def agrees(key: str, value: Any) -> bool:
        if key == "head_dim" and value == 0:  # 0 = hidden_size / num_heads, of the checkpoint's sizes
            return found.head_dim * found.num_heads == found.hidden_size
        return value == getattr(found, key)

    clash = [k for k in given if k in command_line and not agrees(k, given[k])]
    if clash:
        raise ConfigError(
            f"model.hf_path={hf_path!r} defines the architecture, and the command line contradicts its config.json: "
            + ", ".join(f"model.{k}={given[k]!r} (config.json: {getattr(found, k)!r})" for k in clash)
            + "; leave these keys out")
    yielded = [k for k in given if k not in command_line and not agrees(k, given[k])]
    if yielded:
        logger.info("model.hf_path=%s defines the architecture: %s's %s yield to its config.json (%s)", hf_path,
                    path.name if path else "the config", ", ".join(f"model.{k}={given[k]!r}" for k in yielded),
                    ", ".join(f"{k}={getattr(found, k)!r}" for k in yielded))
    return found
