"""AgentLoopOutput: what one rollout session returns for one trajectory, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from protocol.checks import INT, NUMBER, only_types

__all__ = ["AgentLoopOutput", "AgentLoopOutputError"]


class AgentLoopOutputError(ValueError):
    """An AgentLoopOutput whose fields are missing, of the wrong type, or of unequal lengths."""


def non_ints(values: list) -> list:
    """The items of ``values`` that are not ints (bools are not), most often none, found in one pass."""
    if only_types(values, INT):
        return []
    return [v for v in values if isinstance(v, bool) or not isinstance(v, int)]


def _as_list(name: str, value: Any, what: str) -> list:
    if type(value) is list:
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise AgentLoopOutputError(f"AgentLoopOutput.{name} must be a list of {what} or a 1-D tensor, "
                                   f"got {type(value).__name__}")
    return list(value)


def _as_ids(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise AgentLoopOutputError(f"AgentLoopOutput.{name} must be 1-D, got shape {tuple(value.shape)}")
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise AgentLoopOutputError(f"AgentLoopOutput.{name} must hold integers, got dtype {value.dtype}")
        return value.detach().to("cpu", torch.int64)
    value = _as_list(name, value, "ints")
    if not only_types(value, INT):  # what generators return passes in one pass
        bad = non_ints(value)
        if bad:
            raise AgentLoopOutputError(f"AgentLoopOutput.{name} must hold ints, found {bad[:3]!r}")
        value = [int(v) for v in value]  # int subclasses (IntEnum) as plain ints
    try:  # through numpy: a few times cheaper than torch.tensor for the short lists of one trajectory
        return torch.from_numpy(np.fromiter(value, dtype=np.int64, count=len(value)))
    except OverflowError:
        raise AgentLoopOutputError(f"AgentLoopOutput.{name} holds an int outside int64") from None


def _token_lists(prompt_ids: Any, response_ids: Any, response_mask: Any
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The three id lists of a trajectory, when all are lists of plain ints and the mask is 0/1, as int64 views of
    one array (one type check and one conversion instead of three); None: the per-field path decides (and names
    the problem)."""
    if type(prompt_ids) is not list or type(response_ids) is not list or type(response_mask) is not list:
        return None
    ids = prompt_ids + response_ids + response_mask
    if not only_types(ids, INT) or not set(response_mask) <= {0, 1}:
        return None
    try:
        values = np.array(ids, dtype=np.int64)
    except OverflowError:
        return None
    p, r = len(prompt_ids), len(prompt_ids) + len(response_ids)
    return torch.from_numpy(values[:p]), torch.from_numpy(values[p:r]), torch.from_numpy(values[r:])


