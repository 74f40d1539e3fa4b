"""KV stores with TransferQueue semantics: the embedded LocalStore (default) and the TransferQueueStore adapter.

``TransferQueueStore`` is imported lazily: ``import protocol.store`` never imports ray or transfer_queue.
"""
from __future__ import annotations

from typing import Any

from .base import DEFAULT_MAX_CLEARED_MARKS, KVStore, StepStore
from .keys import is_prompt_key, uid_of
from .batching import assemble_field
from .errors import FieldOverwriteError, FieldShapeError, LateWriteError, StoreClosedError, StoreKeyError
from .local import LocalStore

__all__ = [
    "KVStore",
    "StepStore",
    "LocalStore",
    "TransferQueueStore",
    "StoreKeyError",
    "FieldOverwriteError",
    "LateWriteError",
    "FieldShapeError",
    "StoreClosedError",
    "uid_of",
    "is_prompt_key",
    "assemble_field",
    "DEFAULT_MAX_CLEARED_MARKS",
]


def __getattr__(name: str) -> Any:
    if name == "TransferQueueStore":
        from .tq import TransferQueueStore

        return TransferQueueStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
