"""Errors the KV stores raise; every one names the partition, the offending keys/fields and what was expected."""
from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "StoreKeyError",
    "FieldOverwriteError",
    "LateWriteError",
    "FieldShapeError",
    "StoreClosedError",
    "preview",
]


def preview(items: Sequence[Any], limit: int = 5) -> str:
    """Up to ``limit`` items and the total count, for error messages."""
    items = list(items)
    shown = ", ".join(repr(x) for x in items[:limit])
    more = ", ..." if len(items) > limit else ""
    return f"[{shown}{more}] ({len(items)} in total)"


class StoreKeyError(KeyError):
    """Keys, or fields of keys, that a get / tag read asked for and the store does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class FieldOverwriteError(ValueError):
    """A put that would replace an existing field with a different value without ``overwrite=True``."""


class LateWriteError(ValueError):
    """A put that would re-create a key that was cleared, or a key of a cleared group."""


class FieldShapeError(ValueError):
    """Per-key values of one field that cannot be batched (different dtypes, or shapes differing beyond dim 0)."""


class StoreClosedError(ValueError):
    """An operation on a store after ``close()``."""
