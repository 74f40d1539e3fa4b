"""The one trajectory field schema: every store field's dtype, length kind, layout and producing stage.

Invariants, padding samples, the store bridge and both engines read this table instead of spelling field lists
of their own. Length kinds: ``prompt`` (prompt_len), ``response`` (response_len, observation tokens included),
``seq`` (seq_len = prompt_len + response_len) for per-token fields, stored jagged; ``sample`` for one value per
trajectory, stored dense.

    >>> FIELDS["advantages"].length, FIELDS["advantages"].producer, FIELDS["advantages"].jagged
    ('response', 'advantage', True)
    >>> names(length="seq")
    ('input_ids', 'position_ids')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "Field", "FIELDS", "LengthKind", "Stage", "names",
    "PROMPT_FIELDS", "SEQUENCE_FIELDS", "RESPONSE_FIELDS", "MASK_FIELDS", "MASKED_ZERO_FIELDS", "DENSE_FIELDS",
    "INT_FIELDS", "FLOAT_FIELDS", "INFER_INPUT_FIELDS", "TRAIN_INPUT_FIELDS", "PIXEL_VALUES", "IMAGE_GRID_THW",
    "PROMPT_IMAGE_FIELDS",
]

LengthKind = Literal["prompt", "response", "seq", "sample"]
Stage = Literal["rollout", "dispatch", "reward", "judge", "old_log_prob", "ref", "reward_model", "advantage",
                "critic"]


@dataclass(frozen=True)
class Field:
    """One trajectory field: how it is stored and which stage writes it."""

    name: str
    dtype: torch.dtype
    length: LengthKind
    producer: Stage
    mask: bool = False  # 1 = policy token, 0 = observation / padding
    masked_zero: bool = False  # must be 0 wherever response_mask is 0

    @property
    def jagged(self) -> bool:
        """Per-token fields are stored as jagged (nested) tensors; per-sample fields dense."""
        return self.length != "sample"


_I, _F = torch.int64, torch.float32
FIELDS: dict[str, Field] = {f.name: f for f in (
    Field("prompts", _I, "prompt", "rollout"),
    Field("responses", _I, "response", "rollout"),
    Field("input_ids", _I, "seq", "rollout"),
    Field("position_ids", _I, "seq", "rollout"),
    Field("response_mask", _I, "response", "rollout", mask=True),
    Field("loss_mask", _I, "response", "rollout", mask=True),
    Field("rollout_log_probs", _F, "response", "rollout"),
    Field("reward_score", _F, "sample", "rollout"),
    Field("is_padding", torch.bool, "sample", "dispatch"),
    Field("rm_scores", _F, "response", "reward", masked_zero=True),
    Field("rm_judge_scores", _F, "response", "judge", masked_zero=True),
    Field("rm_model_scores", _F, "response", "reward_model", masked_zero=True),
    Field("old_log_probs", _F, "response", "old_log_prob"),
    Field("entropy", _F, "response", "old_log_prob"),
    Field("ref_log_prob", _F, "response", "ref"),
    Field("token_level_scores", _F, "response", "advantage", masked_zero=True),
    Field("token_level_rewards", _F, "response", "advantage", masked_zero=True),
    Field("advantages", _F, "response", "advantage", masked_zero=True),
    Field("returns", _F, "response", "advantage", masked_zero=True),
    Field("values", _F, "response", "critic", masked_zero=True),
)}


def names(*, length: LengthKind | None = None, dtype: torch.dtype | None = None, jagged: bool | None = None,
          mask: bool | None = None, masked_zero: bool | None = None) -> tuple[str, ...]:
    """Field names matching every given attribute, in schema order."""
    return tuple(f.name for f in FIELDS.values()
                 if (length is None or f.length == length) and (dtype is None or f.dtype == dtype)
                 and (jagged is None or f.jagged == jagged) and (mask is None or f.mask == mask)
                 and (masked_zero is None or f.masked_zero == masked_zero))


PROMPT_FIELDS = names(length="prompt")
SEQUENCE_FIELDS = names(length="seq")
RESPONSE_FIELDS = names(length="response")
MASK_FIELDS = names(mask=True)
MASKED_ZERO_FIELDS = names(masked_zero=True)
DENSE_FIELDS = names(jagged=False)
#: integer per-token fields -> their length kind (what a padding sample must carry to enter an engine)
INT_FIELDS: dict[str, LengthKind] = {n: FIELDS[n].length for n in names(dtype=torch.int64, jagged=True)}
FLOAT_FIELDS = names(dtype=torch.float32, jagged=True)
#: what an engine reads to compute log-probs, and additionally to train
INFER_INPUT_FIELDS: tuple[str, ...] = ("input_ids", "response_mask")
TRAIN_INPUT_FIELDS: tuple[str, ...] = (*INFER_INPUT_FIELDS, "old_log_probs", "advantages")
#: a vision-language prompt's images, stored once on its prompt key ``{uid}`` (not per trajectory) and handed to an
#: engine per sample: the patches flattened ([N * patch_dim], float32) and the images' (t, h, w) flattened ([k * 3],
#: int64), the image processor's ``pixel_values`` / ``image_grid_thw``
PIXEL_VALUES, IMAGE_GRID_THW = "multi_modal_inputs.pixel_values", "multi_modal_inputs.image_grid_thw"
PROMPT_IMAGE_FIELDS: tuple[str, ...] = (PIXEL_VALUES, IMAGE_GRID_THW)
