"""Schedules: when and where generation runs around the one step body, one module per ``trainer.mode``, registered
by name (:func:`schedule_class`)."""
from rldispatch.config import ConfigError
from rldispatch.schedules.base import SCHEDULES, Schedule, Seams, register_schedule
from rldispatch.schedules.colocate_async import ColocateAsyncSchedule
from rldispatch.schedules.separate_async import SeparateAsyncSchedule
from rldispatch.schedules.sync import SyncSchedule

__all__ = ["Schedule", "Seams", "register_schedule", "schedule_class", "schedules", "SyncSchedule",
           "ColocateAsyncSchedule", "SeparateAsyncSchedule"]


def schedules() -> list[str]:
    """The registered ``trainer.mode`` names."""
    return sorted(SCHEDULES)


def schedule_class(mode: str) -> type[Schedule]:
    """The schedule of ``trainer.mode=mode``."""
    if mode not in SCHEDULES:
        raise ConfigError(f"trainer.mode={mode!r} has no schedule; registered: {schedules()}")
    return SCHEDULES[mode]
