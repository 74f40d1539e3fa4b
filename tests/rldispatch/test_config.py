"""The run config: YAML + overrides into typed sections; every bad value names its key."""
from __future__ import annotations

import dataclasses

import pytest

from rldispatch.config import ConfigError, RunConfig, load_config

REPO_CONFIG = "configs/grpo_tiny.yaml"


def test_shipped_config_loads_and_overrides_apply():
    cfg = load_config(REPO_CONFIG, ["actor.backend=megatron", "actor.megatron.tp=2", "actor.optim.lr=0.5"])
    assert isinstance(cfg, RunConfig)
    assert cfg.actor.backend == "megatron" and cfg.actor.megatron.tp == 2 and cfg.actor.optim.lr == 0.5
    assert cfg.topology_config().backend == "megatron" and cfg.topology_config().tp == 2
    eng = cfg.engine_config()
    assert eng.model == cfg.model and eng.optim.lr == 0.5


def test_defaults_need_no_file():
    cfg = load_config(None)
    assert cfg.actor.backend == "fsdp" and cfg.trainer.total_steps > 0


@pytest.mark.parametrize("overrides, expected", [
    (["actor.bogus=1"], "unknown config key actor.bogus; valid keys under actor:"),
    (["nonsense.key=1"], "unknown config key nonsense"),
    (["actor.optim.lr=abc"], "actor.optim.lr: expected a number"),
    (["actor.ppo_epochs=1.5"], "actor.ppo_epochs: expected an integer"),
    (["actor.backend=tpu"], "actor.backend must be one of ['fsdp', 'megatron']"),
    (["data.train_batch_size=6"], "data.train_batch_size (6) must be a multiple of actor.ppo_mini_batch_size (8)"),
    (["rollout.n=0"], "rollout.n must be a positive integer"),
    (["actor.optim.lr_schedule=linear"], "actor.optim.lr_schedule must be one of"),
    (["actor.loss.loss_agg_mode=mean"], "actor.loss.loss_agg_mode must be one of"),
    (["model.hidden_size=30"], "model.hidden_size (30) must be divisible by model.num_heads"),
    (["actor.use_dynamic_bsz=true", "actor.max_token_len_per_gpu=10"], "actor.max_token_len_per_gpu (10)"),
    (["trainer.resume"], "must look like key=value"),
    (["algorithm.use_kl_in_reward=true", "ref.enabled=false"], "use_kl_in_reward=true needs the reference policy"),
    (["actor.optim.betas=[0.9]"], "actor.optim.betas: expected 2 values"),
])
def test_bad_configs_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(REPO_CONFIG, overrides)
    assert expected in str(info.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")


def test_estimator_and_horizon():
    # gae turns the critic on (the reference system's rule); critic.enabled=false keeps it off, and is refused
    assert load_config(REPO_CONFIG, ["algorithm.adv_estimator=gae"]).critic.enabled is True
    assert load_config(REPO_CONFIG).critic.enabled is False  # grpo reads no values: no critic
    with pytest.raises(ConfigError, match="gae needs a critic's values, and critic.enabled=false"):
        load_config(REPO_CONFIG, ["algorithm.adv_estimator=gae", "critic.enabled=false"])
    with pytest.raises(ConfigError, match="algorithm.adv_estimator must be one of"):
        load_config(REPO_CONFIG, ["algorithm.adv_estimator=ppo2"])
    cfg = load_config(REPO_CONFIG, ["algorithm.adv_estimator=rloo", "data.max_response_length=12"])
    assert cfg.engine_config().loss.horizon == 12  # seq-mean-token-sum-norm's fixed horizon
    assert load_config(REPO_CONFIG, ["actor.loss.horizon=7"]).engine_config().loss.horizon == 7


def test_loss_temperature_follows_the_rollout():
    cfg = load_config(REPO_CONFIG, ["rollout.temperature=0.7"])
    assert cfg.engine_config().loss.temperature == 0.7
    with pytest.raises(ConfigError, match=r"actor.loss.temperature \(0.5\) differs from rollout.temperature"):
        load_config(REPO_CONFIG, ["rollout.temperature=0.7", "actor.loss.temperature=0.5"])


def _write_hf_checkpoint(folder, seed=5):
    """A tiny Hugging Face Llama-layout checkpoint (config.json + pytorch_model.bin) made from the project's model."""
    import json

    import torch

    from backends.model.config import ModelConfig
    from backends.model.llama import LlamaModel

    cfg = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = LlamaModel.from_seed(cfg, seed)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({(n if n == "lm_head.weight" else f"model.{n}"): p.detach().clone()
                for n, p in model.state_dict().items()}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "max_position_embeddings": 4096, "hidden_act": "silu"}))
    return model


