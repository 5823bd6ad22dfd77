"""Batch containers rebuilt with new entries: the same mapping or sequence type where it can be."""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["rebuild_mapping", "rebuild_sequence"]


def rebuild_mapping(batch: Mapping[Any, Any], new: dict[Any, Any]) -> Mapping[Any, Any]:
    """The same mapping type where it can be rebuilt, else a dict (as torch's pin_memory does).

    A mutable mapping is copied and updated, so attributes beside the items survive (an HF
    ``BatchEncoding`` keeps its ``encodings``); another mapping type is called with a dict.
    """
    try:
        if isinstance(batch, MutableMapping):
            clone = copy.copy(batch)
            clone.update(new)
            return clone
        return type(batch)(new)  # type: ignore[call-arg]
    except TypeError:
        return new


def rebuild_sequence(batch: Sequence[Any], items: list[Any]) -> Sequence[Any]:
    cls: Any = type(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        rebuilt: Sequence[Any] = cls(*items)
        return rebuilt
    try:
        rebuilt = cls(items)  # tuple, list or a subclass that takes an iterable
        return rebuilt
    except TypeError:
        return tuple(items) if isinstance(batch, tuple) else items
