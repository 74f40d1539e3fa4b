"""Schedules are registered by trainer.mode, each declaring what its mode needs; one lookup serves the trainer."""
from __future__ import annotations

import pytest

from rldispatch.config import ConfigError, load_config
from rldispatch.schedules import (ColocateAsyncSchedule, Schedule, SeparateAsyncSchedule, SyncSchedule,
                                  register_schedule, schedule_class, schedules)
from rldispatch.schedules.base import SCHEDULES


def test_every_mode_of_the_config_has_a_registered_schedule():
    from typing import get_args, get_type_hints

    from rldispatch.config import TrainerSection

    modes = get_args(get_type_hints(TrainerSection)["mode"])
    assert sorted(modes) == schedules() == ["colocate_async", "separate_async", "sync"]
    for mode in modes:
        assert schedule_class(mode).name == mode
        assert load_config(None, [f"trainer.mode={mode}"]).trainer.mode == mode


def test_each_schedule_declares_its_needs():
    assert (SyncSchedule.replay_mode, SyncSchedule.partial_rollout, SyncSchedule.splits_world) == \
        ("sync", False, False)
    assert (ColocateAsyncSchedule.replay_mode, ColocateAsyncSchedule.partial_rollout,
            ColocateAsyncSchedule.splits_world, ColocateAsyncSchedule.keeps_generating) == ("async", True, False, True)
    assert (SeparateAsyncSchedule.replay_mode, SeparateAsyncSchedule.partial_rollout,
            SeparateAsyncSchedule.splits_world, SeparateAsyncSchedule.keeps_generating) == ("async", True, True, False)
    # separate_async shares the prompt stream's bookkeeping with colocate_async, not colocate_async's generation
    assert not issubclass(SeparateAsyncSchedule, ColocateAsyncSchedule)


def test_an_unknown_mode_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer.mode='overlap' has no schedule; registered: \['colocate_async'"):
        schedule_class("overlap")


def test_a_new_schedule_is_one_registered_class():
    @register_schedule
    class Fifo(Schedule):
        name = "fifo_for_test"

    try:
        assert schedule_class("fifo_for_test") is Fifo and "fifo_for_test" in schedules()
        with pytest.raises(ValueError, match="registered twice"):
            register_schedule(Fifo)
    finally:
        SCHEDULES.pop("fifo_for_test")