def test_hf_checkpoint_defines_the_architecture_and_the_start_weights(tmp_path):
    import torch

    from backends.model.hf import HFCheckpointError, initial_model

    src = _write_hf_checkpoint(tmp_path / "ckpt")
    cfg = load_config(None, [f"model.hf_path={tmp_path / 'ckpt'}"])
    assert cfg.model.hidden_size == 32 and cfg.model.intermediate_size == 64 and cfg.model.hf_path
    start = initial_model(cfg.model, seed=0)  # what both engines load
    for name, p in src.state_dict().items():
        assert torch.equal(start.state_dict()[name], p), name
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(None, [f"model.hf_path={tmp_path}"])
    with pytest.raises(HFCheckpointError, match="hidden_size: config 64 vs checkpoint 32"):
        initial_model(type(cfg.model)(hf_path=str(tmp_path / "ckpt")), seed=0)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    """A tiny Qwen2 checkpoint written by transformers (vocab 320, hidden 32, intermediate 64, 4 heads, 2 kv heads)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    import hf_tiny

    return str(hf_tiny.make_checkpoint(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", tokenizer=True))


def test_hf_path_over_a_shipped_config_with_a_model_block(qwen2_folder, caplog):
    """The checkpoint's config.json defines the architecture; the file's model keys yield to it in one log line."""
    from backends.model.hf import initial_model, read_hf_config

    with caplog.at_level("INFO", logger="rldispatch.config"):
        cfg = load_config("grpo_tiny", [f"model.hf_path={qwen2_folder}"])
    assert cfg.model == read_hf_config(qwen2_folder)
    assert (cfg.model.model_type, cfg.model.vocab_size, cfg.model.hidden_size) == ("qwen2", 320, 32)
    assert cfg.data.tokenizer == qwen2_folder  # the folder's own tokenizer
    notes = [r.getMessage() for r in caplog.records if r.name == "rldispatch.config"]
    assert notes == [f"model.hf_path={qwen2_folder} defines the architecture: grpo_tiny.yaml's model.vocab_size=128, "
                     f"model.hidden_size=64, model.intermediate_size=128 yield to its config.json (vocab_size=320, "
                     f"hidden_size=32, intermediate_size=64)"]
    initial_model(cfg.model, seed=0)  # the engines' start: the weights match the architecture
    # command-line keys that agree with config.json are fine; the checkpoint ignores init_std, which stays as given
    cfg = load_config("grpo_tiny", [f"model.hf_path={qwen2_folder}", "model.hidden_size=32", "model.num_heads=4",
                                    "model.head_dim=0", "model.init_std=0.5"])
    assert cfg.model == dataclasses.replace(read_hf_config(qwen2_folder), init_std=0.5)


@pytest.mark.parametrize("overrides, expected", [
    (["model.hidden_size=64"], "the command line contradicts its config.json: model.hidden_size=64 (config.json: 32); "
                               "leave these keys out"),
    (["model.num_heads=14", "model.vocab_size=151936"], "model.vocab_size=151936 (config.json: 320), "
                                                       "model.num_heads=14 (config.json: 4)"),
    (["model.model_type=llama"], "model.model_type='llama' (config.json: 'qwen2')"),
    (["model.hidden_size=abc"], "model.hidden_size: expected an integer, got 'abc'"),
    (["model.hiden_size=32"], "unknown config key model.hiden_size; valid keys under model:"),
])
def test_hf_path_refuses_command_line_keys_that_contradict_the_checkpoint(qwen2_folder, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config("grpo_tiny", [f"model.hf_path={qwen2_folder}", *overrides])
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_hf_path_in_a_config_file_makes_its_model_keys_yield(qwen2_folder, tmp_path, caplog):
    path = tmp_path / "mine.yaml"
    path.write_text(f"model:\n  hf_path: {qwen2_folder}\n  num_layers: 2\n  num_heads: 8\n")
    with caplog.at_level("INFO", logger="rldispatch.config"):
        assert load_config(path).model == load_config(None, [f"model.hf_path={qwen2_folder}"]).model
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records if r.name == "rldispatch.config"] == [
        "mine.yaml's model.num_heads=8 yield to its config.json (num_heads=4)"]
    with pytest.raises(ConfigError, match=r"model.num_heads=8 \(config.json: 4\)"):  # unless the user says it again
        load_config(path, ["model.num_heads=8"])


def _literal_keys(cls, prefix=""):
    """Every Literal-typed key of the config tree, dotted, with its choices."""
    import dataclasses
    import typing

    from protocol.config import literal_choices

    hints = typing.get_type_hints(cls)
    out = {f"{prefix}{k}": v for k, v in literal_choices(cls).items()}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_literal_keys(hints[f.name], f"{prefix}{f.name}."))
    return out


def _get_dotted(obj, key):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_literal_choice_is_accepted_and_anything_else_refused_naming_key_and_choices():
    from protocol.config import build_dataclass

    keys = _literal_keys(RunConfig)
    # the choice keys the schema owns (a table that once lived in a _CHOICES dict and in __post_init__s)
    assert {"actor.backend", "rollout.log_prob_mode", "algorithm.kl_ctrl.type", "replay.failure_policy",
            "replay.off_policy_strategy", "trainer.device", "actor.optim.name", "actor.optim.lr_schedule",
            "actor.loss.loss_agg_mode", "actor.fsdp.param_dtype", "actor.fsdp.reduce_dtype",
            "model.rope_type"} <= set(keys)
    for key, choices in keys.items():
        *path, leaf = key.split(".")

        def tree(value):
            node = {leaf: value}
            for part in reversed(path):
                node = {part: node}
            return node

        for choice in choices:
            assert _get_dotted(build_dataclass(RunConfig, tree(choice)), key) == choice
        with pytest.raises(ConfigError) as info:
            build_dataclass(RunConfig, tree("not-a-choice"))
        assert str(info.value) == f"{key} must be one of {list(choices)}, got 'not-a-choice'"


def test_registry_choices_are_checked_at_load_time():
    from protocol.algos.kl import KL_KINDS

    with pytest.raises(ConfigError, match=r"algorithm.kl_penalty must be one of \['kl', .*got 'k9'"):
        load_config(REPO_CONFIG, ["algorithm.kl_penalty=k9"])
    with pytest.raises(ConfigError, match=r"actor.loss.kl_loss_type must be one of \['kl', .*got 'k9'"):
        load_config(REPO_CONFIG, ["actor.loss.kl_loss_type=k9"])
    with pytest.raises(ConfigError, match=r"rollout.agent_loop must be one of \[.*'single_turn'.*got 'react'"):
        load_config(REPO_CONFIG, ["rollout.agent_loop=react"])
    for kind in KL_KINDS:
        cfg = load_config(REPO_CONFIG, [f"algorithm.kl_penalty={kind}", f"actor.loss.kl_loss_type={kind}"])
        assert cfg.algorithm.kl_penalty == cfg.actor.loss.kl_loss_type == kind


def test_sections_built_in_code_check_their_choices_too():
    from backends.config import EngineConfigError, FSDPConfig, OptimConfig, PolicyLossConfig

    with pytest.raises(EngineConfigError, match=r"actor.optim.name must be one of \['adamw', 'sgd'\], got 'adam'"):
        OptimConfig(name="adam")
    with pytest.raises(EngineConfigError, match=r"actor.loss.loss_agg_mode must be one of"):
        PolicyLossConfig(loss_agg_mode="mean")
    with pytest.raises(ConfigError, match=r"actor.fsdp.param_dtype must be one of \['auto'"):
        FSDPConfig(param_dtype="int8")


def test_one_config_error_family():
    from backends.config import EngineConfigError
    from backends.model.config import ModelConfigError
    from dispatch import DispatchConfigError, TopologyError
    from protocol.config import ConfigError as Base

    assert ConfigError is Base
    for err in (TopologyError, DispatchConfigError, EngineConfigError, ModelConfigError):
        assert issubclass(err, Base) and issubclass(err, ValueError)
    with pytest.raises(ConfigError, match=r"actor.fsdp: ulysses_sp must be a positive int, got int 0"):
        load_config(REPO_CONFIG, ["actor.fsdp.ulysses_sp=0"])
    with pytest.raises(ConfigError, match=r"actor.megatron: tp must be a positive int"):
        load_config(REPO_CONFIG, ["actor.megatron.tp=0"])


def test_active_parallel_section_builds_the_topology():
    from dispatch import FSDPParallel, MegatronParallel, Topology

    fsdp = load_config(REPO_CONFIG, ["actor.fsdp.ulysses_sp=2", "actor.megatron.tp=4"])
    assert isinstance(fsdp.actor.parallel, FSDPParallel) and fsdp.actor.parallel is fsdp.actor.fsdp
    assert Topology.from_config(fsdp.actor.parallel, 4) == Topology(backend="fsdp", world_size=4, ulysses_sp=2)
    mg = load_config(REPO_CONFIG, ["actor.backend=megatron", "actor.megatron.tp=2", "actor.megatron.pp=2"])
    assert isinstance(mg.actor.parallel, MegatronParallel) and mg.topology_config() is mg.actor.megatron
    assert Topology.from_config(mg.topology_config(), 8).dp_size == 2


def test_plan_command_reports_every_config_error_with_exit_2(capsys):
    from rldispatch.commands.plan import main

    assert main(["--config", REPO_CONFIG, "--world", "3", "actor.backend=megatron", "actor.megatron.tp=2"]) == 2
    assert "tp*pp*cp = 2*1*1 = 2" in capsys.readouterr().err  # a TopologyError
    assert main(["--config", REPO_CONFIG, "--world", "8", "actor.backend=megatron", "actor.megatron.tp=3"]) == 2
    assert "actor.megatron.tp=3 does not divide model.num_heads=4" in capsys.readouterr().err  # the model's fit
    assert main(["--config", REPO_CONFIG, "--world", "3"]) == 2
    assert "not divisible by the logical DP size 3" in capsys.readouterr().err  # a DispatchConfigError
    assert main(["--config", REPO_CONFIG, "--world", "2", "actor.optim.name=adam"]) == 2
    assert "actor.optim.name must be one of" in capsys.readouterr().err  # a schema ConfigError


def test_critic_section_for_gae():
    cfg = load_config("ppo_tiny")
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enabled
    ec = cfg.critic_engine_config()
    # the critic's own optimizer, the actor's architecture and loss aggregation, cliprange_value by default 0.5
    assert ec.model == cfg.model and ec.optim.lr == cfg.critic.optim.lr and ec.fsdp == cfg.critic.fsdp
    assert ec.value_loss.cliprange_value == 0.5 and ec.value_loss.loss_agg_mode == cfg.actor.loss.loss_agg_mode
    assert ec.value_loss.horizon == cfg.data.max_response_length
    assert ec.optim.total_steps == cfg.engine_config().optim.total_steps
    cfg = load_config("ppo_tiny", ["critic.optim.lr=0.01", "actor.loss.loss_agg_mode=seq-mean-token-mean",
                                   "critic.cliprange_value=0.2", "critic.fsdp.fsdp_size=1"])
    ec = cfg.critic_engine_config()
    assert ec.optim.lr == 0.01 and cfg.engine_config().optim.lr != 0.01
    assert ec.value_loss.loss_agg_mode == "seq-mean-token-mean" and ec.value_loss.cliprange_value == 0.2
    assert ec.fsdp.fsdp_size == 1 and cfg.engine_config().fsdp.fsdp_size == -1


def test_megatron_critic_has_the_actors_degrees():
    """On actor.backend=megatron the critic's engine config carries actor.megatron (it joins that parallel state)."""
    cfg = load_config("ppo_tiny", ["actor.backend=megatron", "actor.megatron.tp=2", "critic.optim.lr=0.01"])
    ec = cfg.critic_engine_config()
    assert ec.megatron == cfg.actor.megatron and ec.megatron.tp == 2
    assert ec.optim.lr == 0.01 and cfg.engine_config().optim.lr != 0.01


