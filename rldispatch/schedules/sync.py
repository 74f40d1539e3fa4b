"""trainer.mode=sync: generate the step's prompts, wait for every group, train on them."""
from __future__ import annotations

import time

from protocol.store.meta import KVBatchMeta
from rldispatch.config import ConfigError
from rldispatch.rollout import TRAIN
from rldispatch.schedules.base import Schedule, register_schedule
from rldispatch.step_state import StepState

__all__ = ["SyncSchedule"]


@register_schedule
class SyncSchedule(Schedule):
    """Every trajectory is one policy version old: the step's ``data.train_batch_size`` prompts are generated on the
    DP replicas' reporting ranks and waited for before anything trains."""

    name = "sync"

    def generate(self, st: StepState) -> None:
        t0 = time.perf_counter()
        s = self.seams
        st.prompts = s.stream.take_step(st.step)
        s.rollout.submit_share(*st.prompts, TRAIN, st.step, seed_batch=st.step)
        s.store.sync()
        self.generating_s = self.waiting_s = time.perf_counter() - t0

    def sample(self, st: StepState, batch_size: int) -> KVBatchMeta:
        # every group of the step is terminal now, so fewer usable groups than asked means some failed: train on
        # the rest rather than wait for groups that never come
        t0 = time.perf_counter()
        try:
            return self.replay.sample(batch_size, current_step=st.step,
                                      timeout=self.seams.cfg.replay.sample_timeout_s, partial_ok=True)
        finally:
            self.waiting_s += time.perf_counter() - t0

    def after_clear(self, st: StepState) -> None:
        self.seams.store.kv_clear(st.uids, TRAIN)  # prompt keys of groups the replay buffer dropped earlier
        super().after_clear(st)

    def restore(self, state: dict | None) -> None:
        if state and state.get("outstanding"):
            raise ConfigError(f"trainer.resume: the checkpoint is of an asynchronous run with "
                              f"{len(state['outstanding'])} prompt(s) in flight; resume it with the trainer.mode it "
                              f"was saved with ({state.get('mode')})")
