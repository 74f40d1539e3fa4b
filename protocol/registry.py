"""Named registries: components selectable by a config value, with errors that list what is known."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to components, filled by a decorator.

    ``what`` names the kind of component in messages; ``key`` is the config key that selects one. Registering a
    different object under a taken name, or asking for an unknown name, raises ``error`` with the known names.

    >>> estimators = Registry("advantage estimator", key="algorithm.adv_estimator")
    >>> @estimators.register("mean")
    ... def mean(xs): return sum(xs) / len(xs)
    >>> estimators.get("mean")([1, 3]), estimators.names()
    (2.0, ['mean'])
    """

    #: bumped by every change of any registry, so a lookup cached on it knows when to look again
    generation = 0

    def __init__(self, what: str, *, key: str | None = None, error: type[Exception] = ValueError):
        self.what, self.key, self.error = what, key, error
        self._items: dict[str, T] = {}

    def register(self, name: str, *, check: Callable[[T], None] | None = None) -> Callable[[T], T]:
        """Decorator registering its argument under ``name``; ``check`` may refuse the object first."""
        if not isinstance(name, str) or not name:
            raise self.error(f"{self.what} name must be a non-empty str, got {name!r}")

        def deco(obj: T) -> T:
            if check is not None:
                check(obj)
            taken = self._items.get(name)
            if taken is not None and taken is not obj:
                raise self.error(f"{self.what} {name!r} is already registered "
                                 f"({getattr(taken, '__name__', type(taken).__name__)})")
            if taken is None:
                self._items[name] = obj
                Registry.generation += 1
            return obj

        return deco

    def get(self, name: str) -> T:
        """The component registered under ``name``."""
        if name not in self._items:
            where = f"{self.key}={name!r} is not a known {self.what}" if self.key else f"unknown {self.what} {name!r}"
            raise self.error(f"{where}; known: {self.names()}")
        return self._items[name]

    def unregister(self, name: str) -> T:
        """Remove ``name`` (plugins and tests that register temporary components); returns what it held."""
        if name not in self._items:
            raise self.error(f"{self.what} {name!r} is not registered; known: {self.names()}")
        Registry.generation += 1
        return self._items.pop(name)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
