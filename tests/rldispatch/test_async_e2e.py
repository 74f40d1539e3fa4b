"""trainer.mode=colocate_async end to end: equal to sync when nothing may be off-policy; off-policy on 2 ranks."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "scripts" / "train.py")
CONFIG = str(REPO / "configs" / "grpo_tiny.yaml")
SMALL = ["trainer.progress_bar=false", "trainer.tensorboard=false", "data.val_batch_size=4", "data.train_size=64",
         "data.val_size=8"]
#: what differs between two identical runs: wall-clock times and what derives from them
CLOCKED = ("timing_s/", "perf/", "progress/", "replay/wait_s", "actor/time", "async/")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _data_args(tmp_path: Path) -> list[str]:
    return [f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/val.parquet]"]


def _train(*args: str) -> None:
    proc = subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, timeout=400, cwd=tempfile.gettempdir(),
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_colocate_async_with_nothing_off_policy_equals_sync_bit_for_bit(tmp_path):
    """No warm-up batch ahead, threshold 1, no partial rollout: the same step metrics as sync, exactly."""
    common = ["--config", CONFIG, *SMALL, *_data_args(tmp_path), "trainer.total_steps=3"]
    _train(*common, f"trainer.run_dir={tmp_path / 'sync'}")
    _train(*common, f"trainer.run_dir={tmp_path / 'async'}", "trainer.mode=colocate_async",
           "trainer.colocate_async.num_warmup_batches=0", "replay.max_off_policy_threshold=1",
           "rollout.partial_rollout=false")
    a, b = _metrics(tmp_path / "sync"), _metrics(tmp_path / "async")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith(CLOCKED)}
        assert keys == {k for k in rb if not k.startswith(CLOCKED)}
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
        assert "actor/loss" in keys and "reward/score/mean" in keys
        assert ra["off_policy/trajectory_staleness/max"] == 0 and ra["off_policy/span/max"] == 1
    assert "val/score/mean" in b[0] and "val/score/mean" in b[-1]


@pytest.mark.dist
@pytest.mark.slow
def test_colocate_async_off_policy_on_two_megatron_ranks(torchrun, tmp_path):
    """A warm-up batch ahead, partial rollout in 2-token chunks, drop at span > 2, token IS weights and token
    rejection, Megatron DP=2:
    every step trains whole groups within the threshold, the tags and the correction metrics say how far
    off-policy they are, and the run exits with an empty store (shutdown raises otherwise). FSDP DP=2 with the same
    settings trains the same trajectories to the same metrics: the asynchronous path is backend-independent."""
    run_dir, fsdp_dir = tmp_path / "run", tmp_path / "fsdp"
    args = ["--config", CONFIG, *SMALL, *_data_args(tmp_path), "trainer.total_steps=4", "trainer.val_freq=0",
            "trainer.mode=colocate_async", "trainer.colocate_async.num_warmup_batches=1",
            "replay.max_off_policy_threshold=2", "rollout.partial_rollout_chunk=2", "data.max_response_length=12",
            "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"]
    torchrun(TRAIN, 2, *args, f"trainer.run_dir={run_dir}", "actor.backend=megatron", timeout=400)
    torchrun(TRAIN, 2, *args, f"trainer.run_dir={fsdp_dir}", "actor.backend=fsdp", timeout=400)
    records = _metrics(run_dir)
    for rm, rf in zip(records, _metrics(fsdp_dir), strict=True):
        for key in ("reward/score/mean", "response_length/mean", "off_policy/span/max", "partial/partial_ratio"):
            assert rm[key] == rf[key], (rm["step"], key, rm[key], rf[key])
        for key in ("actor/loss", "actor/grad_norm", "actor/entropy", "rollout_corr/rollout_is_mean",
                    "rollout_corr/kl"):
            assert rm[key] == pytest.approx(rf[key], rel=1e-4, abs=1e-6), (rm["step"], key, rm[key], rf[key])
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["replay/num_groups"] == 16 and r["samples/real"] == r["replay/num_trajectories"] == r["actor/seqs"]
        assert 1 <= r["off_policy/span/max"] <= 2
        # every token was generated at or after its prompt's dispatch step: versions spanned <= the span
        assert r["off_policy/trajectory_spans/max"] <= r["off_policy/span/max"]
        assert 0 <= r["off_policy/trajectory_staleness/min"] <= r["off_policy/trajectory_staleness_worst/max"] <= 1
        assert 0 < r["rollout_corr/rollout_is_mean"] <= 2.0
        assert 0 < r["rollout_corr/rollout_is_eff_sample_size"] <= 1.0
        assert 0 <= r["rollout_corr/rollout_rs_masked_fraction"] <= 1.0
        for key in ("rollout_corr/kl", "rollout_corr/rollout_is_ratio_fraction_high", "partial/partial_ratio",
                    "partial/max_partial_span", "timing_s/trainer_idle", "timing_s/rollout_idle"):
            assert key in r, key
    assert any(r["off_policy/span/max"] == 2 for r in records), "the warm-up batch is trained a step late"
    assert any(r["rollout_corr/kl"] != 0 for r in records), "trajectories of older weights differ from pi_old"


@pytest.mark.slow
def test_colocate_async_drop_evicts_the_warm_up_batch_and_refills_it(tmp_path):
    """Threshold 1 with a batch ahead: what is left of the warm-up batch has span 2 at step 1, so it is evicted
    (never trained) and exactly as many fresh prompts are submitted; every trained group has span 1. FSDP, with
    sequence-level IS weights, and a generative judge as the only reward: it answers in its own engine while the
    policy's is paused, and the step trains on its scores."""
    sys.path.insert(0, str(REPO / "tests" / "dist"))
    import hf_tiny

    judge = hf_tiny.make_checkpoint(tmp_path / "judge", "llama", tokenizer=False, vocab_size=128, seed=3)
    run_dir = tmp_path / "run"
    _train("--config", CONFIG, *SMALL, *_data_args(tmp_path), f"trainer.run_dir={run_dir}", "trainer.total_steps=3",
           "trainer.val_freq=0", "trainer.mode=colocate_async", "trainer.colocate_async.num_warmup_batches=1",
           "replay.max_off_policy_threshold=1", "algorithm.rollout_correction.rollout_is=sequence",
           "reward.judge.enable=true", f"reward.judge.hf_path={judge}", "reward.judge.chat_template=false",
           "reward.judge.template='Q:{prompt} A:{response} Score:'")
    records = _metrics(run_dir)
    for r in records:  # reward.rule_weight 0: the judge's scores are the reward; the rule's stay a metric
        assert r["reward/score/mean"] == pytest.approx(r["reward/judge/score/mean"], rel=1e-6, abs=1e-6)
        assert "reward/rule/mean" in r and "timing_s/judge" in r
    assert all(r["off_policy/span/max"] == 1 and r["replay/num_groups"] == 16 for r in records)
    assert all(0 < r["rollout_corr/rollout_is_mean"] <= 2.0 for r in records)  # FSDP's loss takes the weights
    evicted = sum(r["off_policy/evicted_groups"] for r in records)
    assert evicted >= 16 and sum(r["replay/groups_refilled"] for r in records) == evicted
    assert all(r["off_policy/evicted_samples_staleness/min"] == 2 for r in records if r["off_policy/evicted_groups"])


