"""Images of a dataset row, as a vision-language policy reads them: the row's ``images`` column opened (bytes, a
path, or the ``{"bytes", "path"}`` records Hugging Face datasets write), the ``<image>`` placeholders of its prompt
turned into the model's vision tokens, and each image's run of image tokens sized by its patch grid.

The pixels come from transformers' image processor of the model family (for Qwen2-VL: resized to multiples of
``patch_size * merge_size``, normalised, cut into patches in merge-block order): ``pixel_values`` [patches,
``C * T * P * P``] and ``image_grid_thw`` [images, 3]. Image ``i`` then fills ``t * h * w / merge²`` image tokens.

Example::

    >>> expand_image_tokens([7, 9, 8, 9, 8], pad_id=9, counts=[2, 3])
    [7, 9, 9, 8, 9, 9, 9, 8]
"""
from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ImageError", "IMAGE_PLACEHOLDER", "open_image", "open_images", "count_placeholders",
           "replace_placeholders", "image_token_counts", "expand_image_tokens", "VisionProcessor",
           "load_image_processor"]

#: how a verl-format prompt marks where an image goes
IMAGE_PLACEHOLDER = "<image>"


class ImageError(ValueError):
    """An image that cannot be read, or a row whose images and placeholders disagree; the message names the file
    (or the column entry) and the row."""


def open_image(item: Any, where: str) -> Any:
    """One ``images`` entry as an RGB ``PIL.Image``: encoded bytes, a file path, a ``{"bytes", "path"}`` record
    (bytes first), or an image already opened."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    source: Any = item
    if isinstance(item, Mapping):
        source = item.get("bytes") or item.get("path")
        if source is None:
            raise ImageError(f"{where}: an images entry with neither 'bytes' nor 'path' ({sorted(item)})")
    try:
        if isinstance(source, (bytes, bytearray)):
            with Image.open(io.BytesIO(source)) as img:
                return img.convert("RGB")
        if isinstance(source, (str, os.PathLike)):
            if not os.path.isfile(source):
                raise ImageError(f"{where}: image file {os.fspath(source)!r} not found")
            with Image.open(source) as img:
                return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        what = f"file {os.fspath(source)!r}" if isinstance(source, (str, os.PathLike)) else \
            f"{len(source)} bytes"
        raise ImageError(f"{where}: the image ({what}) cannot be read: {exc}") from exc
    raise ImageError(f"{where}: an images entry must be bytes, a path or a {{'bytes', 'path'}} record, got "
                     f"{type(item).__name__}")


def open_images(entries: Any, where: str) -> list[Any]:
    """Every image of a row's ``images`` column (a list of entries, one entry, or None: no image), opened; an error
    names ``where`` (the file and row) and the entry."""
    if entries is None:
        return []
    if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Sequence):
        entries = [entries]
    return [open_image(item, f"{where}, images[{i}]") for i, item in enumerate(entries)]


def count_placeholders(prompt: Any) -> int:
    """How many ``<image>`` a prompt (a string or chat messages with string contents) holds."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in prompt)


def replace_placeholders(prompt: Any, vision: str, images: int, where: str) -> Any:
    """The prompt with each ``<image>`` replaced by ``vision`` (the model's vision-start, image-pad, vision-end
    text); the placeholders must be as many as the row's images."""
    found = count_placeholders(prompt)
    if found != images:
        raise ImageError(f"{where}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) for {images} image(s)")
    if isinstance(prompt, str):
        return prompt.replace(IMAGE_PLACEHOLDER, vision)
    return [{**m, "content": str(m.get("content", "")).replace(IMAGE_PLACEHOLDER, vision)} for m in prompt]


def image_token_counts(grid_thw: Any, merge: int) -> list[int]:
    """Image tokens of each image: ``t * h * w / merge²`` of its patch grid."""
    return [int(t) * int(h) * int(w) // merge ** 2 for t, h, w in (grid_thw.tolist() if hasattr(grid_thw, "tolist")
                                                                    else grid_thw)]


def expand_image_tokens(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """``ids`` with the i-th image-pad token repeated ``counts[i]`` times; as many pads as images are needed."""
    pads = sum(1 for t in ids if t == pad_id)
    if pads != len(counts):
        raise ImageError(f"the tokenized prompt has {pads} image-pad token(s) for {len(counts)} image(s)")
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out.extend([t] * next(it) if t == pad_id else [t])
    return out


class VisionProcessor:
    """A row's prompt and images as a Qwen2-VL-family policy reads them: ``__call__(messages, images, where)`` gives
    the prompt's token ids (``<image>`` placeholders as vision-start, one image-pad run per image, vision-end, in
    the tokenizer's chat template) and ``{"pixel_values", "image_grid_thw"}`` from the model family's image
    processor (transformers'; ``merge_size`` read from it)."""

    def __init__(self, image_processor: Any, tokenizer: Any, *, vision_start: str = "<|vision_start|>",
                 image_pad: str = "<|image_pad|>", vision_end: str = "<|vision_end|>") -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.vision_text = vision_start + image_pad + vision_end
        ids = tokenizer.encode(image_pad)
        if len(ids) != 1:
            raise ImageError(f"the tokenizer reads {image_pad!r} as {len(ids)} tokens; the vision tokens must be "
                             "special tokens of the policy's tokenizer")
        self.pad_id = ids[0]
        if not isinstance(getattr(image_processor, "merge_size", None), int):
            raise ImageError(f"the image processor {type(image_processor).__name__} has no merge_size; a "
                             "Qwen2-VL-family image processor says how many patches one image token merges")
        self.merge = image_processor.merge_size

    def __call__(self, messages: Any, images: Sequence[Any], where: str) -> tuple[list[int], dict[str, Any]]:
        msgs = replace_placeholders(messages, self.vision_text, len(images), where)
        ids = list(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
        if not images:
            return ids, {}
        out = self.image_processor(images=list(images), return_tensors="pt")
        inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        return expand_image_tokens(ids, self.pad_id, image_token_counts(inputs["image_grid_thw"], self.merge)), inputs


def load_image_processor(path: str) -> Any:
    """The Qwen2-VL-family image processor saved in folder ``path`` (``preprocessor_config.json``), read with
    transformers' PIL implementation (its fast one needs torchvision); nothing is downloaded."""
    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        raise ImageError(f"{path} has no preprocessor_config.json: a vision-language policy's folder carries its "
                         "image processor")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(path)
