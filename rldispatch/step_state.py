"""What one step's stages hand each other besides the KVBatchMeta (the trainer and its schedule both read it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from protocol.store.meta import KVBatchMeta
from rldispatch.metrics import ComputeClock, StepStats
from rldispatch.plan import StepPlan

__all__ = ["StepState"]


@dataclass
class StepState:
    """What one step's stages hand each other besides the KVBatchMeta: its prompts, plan, this rank's keys, metrics."""

    step: int
    prompts: tuple[list[dict], list[str]] = ((), ())  # (rows, uids) the step submitted (the schedule's generate)
    metrics: dict[str, float] = field(default_factory=dict)
    stats: StepStats = field(default_factory=StepStats)  # cross-rank metrics, reduced once in _finish
    times: dict[str, float] = field(default_factory=dict)
    compute: ComputeClock = field(default_factory=ComputeClock)  # this rank's inference / update compute
    sampled: KVBatchMeta | None = None  # the replay buffer's batch (real trajectories)
    plan: StepPlan | None = None
    own: list[str] = field(default_factory=list)  # trajectories generated on this rank (and padding on rank 0)
    owners: list[list[str]] = field(default_factory=list)  # ``own`` of every rank (index = store rank)
    own_pad: torch.Tensor | None = None
    mine: KVBatchMeta | None = None  # this DP rank's share for inference
    infer_inputs: TensorDict | None = None
    #: this rank's own responses / masks and their RewardInputs, read once by the reward stage (the judge's too)
    reward_inputs: tuple[TensorDict, list] | None = None

    @property
    def rows(self) -> list[dict]:
        return self.prompts[0]

    @property
    def uids(self) -> list[str]:
        return self.prompts[1]
