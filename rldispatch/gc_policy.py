"""When Python's cyclic garbage collector runs during training: at step boundaries, not mid-stage.

A step allocates hundreds of thousands of small objects (sessions, tags, per-key rows). Left automatic, the
collector runs dozens of times per step, and its full passes walk every live object — the loaded model and
libraries included — so they cost more the bigger the job is (at 4096 trajectories per rank they were 40 % of
the step's own overhead). ``trainer.gc_interval = N`` turns the automatic collector off for the run and collects
once every N steps, as its own timed stage (``timing_s/gc``); 0 keeps Python's automatic collector.

Reference counting still frees everything that is not in a cycle at once; only cyclic garbage waits for the
boundary. Objects alive when the run starts (modules, the model) are frozen out of the collector's passes with
:func:`gc.freeze`, so a boundary collection looks at what the run allocated since.
"""
from __future__ import annotations

import gc

__all__ = ["StepGC"]


class StepGC:
    """Collect garbage every ``interval`` steps (0: leave Python's automatic collector as it is)."""

    def __init__(self, interval: int):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"trainer.gc_interval must be an int >= 0 (0 = Python's automatic GC), got {interval!r}")
        self.interval = interval
        self._was_enabled: bool | None = None

    def start(self) -> None:
        """Freeze what is alive now and switch the automatic collector off (idempotent)."""
        if not self.interval or self._was_enabled is not None:
            return
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()

    def step_done(self, step: int) -> bool:
        """After step ``step`` (0-based): collect if it is due (the trainer times it as a stage); True if it did."""
        if not self.interval or self._was_enabled is None or (step + 1) % self.interval:
            return False
        gc.collect()
        return True

    def stop(self) -> None:
        """Give the process its collector back as it was (the frozen objects are collectable again)."""
        if self._was_enabled is None:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
