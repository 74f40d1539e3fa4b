"""Post-processing: turn a prompt group's AgentLoopOutputs into trajectory keys, jagged fields and tags.

Per output ``index`` of session ``session_id`` of group ``uid`` the key is ``{uid}_{session_id}_{index}`` and the
fields are (jagged = one variable-length row per trajectory, ``torch.jagged`` layout):

======================== ======= =============== =====================================================
field                    dtype   length          value
======================== ======= =============== =====================================================
prompts                  int64   prompt_len      prompt token ids
responses                int64   response_len    response token ids (generations and observations)
input_ids                int64   seq_len         prompts ⧺ responses
position_ids             int64   seq_len         0 .. seq_len - 1
response_mask            int64   response_len    1 = policy token, 0 = observation
loss_mask                int64   response_len    = response_mask
rollout_log_probs        float32 response_len    sampling log-probs (only when every output has them)
reward_score             float32 dense [n]       environment score (only when every output has one)
multi_modal_inputs.NAME  any     first dim varies processor tensor NAME (only when every output has it)
======================== ======= =============== =====================================================

Tags: :func:`protocol.store.keys.trajectory_tag` plus ``num_turns`` and ``truncated`` (from ``extra_fields``).
A field present on some outputs of a batch and absent on others is an error, never silently dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from protocol.store.keys import check_uid, trajectory_key, trajectory_tag
from protocol.batch.nested import to_nested

if TYPE_CHECKING:  # runtime import would be circular (agent_loop.group imports this module)
    from protocol.rollout.agent_loop.output import AgentLoopOutput

__all__ = ["MULTI_MODAL_PREFIX", "PostprocessError", "TrajectoryBatch", "outputs_to_fields", "outputs_to_rows",
           "postprocess_group"]


#: Field-name prefix of the processor tensors of multimodal prompts (``multi_modal_inputs.pixel_values``, ...).
MULTI_MODAL_PREFIX = "multi_modal_inputs."


class PostprocessError(ValueError):
    """Outputs that cannot be written as one batch (inconsistent optional fields, bad session ids)."""


@dataclass
class TrajectoryBatch:
    """What one ``kv_batch_put`` writes: ``keys``, their per-key field ``rows`` and ``tags``.

    ``rows`` maps a jagged field to one tensor per key and a dense field to a ``[len(keys)]`` tensor: the store
    keeps a value per key, so the put cuts nothing. ``fields`` is the same batch as a TensorDict of jagged tensors.
    """

    keys: list[str]
    rows: dict[str, Any] | None
    tags: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def fields(self) -> TensorDict | None:
        return None if self.rows is None else _as_tensordict(self.rows, len(self.keys))


def _all_or_none(outputs: Sequence["AgentLoopOutput"], attr: str) -> bool:
    have = [getattr(o, attr) is not None for o in outputs]
    if any(have) and not all(have):
        missing = [i for i, h in enumerate(have) if not h]
        raise PostprocessError(f"{attr} is set on {sum(have)} of {len(have)} outputs but missing on outputs "
                               f"{missing[:5]}; it must be set on all outputs of a batch or on none")
    return bool(have) and all(have)


def _as_tensordict(rows: Mapping[str, Any], n: int) -> TensorDict:
    return TensorDict({k: v if isinstance(v, torch.Tensor) else to_nested(v) for k, v in rows.items()},
                      batch_size=[n])


def outputs_to_rows(outputs: Sequence["AgentLoopOutput"]) -> dict[str, Any]:
    """The trajectory fields of ``outputs`` (see the module table): a list of per-output tensors for each jagged
    field, a ``[len(outputs)]`` tensor for ``reward_score``. No nested tensor is built: writing rows costs no cut."""
    outputs = list(outputs)
    if not outputs:
        raise PostprocessError("post-processing needs at least one AgentLoopOutput, got none")
    prompts = [o.prompt_ids for o in outputs]
    responses = [o.response_ids for o in outputs]
    masks = [o.response_mask for o in outputs]
    input_ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    # views of one numpy arange: torch.from_numpy of a numpy slice costs less than slicing a tensor
    positions = np.arange(max(map(torch.Tensor.numel, input_ids)), dtype=np.int64)
    rows: dict[str, Any] = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "position_ids": [torch.from_numpy(positions[:x.numel()]) for x in input_ids],
        "response_mask": masks,
        "loss_mask": list(masks),  # the store copies each value: loss_mask never shares memory with response_mask
    }
    if _all_or_none(outputs, "response_logprobs"):
        rows["rollout_log_probs"] = [o.response_logprobs for o in outputs]
    if _all_or_none(outputs, "reward_score"):
        rows["reward_score"] = torch.tensor([o.reward_score for o in outputs], dtype=torch.float32)
    if _all_or_none(outputs, "multi_modal_inputs"):
        names = sorted(outputs[0].multi_modal_inputs)
        for i, o in enumerate(outputs):
            if sorted(o.multi_modal_inputs) != names:
                raise PostprocessError(f"multi_modal_inputs of output {i} has keys {sorted(o.multi_modal_inputs)}, "
                                       f"output 0 has {names}; they must match")
        for k in names:  # flat names: the store keeps one level of fields
            values = [o.multi_modal_inputs[k] for o in outputs]
            to_nested(values)  # same dtype and trailing dims, checked here rather than at the first read
            rows[f"{MULTI_MODAL_PREFIX}{k}"] = values
    return rows


def outputs_to_fields(outputs: Sequence["AgentLoopOutput"]) -> TensorDict:
    """The jagged trajectory fields of ``outputs`` as a TensorDict (batch dim = len(outputs)); see the module table."""
    outputs = list(outputs)
    return _as_tensordict(outputs_to_rows(outputs), len(outputs))


def _tag(o: "AgentLoopOutput", global_steps: int) -> dict[str, Any]:
    extra = o.extra_fields
    tag = trajectory_tag(o.prompt_len, o.response_len, global_steps,
                         extra.get("min_global_steps"), extra.get("max_global_steps"))
    tag["num_turns"] = int(o.num_turns)
    tag["truncated"] = bool(extra.get("truncated", False))
    return tag


def postprocess_group(uid: str, session_outputs: Mapping[int, Sequence["AgentLoopOutput"]],
                      global_steps: int) -> TrajectoryBatch:
    """Keys ``{uid}_{session}_{index}``, fields and tags of every output of every session of group ``uid``.

    ``session_outputs`` maps session_id -> the list that session returned (sessions in ascending order in the
    result). A group with no outputs gives an empty batch (``fields=None``).
    """
    check_uid(uid)
    keys, tags, flat = [], [], []
    for session_id in sorted(session_outputs):
        if isinstance(session_id, bool) or not isinstance(session_id, int) or session_id < 0:
            raise PostprocessError(f"session ids must be non-negative ints, got {session_id!r} for group {uid!r}")
        for index, out in enumerate(session_outputs[session_id]):
            if not hasattr(out, "response_mask") or not hasattr(out, "prompt_ids"):
                raise PostprocessError(f"session {session_id} of group {uid!r} returned {type(out).__name__} at "
                                       f"index {index}; expected AgentLoopOutput")
            keys.append(trajectory_key(uid, session_id, index))
            tags.append(_tag(out, global_steps))
            flat.append(out)
    return TrajectoryBatch(keys, outputs_to_rows(flat) if flat else None, tags)
