"""Checks over many values in a few C-level passes: the common case of a hot path, decided without a Python step
per item. A caller that gets False runs its own per-item loop, which names the culprit (or accepts subclasses)."""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["INT", "FLOAT", "NUMBER", "STR", "DICT", "SCALAR", "only_types", "plain_keys"]

INT, FLOAT, NUMBER = frozenset({int}), frozenset({float}), frozenset({int, float})
STR, DICT = frozenset({str}), frozenset({dict})
#: the exact types of a JSON scalar: what a tag value is, nearly always
SCALAR = frozenset({str, int, float, bool, type(None)})


def only_types(values: Iterable, allowed: frozenset) -> bool:
    """Every item of ``values`` is exactly of an ``allowed`` type (a subclass, a bool among ints, counts as
    another type): one pass over ``map(type, values)``, where an ``isinstance`` per item is a Python step each.

    >>> only_types([1, 2], INT), only_types([1, True], INT)
    (True, False)
    """
    return set(map(type, values)) <= allowed


def plain_keys(keys: list) -> bool:
    """``keys`` are unique, non-empty and exactly ``str`` (False: look closer, key by key)."""
    return only_types(keys, STR) and "" not in keys and len(set(keys)) == len(keys)
