"""The run config: YAML + overrides into typed sections; every bad value names its key."""
from __future__ import annotations

import pytest

from rldispatch.config import ConfigError, RunConfig, load_config

REPO_CONFIG = "configs/grpo_tiny.yaml"


def test_shipped_config_loads_and_overrides_apply():
    cfg = load_config(REPO_CONFIG, ["actor.backend=megatron", "actor.megatron.tp=2", "actor.optim.lr=0.5"])
    assert isinstance(cfg, RunConfig)
    assert cfg.actor.backend == "megatron" and cfg.actor.megatron.tp == 2 and cfg.actor.optim.lr == 0.5
    assert cfg.topology_config()["backend"] == "megatron" and cfg.topology_config()["tp"] == 2
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
    with pytest.raises(ConfigError, match="gae needs a critic"):
        load_config(REPO_CONFIG, ["algorithm.adv_estimator=gae"])
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
    with pytest.raises(ConfigError, match=r"model.hidden_size=64, model.intermediate_size=128 disagree with its "
                                          r"config.json \(hidden_size=32, intermediate_size=64\)"):
        load_config(REPO_CONFIG, [f"model.hf_path={tmp_path / 'ckpt'}"])
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(None, [f"model.hf_path={tmp_path}"])
    with pytest.raises(HFCheckpointError, match="hidden_size: config 64 vs checkpoint 32"):
        initial_model(type(cfg.model)(hf_path=str(tmp_path / "ckpt")), seed=0)
