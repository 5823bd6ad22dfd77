"""Every piece of process-global state ddpgraph keeps, in one registry, with its one reset.

A module declares its state here instead of in a bare module global, and reads and writes
``.value``::

    _ACTIVE: Global[Watchdog | None] = process_global(
        "watchdog.active", lambda: None, reset_at_shutdown=True
    )

:func:`ddpgraph.shutdown` ends with :func:`reset_at_shutdown`: every value marked
``reset_at_shutdown`` goes back to its initial value, so nothing of one ``init()`` leaks into the
next. The others live as long as the process, on purpose: a counter that keeps store keys unique
across inits, a cache whose entries stay valid (call sites, per-group sequence numbers that the
peers count too, CUDA streams whose cuBLAS workspaces would leak if made again).
:func:`registered` lists them all, for tests and for a reader who wants to know what a process
holds between calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

__all__ = ["Global", "process_global", "registered", "reset_at_shutdown"]

T = TypeVar("T")


@dataclass(eq=False)
class Global(Generic[T]):
    """One process-global value: ``.value`` to read or write it, :meth:`reset` to start over."""

    name: str  # "module.what", unique
    initial: Callable[[], T]  # makes the value a fresh process starts with
    reset_at_shutdown: bool  # True: it belongs to one init(); False: to the process
    value: T

    def reset(self) -> None:
        self.value = self.initial()


_REGISTRY: dict[str, Global[Any]] = {}


def process_global(name: str, initial: Callable[[], T], *, reset_at_shutdown: bool) -> Global[T]:
    """Declare a process-global value named ``name`` (``"module.what"``), starting at
    ``initial()``. Call once, at module level; a module imported again replaces its entry."""
    slot = Global(name, initial, reset_at_shutdown, initial())
    _REGISTRY[name] = slot
    return slot


def reset_at_shutdown() -> None:
    """Put every value that belongs to one ``init()`` back to its initial value."""
    for slot in _REGISTRY.values():
        if slot.reset_at_shutdown:
            slot.reset()


def registered() -> Mapping[str, Global[Any]]:
    """Every declared value by name (read-only view)."""
    return MappingProxyType(_REGISTRY)
