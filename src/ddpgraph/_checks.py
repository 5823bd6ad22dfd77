"""Checks of option values shared by the step, the data path and the runtime."""

from __future__ import annotations

import numbers

from .errors import ConfigError

__all__ = ["check_int", "is_int", "is_number"]


def is_int(value: object) -> bool:
    """An integer, numpy's too, but not a bool (``True`` is an int to Python)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number, numpy's too, but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: object, *, minimum: int | None, fix: str) -> None:
    """An integer option (not a bool) of at least ``minimum``; ``ConfigError`` naming it."""
    if not is_int(value) or (minimum is not None and value < minimum):  # type: ignore[operator]
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{name}={value!r} must be an integer{bound}; {fix}.")
