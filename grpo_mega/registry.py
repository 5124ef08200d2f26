"""Small name -> object registries for the project's extension points (KL estimators, loss aggregation
modes, reward functions, rollout engines). Looking up an unknown name raises a ValueError that lists the
valid names, so a typo in a config fails at start-up with the fix in the message."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            for key in (name, *aliases):
                if key in self._items:
                    raise ValueError(f"{self.kind} {key!r} is registered twice")
                self._items[key] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


def import_path(path: str, what: str):
    """The object at dotted path `pkg.mod:name` (or `pkg.mod.name`); a ValueError naming `what` (the setting)
    when it does not import."""
    import importlib

    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{what}={path!r}: cannot import {attr!r} from {module!r} ({e})") from None


def import_async_function(path: str, what: str):
    """The `async def` function at dotted path `path` (import_path); a ValueError when it is not one."""
    import inspect

    fn = import_path(path, what)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{what}={path!r} must be an `async def` function; got {type(fn).__name__}")
    return fn