def _logged(stderr: str, what: str) -> list[list[int]]:
    return [json.loads(line.split(what, 1)[1].split("]")[0] + "]") for line in stderr.splitlines() if what in line]


@pytest.mark.slow
def test_colocate_async_resume_trains_nothing_twice_and_loses_nothing(tmp_path):
    """A run that stops with prompts in flight and buffered, resumed: those prompts are submitted again at the
    resumed step, no prompt is trained twice, and every prompt outstanding at the checkpoint is trained later or
    still outstanding at the end."""
    common = ["--config", CONFIG, *SMALL, *_data_args(tmp_path), f"trainer.run_dir={tmp_path / 'run'}",
              "trainer.val_freq=0", "trainer.mode=colocate_async", "trainer.colocate_async.num_warmup_batches=1"]
    runs = []
    for steps, resume in ((2, "never"), (4, "auto")):
        proc = subprocess.run([sys.executable, TRAIN, *common, f"trainer.total_steps={steps}",
                               f"trainer.resume={resume}"], capture_output=True, text=True, timeout=400, cwd=tempfile.gettempdir(),
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(proc.stderr)
    trained = [_logged(err, "trains prompts ") for err in runs]
    outstanding = [_logged(err, "outstanding prompts ") for err in runs]
    assert [len(t) for t in trained] == [2, 2] and all(len(step) == 16 for t in trained for step in t)
    first, second = {p for step in trained[0] for p in step}, [p for step in trained[1] for p in step]
    assert len(first) == 32 and len(set(second)) == len(second) == 32 and not first & set(second)
    saved = set(outstanding[0][-1])
    assert saved and _logged(runs[1], "resume: prompts ")[0] == sorted(saved)
    assert saved <= set(second) | set(outstanding[1][-1])
    assert not saved & first
