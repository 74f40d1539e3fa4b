"""trainer.mode=separate_async: one rollout rank and one training rank under torchrun, and its config errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rldispatch.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "scripts" / "train.py")
CONFIG = str(REPO / "configs" / "grpo_tiny.yaml")
SMALL = ["trainer.progress_bar=false", "trainer.tensorboard=false", "data.val_batch_size=4", "data.train_size=64",
         "data.val_size=8"]


@pytest.mark.parametrize("overrides, fragment", [
    (["trainer.separate_async.rollout_ranks=0"], "trainer.separate_async.rollout_ranks"),
    (["trainer.separate_async.parameter_sync_step=0"], "trainer.separate_async.parameter_sync_step"),
    (["trainer.separate_async.num_warmup_batches=-1"], "trainer.separate_async.num_warmup_batches"),
    # the shipped config: 16 prompts a step, mini-batches of 8: a global step of 1 mini-batch does not fit
    ([], r"data.train_batch_size=16 must equal trainer.separate_async.parameter_sync_step=1 x "
         r"actor.ppo_mini_batch_size=8"),
    (["trainer.separate_async.parameter_sync_step=3"], "parameter_sync_step=3"),
])
def test_separate_async_config_errors_name_the_keys(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(CONFIG, ["trainer.mode=separate_async", *overrides])


def test_separate_async_config_accepts_a_whole_global_step():
    cfg = load_config(CONFIG, ["trainer.mode=separate_async", "trainer.separate_async.parameter_sync_step=2"])
    sa = cfg.trainer.separate_async
    assert (sa.rollout_ranks, sa.parameter_sync_step, sa.num_warmup_batches) == (1, 2, 1)
    assert load_config(CONFIG, ["trainer.mode=separate_async", "actor.ppo_mini_batch_size=16"])


def test_separate_async_needs_a_training_rank(monkeypatch):
    """rollout_ranks must leave a training rank: checked against the launch's world when it is known."""
    from rldispatch.separate import split_world
    from tests.conftest import _free_port

    cfg = load_config(CONFIG, ["trainer.mode=separate_async", "trainer.separate_async.parameter_sync_step=2",
                               "trainer.dist_timeout_s=20", "trainer.device=cpu"])
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(ConfigError, match=r"trainer.separate_async.rollout_ranks=1 leaves no training rank in a "
                                          r"world of 1"):
        split_world(cfg)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.slow
def test_separate_async_one_rollout_rank_one_training_rank(process_tree, tmp_path):
    """Rank 1 generates, rank 0 trains (FSDP on a world of one): every step trains 16 whole groups within the
    staleness threshold, their tags say how far off-policy they are, the weights the rollout rank holds after each
    sync are the trainer's (a checksum each side computes of its own copy), and both sides exit with empty stores."""
    run_dir = tmp_path / "run"
    from tests.conftest import _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", TRAIN, "--config", CONFIG, *SMALL,
           f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/val.parquet]",
           f"trainer.run_dir={run_dir}", "trainer.total_steps=4", "trainer.val_freq=0", "trainer.mode=separate_async",
           "trainer.separate_async.parameter_sync_step=2", "replay.max_off_policy_threshold=2",
           "rollout.partial_rollout_chunk=2", "data.max_response_length=12", "debug.weight_checksums=true"]
    proc = process_tree(cmd, timeout=300, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    out = proc.stderr
    assert proc.returncode == 0, out[-6000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["replay/num_groups"] == 16 and r["samples/real"] == r["replay/num_trajectories"] == r["actor/seqs"]
        assert r["actor/optimizer_steps"] == 2  # parameter_sync_step mini-batches, then one sync
        assert 1 <= r["off_policy/span/min"] <= r["off_policy/span/max"] <= 2
        # every token was generated at or after its prompt's dispatch step: versions spanned <= the span
        assert r["off_policy/trajectory_spans/max"] <= r["off_policy/span/max"]
        assert 0 <= r["off_policy/trajectory_staleness/min"] <= r["off_policy/trajectory_staleness_worst/max"] <= 1
        assert 0 <= r["timing_s/trainer_idle"] <= r["timing_s/step"]
        assert 0 <= r["timing_s/rollout_idle"] <= r["timing_s/step"]
        for key in ("partial/partial_ratio", "partial/max_partial_span", "off_policy/evicted_samples"):
            assert key in r, key
    assert any(r["off_policy/span/max"] == 2 for r in records), "the warm-up batch is trained a step late"
    syncs = [json.loads(line) for line in (run_dir / "weight_sync.jsonl").read_text().splitlines()]
    trainer = {s["version"]: s["checksum"] for s in syncs if s["side"] == "trainer"}
    rollout = {s["version"]: s["checksum"] for s in syncs if s["side"] == "rollout" and s["rank"] == 1}
    assert sorted(trainer) == [0, 1, 2, 3, 4] and rollout == trainer
    assert len(set(trainer.values())) == 5, "every sync carries new weights"
    assert "rollout rank 1 stopped:" in out and ", 0 left" in out
    assert "separate_async shutdown:" in out and "store empty" in out
