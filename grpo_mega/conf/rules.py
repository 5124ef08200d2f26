"""Checks shared by the config components."""

from __future__ import annotations

from typing import Any


def positive(name: str, value: Any) -> None:
    """A ValueError unless `value` is a positive int (not a bool), naming the setting `name`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
