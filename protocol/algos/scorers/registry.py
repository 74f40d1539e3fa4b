"""Scorers by ``data_source``: the registry and its lookup.

A *scorer* maps ``(solution_str, ground_truth, extra_info)`` to a float, or to a dict with a ``"score"`` entry and
extra per-trajectory values (``"acc"``, ``"pred"``, ...). Register one with ``@register_scorer("my_source")``; the
learnable tasks of :mod:`protocol.rollout.tasks` register theirs under their names when that package is imported.
Names registered with ``prefix=True`` also serve every ``data_source`` that starts with them (``aime2024``).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

from protocol.registry import Registry

__all__ = [
    "RewardError",
    "UnknownDataSourceError",
    "Scorer",
    "ScorerSpec",
    "register_scorer",
    "get_scorer",
    "scorer_spec",
    "needs_ground_truth",
    "known_scorers",
]


class RewardError(ValueError):
    """An unknown data_source or reward manager, a scorer result of the wrong type, or mis-shaped score inputs."""


class UnknownDataSourceError(RewardError, NotImplementedError):
    """No scorer for a ``data_source``; a ``NotImplementedError`` too, as the reference system raises there."""


Scorer = Callable[[str, Any, "Mapping[str, Any] | None"], "float | Mapping[str, Any]"]


@dataclass(frozen=True)
class ScorerSpec:
    """A registered scorer: the function, whether it compares against a ground truth, whether ``name`` is a prefix."""

    name: str
    fn: Scorer
    needs_ground_truth: bool = True
    prefix: bool = False


_SCORERS: Registry[ScorerSpec] = Registry("scorer for data_source", error=RewardError)


def register_scorer(name: str, *, needs_ground_truth: bool = True, prefix: bool = False) -> Callable[[Scorer], Scorer]:
    """Decorator: score trajectories whose ``data_source == name`` (or starts with it, ``prefix=True``)."""
    register = _SCORERS.register(name)

    def deco(fn: Scorer) -> Scorer:
        if not callable(fn):
            raise RewardError(f"scorer {name!r} must be callable, got {type(fn).__name__}")
        register(ScorerSpec(name, fn, needs_ground_truth, prefix))
        return fn

    return deco


def known_scorers() -> list[str]:
    """Every data_source that can be scored: the registered scorers, ``name*`` for prefixes."""
    return sorted(f"{s}*" if _SCORERS.get(s).prefix else s for s in _SCORERS.names())


_resolved: dict[str, ScorerSpec] = {}  # data_source -> its scorer, while Registry.generation is _resolved_at
_resolved_at = -1


def scorer_spec(data_source: str) -> ScorerSpec:
    """The scorer of ``data_source``: its exact name, else the longest matching prefix.

    Resolved once per data_source until a registry changes (every trajectory of a batch asks)."""
    global _resolved_at
    if _resolved_at != Registry.generation:
        _resolved.clear()
        _resolved_at = Registry.generation
    spec = _resolved.get(data_source) if isinstance(data_source, str) else None
    if spec is None:
        spec = _resolved[data_source] = _resolve(data_source)
    return spec


def _resolve(data_source: str) -> ScorerSpec:
    if not isinstance(data_source, str):
        raise RewardError(f"data_source must be a str, got {type(data_source).__name__} {data_source!r}")
    if data_source in _SCORERS:
        return _SCORERS.get(data_source)
    matches = [s for s in _SCORERS.names() if _SCORERS.get(s).prefix and data_source.startswith(s)]
    if matches:
        return _SCORERS.get(max(matches, key=len))
    raise UnknownDataSourceError(f"no scorer for data_source {data_source!r}; known data sources: {known_scorers()} "
                                 f"(or set custom_reward_function.path / .name)")


def get_scorer(data_source: str) -> Scorer:
    """The scorer function of ``data_source``; an unknown one lists the known data sources."""
    return scorer_spec(data_source).fn


def needs_ground_truth(data_source: str) -> bool:
    """Whether the scorer of ``data_source`` compares against ``reward_model.ground_truth`` (unknown: an error)."""
    return scorer_spec(data_source).needs_ground_truth
