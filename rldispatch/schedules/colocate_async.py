"""trainer.mode=colocate_async: the training ranks generate too, and generation outlives the step.

The sample stage drives this rank's generation in short slices until enough whole groups are terminal; then the
rollout engine is paused while the step trains, and resumed once it holds the step's new weights: with partial
rollout, sessions still running continue with them (``min_global_steps`` / ``max_global_steps`` tag the versions a
trajectory spans).
"""
from __future__ import annotations

from protocol.rollout.agent_loop import register_prompts
from protocol.store.meta import KVBatchMeta
from rldispatch.rollout import DRIVE_SLICE_S, TRAIN
from rldispatch.schedules.base import register_schedule
from rldispatch.schedules.streaming import StreamingSchedule
from rldispatch.step_state import StepState

__all__ = ["ColocateAsyncSchedule"]


@register_schedule
class ColocateAsyncSchedule(StreamingSchedule):
    """Generation on the training ranks' own rollout engines, running ahead of training (module docstring)."""

    name = "colocate_async"
    keeps_generating = True

    def _submit(self, rows: list[dict], uids: list[str], step: int, seed_batch: int | None) -> None:
        mine = self.seams.rollout.submit_share(rows, uids, TRAIN, step, seed_batch=seed_batch, wait=False)
        if mine:  # pending tags at once (no session runs before the loop is driven): the buffer counts them in flight
            register_prompts(self.seams.store, [uids[i] for i in mine], step, TRAIN)

    def _idle(self, _poll: float) -> None:
        self.generating_s += self.seams.rollout.drive(DRIVE_SLICE_S)
        self.seams.store.sync()  # every rank decides from the same listing

    def sample(self, st: StepState, batch_size: int) -> KVBatchMeta:
        meta = super().sample(st, batch_size)
        self.seams.rollout.engine.pause()  # nothing generates while the step trains
        return meta

    def sync_weights(self, weights: dict, version: int) -> None:
        self.seams.rollout.engine.resume()  # the engine holds the new weights: the paused sessions go on

    def step_metrics(self, st: StepState, seconds: float) -> dict[str, float]:
        out = super().step_metrics(st, seconds)
        out["async/tasks_in_flight"] = float(self.seams.rollout.in_flight())
        return out

    def end(self) -> int:
        """Cancel the sessions still in flight and clear every training key they and the buffer left."""
        rollout = self.seams.rollout
        rollout.engine.resume()
        return self._clear_store(rollout.cancel())
