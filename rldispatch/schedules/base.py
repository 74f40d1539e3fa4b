"""What every schedule is: hooks around the one step body, the typed seams it may use, and the registry by
``trainer.mode``.

The step's stages stay the same in every mode; a schedule decides when and where generation runs (the reference
system's V1 ``on_train_begin`` / ``on_step_begin`` / ``on_sample_end`` / ``on_step_end`` split):

* :meth:`Schedule.begin` / :meth:`Schedule.end` – before the first step (warm-up submissions) and at shutdown;
* :meth:`Schedule.generate` – the ``rollout`` stage: what the step submits (and, in sync mode, waits for);
* :meth:`Schedule.sample` – the ``sample`` stage: whole terminal groups from the replay buffer it owns;
* :meth:`Schedule.after_clear` – after the step's keys are cleared;
* :meth:`Schedule.sync_weights` – after the trainer's own rollout engine took the step's new weights;
* :meth:`Schedule.step_metrics`, :meth:`Schedule.state` / :meth:`Schedule.restore` – metrics and checkpoints.

A schedule sees the run only through :class:`Seams`: the prompt stream, the store, this rank's rollout, the actor's
weights and (separate_async) the links of the split world. A new schedule is one module with a
:func:`register_schedule` class; the trainer finds it by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from protocol.store.meta import KVBatchMeta
from protocol.store.replay_buffer import ReplayBuffer
from rldispatch.config import RunConfig
from rldispatch.dataplane import ShardedStore
from rldispatch.prompts import PromptStream
from rldispatch.rollout import TRAIN, LocalRollout
from rldispatch.step_state import StepState

__all__ = ["Seams", "Schedule", "register_schedule", "SCHEDULES"]


@dataclass
class Seams:
    """Everything a schedule may use (typed interfaces; never the trainer)."""

    cfg: RunConfig
    stream: PromptStream
    store: ShardedStore
    rollout: LocalRollout  # this rank's generation (and the trainer's validation)
    actor_weights: Callable[[], dict[str, torch.Tensor]]  # the actor's current full weights
    holders: list[int]  # the rank holding the groups of each DP replica (its reporting rank), in DP order
    link: Any = None  # separate_async: this rank's place in the split world (rldispatch.separate.transport.Split)


class Schedule:
    """The hooks of one ``trainer.mode``; subclasses declare what the mode needs as class attributes."""

    name: ClassVar[str]
    #: the replay buffer's mode: ``sync`` (no staleness: every group is of the step) or ``async`` (staleness, refill)
    replay_mode: ClassVar[str] = "sync"
    #: the default of ``rollout.partial_rollout``
    partial_rollout: ClassVar[bool] = False
    #: whether the world splits into training and rollout ranks (the launch then runs rldispatch.separate)
    splits_world: ClassVar[bool] = False
    #: whether training generation outlives a call on this rank's event loop (validation then leaves it running)
    keeps_generating: ClassVar[bool] = False

    def __init__(self, seams: Seams, step: int):
        self.seams = seams
        cfg = seams.cfg
        self.replay = ReplayBuffer(seams.store, TRAIN, max_off_policy_threshold=cfg.replay.max_off_policy_threshold,
                                   off_policy_strategy=cfg.replay.off_policy_strategy,
                                   failure_policy=cfg.replay.failure_policy, mode=self.replay_mode,
                                   refill=self.refill if self.replay_mode == "async" else None)
        self.generating_s = 0.0  # seconds the step spent generating
        self.waiting_s = 0.0  # seconds the step's trainer waited for trajectories

    def begin(self, step: int) -> None:
        """Before the first step (after the initial validation)."""

    def generate(self, st: StepState) -> None:
        raise NotImplementedError

    def sample(self, st: StepState, batch_size: int) -> KVBatchMeta:
        raise NotImplementedError

    def refill(self, count: int) -> None:
        """The replay buffer evicted ``count`` groups (async replay only)."""

    def after_clear(self, st: StepState) -> None:
        """After the step's keys are cleared: its prompts are done with."""
        self.seams.stream.forget(st.uids)

    def sync_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The step's new weights (version ``version``), already loaded into this rank's rollout engine."""

    def step_metrics(self, st: StepState, seconds: float) -> dict[str, float]:
        """Idle times of the step (the trainer waiting for trajectories, the rollout not generating) and the
        sampled trajectories' version spans."""
        out = {"timing_s/trainer_idle": self.waiting_s,
               "timing_s/rollout_idle": max(seconds - self.generating_s, 0.0)}
        self.generating_s = self.waiting_s = 0.0
        spans = [int(t["max_global_steps"]) - int(t["min_global_steps"]) + 1 for t in st.sampled.tags
                 if "max_global_steps" in t and "min_global_steps" in t]
        if spans:
            out["partial/partial_ratio"] = sum(s > 1 for s in spans) / len(spans)
            out["partial/max_partial_span"] = float(max(spans))
        return out

    def end(self) -> int:
        """At the end of the run (also after an error); returns the keys left in the store."""
        return 0

    def state(self, step: int) -> dict | None:
        """What a checkpoint keeps of the schedule (None: nothing)."""
        return None

    def restore(self, state: dict | None) -> None:
        """Take a checkpoint's :meth:`state`."""


SCHEDULES: dict[str, type[Schedule]] = {}


def register_schedule(cls: type[Schedule]) -> type[Schedule]:
    """Class decorator: ``cls`` serves ``trainer.mode=cls.name``."""
    if cls.name in SCHEDULES:
        raise ValueError(f"schedule {cls.name!r} is registered twice")
    SCHEDULES[cls.name] = cls
    return cls
