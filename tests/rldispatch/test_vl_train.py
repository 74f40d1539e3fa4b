"""A vision-language policy in the trainer: the config reads a Qwen2-VL folder (the decoder from it, the keys a
vision policy cannot honour refused by name), the rows' images reach the rollout, the store and the engines, and
a batch mixing rows with 0, 1 and 2 images trains on 2 ranks."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from protocol.config import ConfigError
from rldispatch.config import load_config, vision_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "rldispatch" / "configs" / "grpo_vl_tiny.yaml"


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    from backends.model.tiny_vl import write_tiny_vl

    from rldispatch.commands.models import VL_TINY_FORMAT_STEPS

    out = tmp_path_factory.mktemp("vl") / "vl_tiny"
    write_tiny_vl(str(out), seed=0, format_steps=VL_TINY_FORMAT_STEPS)  # what `rldispatch models vl_tiny` writes
    return str(out)


def test_the_config_reads_the_vision_language_folder(vl_folder):
    cfg = load_config(CONFIG, [f"model.hf_path={vl_folder}", "actor.freeze_vision_tower=true"])
    vl = vision_config(cfg)
    assert vl is not None and cfg.model == vl.text and cfg.model.hidden_size == 64
    engine = cfg.engine_config()
    assert engine.vision == vl and engine.freeze_vision_tower
    from rldispatch.plan import batch_settings
    from dispatch import Topology

    work = batch_settings(cfg, Topology.from_config(cfg.actor.parallel, 2), step=0).workload
    assert work.vision_linear > 0, "the plan counts the vision tower's cost"


@pytest.mark.parametrize("override, names", [
    ("actor.backend=megatron", "actor.backend=megatron"),
    ("rollout.engine=vllm", "rollout.engine=vllm"),
    ("actor.lora.rank=4", "actor.lora.rank"),
    ("algorithm.adv_estimator=gae", "a critic"),
])
def test_what_a_vision_policy_cannot_run_is_refused_by_key(vl_folder, override, names):
    with pytest.raises(ConfigError, match="is a vision-language policy, which is not built with") as err:
        load_config(CONFIG, [f"model.hf_path={vl_folder}", override])
    assert names in str(err.value)


def test_freezing_a_tower_a_text_policy_lacks_is_refused():
    with pytest.raises(ConfigError, match="actor.freeze_vision_tower=true but model.hf_path=''"):
        load_config(REPO / "rldispatch" / "configs" / "grpo_tiny.yaml", ["actor.freeze_vision_tower=true"])


def _mixed_rows(n: int, seed: int) -> list[dict]:
    """``colors`` rows whose image count cycles 1, 0, 2: a row without its picture (the prompt then names no
    image) and one with a second picture of the same split."""
    from protocol.rollout.tasks import get_task

    task, rng, rows = get_task("colors"), random.Random(seed), []
    for i in range(n):
        row = task.make_row(i, rng)
        k = (1, 0, 2)[i % 3]
        text = row["prompt"][-1]["content"]
        row["prompt"][-1]["content"] = text.replace("<image>", "<image> <image>" if k == 2 else "" if k == 0 else
                                                    "<image>")
        row["images"] = row["images"] * k
        rows.append(row)
    return rows


def _write(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _train(torchrun, vl_folder, tmp_path, *overrides: str) -> list[dict]:
    """Three steps of grpo_vl_tiny on 2 ranks over rows mixing 0, 1 and 2 images; the metrics records."""
    _write(_mixed_rows(48, 0), tmp_path / "data" / "train.parquet")
    _write(_mixed_rows(12, 1), tmp_path / "data" / "val.parquet")
    run = tmp_path / "run"
    torchrun(str(REPO / "scripts" / "train.py"), 2, "--config", str(CONFIG), f"model.hf_path={vl_folder}",
             f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
             f"data.val_files=[{tmp_path / 'data' / 'val.parquet'}]", "data.max_prompt_length=128",
             "trainer.total_steps=3", "trainer.val_freq=3", "trainer.save_freq=0", f"trainer.run_dir={run}",
             "trainer.progress_bar=false", "trainer.tensorboard=false", "actor.micro_batch_size_per_gpu=4",
             "data.val_batch_size=12", *overrides, timeout=240)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_the_async_schedules_train_on_images(torchrun, vl_folder, tmp_path, mode):
    """colocate_async (generation outliving the step, partial rollout with the images in every chunk) and
    separate_async (rank 1 generating for rank 0: each prompt's images posted once, stored once per group, shipped
    with the group) train 3 steps on rows with 0, 1 and 2 images (an image token without its pixels would stop
    the old log-prob stage)."""
    records = _train(torchrun, vl_folder, tmp_path, f"trainer.mode={mode}")
    assert [r["step"] for r in records if "actor/optimizer_steps" in r] == [1, 2, 3]


@pytest.mark.dist
def test_a_batch_mixing_zero_one_and_two_images_trains_on_two_ranks(torchrun, vl_folder, tmp_path):
    """Rows with 0, 1 and 2 images in every batch, 2 ranks (DP=2), 3 steps with the tower trained: the run
    finishes (FSDP would hang were the ranks' micro-batch counts unequal), every step trains, and
    every step's clear leaves the store empty (the prompt keys holding the images included)."""
    records = _train(torchrun, vl_folder, tmp_path)
    steps = [r for r in records if "actor/optimizer_steps" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["actor/micro_batches"] >= 2 for r in steps)
    assert all(r["store/keys_after_clear"] == 0 for r in steps), "the prompt keys and their images are cleared"
    assert any("val/score/mean" in r for r in records)


def test_vl_tiny_knows_the_format_not_the_answer(vl_folder):
    """Format teaching on grey pictures: at the answer position the four colour names (4 of 136 tokens, 3% of a
    uniform distribution) hold a quarter of the probability or more on average over real pictures, and no colour
    takes half of it (the model has not learned which one)."""
    import torch

    from backends.model.vision import load_vl_checkpoint, packed_vl_inputs
    from protocol.rollout.images import VisionProcessor, load_image_processor, open_images
    from protocol.rollout.tasks import get_task
    from protocol.rollout.tasks.colors import COLORS
    from protocol.rollout.tokenizer import load_tokenizer

    out = vl_folder
    model, tok = load_vl_checkpoint(out), load_tokenizer(out)
    proc = VisionProcessor(load_image_processor(out), tok)
    words = [tok.encode(c)[0] for c in sorted(COLORS)]
    assert all(len(tok.encode(c)) == 1 for c in COLORS), "colour names are whole-word tokens"
    rows = [get_task("colors").make_row(i, random.Random(i)) for i in range(16)]
    mass = []
    for row in rows:
        ids, mm = proc(row["prompt"], open_images(row["images"], "r"), "r")
        seq = torch.tensor(ids)
        pos, extra = packed_vl_inputs(model.vl, [seq], [(mm["pixel_values"], mm["image_grid_thw"])], "cpu")
        with torch.no_grad():
            p = model(seq, pos, torch.tensor([0, len(seq)], dtype=torch.int32), **extra)[-1].softmax(-1)[words]
        assert p.max() < 0.5, p.tolist()
        mass.append(float(p.sum()))
    assert sum(mass) / len(mass) > 0.25, mass
