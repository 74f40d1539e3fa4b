"""The run config: YAML + overrides into typed sections; every bad value names its key."""
from __future__ import annotations

import pytest

from trainer.config import ConfigError, RunConfig, load_config

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
