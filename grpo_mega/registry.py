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
