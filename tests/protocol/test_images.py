"""A row's images: opened from every form a verl-format parquet holds them in, named errors for bad ones, and the
image tokens sized as transformers' Qwen2-VL processor sizes them from its image processor's grids."""
from __future__ import annotations

import io
import types

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from protocol.rollout.images import (ImageError, count_placeholders, expand_image_tokens, image_token_counts,
                                     open_image, open_images, replace_placeholders)


def _png(h: int, w: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_images_open_from_bytes_paths_and_records_and_bad_ones_are_named(tmp_path):
    data = _png(5, 7)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    row = {"images": [data, str(path), {"bytes": data, "path": None}, {"bytes": None, "path": str(path)}]}
    images = open_images(row["images"], "train.parquet row 3")
    assert [im.size for im in images] == [(7, 5)] * 4 and all(im.mode == "RGB" for im in images)
    assert np.array_equal(np.asarray(images[0]), np.asarray(images[1]))
    assert open_images(None, "row 0") == []
    with pytest.raises(ImageError, match=r"train.parquet row 3, images\[1\]: image file '.*missing.png' not found"):
        open_images([data, str(tmp_path / "missing.png")], "train.parquet row 3")
    with pytest.raises(ImageError, match=r"row 4, images\[0\]: the image \(5 bytes\) cannot be read"):
        open_images([b"trunc"], "row 4")
    with pytest.raises(ImageError, match="neither 'bytes' nor 'path'"):
        open_image({"bytes": None, "path": None}, "row 5")


def test_placeholders_must_match_the_images():
    msgs = [{"role": "user", "content": "<image> left or <image> right?"}]
    assert count_placeholders(msgs) == 2 and count_placeholders("a <image>") == 1
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert replace_placeholders(msgs, vision, 2, "row 0")[0]["content"] == f"{vision} left or {vision} right?"
    with pytest.raises(ImageError, match=r"row 7: the prompt has 2 <image> placeholder\(s\) for 1 image\(s\)"):
        replace_placeholders(msgs, vision, 1, "row 7")


@given(counts=st.lists(st.integers(1, 6), max_size=4), text=st.lists(st.integers(0, 8), max_size=6))
def test_expansion_repeats_each_pad_by_its_count_and_keeps_the_rest(counts, text):
    pad = 9
    ids = text[: len(text) // 2] + [x for c in counts for x in (pad, 8)] + text[len(text) // 2:]
    out = expand_image_tokens(ids, pad, counts)
    assert [t for t in out if t != pad] == [t for t in ids if t != pad]
    assert sum(t == pad for t in out) == sum(counts)
    runs = [len(r) for r in "".join("p" if t == pad else "." for t in out).split(".") if r]
    assert runs == [c for c in counts]


def test_image_token_counts_are_transformers_processor_counts():
    """transformers' Qwen2-VL image processor (PIL, patch 2, merge 2) gives each image a grid; the image tokens of
    each are what its processor's replace_image_token writes for that grid."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    ip = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=256)
    images = [Image.open(io.BytesIO(_png(h, w, s))) for s, (h, w) in enumerate([(10, 14), (6, 6), (3, 17)])]
    out = ip(images=images, return_tensors="pt")
    grids = out["image_grid_thw"]
    assert out["pixel_values"].shape == (int(grids.prod(-1).sum()), 3 * 2 * 2 * 2)
    theirs = types.SimpleNamespace(image_processor=ip, image_token="P")
    want = [len(Qwen2VLProcessor.replace_image_token(theirs, {"image_grid_thw": grids}, i)) for i in range(3)]
    assert image_token_counts(grids, 2) == want and len(set(want)) > 1
    assert expand_image_tokens([1, 9, 2, 9, 3, 9], 9, want) == \
        [1] + [9] * want[0] + [2] + [9] * want[1] + [3] + [9] * want[2]
    assert torch.equal(grids[:, 0], torch.ones(3, dtype=grids.dtype))  # one frame per image


def _vision_processor(tmp_path):
    import sys
    from pathlib import Path

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    import hf_tiny

    from protocol.rollout.images import VisionProcessor
    from protocol.rollout.tokenizer import load_tokenizer

    hf = hf_tiny.make_chatml_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    hf.save_pretrained(str(tmp_path / "tok"))
    ip = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=256)
    return VisionProcessor(ip, load_tokenizer(str(tmp_path / "tok")))


def test_a_dataset_with_images_is_checked_at_load_and_counts_image_tokens(tmp_path):
    """Rows with images as bytes and as paths, and a row without: lengths count the image tokens, a row comes with
    its prompt ids and processed images; a missing file, an unreadable image and a placeholder count that is not
    the image count each stop the load naming the file and row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from protocol.rollout.dataset import DatasetError, RLHFDataset

    proc = _vision_processor(tmp_path)
    png = _png(10, 14)
    (tmp_path / "b.png").write_bytes(_png(6, 6, seed=1))
    rows = [{"prompt": [{"role": "user", "content": "<image> which colour?"}], "data_source": "d",
             "images": [{"bytes": png, "path": None}]},
            {"prompt": [{"role": "user", "content": "<image> vs <image>"}], "data_source": "d",
             "images": [{"bytes": None, "path": str(tmp_path / "b.png")}, {"bytes": png, "path": None}]},
            {"prompt": [{"role": "user", "content": "no picture"}], "data_source": "d", "images": None}]

    def load(rs, name):
        pq.write_table(pa.Table.from_pylist(rs), tmp_path / name)
        return RLHFDataset(str(tmp_path / name), proc.tokenizer, 512, processor=proc)

    ds = load(rows, "ok.parquet")
    plain = [len(proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": r["prompt"][0]["content"].replace("<image>", proc.vision_text)}])) for r in rows]
    tokens = [int(ds[i]["multi_modal_inputs"]["image_grid_thw"].prod(-1).sum()) // 4 if i < 2 else 0
              for i in range(3)]
    assert ds.prompt_lengths == [p - (1 if i == 0 else 2 if i == 1 else 0) + t
                                 for i, (p, t) in enumerate(zip(plain, tokens))]
    assert [len(ds[i]["prompt_ids"]) for i in range(3)] == ds.prompt_lengths
    assert ds[2]["multi_modal_inputs"] == {}
    bad = [dict(rows[0], images=[{"bytes": None, "path": str(tmp_path / "gone.png")}])]
    with pytest.raises(DatasetError, match=r"bad.parquet: row 0, images\[0\]: image file '.*gone.png' not found"):
        load(bad, "bad.parquet")
    with pytest.raises(DatasetError, match=r"junk.parquet: row 0, images\[0\]: the image \(4 bytes\) cannot be read"):
        load([dict(rows[0], images=[{"bytes": b"junk", "path": None}])], "junk.parquet")
    with pytest.raises(DatasetError, match=r"count.parquet: row 0: the prompt has 1 <image> placeholder\(s\) for 2"):
        load([dict(rows[0], images=[{"bytes": png, "path": None}] * 2)], "count.parquet")


def test_the_colors_task_loads_with_its_pictures(tmp_path):
    """The shipped ``colors`` rows load through a vision processor: one picture each, its image tokens in the
    prompt ids, the prompt's text the same for every answer."""
    from protocol.rollout.dataset import RLHFDataset
    from protocol.rollout.tasks import write_task_data

    proc = _vision_processor(tmp_path)
    paths = write_task_data(tmp_path / "colors", "colors", train=6, val=2, seed=0)
    ds = RLHFDataset(str(paths["train"]), proc.tokenizer, 512, processor=proc)
    for i in range(len(ds)):
        row = ds[i]
        grids = row["multi_modal_inputs"]["image_grid_thw"]
        assert grids.shape == (1, 3)
        assert row["prompt_ids"].count(proc.pad_id) == int(grids.prod()) // 4
