"""Typed configuration sections from plain mappings: one error family, and every refusal names the dotted key.

:func:`build_dataclass` walks a dataclass's type hints: unknown keys, wrong types and a value outside a
``typing.Literal`` are refused with a :class:`ConfigError` naming the key (``actor.optim.lr_schedule``) and,
for a choice, the valid names. Every layer's configuration errors (topology, batch settings, engine and
model sections) subclass :class:`ConfigError`, so a command line catches that one type.

Example::

    >>> import typing
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Optim:
    ...     name: typing.Literal["adamw", "sgd"] = "adamw"
    ...     lr: float = 1e-3
    >>> build_dataclass(Optim, {"lr": 1}, "actor.optim")
    Optim(name='adamw', lr=1.0)
    >>> build_dataclass(Optim, {"name": "adam"}, "actor.optim")
    Traceback (most recent call last):
    ...
    protocol.config.ConfigError: actor.optim.name must be one of ['adamw', 'sgd'], got 'adam'
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigError", "build_dataclass", "coerce_field", "to_plain", "literal_choices", "check_choices"]


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names the key and what to change."""


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + str(list(typing.get_args(tp)))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _choice(value: Any, choices: tuple, key: str, error: type[ConfigError] = ConfigError) -> Any:
    # bool is an int subclass (True == 1): a choice matches only a value of its own type
    if any(type(value) is type(c) and value == c for c in choices):
        return value
    raise error(f"{key} must be one of {list(choices)}, got {value!r}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return _choice(value, typing.get_args(tp), key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a section (mapping) of {tp.__name__}, got {value!r}")
        return build_dataclass(tp, value, key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)} ({value!r})")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def build_dataclass(cls: type, data: Mapping[str, Any] | None, prefix: str = "") -> Any:
    """Instantiate ``cls`` from ``data``: unknown keys, wrong types and values outside a ``Literal`` raise
    :class:`ConfigError` naming the dotted key; an error of the section's own checks is re-raised with its prefix."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = prefix or "the top level"
        raise ConfigError(
            f"unknown config key {', '.join(_join(prefix, k) for k in unknown)}; valid keys under {where}: "
            f"{', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(value, hints[name], _join(prefix, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError) and (not prefix or prefix in str(exc)):
            raise  # the section's own check already names the key
        raise ConfigError(f"{prefix or cls.__name__}: {exc}") from exc


def coerce_field(cls: type, name: str, value: Any, prefix: str = "") -> Any:
    """``value`` as field ``name`` of dataclass ``cls`` holds it, checked as :func:`build_dataclass` checks it, but
    alone (the section's own cross-field checks do not run); an unknown name is refused like an unknown key."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    if name not in fields:
        raise ConfigError(f"unknown config key {_join(prefix, name)}; valid keys under {prefix or 'the top level'}: "
                          f"{', '.join(sorted(fields))}")
    return _coerce(value, typing.get_type_hints(cls)[name], _join(prefix, name))


@functools.cache
def literal_choices(cls: type) -> dict[str, tuple]:
    """The fields of dataclass ``cls`` typed as a ``Literal``, each with its valid values (in declaration order)."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is typing.Literal}


def check_choices(obj: Any, prefix: str | None = None, error: type[ConfigError] = ConfigError) -> None:
    """Refuse a dataclass instance whose ``Literal`` fields hold other values, raising ``error`` (for sections built
    directly in code; :func:`build_dataclass` already checks with the dotted key). ``prefix`` names the section."""
    where = type(obj).__name__ if prefix is None else prefix
    for name, choices in literal_choices(type(obj)).items():
        _choice(getattr(obj, name), choices, _join(where, name), error)


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (for logging and checkpoint metadata)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
