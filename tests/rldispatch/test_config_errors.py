"""Start-up errors a new user meets: each is one line naming the key, raised while the config loads or, for what
the machine lacks, right after (every rank alike, before any collective); the train command turns it into
``config error: ...`` with exit status 2."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from rldispatch.config import ConfigError, check_environment, load_config

REPO = Path(__file__).resolve().parents[2]

# (overrides on top of grpo_tiny, the key the message must name, a piece of the message)
BAD = [
    (["actor.backend=megatron", "actor.megatron.tp=2", "model.num_heads=1", "model.num_kv_heads=1"],
     "actor.megatron.tp", "actor.megatron.tp=2 does not divide model.num_heads=1"),
    (["actor.backend=megatron", "actor.megatron.tp=2", "model.num_kv_heads=1"], "actor.megatron.tp",
     "does not divide model.num_kv_heads=1"),
    (["actor.backend=megatron", "actor.megatron.pp=2", "model.num_layers=3"], "actor.megatron.pp",
     "= 2 x 1 = 2 does not divide model.num_layers=3"),
    (["actor.backend=megatron", "actor.megatron.vpp=2"], "actor.megatron.vpp", "needs actor.megatron.pp >= 2"),
    (["actor.backend=megatron", "actor.megatron.cp=2"], "actor.megatron.cp", "set actor.megatron.cp=1"),
    (["actor.backend=megatron", "actor.megatron.ep=2"], "actor.megatron.ep", "must be 1 for the dense decoder"),
    (["actor.backend=megatron", "actor.optim.name=sgd"], "actor.megatron.use_distributed_optimizer",
     "needs actor.optim.name='adamw'"),
    (["data.train_files=[]"], "data.train_files", "is empty"),
    (["data.val_files=[]"], "data.val_files", "is empty"),
    (["data.task=nope"], "data.task", "'nope' is not a known task"),
    (["data.train_files=[data/mine/rows.parquet]"], "data.train_files",
     "data/mine/rows.parquet does not exist (a missing file is generated from data.task only when"),
    (["actor.loss.clip_ratio_low=-1"], "actor.loss.clip_ratio_low", "must be in [0, 1), got -1.0"),
    (["actor.loss.clip_ratio_low=1"], "actor.loss.clip_ratio_low", "must be in [0, 1), got 1.0"),
    (["actor.loss.clip_ratio_high=-0.5"], "actor.loss.clip_ratio_high", "must be >= 0"),
    (["actor.loss.clip_ratio_c=0.5"], "actor.loss.clip_ratio_c", "must be > 1"),
    (["actor.optim.lr=-1"], "actor.optim.lr", "got -1.0"),
    (["actor.optim.clip_grad=-1"], "actor.optim.clip_grad", "must be > 0"),
    (["rollout.n=0"], "rollout.n", "must be a positive integer"),
    (["rollout.temperature=0"], "rollout.temperature", "must be > 0"),
    (["rollout.top_p=1.5"], "rollout.top_p", "must be in (0, 1]"),
    (["data.train_batch_size=0"], "data.train_batch_size", "must be a positive integer"),
    (["actor.ppo_mini_batch_size=32"], "actor.ppo_mini_batch_size", "must be a multiple of"),
    (["model.num_kv_heads=3"], "model.num_kv_heads", "must be divisible by"),
    (["model.hf_path=/nonexistent/model"], "model.hf_path", "has no config.json"),
    (["model.max_position_embeddings=16"], "model.max_position_embeddings", "exceeds"),
    (["trainer.total_steps=0"], "trainer.total_steps", "must be a positive integer"),
    (["trainer.dist_timeout_s=0"], "trainer.dist_timeout_s", "must be > 0"),
    (["algorithm.adv_estimator=gae", "critic.enabled=false"], "critic.enabled=false", "gae needs a critic"),
    (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type", "must be one of"),
    (["reward.manager=batch"], "custom_reward_function.path", "reward.manager=batch needs"),
    (["custom_reward_function.path=/nonexistent/reward.py"], "custom_reward_function.path", "no such file"),
    (["algorithm.kl_ctrl.kl_coef=-1"], "algorithm.kl_ctrl.kl_coef", "must be a finite number >= 0"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon",
     "must be > 0 for the adaptive controller"),
    (["replay.max_off_policy_threshold=-1"], "replay.max_off_policy_threshold", "must be > 0"),
    (["rollout.agent_loop=tool", "rollout.max_turns=0"], "rollout.max_turns", "must be a positive integer"),
    (["debug.inject_rollout_failures=2"], "debug.inject_rollout_failures", "in [0, 1]"),
    (["data.train_files=data/repeat/train.parquet"], "data.train_files", "expected a list"),
    (["model.rope_type=yarn"], "model.rope_type", "must be one of"),
    (["trainer.seed=-1"], "trainer.seed", "must be an integer >= 0"),
    (["actor.balance.hidden_size=0"], "actor.balance.hidden_size", "must be a positive integer"),
    (["actor.loss.kl_loss_coef=-1"], "actor.loss.kl_loss_coef", "must be >= 0"),
    (["actor.backend=tpu"], "actor.backend", "must be one of ['fsdp', 'megatron']"),
    (["actor.bogus=1"], "actor.bogus", "unknown config key"),
]
if not torch.cuda.is_available():
    BAD.append((["trainer.device=cuda"], "trainer.device", "no CUDA device is visible"))


@pytest.mark.parametrize("overrides, key, text", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_bad_config_is_one_line_naming_its_key_at_load(overrides, key, text):
    with pytest.raises(ConfigError) as info:
        check_environment(load_config("grpo_tiny", overrides))  # what the train command does first
    message = str(info.value)
    assert key in message and text in message and "\n" not in message, message


def test_a_missing_data_file_where_nothing_can_be_written_names_the_key_and_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = blocker / "data" / "train.parquet"
    with pytest.raises(ConfigError) as info:
        check_environment(load_config("grpo_tiny", [f"data.train_files=[{path}]"]))
    assert str(info.value) == (f"data.train_files: {path} does not exist, and data.task='repeat' cannot generate it: "
                               f"{blocker} is not a folder this process can write")
    if os.getuid() != 0:  # root writes into a read-only folder all the same
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(ConfigError, match=f"data.val_files: {ro}/sub/val.parquet does not exist"):
            check_environment(load_config("grpo_tiny", [f"data.val_files=[{ro}/sub/val.parquet]"]))


def test_the_parallel_degrees_are_checked_against_the_launched_world(monkeypatch):
    cfg = load_config("grpo_tiny", ["actor.fsdp.ulysses_sp=3"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^actor.fsdp on 2 rank\(s\): world_size \(2\) is not divisible by "
                                          r"ulysses_sp \(3\)"):
        check_environment(cfg)
    monkeypatch.setenv("WORLD_SIZE", "3")
    check_environment(cfg)


def test_what_the_machine_lacks_is_checked_at_start_up_not_by_loading():
    """``rldispatch plan`` loads configs for other machines: a data file or a GPU missing here is no error to it."""
    overrides = ["data.train_files=[/nonexistent/rows.parquet]"] + ([] if torch.cuda.is_available() else
                                                                    ["trainer.device=cuda"])
    cfg = load_config("grpo_tiny", overrides)
    with pytest.raises(ConfigError, match="trainer.device=cuda|data.train_files: /nonexistent/rows.parquet"):
        check_environment(cfg)


def test_the_train_command_prints_one_config_error_line_and_exits_2(capsys):
    from rldispatch.commands.train import main

    assert main(["--config", "grpo_tiny", "actor.loss.clip_ratio_low=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["config error: actor.loss.clip_ratio_low must be in [0, 1), got -1.0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_no_rank_reports_a_peers_crash(tmp_path, process_tree):
    """Errors met after the ranks joined (a barrier behind them): prompts all longer than data.max_prompt_length,
    found by every rank reading the data; and, as root, a data folder the load-time check cannot see is unwritable
    (/proc), met by rank 0 alone while generating the data as rank 1 waits in a barrier. Each ends in the config
    error line; no traceback and no gloo "Connection closed by peer" comes first."""
    cases = [("data.max_prompt_length=4", "config error: data.train_files: no rows left in ")]
    if os.getuid() == 0:
        cases.append(("data.train_files=[/proc/rldispatch_test/train.parquet]",
                      "config error: data.train_files: ['/proc/rldispatch_test/train.parquet'] not found, and "
                      "data.task='repeat' could not generate them"))
    for override, expected in cases:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", "-m", "rldispatch", "train", "--config", "grpo_tiny", override,
               f"trainer.run_dir={tmp_path / 'run'}", "trainer.run_dir_exists=overwrite", "trainer.progress_bar=false"]
        proc = process_tree(cmd, timeout=240, cwd=tmp_path, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "exitcode  : 2" in out, out[-4000:]
        assert "]: Traceback" not in out and "Connection closed" not in out, out[-4000:]  # no rank's traceback
        worker = proc.stderr.split("Traceback (most recent call last)")[0]  # before torchrun's own report
        first = next(line for line in worker.splitlines() if "error" in line.lower())
        assert first.startswith(expected), worker[-4000:]
