"""The main job end to end: scripts/train.py under torchrun (2 gloo ranks) on each backend, and resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TRAIN = str(REPO / "scripts" / "train.py")
CONFIG = str(REPO / "configs" / "grpo_tiny.yaml")
SMALL = ["trainer.progress_bar=false", "trainer.tensorboard=false", "data.val_batch_size=4",
         "data.train_size=64", "data.val_size=8"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _data_args(tmp_path: Path) -> list[str]:
    return [f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/val.parquet]"]


def _check_step_records(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["store/keys_after_clear"] == 0.0, r  # every key of the step was cleared, on every rank
        # padding samples never enter a metric: the real-sample count matches what the replay buffer handed out,
        # and the optimizer saw exactly those sequences (none from a failed or padding sample)
        assert r["samples/real"] == r["replay/num_trajectories"] == r["actor/seqs"], r
        assert r["samples/padding"] == r["dispatch/padding"], r
        assert r["dispatch/num_samples"] == r["samples/real"] + r["samples/padding"], r
        for key in ("reward/score/mean", "actor/loss", "actor/grad_norm", "actor/lr", "response_length/mean",
                    "policy_length/mean", "dispatch/balance_after", "perf/tokens_per_s", "timing_s/step"):
            assert key in r and r[key] is not None, (key, r)
        for stage in ("perf/rank_time/update", "perf/rank_time"):  # each rank's own compute, max over mean
            assert 0 < r[f"{stage}/mean"] <= r[f"{stage}/max"], r
            assert r[f"{stage}/straggler_ratio"] == pytest.approx(r[f"{stage}/max"] / r[f"{stage}/mean"]), r


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_run_with_failures_padding_a_reward_model_and_a_judge(torchrun, tmp_path):
    """grpo_tiny on 2 ranks with injected failures (dropped groups -> padding samples), invariants and traces on, a
    reward model re-tokenizing in its own chat template and a generative judge beside the rule (weights 2, 0.25
    and 0.5; the reward model's forwards cut to 3 sequences): every step reports each scorer's scores over the real samples, counts the judge's answers
    without a usable score, and trains on 2 x model + 0.25 x judge + 0.5 x rule."""
    sys.path.insert(0, str(REPO / "tests" / "dist"))
    import hf_tiny

    # the reward model reads each trajectory in its own ChatML template and BPE vocabulary (the policy's is chars)
    rm = hf_tiny.make_checkpoint(tmp_path / "rm", "qwen2", classifier=True, tokenizer=True)
    judge = hf_tiny.make_checkpoint(tmp_path / "judge", "llama", tokenizer=False, vocab_size=128, seed=3)
    run_dir = tmp_path / "run"
    out = torchrun(TRAIN, 2, "--config", CONFIG, *SMALL, *_data_args(tmp_path), f"trainer.run_dir={run_dir}",
                   "trainer.total_steps=3", "debug.inject_rollout_failures=0.3", "trace.enabled=true",
                   "debug.check_invariants=true", "rollout.log_prob_mode=bypass", f"reward.model.hf_path={rm}",
                   "reward.model.weight=2", "reward.rule_weight=0.5", "reward.model.micro_batch_size=3",
                   "reward.model.retokenize=true", "reward.judge.enable=true", f"reward.judge.hf_path={judge}", "reward.judge.weight=0.25",
                   "reward.judge.template='Q:{prompt} A:{response} Score:'", "reward.judge.chat_template=false",
                   "reward.judge.max_score=4", timeout=400)
    records = _metrics(run_dir)
    _check_step_records(records, 3)
    for r in records:
        want = 2 * r["reward/model/mean"] + 0.25 * r["reward/judge/score/mean"] + 0.5 * r["reward/rule/mean"]
        assert r["reward/score/mean"] == pytest.approx(want, rel=1e-6, abs=1e-6), r
        assert r["reward/model/std"] > 0 and r["reward/model/truncated"] == 0.0 and "timing_s/reward_model" in r
        assert 0 <= r["reward/judge/score/min"] <= r["reward/judge/score/max"] <= 4 and "timing_s/judge" in r
        assert r["reward/judge/no_score"] + r["reward/judge/out_of_range"] <= r["samples/real"]
    assert sum(r["reward/judge/no_score"] + r["reward/judge/out_of_range"] for r in records) > 0, \
        "a random judge gives answers without a usable score: they are counted"
    assert any(r["reward/judge/score/max"] > 0 for r in records), "and answers with one"
    # the run ends with one summary from rank 0: steps, val first -> best -> last, where the outputs are
    first, last = records[0]["val/score/mean"], records[-1]["val/score/mean"]
    assert out.count("run finished: 3 step(s) this run, step 3 of 3") == 1, out[-3000:]
    assert f"val score (val/score/mean): {first:.3f} (step 0) -> best {max(first, last):.3f}" in out, out[-3000:]
    assert f"-> last {last:.3f} (step 3)" in out and f"metrics:     {run_dir / 'metrics.jsonl'}" in out
    assert f"checkpoints: {run_dir / 'checkpoints' / 'step_3'}" in out and f"rldispatch plot {run_dir}" in out
    assert sum(r["replay/failed_groups_dropped"] for r in records) > 0, "the injected failures must be dropped"
    assert sum(r["dispatch/padding"] for r in records) > 0, "dropped groups must be replaced by padding samples"
    assert all(r["dataplane/bytes_received/rank0"] > 0 and r["dataplane/bytes_received/rank1"] > 0 for r in records)
    assert "val/score/mean" in records[0] and "val/score/mean" in records[-1]
    # wall time since training began (validations included), so curves can be drawn against the clock
    elapsed = [r["progress/elapsed_s"] for r in records]
    assert all(b > a for a, b in zip(elapsed, elapsed[1:])), elapsed
    assert elapsed[0] >= records[0]["timing_s/step"] + records[0]["timing_s/val"], records[0]
    assert [("timing_s/val" in r) for r in records] == [True, False, True], "validated before step 1 and at the end"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_3"
    traces = list(run_dir.glob("trace.rank*.jsonl"))
    stages = {json.loads(line)["stage"] for p in traces for line in p.read_text().splitlines()}
    assert {"rollout", "reward", "judge", "old_log_prob", "reward_model", "advantage"} <= stages, stages


@pytest.mark.dist
@pytest.mark.slow
def test_ppo_on_megatron_tp2_checkpoints_and_resumes_the_critic(torchrun, tmp_path):
    """ppo_tiny on actor.backend=megatron with TP 2 (the critic in the actor's parallel state) and a LoRA actor
    (the critic trains all its weights), dropped groups replaced by padding samples, invariants on; the critic's
    checkpoint sits beside the actor's, and a run resumed from step 1 (the critic's warm-up: two AdamW steps of the
    critic alone) takes the same step 2."""
    common = ["--config", "ppo_tiny", *SMALL, *_data_args(tmp_path), "trainer.val_freq=0", "actor.backend=megatron",
              "actor.megatron.tp=2", "debug.inject_rollout_failures=0.3", "critic.warmup_steps=1",
              "trainer.total_steps=2", "actor.lora.rank=4", "actor.lora.alpha=8"]
    full, split = tmp_path / "full", tmp_path / "split"
    torchrun(TRAIN, 2, *common, f"trainer.run_dir={full}", "trainer.save_freq=1", "debug.check_invariants=true",
             timeout=400)
    records = _metrics(full)
    assert [r["step"] for r in records] == [1, 2]
    assert "actor/loss" not in records[0] and "actor/loss" in records[1], "step 1 is the critic's warm-up"
    assert sum(r["dispatch/padding"] for r in records) > 0, "dropped groups must be replaced by padding samples"
    for r in records:
        assert r["critic/seqs"] == r["samples/real"] == r["replay/num_trajectories"], r
        assert r["critic/optimizer_steps"] == 2.0 and r["store/keys_after_clear"] == 0.0
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm",
                    "critic/vf_explained_var", "critic/values/mean", "critic/returns/mean"):
            assert key in r and r[key] == r[key], (key, r)
    ckpt = full / "checkpoints" / "step_1"
    assert (ckpt / "engine_state.pt").is_file() and (ckpt / "critic" / "engine_state.pt").is_file()
    _check_lora_actor_beside_full_critic(full / "checkpoints")

    torchrun(TRAIN, 2, *common, f"trainer.run_dir={split}", f"trainer.resume={ckpt}", timeout=400)
    a, b = records[1], _metrics(split)[-1]
    assert b["step"] == 2
    for key in ("reward/score/mean", "critic/global_step", "actor/global_step"):
        assert a[key] == b[key], (key, a[key], b[key])
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/vf_explained_var",
                "actor/loss", "actor/grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])


def _check_lora_actor_beside_full_critic(ckpts: Path) -> None:
    """From step 1 to step 2 the actor's base stays and its adapters move; every critic layer weight moves."""
    import torch

    from backends.megatron.checkpoint import read_model_weights
    from backends.model.config import ModelConfig
    from backends.model.lora import is_adapter_name
    from rldispatch.commands.export import read_checkpoint

    (_, _, run_cfg, a1), (_, _, _, a2) = (read_checkpoint(ckpts / f"step_{s}") for s in (1, 2))
    base = [n for n in a1 if not is_adapter_name(n)]
    assert len(base) < len(a1) and all(torch.equal(a1[n], a2[n]) for n in base), "the actor's base moved"
    assert any(not torch.equal(a1[n], a2[n]) for n in a1 if n.endswith("lora_B")), "the adapters did not move"
    cfg = ModelConfig(**run_cfg["model"])
    c1, c2 = (read_model_weights(str(ckpts / f"step_{s}" / "critic"), cfg) for s in (1, 2))
    layers = [n for n in c1 if n.startswith("layers.")]
    assert layers and not any(is_adapter_name(n) for n in c1)
    assert all(not torch.equal(c1[n], c2[n]) for n in layers), "a critic weight did not train"


@pytest.mark.dist
@pytest.mark.slow
def test_megatron_tp2_lora_run_matches_fsdp_lora_single_process(torchrun, tmp_path):
    """A LoRA actor on Megatron TP=2 (DP=1) and on FSDP in one process see the same data and sampling: 3 steps with
    the same rewards and responses, and losses, grad norm and KL loss (reference = the actor, adapters off) equal to
    float32 rounding. (Full-parameter Megatron vs FSDP parity: tests/dist/megatron_parity_worker.py.)"""
    args = ["--config", CONFIG, *SMALL, *_data_args(tmp_path), "trainer.total_steps=3", "rollout.agent_loop=tool",
            "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=0.05", "actor.loss.use_kl_loss=true"]
    meg, ref = tmp_path / "megatron", tmp_path / "fsdp1"
    torchrun(TRAIN, 2, *args, f"trainer.run_dir={meg}", "actor.backend=megatron", "actor.megatron.tp=2",
             timeout=400)
    subprocess.run([sys.executable, TRAIN, *args, f"trainer.run_dir={ref}"], check=True, capture_output=True,
                   timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    a, b = _metrics(meg), _metrics(ref)
    _check_step_records(a, 3)
    for ra, rb in zip(a, b):
        for key in ("reward/score/mean", "response_length/mean", "samples/real"):
            assert ra[key] == rb[key], (key, ra[key], rb[key])
        for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "kl/mean"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (key, ra[key], rb[key])
    assert a[-1]["actor/kl_loss"] > 0.0  # the adapters moved away from the reference
    from backends.model.lora import is_adapter_name
    from rldispatch.commands.export import read_checkpoint

    backend, step, _, saved = read_checkpoint(meg / "checkpoints" / "step_3")
    assert (backend, step) == ("megatron", 3)
    assert sum(1 for n in saved if is_adapter_name(n)) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)


@pytest.mark.dist
@pytest.mark.slow
def test_resume_equals_uninterrupted(torchrun, tmp_path):
    common = ["--config", CONFIG, *SMALL, *_data_args(tmp_path), "trainer.val_freq=0"]
    full, split = tmp_path / "full", tmp_path / "split"
    torchrun(TRAIN, 2, *common, f"trainer.run_dir={full}", "trainer.total_steps=3", "trainer.save_freq=2",
             timeout=400)
    torchrun(TRAIN, 2, *common, f"trainer.run_dir={split}", "trainer.total_steps=3",
             f"trainer.resume={full / 'checkpoints' / 'step_2'}", timeout=400)
    a, b = _metrics(full), _metrics(split)
    assert [r["step"] for r in b] == [3]
    # the rollout of step 3 is identical (same weights, same seeded sampling), so its rewards match exactly
    for key in ("reward/score/mean", "reward/score/std", "response_length/mean", "policy_length/mean", "actor/lr",
                "actor/global_step"):
        assert a[2][key] == b[0][key], (key, a[2][key], b[0][key])
    # losses agree to float32 rounding: reloaded parameters may sit in differently laid out buffers, which can
    # change the summation order inside matmul kernels by an ulp
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert a[2][key] == pytest.approx(b[0][key], rel=1e-5, abs=1e-7), (key, a[2][key], b[0][key])


@pytest.mark.slow
def test_step_without_usable_groups_stops_with_a_clear_error(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, TRAIN, "--config", CONFIG, *SMALL, *_data_args(tmp_path), f"trainer.run_dir={run_dir}",
         "trainer.total_steps=1", "debug.inject_rollout_failures=1.0", "ref.enabled=false"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "NoUsableGroupsError" in proc.stderr and "no usable prompt group among 16" in proc.stderr, proc.stderr[-3000:]


def test_bad_config_exits_2_naming_the_key(tmp_path):
    """Refused at start-up whatever a user's own runs left: run from an empty folder, the shipped config's
    default run_dir is fresh."""
    proc = subprocess.run([sys.executable, TRAIN, "--config", CONFIG, "actor.backend=tpu"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "config error: actor.backend must be one of ['fsdp', 'megatron'], got 'tpu'" in proc.stderr
    # refused at start-up against the world size, before any rollout
    proc = subprocess.run([sys.executable, TRAIN, "--config", CONFIG, "actor.micro_batch_size_per_gpu=100"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "config error: micro_batch_size_per_gpu (100) exceeds the per-rank mini-batch" in proc.stderr


@pytest.mark.dist
@pytest.mark.slow
def test_ppo_with_critic_runs_checkpoints_and_resumes(torchrun, tmp_path):
    """ppo_tiny (GAE, FSDP critic) on 2 ranks with dropped groups replaced by padding samples; the checkpoint holds
    the critic beside the actor (the exported weights stay the actor's), and a resumed step 3 equals the
    uninterrupted one."""
    from backends.fsdp.checkpoint import read_model_weights

    common = ["--config", "ppo_tiny", *SMALL, *_data_args(tmp_path), "trainer.val_freq=0",
              "debug.inject_rollout_failures=0.3", "critic.warmup_steps=1"]
    full, split = tmp_path / "full", tmp_path / "split"
    torchrun(TRAIN, 2, *common, f"trainer.run_dir={full}", "trainer.total_steps=3", "trainer.save_freq=2",
             "debug.check_invariants=true", timeout=400)
    records = _metrics(full)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "actor/loss" not in records[0] and "actor/loss" in records[1], "step 1 is the critic's warm-up"
    assert sum(r["dispatch/padding"] for r in records) > 0, "dropped groups must be replaced by padding samples"
    for r in records:
        # padding samples move no value loss: the critic saw exactly the real sequences, over the actor's batches
        assert r["critic/seqs"] == r["samples/real"] == r["replay/num_trajectories"], r
        assert r["critic/optimizer_steps"] == 2.0 and r["store/keys_after_clear"] == 0.0
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm",
                    "critic/vf_explained_var", "critic/values/mean", "critic/returns/mean", "timing_s/values",
                    "timing_s/critic_update"):
            assert key in r and r[key] == r[key], (key, r)  # present and not NaN
    # with gamma = lam = 1 the return of every token is its trajectory's score
    assert records[0]["critic/returns/mean"] != 0.0
    ckpt = full / "checkpoints" / "step_2"
    assert (ckpt / "critic" / "engine_state.pt").is_file()
    actor = read_model_weights(str(ckpt))
    assert "lm_head.weight" in actor and not any(k.startswith("value_head") for k in actor)
    assert "value_head.weight" in read_model_weights(str(ckpt / "critic"))

    torchrun(TRAIN, 2, *common, f"trainer.run_dir={split}", "trainer.total_steps=3", f"trainer.resume={ckpt}",
             timeout=400)
    a, b = records[2], _metrics(split)[-1]
    assert b["step"] == 3
    for key in ("reward/score/mean", "critic/global_step", "actor/global_step"):
        assert a[key] == b[key], (key, a[key], b[key])
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/vf_explained_var",
                "actor/loss", "actor/grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])
