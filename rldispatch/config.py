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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from backends.config import EngineConfig, FSDPConfig, MegatronConfig, OptimConfig, PolicyLossConfig
from backends.model.config import ModelConfig
from protocol.algos.reward import CustomRewardFunctionConfig, RewardConfig
from protocol.algos.rollout_correction import RolloutCorrectionConfig
from dispatch.topology import BackendName, ParallelSection
from protocol.config import ConfigError, build_dataclass

__all__ = ["RunConfig", "load_config", "ConfigError"]


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


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # a registered estimator of protocol.algos.advantage, except gae (needs a critic)
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

    @property
    def parallel(self) -> ParallelSection:
        """The active backend's section (``fsdp`` or ``megatron``): its parallel degrees build the topology."""
        return self.fsdp if self.backend == "fsdp" else self.megatron


@dataclass
class RefConfig:
    enabled: bool = True  # a frozen copy of the initial policy


@dataclass
class ReplayConfig:
    failure_policy: Literal["drop", "keep_successful"] = "drop"
    off_policy_strategy: Literal["drop", "wait"] = "drop"
    max_off_policy_threshold: int = 8  # global steps from a prompt's dispatch to its training (span), async modes
    sample_timeout_s: float = 600.0


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: int = 1  # batches of prompts submitted ahead of the first step


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
    host_channel: bool = True  # gloo ranks on one host exchange the step's frames over loopback sockets
    # sync: generate the step's prompts, then train on them; colocate_async: the training ranks also generate, and
    # generation outlives the step (docs/async.md); separate_async (rollout ranks apart): refused in this version
    mode: Literal["sync", "colocate_async", "separate_async"] = "sync"
    colocate_async: ColocateAsyncConfig = field(default_factory=ColocateAsyncConfig)


@dataclass
class TraceConfig:
    enabled: bool = False
    path: str = ""  # default: {run_dir}/trace.jsonl


@dataclass
class DebugConfig:
    check_invariants: bool = False  # run protocol.invariants after every stage (slow; for debugging)
    inject_rollout_failures: float = 0.0  # fraction of prompt groups whose session 0 raises (tests the failure policy)


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
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
            megatron=self.actor.megatron, seed=self.trainer.seed,
            max_token_len_per_gpu=self.actor.max_token_len_per_gpu if self.actor.use_dynamic_bsz else None,
            dist_timeout_s=self.trainer.dist_timeout_s, rollback_nonfinite=self.trainer.on_nonfinite == "skip",
        )

    def topology_config(self) -> ParallelSection:
        """The active backend's parallel section, for ``dispatch.Topology.from_config`` (same as ``actor.parallel``)."""
        return self.actor.parallel


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
    positive = ["data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "rollout.n",
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
        raise ConfigError("trainer.mode=separate_async is not available in this version (rollout ranks and a weight "
                          "transfer group are not implemented); use trainer.mode=colocate_async or sync")
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


def _check_registered(cfg: RunConfig) -> None:
    """Keys whose valid names come from a registry, checked at load time rather than at first use."""
    from protocol.algos.advantage import known_advantages
    from protocol.algos.kl import KL_KINDS
    from protocol.rollout.agent_loop import known_agent_loops

    critic_free = [n for n in known_advantages() if n != "gae"]
    if cfg.algorithm.adv_estimator not in critic_free:
        hint = " (gae needs a critic's values, which this trainer does not run)" \
            if cfg.algorithm.adv_estimator == "gae" else ""
        raise ConfigError(f"algorithm.adv_estimator must be one of {critic_free}, got "
                          f"{cfg.algorithm.adv_estimator!r}{hint}")
    if cfg.algorithm.kl_penalty not in KL_KINDS:
        raise ConfigError(f"algorithm.kl_penalty must be one of {list(KL_KINDS)}, got {cfg.algorithm.kl_penalty!r}")
    loops = known_agent_loops()
    if cfg.rollout.agent_loop not in loops:
        raise ConfigError(f"rollout.agent_loop must be one of {loops}, got {cfg.rollout.agent_loop!r}")


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
    cfg = build_dataclass(RunConfig, data)
    if cfg.model.hf_path:
        cfg.model = _checkpoint_architecture(cfg.model, set((data.get("model") or {}).keys()))
    from protocol.rollout.tokenizer import resolve_tokenizer

    cfg.data.tokenizer = resolve_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)  # recorded in checkpoints
    return validate(cfg)


def _checkpoint_architecture(model: ModelConfig, given: set[str]) -> ModelConfig:
    """With ``model.hf_path`` the checkpoint's config.json defines the architecture; given keys must agree with it."""
    from backends.model.hf import HFCheckpointError, read_hf_config

    try:
        found = read_hf_config(model.hf_path)
    except HFCheckpointError as exc:
        raise ConfigError(str(exc)) from exc
    clash = sorted(k for k in given - {"hf_path", "init_std"} if getattr(model, k) != getattr(found, k))
    if clash:
        raise ConfigError(
            f"model.hf_path={model.hf_path!r}: " + ", ".join(f"model.{k}={getattr(model, k)!r}" for k in clash)
            + " disagree with its config.json (" + ", ".join(f"{k}={getattr(found, k)!r}" for k in clash)
            + "); remove these keys, the checkpoint defines the architecture")
    return found
