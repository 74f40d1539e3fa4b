"""The ``colors`` task: the picture alone says which colour fills more of it, and the blank control keeps every
prompt and answer while greying the pictures."""
from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from protocol.rollout.tasks import get_task, make_rows
from protocol.rollout.tasks.colors import COLORS


def _pixels(row) -> Counter:
    img = np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB"))
    names = {v: k for k, v in COLORS.items()}
    return Counter(names.get(tuple(int(c) for c in px), "other") for px in img.reshape(-1, 3))


def test_the_picture_alone_gives_the_answer():
    rows = make_rows("colors", 40, seed=3)
    assert rows == make_rows("colors", 40, seed=3)  # seeded
    first_named = 0
    for row in rows:
        counts = _pixels(row)
        answer = row["reward_model"]["ground_truth"]
        assert set(counts) <= set(COLORS) and len(counts) == 2
        assert counts.most_common(1)[0][0] == answer and counts[answer] > 28 * 28 * 0.55
        text = row["prompt"][0]["content"]
        assert text.startswith("<image> ") and all(c in text for c in counts)
        first_named += text.index(answer) < min(text.index(c) for c in counts if c != answer)
    assert 10 <= first_named <= 30, "the answer's place in the prompt says nothing"


def test_blank_pictures_keep_prompts_and_answers():
    rows, blank = make_rows("colors", 20, seed=3), make_rows("colors", 20, seed=3, blank=True)
    for a, b in zip(rows, blank):
        assert a["prompt"] == b["prompt"] and a["reward_model"] == b["reward_model"]
        assert _pixels(b) == Counter({"other": 28 * 28})


def test_scores():
    """1 for the answer's name (one final eos allowed), 0 for anything else: naming the other colour, padding, a
    half-way string."""
    task = get_task("colors")
    assert task.score("red", "red") == 1.0 and task.score("red<|eos|>", "red") == 1.0
    for wrong in ("blue", "red red", "red ", "rd", "", "<|pad|>red"):
        assert task.score(wrong, "red") == 0.0
    with pytest.raises(ValueError, match="not one of"):
        task.score("red", "purple")
