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
    (["trainer.separate_async.num_warmup_batches=-1"], "trainer.separate_async.num_warmup_batches"),
    # the reference system's trigger_parameter_sync_step: here a global step is train_batch_size / mini-batch
    (["trainer.separate_async.parameter_sync_step=2"], r"parameter_sync_step is not a key: .* set "
                                                       r"data.train_batch_size = N x actor.ppo_mini_batch_size"),
])
def test_separate_async_config_errors_name_the_keys(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(CONFIG, ["trainer.mode=separate_async", *overrides])


def test_separate_async_config_defaults():
    sa = load_config(CONFIG, ["trainer.mode=separate_async"]).trainer.separate_async
    assert (sa.rollout_ranks, sa.num_warmup_batches) == (1, 1)


def test_separate_async_needs_a_training_rank(monkeypatch):
    """rollout_ranks must leave a training rank: checked against the launch's world when it is known."""
    from rldispatch.separate.transport import split_world
    from tests.conftest import _free_port

    cfg = load_config(CONFIG, ["trainer.mode=separate_async",
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


def _logged(stderr: str, what: str) -> list[list[int]]:
    return [json.loads(line.split(what, 1)[1].split("]")[0] + "]") for line in stderr.splitlines() if what in line]


@pytest.mark.dist
@pytest.mark.slow
def test_separate_async_one_rollout_rank_one_training_rank(process_tree, tmp_path):
    """Rank 1 generates, rank 0 trains (FSDP on a world of one), 2 steps, then resumed to 4: every step trains 16
    whole groups within the staleness threshold, their tags say how far off-policy they are, the weights the
    rollout rank holds after each sync are the trainer's (a checksum each side computes of its own copy), both
    sides exit with empty stores, and the resumed run submits the outstanding prompts again and trains none twice."""
    from tests.conftest import _free_port

    run_dir = tmp_path / "run"
    errs = []
    for steps, resume in ((2, "never"), (4, "auto")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", TRAIN, "--config", CONFIG, *SMALL,
               f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/val.parquet]",
               f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", f"trainer.resume={resume}",
               "trainer.val_freq=0", "trainer.mode=separate_async",
               "replay.max_off_policy_threshold=2", "rollout.partial_rollout_chunk=2", "data.max_response_length=12",
               "debug.weight_checksums=true"]
        proc = process_tree(cmd, timeout=300, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr[-6000:]
        errs.append(proc.stderr)
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["replay/num_groups"] == 16 and r["samples/real"] == r["replay/num_trajectories"] == r["actor/seqs"]
        assert r["actor/optimizer_steps"] == 2  # train_batch_size / ppo_mini_batch_size updates, then one sync
        assert 1 <= r["off_policy/span/min"] <= r["off_policy/span/max"] <= 2
        # every token was generated at or after its prompt's dispatch step: versions spanned <= the span
        assert r["off_policy/trajectory_spans/max"] <= r["off_policy/span/max"]
        assert 0 <= r["off_policy/trajectory_staleness/min"] <= r["off_policy/trajectory_staleness_worst/max"] <= 1
        assert 0 <= r["timing_s/trainer_idle"] <= r["timing_s/step"]
        assert 0 <= r["timing_s/rollout_idle"] <= r["timing_s/step"]
        for key in ("partial/partial_ratio", "partial/max_partial_span", "off_policy/evicted_samples"):
            assert key in r, key
    assert records[1]["off_policy/span/max"] == 2, "the warm-up batch is trained a step late"
    syncs = [json.loads(line) for line in (run_dir / "weight_sync.jsonl").read_text().splitlines()]
    trainer = [(s["version"], s["checksum"]) for s in syncs if s["side"] == "trainer"]
    rollout = [(s["version"], s["checksum"]) for s in syncs if s["side"] == "rollout" and s["rank"] == 1]
    # versions 0-2 in the first run, 2 (the checkpoint's weights, sent at the start) to 4 in the resumed one
    assert sorted(trainer) == sorted(rollout) and [v for v, _ in sorted(trainer)] == [0, 1, 2, 2, 3, 4]
    assert len({c for _, c in trainer}) == 5, "every sync carries new weights; the resumed run starts from the saved"
    for err in errs:
        assert "rollout rank 1 stopped:" in err and ", 0 left" in err
        assert "separate_async shutdown:" in err and "store empty" in err
    trained = [_logged(err, "trains prompts ") for err in errs]
    first, second = {p for step in trained[0] for p in step}, [p for step in trained[1] for p in step]
    assert len(first) == 32 and len(set(second)) == len(second) == 32 and not first & set(second)
    saved = set(_logged(errs[0], "outstanding prompts ")[-1])
    assert saved and _logged(errs[1], "resume: prompts ")[0] == sorted(saved)
    assert saved <= set(second) | set(_logged(errs[1], "outstanding prompts ")[-1])


@pytest.mark.dist
@pytest.mark.slow
def test_separate_async_groups_go_to_the_training_rank_that_owns_them(process_tree, tmp_path):
    """2 training ranks (FSDP DP=2) + 1 rollout rank: each finished group travels from the rollout rank straight to
    its owner (the reporting rank of DP replica i % 2 for a submission's prompt i), so both training ranks receive
    half of the groups and none funnels through rank 0; both shut down with empty stores. A generative judge
    answers on the training ranks, each for the groups it received."""
    from tests.conftest import _free_port

    sys.path.insert(0, str(REPO / "tests" / "dist"))
    import hf_tiny

    judge = hf_tiny.make_checkpoint(tmp_path / "judge", "llama", tokenizer=False, vocab_size=128, seed=3)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", TRAIN, "--config", CONFIG, *SMALL,
           f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/val.parquet]",
           f"trainer.run_dir={run_dir}", "trainer.total_steps=3", "trainer.val_freq=0", "trainer.save_freq=0",
           "trainer.mode=separate_async", "debug.weight_checksums=true", "reward.judge.enable=true",
           f"reward.judge.hf_path={judge}", "reward.judge.chat_template=false", "reward.rule_weight=1",
           "reward.judge.template='Q:{prompt} A:{response} Score:'"]
    proc = process_tree(cmd, timeout=300, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # the rule's score plus the judge's (both weight 1)
        want = r["reward/rule/mean"] + r["reward/judge/score/mean"]
        assert r["reward/score/mean"] == pytest.approx(want, rel=1e-6, abs=1e-6) and "timing_s/judge" in r
    got = [sum(r[f"async/groups_received/rank{k}"] for r in records) for k in (0, 1)]
    # 16 prompts a step, dealt round robin over the 2 replicas: 8 groups each per submitted batch; the warm-up batch
    # and the 3 steps' batches are 64 groups, of which at least the 48 trained arrived before shutdown
    assert got[0] >= 24 and got[1] >= 24 and abs(got[0] - got[1]) <= 8, got
    for r in records:
        assert r["replay/num_groups"] == 16 and r["samples/real"] == r["replay/num_trajectories"]
    syncs = [json.loads(line) for line in (run_dir / "weight_sync.jsonl").read_text().splitlines()]
    trainer = sorted((s["version"], s["checksum"]) for s in syncs if s["side"] == "trainer")
    assert trainer == sorted((s["version"], s["checksum"]) for s in syncs if s["side"] == "rollout")
    assert "rollout rank 2 stopped:" in proc.stderr and ", 0 left" in proc.stderr


def test_groups_travel_whole_and_unchanged():
    """What a rollout rank sends of its finished groups is what its store holds: jagged fields jagged, dense dense,
    every tag, bytes equal (fields of several dtypes, so their offsets in the payload are not aligned), and a
    vision-language group's images from its prompt key, once."""
    import torch
    from tensordict import TensorDict

    from protocol.batch.nested import to_nested
    from protocol.fields import IMAGE_GRID_THW, PIXEL_VALUES
    from protocol.store import LocalStore
    from rldispatch.separate.transport import pack_groups, unpack_fields

    store = LocalStore()
    keys = ["aa_0_0", "aa_1_0", "bb_0_0"]
    lengths = [3, 5, 2]
    fields = TensorDict({
        "responses": to_nested([torch.arange(n, dtype=torch.int64) + 7 for n in lengths]),
        "rollout_log_probs": to_nested([torch.linspace(-1, 0, n, dtype=torch.float32) for n in lengths]),
        "flag": torch.tensor([1, 0, 1], dtype=torch.uint8),
        "score": torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64)}, batch_size=[3])
    store.kv_batch_put(["aa", "bb", "cc"], "train", tags=[{"is_prompt": True, "status": "finished",
                                                           "global_steps": 3}] * 3)
    store.kv_batch_put(keys, "train", fields, tags=[{"response_len": n, "min_global_steps": 3} for n in lengths])
    pixels = torch.randn(2 * 4 * 12)  # group bb's images, once on its prompt key (aa has none)
    grids = torch.tensor([1, 2, 2, 1, 2, 2])
    store.kv_batch_put(["bb"], "train", {PIXEL_VALUES: [pixels], IMAGE_GRID_THW: [grids]})
    header, payload = pack_groups(store, ["aa", "bb"], image_uids={"bb", "cc"})
    assert header["keys"] == keys and header["uids"] == ["aa", "bb"] and payload.numel() == header["nbytes"]
    assert header["tags"] == store.kv_batch_get_tags(keys, "train") and header["image_uids"] == ["bb"]
    assert header["prompt_tags"] == store.kv_batch_get_tags(["aa", "bb"], "train")
    got, images = unpack_fields(header, payload.clone())
    want = store.kv_batch_get(keys, "train", jagged=["responses", "rollout_log_probs"])
    assert set(got.keys()) == set(want.keys())
    for name in want.keys():
        a, b = got[name], want[name]
        assert a.is_nested == b.is_nested and a.dtype == b.dtype, name
        for x, y in zip(a.unbind(), b.unbind()):
            assert torch.equal(x, y), name
    assert torch.equal(images[PIXEL_VALUES][0], pixels) and torch.equal(images[IMAGE_GRID_THW][0], grids)
    assert unpack_fields(*pack_groups(store, ["aa"]))[1] is None


def test_mailbox_delivers_in_order_and_once():
    """Messages from one sender arrive in the order posted, each once; a poll with nothing new returns nothing."""
    import torch.distributed as dist

    from rldispatch.separate.transport import Mailbox

    store = dist.HashStore()
    a, b, c = Mailbox(store, 0), Mailbox(store, 1), Mailbox(store, 2)
    assert b.poll(0) == []
    for i in range(5):
        a.post(1, ("n", i))
    c.post(1, ("from c",))
    a.post(2, ("to c",))
    assert b.poll(0) == [("n", i) for i in range(5)] and b.poll(0) == []
    assert b.poll(2) == [("from c",)] and c.poll(0) == [("to c",)]
    a.post(1, ("late",))
    assert b.poll(0) == [("late",)]