@pytest.mark.parametrize("overrides, expected", [
    (["critic.enabled=false"], "algorithm.adv_estimator=gae needs a critic's values, and critic.enabled=false turns"),
    (["algorithm.adv_estimator=grpo"], "critic.enabled=true but algorithm.adv_estimator=grpo reads no values"),
    (["actor.backend=megatron", "critic.fsdp.fsdp_size=1"],
     "critic.fsdp.fsdp_size is set but actor.backend=megatron: the Megatron critic runs with the actor's"),
    (["actor.backend=megatron", "critic.optim.name=sgd"],
     "critic.optim.name='sgd' with actor.megatron.use_distributed_optimizer=true"),
    (["critic.fsdp.ulysses_sp=2"], "critic.fsdp.ulysses_sp (2) must equal actor.fsdp.ulysses_sp (1)"),
    (["critic.cliprange_value=0"], "critic.cliprange_value must be a finite number > 0"),
    (["critic.warmup_steps=-1"], "critic.warmup_steps must be >= 0"),
    (["critic.optim.lr=-1"], "critic.optim.lr must be a finite number"),
    (["critic.optim.betas=[0.9, 1.0]"], "critic.optim.betas[1] must be in [0, 1)"),
    (["critic.bogus=1"], "unknown config key critic.bogus"),
    (["critic.hf_path=/nonexistent/critic"], "critic.hf_path: "),
])
def test_bad_critic_configs_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config("ppo_tiny", overrides)
    assert expected in str(info.value)


def test_critic_hf_path_must_match_the_actor(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    import hf_tiny

    path = hf_tiny.make_checkpoint(tmp_path / "q", "qwen2", tokenizer=False)
    with pytest.raises(ConfigError, match=r"critic.hf_path=.*differs from the actor's in .*hidden_size \(32 vs "
                                          r"model.hidden_size=64\)"):
        load_config("ppo_tiny", [f"critic.hf_path={path}"])
    cfg = load_config(None, ["algorithm.adv_estimator=gae", "critic.enabled=true", f"model.hf_path={path}",
                             f"critic.hf_path={path}", "data.tokenizer=char"])
    assert cfg.critic_engine_config().model.hf_path == str(path)