def _as_floats(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise AgentLoopOutputError(f"AgentLoopOutput.{name} must be 1-D, got shape {tuple(value.shape)}")
        return value.detach().to("cpu", torch.float32)
    value = _as_list(name, value, "floats")
    if only_types(value, NUMBER):
        return torch.from_numpy(np.fromiter(value, dtype=np.float32, count=len(value)))
    try:
        return torch.tensor([float(v) for v in value], dtype=torch.float32)
    except (TypeError, ValueError):
        raise AgentLoopOutputError(f"AgentLoopOutput.{name} must hold numbers") from None


@dataclass
class AgentLoopOutput:
    """One trajectory of a session: the prompt, the response and which response tokens the policy produced.

    * ``prompt_ids`` – the tokenized prompt (``prompt_len >= 1``: the first response token's log-prob comes from
      the logits at the last prompt position);
    * ``response_ids`` – everything after the prompt: policy generations and tool observations;
    * ``response_mask`` – 1 where the policy generated the token, 0 for observations (same length);
    * ``response_logprobs`` – optional sampling log-probs, same length (0 on observation tokens);
    * ``reward_score`` – optional trajectory score from the environment;
    * ``num_turns`` – chat turns in the trajectory (user + assistant + tool; 2 for a single turn);
    * ``extra_fields`` – anything else (truncation report, tool errors, ``min_global_steps`` /
      ``max_global_steps`` for partial rollouts);
    * ``multi_modal_inputs`` – optional processor tensors of the prompt (name -> tensor, first dim varies).

    Lists are converted to CPU tensors (int64 ids and mask, float32 log-probs) at construction.
    """

    prompt_ids: Any
    response_ids: Any
    response_mask: Any
    response_logprobs: Any = None
    reward_score: float | None = None
    num_turns: int = 2
    extra_fields: dict[str, Any] = field(default_factory=dict)
    multi_modal_inputs: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        lists = _token_lists(self.prompt_ids, self.response_ids, self.response_mask)
        if lists is not None:  # the common case: a generator's lists, checked and converted together
            self.prompt_ids, self.response_ids, self.response_mask = lists
            binary = True
        else:
            self.prompt_ids = _as_ids("prompt_ids", self.prompt_ids)
            self.response_ids = _as_ids("response_ids", self.response_ids)
            # a list mask is checked for 0/1 before it becomes a tensor (a set of its values, not four tensor ops)
            binary = type(self.response_mask) is list and set(self.response_mask) <= {0, 1}
            self.response_mask = _as_ids("response_mask", self.response_mask)
        if self.prompt_ids.numel() < 1:
            raise AgentLoopOutputError("AgentLoopOutput.prompt_ids is empty; a trajectory needs prompt_len >= 1")
        n = self.response_ids.numel()
        if self.response_mask.numel() != n:
            raise AgentLoopOutputError(f"AgentLoopOutput.response_mask has {self.response_mask.numel()} entries, "
                                       f"response_ids has {n}; they must be equal")
        if n and not binary and not bool(((self.response_mask == 0) | (self.response_mask == 1)).all()):
            raise AgentLoopOutputError("AgentLoopOutput.response_mask must hold only 0 and 1, got values "
                                       f"{sorted(set(self.response_mask.tolist()))}")
        if self.response_logprobs is not None:
            self.response_logprobs = _as_floats("response_logprobs", self.response_logprobs)
            if self.response_logprobs.numel() != n:
                raise AgentLoopOutputError(f"AgentLoopOutput.response_logprobs has {self.response_logprobs.numel()} "
                                           f"entries, response_ids has {n}; they must be equal")
        if self.reward_score is not None:
            if isinstance(self.reward_score, torch.Tensor) and self.reward_score.numel() == 1:
                self.reward_score = self.reward_score.item()
            if isinstance(self.reward_score, bool) or not isinstance(self.reward_score, (int, float)):
                raise AgentLoopOutputError(f"AgentLoopOutput.reward_score must be a number or None, "
                                           f"got {type(self.reward_score).__name__}")
            if not math.isfinite(float(self.reward_score)):
                raise AgentLoopOutputError(f"AgentLoopOutput.reward_score must be finite, got {self.reward_score}")
            self.reward_score = float(self.reward_score)
        if isinstance(self.num_turns, bool) or not isinstance(self.num_turns, int) or self.num_turns < 0:
            raise AgentLoopOutputError(f"AgentLoopOutput.num_turns must be a non-negative int, got {self.num_turns!r}")
        if not isinstance(self.extra_fields, dict):
            raise AgentLoopOutputError(f"AgentLoopOutput.extra_fields must be a dict, "
                                       f"got {type(self.extra_fields).__name__}")
        if self.multi_modal_inputs is not None:
            if not isinstance(self.multi_modal_inputs, dict) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() >= 1
                    for k, v in self.multi_modal_inputs.items()):
                raise AgentLoopOutputError("AgentLoopOutput.multi_modal_inputs must map str to tensors with >= 1 dim")

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return int(self.prompt_ids.numel())

    @property
    def response_len(self) -> int:
        """Number of response tokens (policy and observation)."""
        return int(self.response_ids.numel())

    @property
    def seq_len(self) -> int:
        """``prompt_len + response_len``."""
        return self.prompt_len + self.response_len

    @property
    def policy_len(self) -> int:
        """Number of policy-generated tokens (``response_mask.sum()``)."""
        return int(self.response_mask.sum())
