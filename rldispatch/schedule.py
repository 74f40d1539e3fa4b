"""Schedules: when and where generation runs around the one step body of :class:`rldispatch.grpo.GRPOTrainer`.

The step's stages stay the same in every mode; a schedule fills its hooks (the reference system's V1
``on_train_begin`` / ``on_step_begin`` / ``on_sample_end`` / ``on_step_end`` split):

* :meth:`SyncSchedule.generate` – the ``rollout`` stage: what the step submits (and, in sync mode, waits for);
* :meth:`SyncSchedule.sample` – the ``sample`` stage: whole terminal groups from the replay buffer;
* :meth:`SyncSchedule.after_clear` – after the step's keys are cleared;
* :meth:`SyncSchedule.begin` / :meth:`SyncSchedule.end` – warm-up submissions and shutdown.

``sync`` generates the step's prompts and waits for every group. ``colocate_async`` keeps generation going on
the same ranks across steps: ``num_warmup_batches`` batches are submitted ahead, every step submits one more,
and the ``sample`` stage drives generation only until enough whole groups are terminal; sessions still running
when the step trains are paused (nothing drives the event loop) and, with partial rollout, continue with the
weights of the next sync. Every rank decides from the same replicated listing after each :meth:`sync`, so every
rank samples, evicts and refills the same groups.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from protocol.rollout.agent_loop import register_prompts
from protocol.store.meta import KVBatchMeta
from rldispatch.config import ConfigError

from rldispatch.step_state import StepState

__all__ = ["SyncSchedule", "ColocateAsyncSchedule", "build_schedule", "DRIVE_SLICE_S"]

logger = logging.getLogger(__name__)
TRAIN = "train"
#: how long the sample stage lets generation run between two looks at the replay buffer (each look is a sync)
DRIVE_SLICE_S = 0.02


class SyncSchedule:
    """Generate the step's ``train_batch_size`` prompts, wait for every group, train on them."""

    name = "sync"
    keeps_generating = False  # whether generation outlives a call (validation then leaves its tasks alone)

    def __init__(self, trainer: Any):
        self.t = trainer
        self.rows: dict[str, dict] = {}  # uid -> dataset row of every prompt submitted and not yet trained on
        self.generating_s = 0.0  # seconds the step spent generating
        self.waiting_s = 0.0  # seconds the step's trainer waited for trajectories

    def begin(self) -> None:
        """Before the first step (after the initial validation)."""

    def generate(self, st: StepState) -> None:
        t0 = time.perf_counter()
        self.rows = dict(zip(st.uids, st.rows))
        self.t._rollout(st.rows, st.uids, TRAIN, st.step, self.t._train_sampling())
        self.generating_s = self.waiting_s = time.perf_counter() - t0

    def sample(self, st: StepState, batch_size: int) -> KVBatchMeta:
        # every group of the step is terminal now, so fewer usable groups than asked means some failed: train on
        # the rest rather than wait for groups that never come
        t0 = time.perf_counter()
        try:
            return self.t.replay.sample(batch_size, current_step=st.step, timeout=self.t.cfg.replay.sample_timeout_s,
                                        partial_ok=True)
        finally:
            self.waiting_s += time.perf_counter() - t0

    def after_clear(self, st: StepState) -> None:
        self.t.store.kv_clear(st.uids, TRAIN)  # prompt keys of groups the replay buffer dropped earlier

    def step_metrics(self, st: StepState, seconds: float) -> dict[str, float]:
        """Idle times of the step: the trainer waiting for trajectories, the rollout not generating."""
        out = {"timing_s/trainer_idle": self.waiting_s,
               "timing_s/rollout_idle": max(seconds - self.generating_s, 0.0)}
        self.generating_s = self.waiting_s = 0.0
        spans = [int(t["max_global_steps"]) - int(t["min_global_steps"]) + 1 for t in st.sampled.tags
                 if "max_global_steps" in t and "min_global_steps" in t]
        if spans:
            out["partial/partial_ratio"] = sum(s > 1 for s in spans) / len(spans)
            out["partial/max_partial_span"] = float(max(spans))
        return out

    def sync_weights(self, weights: dict, version: int) -> None:
        """The step's new weights (version ``version``), already loaded into the trainer's own rollout worker."""

    def end(self) -> int:
        """At the end of the run (also after an error); returns the keys left in the store."""
        return 0

    def state(self) -> dict | None:
        """What a checkpoint keeps of the schedule (sync: nothing, every prompt of a step is trained in it)."""
        return None

    def restore(self, state: dict | None) -> None:
        """Take a checkpoint's :meth:`state`."""
        if state and state.get("outstanding"):
            raise ConfigError(f"trainer.resume: the checkpoint is of an asynchronous run with "
                              f"{len(state['outstanding'])} prompt(s) in flight; resume it with the trainer.mode it "
                              f"was saved with ({state.get('mode')})")


