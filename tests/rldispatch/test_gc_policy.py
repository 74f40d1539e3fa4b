"""trainer.gc_interval: cyclic garbage is collected at step boundaries, and only there."""
from __future__ import annotations

import gc
import weakref

import pytest

from rldispatch.config import ConfigError, load_config
from rldispatch.gc_policy import StepGC


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


def test_collects_every_interval_steps_and_gives_the_collector_back():
    was = gc.isenabled()
    policy = StepGC(2)
    try:
        policy.start()
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        ref = _cycle()
        for _ in range(50_000):  # enough allocations to trigger an automatic collection, were it on
            _ = [object()]
        assert ref() is not None
        assert not policy.step_done(0) and ref() is not None  # step 1 of 2: not due
        assert policy.step_done(1) and ref() is None
    finally:
        policy.stop()
    assert gc.isenabled() == was and gc.get_freeze_count() == 0
    policy.stop()  # idempotent


def test_interval_zero_leaves_python_alone():
    policy = StepGC(0)
    policy.start()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert not policy.step_done(0)
    policy.stop()
    assert gc.isenabled()


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_interval_is_refused(bad):
    with pytest.raises(ValueError, match="gc_interval"):
        StepGC(bad)


def test_config_refuses_a_negative_interval():
    assert load_config("grpo_tiny").trainer.gc_interval == 1
    with pytest.raises(ConfigError, match="trainer.gc_interval must be >= 0"):
        load_config("grpo_tiny", ["trainer.gc_interval=-1"])
