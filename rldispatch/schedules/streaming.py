"""What both asynchronous schedules share: generation that outlives the step, fed from the prompt stream.

``num_warmup_batches`` batches are submitted ahead, every step submits one more, and the ``sample`` stage looks at
the replay buffer (after each idle slice and a tag sync) until enough whole groups are terminal; the buffer evicts
stale or failed groups and refills as many fresh prompts. Every rank decides from the same replicated listing, so
every rank samples, evicts and refills the same groups. Where generation runs is the subclass's: :meth:`_submit`
and :meth:`_idle`.
"""
from __future__ import annotations

import logging
import time

from protocol.store.meta import KVBatchMeta
from rldispatch.rollout import TRAIN
from rldispatch.schedules.base import Schedule, Seams
from rldispatch.step_state import StepState

__all__ = ["StreamingSchedule"]

logger = logging.getLogger(__name__)


class StreamingSchedule(Schedule):
    """Asynchronous generation from the prompt stream; see the module docstring."""

    replay_mode = "async"
    partial_rollout = True
    def __init__(self, seams: Seams, step: int):
        super().__init__(seams, step)
        cfg = seams.cfg
        self.batch_size = cfg.data.train_batch_size
        self.warmup = getattr(cfg.trainer, self.name).num_warmup_batches
        self.batches = step  # batches submitted so far (they seed the sampling stream, as a step does)
        self._resubmit: list[int] = []
        self._step = step
        seams.stream.cursor = step * self.batch_size

    # ---- where generation runs (the subclass's) -------------------------------------------------------------------
    def _submit(self, rows: list[dict], uids: list[str], step: int, seed_batch: int | None) -> None:
        """Start generating ``rows`` (dispatched at ``step``; ``seed_batch`` reseeds the sampling stream)."""
        raise NotImplementedError

    def _idle(self, poll: float) -> None:
        """Called while the buffer has too few terminal groups: let generation advance, then sync the tags."""
        raise NotImplementedError

    # ---- submission -------------------------------------------------------------------------------------------
    def _take_and_submit(self, count: int, step: int, seed_batch: int | None, numbers: list[int] | None = None
                         ) -> tuple[list[dict], list[str]]:
        rows, uids = self.seams.stream.take(count, numbers)
        self._submit(rows, uids, step, seed_batch)
        return rows, uids

    def begin(self, step: int) -> None:
        if self._resubmit:
            logger.info("resume: prompts %s, in flight or buffered at the checkpoint, submitted again at step %d",
                        self._resubmit, step)
            self._take_and_submit(len(self._resubmit), step, self.batches, numbers=self._resubmit)
            self.batches += 1
            self._resubmit = []
            return
        for _ in range(self.warmup):
            self._take_and_submit(self.batch_size, step, self.batches)
            self.batches += 1

    def generate(self, st: StepState) -> None:
        """Submit the step's batch of fresh prompts; generation runs while the sample stage waits."""
        self._step = st.step
        st.prompts = self._take_and_submit(self.batch_size, st.step, self.batches)
        self.batches += 1

    def refill(self, count: int) -> None:
        """The replay buffer evicted ``count`` groups: as many fresh prompts, dispatched at the current step."""
        self._take_and_submit(count, self._step, None)

    # ---- sampling -----------------------------------------------------------------------------------------------
    def sample(self, st: StepState, batch_size: int) -> KVBatchMeta:
        self._step = st.step
        t0 = time.perf_counter()
        stream = self.seams.stream
        try:
            self.seams.store.sync()
            meta = self.replay.sample(batch_size, current_step=st.step,
                                      timeout=self.seams.cfg.replay.sample_timeout_s, idle=self._idle)
            logger.info("step %d trains prompts %s", st.step, stream.position(meta.extra_info["uids"]))
            return meta
        finally:
            self.waiting_s += time.perf_counter() - t0
            stream.forget(self.replay.evicted)
            self.replay.evicted.clear()

    def after_clear(self, st: StepState) -> None:
        self.seams.stream.forget(st.sampled.extra_info.get("uids", []))

    # ---- checkpoint -------------------------------------------------------------------------------------------
    def state(self, step: int) -> dict:
        """The prompt stream's cursor and every prompt submitted and neither trained nor evicted (pending,
        running, or finished and waiting in the buffer), by stream position."""
        stream = self.seams.stream
        outstanding = stream.outstanding()
        logger.info("checkpoint at step %d: prompt stream at %d, outstanding prompts %s", step, stream.cursor,
                    outstanding)
        return {"mode": self.name, "cursor": stream.cursor, "batches": self.batches, "outstanding": outstanding}

    def restore(self, state: dict | None) -> None:
        """Resume: the stream continues at the saved cursor; :meth:`begin` submits the outstanding prompts again,
        dispatched at the resumed step (their partial trajectories died with the process; none was trained)."""
        if not state:  # a sync run's checkpoint: the stream continues where its steps left it
            return
        self.seams.stream.cursor, self.batches = int(state["cursor"]), int(state["batches"])
        self._resubmit = [int(p) for p in state["outstanding"]]

    # ---- shutdown ---------------------------------------------------------------------------------------------
    def _clear_store(self, cancelled: int) -> int:
        """Clear every training key this rank holds or knows of (no collective); the store must then be empty."""
        store = self.seams.store
        cleared = store.kv_clear_partition(TRAIN)
        self.seams.stream.forget(list(self.seams.stream.rows))
        remaining = store.num_keys()
        if remaining:
            raise RuntimeError(f"{remaining} key(s) left in the store after shutdown")
        logger.info("%s shutdown: %d in-flight task(s) cancelled, %d training key(s) cleared; store empty",
                    self.name, cancelled, cleared)
        return remaining
