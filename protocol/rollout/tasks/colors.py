"""``colors``: a task only the image answers. Each picture is split (vertically or horizontally) between two
colours; the prompt names both in a random order and asks which fills more of it. The text is the same for every
answer, so a policy that does not read the image scores 0.5 at best; ``blank=True`` draws the same rows with grey
pictures (the control that shows the image matters).

Rows carry the picture as PNG bytes in an ``images`` column (the ``{"bytes", "path"}`` record Hugging Face
datasets write) and an ``<image>`` placeholder in the prompt. The score is 1 when the response (special tokens kept,
one final eos removed) is the answer's colour name, else 0 (a verifiable reward, as the strict GSM8K rule).
A policy blind to the picture scores 0.5 at best (naming one of the two colours); string credit towards the
answer, as the other tasks give, would pay a policy that always names the same colour about half as much as one
that reads the picture, and a small policy settles there (docs/multimodal.md).
"""
from __future__ import annotations

import io
import random
from dataclasses import dataclass
from typing import Any

from protocol.rollout.tasks.base import Task, TaskError, TaskExample, register_task
from protocol.rollout.tasks.strings import normalize_response

__all__ = ["ColorsTask", "BlankColorsTask", "COLORS", "picture"]

#: the colours a picture uses, by name
COLORS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60),
                                           "yellow": (230, 210, 40)}
_GREY = (128, 128, 128)


def picture(size: int, first: str, second: str, share: int, vertical: bool, blank: bool = False) -> bytes:
    """PNG bytes of a ``size x size`` picture: ``share`` of its rows (or columns) in ``first``, the rest in
    ``second`` (all grey when ``blank``)."""
    from PIL import Image

    img = Image.new("RGB", (size, size), _GREY if blank else COLORS[second])
    if not blank:
        box = (0, 0, share, size) if vertical else (0, 0, size, share)
        img.paste(COLORS[first], box)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@register_task("colors")
@dataclass
class ColorsTask(Task):
    """``<image> Which colour fills more of the picture, red or blue?`` -> ``red``. ``size``: the picture's side in
    pixels; the larger colour covers 60-85% of it."""

    size: int = 28
    blank: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 8:
            raise TaskError(f"colors: size must be an int >= 8 (pixels), got {self.size!r}")

    def sample(self, rng: random.Random) -> TaskExample:
        first, second = rng.sample(sorted(COLORS), 2)
        share = rng.randint(round(0.6 * self.size), round(0.85 * self.size))
        if rng.random() < 0.5:  # the smaller colour painted first half of the time: position says nothing
            share = self.size - share
        larger = first if share * 2 > self.size else second
        vertical = rng.random() < 0.5
        named = [first, second] if rng.random() < 0.5 else [second, first]
        prompt = f"<image> Which colour fills more of the picture, {named[0]} or {named[1]}?"
        return TaskExample(prompt, larger, {"picture": picture(self.size, first, second, share, vertical,
                                                              self.blank)})

    def make_row(self, index: int, rng: random.Random, split: str = "train") -> dict[str, Any]:
        ex = self.sample(rng)
        return {
            "prompt": self.messages(ex),
            "data_source": self.name,
            "images": [{"bytes": ex.params["picture"], "path": None}],
            "extra_info": {"index": int(index), "split": split, "ground_truth": ex.ground_truth},
            "reward_model": {"style": "rule", "ground_truth": ex.ground_truth},
        }

    def score(self, response_text: str, ground_truth: str, extra_info: dict | None = None) -> float:
        if ground_truth not in COLORS:
            raise TaskError(f"colors: ground truth {ground_truth!r} is not one of {sorted(COLORS)}")
        return 1.0 if normalize_response(response_text) == ground_truth else 0.0


@register_task("colors_blank")
@dataclass
class BlankColorsTask(ColorsTask):
    """``colors`` with every picture grey: the same prompts and answers, nothing in the image to read (the control
    run of a vision-language policy: it cannot beat choosing one of the two named colours, 0.5)."""

    blank: bool = True