class ColocateAsyncSchedule(SyncSchedule):
    """The training ranks generate too, and generation outlives the step (see the module docstring)."""

    name = "colocate_async"
    keeps_generating = True

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        cfg = trainer.cfg
        self.batch_size = cfg.data.train_batch_size
        self.warmup = cfg.trainer.colocate_async.num_warmup_batches
        self.cursor = trainer.step * self.batch_size  # prompts taken from the training stream so far
        self.batches = trainer.step  # batches submitted so far (they seed the sampling stream, as a step does)
        self.tasks: list[asyncio.Task] = []
        self.numbers: dict[str, int] = {}  # uid -> its position in the prompt stream, for every row in self.rows
        self._resubmit: list[int] = []
        self._step = trainer.step
        trainer.replay.refill = self.refill

    # ---- checkpoint -------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """The prompt stream's cursor and every prompt submitted and neither trained nor evicted (pending,
        running, or finished and waiting in the buffer), by stream position."""
        outstanding = sorted(self.numbers.values())
        logger.info("checkpoint at step %d: prompt stream at %d, outstanding prompts %s", self.t.step, self.cursor,
                    outstanding)
        return {"mode": self.name, "cursor": self.cursor, "batches": self.batches, "outstanding": outstanding}

    def restore(self, state: dict | None) -> None:
        """Resume: the stream continues at the saved cursor; :meth:`begin` submits the outstanding prompts again,
        dispatched at the resumed step (their partial trajectories died with the process; none was trained)."""
        if not state:  # a sync run's checkpoint: the stream continues where its steps left it
            return
        self.cursor, self.batches = int(state["cursor"]), int(state["batches"])
        self._resubmit = [int(p) for p in state["outstanding"]]

    # ---- submission -------------------------------------------------------------------------------------------
    def _take_prompts(self, count: int, numbers: list[int] | None) -> tuple[list[dict], list[str]]:
        """The stream's next ``count`` prompts (or the prompts ``numbers``), recorded as outstanding."""
        if numbers is None:
            numbers = list(range(self.cursor, self.cursor + count))
            self.cursor += count
        rows, uids = [], []
        for start, run in _runs(numbers):
            r, u = self.t._prompts_at(start, run)
            rows += r
            uids += u
        self.rows.update(zip(uids, rows))
        self.numbers.update(zip(uids, numbers))
        return rows, uids

    def _submit(self, count: int, step: int, seed_batch: int | None, numbers: list[int] | None = None
                ) -> tuple[list[dict], list[str]]:
        t = self.t
        rows, uids = self._take_prompts(count, numbers)
        mine = t._my_prompts(len(rows))
        if mine:  # pending tags at once, so the buffer counts them in flight before their sessions start
            register_prompts(t.store, [uids[i] for i in mine], step, TRAIN)
        task = t._rollout(rows, uids, TRAIN, step, t._train_sampling(), seed_step=seed_batch, wait=False)
        if task is not None:
            self.tasks.append(task)
        return rows, uids

    def begin(self) -> None:
        if self._resubmit:
            logger.info("resume: prompts %s, in flight or buffered at the checkpoint, submitted again at step %d",
                        self._resubmit, self.t.step)
            self._submit(len(self._resubmit), self.t.step, self.batches, numbers=self._resubmit)
            self.batches += 1
            self._resubmit = []
            return
        for _ in range(self.warmup):
            self._submit(self.batch_size, self.t.step, self.batches)
            self.batches += 1

    def generate(self, st: StepState) -> None:
        """Submit the step's batch of fresh prompts; generation runs when the sample stage drives it."""
        self._step = st.step
        rows, uids = self._submit(self.batch_size, st.step, self.batches)
        self.batches += 1
        st.prompts = (rows, uids)

    def refill(self, count: int) -> None:
        """The replay buffer evicted ``count`` groups: as many fresh prompts, dispatched at the current step."""
        self._submit(count, self._step, None)

    # ---- driving generation -----------------------------------------------------------------------------------
    def _drive(self, seconds: float) -> None:
        """Run this rank's generation for up to ``seconds`` (less when every session ends first)."""
        self.tasks = [task for task in self.tasks if not task.done()]
        if not self.tasks:
            return
        t0 = time.perf_counter()
        done, _ = self.t.loop.run_until_complete(asyncio.wait(self.tasks, timeout=seconds))
        self.generating_s += time.perf_counter() - t0
        for task in done:
            task.result()  # an error that is not a session failure (those are in the group's tag) stops the run

    def _idle(self, _poll: float) -> None:
        self._drive(DRIVE_SLICE_S)
        self.t.store.sync()  # every rank decides from the same listing

    def sample(self, st: StepState, batch_size: int) -> KVBatchMeta:
        self._step = st.step
        t0 = time.perf_counter()
        try:
            self.t.store.sync()
            meta = self.t.replay.sample(batch_size, current_step=st.step,
                                        timeout=self.t.cfg.replay.sample_timeout_s, idle=self._idle)
            logger.info("step %d trains prompts %s", st.step,
                        sorted(self.numbers[u] for u in meta.extra_info["uids"]))
            return meta
        finally:
            self.waiting_s += time.perf_counter() - t0
            self._forget(self.t.replay.evicted)
            self.t.replay.evicted.clear()

    def _forget(self, uids: Any) -> None:
        for uid in uids:
            self.rows.pop(uid, None)
            self.numbers.pop(uid, None)

    def after_clear(self, st: StepState) -> None:
        self._forget(st.sampled.extra_info.get("uids", []))

    def step_metrics(self, st: StepState, seconds: float) -> dict[str, float]:
        out = super().step_metrics(st, seconds)
        out["async/tasks_in_flight"] = float(sum(not task.done() for task in self.tasks))
        return out

    # ---- shutdown ---------------------------------------------------------------------------------------------
    def end(self) -> int:
        """Cancel the sessions still in flight and clear every training key they and the buffer left (no
        collective: each rank clears what it holds and what it knows of)."""
        loop, store = self.t.loop, self.t.store
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self.tasks = []
        known = set(store.kv_list(TRAIN).get(TRAIN, {})) | set(store.local.kv_list(TRAIN).get(TRAIN, {}))
        if known:
            store.kv_clear(sorted(known), TRAIN)
        self.rows.clear()
        self.numbers.clear()
        remaining = store.num_keys()
        if remaining:
            raise RuntimeError(f"{remaining} key(s) left in the store after shutdown")
        logger.info("%s shutdown: %d in-flight task(s) cancelled, %d training key(s) cleared; store empty",
                    self.name, len(left), len(known))
        return remaining


def _runs(numbers: list[int]) -> list[tuple[int, int]]:
    """``numbers`` as (start, length) runs of consecutive values, in order."""
    runs: list[tuple[int, int]] = []
    for p in numbers:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def build_schedule(trainer: Any) -> SyncSchedule:
    """The schedule of ``trainer.mode``."""
    mode = trainer.cfg.trainer.mode
    if mode == "sync":
        return SyncSchedule(trainer)
    if mode == "colocate_async":
        return ColocateAsyncSchedule(trainer)
    raise ConfigError(f"trainer.mode={mode!r} has no schedule here; use sync or colocate_async (separate_async's is "
                      "rldispatch.separate.SeparateAsyncSchedule)")
