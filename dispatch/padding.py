"""Padding samples: minimal, tagged trajectories that fill a batch up to the multiple a step needs.

A padding sample has its own uid (``pad-<hex>``, key ``pad-<hex>_0_0``), the tag ``is_padding=True`` and the
smallest legal shape: prompt_len 1, response_len 1, seq_len 2. Its response_mask and loss_mask are 0 and
every score, reward, advantage and log-prob is 0, so it moves no gradient, advantage or metric; it only
evens out sample counts. At most ``multiple - 1`` are ever added.

Example::

    >>> padding_count(13, 8)
    3
    >>> pad = make_padding(2, global_steps=5, seed=0)
    >>> pad.tags[0]["is_padding"], pad.tags[0]["seq_len"], pad.data["response_mask"].values().tolist()
    (True, 2, [0, 0])
"""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from protocol.fields import DENSE_FIELDS, FLOAT_FIELDS, INT_FIELDS
from protocol.store.batching import batch_of
from protocol.store.keys import trajectory_key, trajectory_tag
from protocol.batch.nested import nested_from_lengths

__all__ = [
    "PaddingError",
    "PaddingBatch",
    "PADDING_UID_PREFIX",
    "INT_FIELDS",
    "FLOAT_FIELDS",
    "DENSE_FIELDS",
    "padding_count",
    "make_padding",
    "is_padding_key",
]

PADDING_UID_PREFIX = "pad-"
_LEN = {"prompt": 1, "response": 1, "seq": 2}


class PaddingError(ValueError):
    """A bad padding request (negative count, unknown field, bad multiple)."""


@dataclass
class PaddingBatch:
    """Keys, tags and field values of ``len(keys)`` padding samples, ready for ``store.kv_batch_put``."""

    keys: list[str]
    tags: list[dict[str, Any]]
    data: TensorDict

    def __len__(self) -> int:
        return len(self.keys)


def padding_count(num_samples: int, multiple: int) -> int:
    """How many padding samples bring ``num_samples`` up to a multiple of ``multiple`` (0 .. multiple-1)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise PaddingError(f"num_samples must be a non-negative int, got {num_samples!r}")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise PaddingError(f"multiple must be a positive int, got {multiple!r}")
    return -num_samples % multiple


def is_padding_key(key: str) -> bool:
    """True for keys made by :func:`make_padding`."""
    return isinstance(key, str) and key.startswith(PADDING_UID_PREFIX)


def _jagged(count: int, length: int, fill: torch.Tensor) -> torch.Tensor:
    values = fill.repeat(count) if fill.numel() == length else fill.new_zeros(count * length)
    return nested_from_lengths(values, np.full(count, length, dtype=np.int64))


def make_padding(count: int, *, global_steps: int = 0, pad_token_id: int = 0,
                 fields: Sequence[str] | None = None, seed: int | None = None) -> PaddingBatch:
    """``count`` padding samples: keys ``pad-<hex>_0_0`` (own uid each), tags and jagged/dense fields.

    ``fields`` chooses which fields to build (default: all of :data:`INT_FIELDS` and :data:`FLOAT_FIELDS`;
    :data:`DENSE_FIELDS` ``reward_score`` (0.0) and ``is_padding`` (True) on request). ``seed`` makes the uids
    reproducible. ``input_ids`` = prompt ⧺ response = ``[pad, pad]``, ``position_ids`` = ``[0, 1]``.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise PaddingError(f"count must be a non-negative int, got {count!r}")
    names = list(INT_FIELDS) + list(FLOAT_FIELDS) if fields is None else list(fields)
    known = set(INT_FIELDS) | set(FLOAT_FIELDS) | set(DENSE_FIELDS)
    unknown = [f for f in names if f not in known]
    if unknown:
        raise PaddingError(f"make_padding cannot build fields {unknown}; known fields: {sorted(known)}")
    rng = random.Random(seed) if seed is not None else None
    keys, tags = [], []
    for _ in range(count):
        hexid = uuid.UUID(int=rng.getrandbits(128), version=4).hex if rng else uuid.uuid4().hex
        keys.append(trajectory_key(PADDING_UID_PREFIX + hexid, 0, 0))
        tags.append(trajectory_tag(1, 1, global_steps, is_padding=True))
    data: dict[str, torch.Tensor] = {}
    for name in names:
        if name in INT_FIELDS:
            kind = INT_FIELDS[name]
            n = _LEN[kind]
            if name in ("prompts", "responses", "input_ids"):
                fill = torch.full((n,), pad_token_id, dtype=torch.int64)
            elif name == "position_ids":
                fill = torch.arange(n, dtype=torch.int64)
            else:  # masks: 0 = not a policy token
                fill = torch.zeros(n, dtype=torch.int64)
            data[name] = _jagged(count, n, fill)
        elif name in FLOAT_FIELDS:
            data[name] = _jagged(count, 1, torch.zeros(1, dtype=torch.float32))
        elif name == "reward_score":
            data[name] = torch.zeros(count, dtype=torch.float32)
        else:
            data[name] = torch.ones(count, dtype=torch.bool)
    return PaddingBatch(keys=keys, tags=tags, data=batch_of(data, count))
