"""The exception types every ddpgraph module raises.

Each message says what broke, the value seen and the fix. Types subclass the builtin that fits
(`ValueError` for bad input or configuration, `RuntimeError` for a bad state at run time) so that
existing ``except`` clauses keep working.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CaptureError",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceConflictError",
    "DistributedStateError",
    "ObjectArgumentError",
    "ObjectCollectiveError",
]


class ConfigError(ValueError):
    """A launcher variable or an option has a value ddpgraph cannot use (e.g. ``LOCAL_RANK=x``)."""


class DistributedStateError(RuntimeError):
    """The process-group state does not allow the call (e.g. ``init`` again with other arguments)."""


class DeviceConflictError(RuntimeError):
    """Two ranks of one host are bound to the same GPU, or a rank's device is not the one it should use.

    Raised on every rank before any NCCL call, so the job fails with this message instead of
    ``ncclInvalidUsage`` or a hang.
    """


class ObjectCollectiveError(RuntimeError):
    """An object collective failed on at least one rank; raised identically on every rank.

    ``ranks`` lists the ranks (of the group) whose object, arguments or call caused the failure.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message, tuple(ranks))
        self.ranks: tuple[int, ...] = tuple(ranks)

    def __str__(self) -> str:
        return str(self.args[0])


class ObjectArgumentError(ObjectCollectiveError, ValueError):
    """A rank passed a bad argument (e.g. an output list of the wrong length) to an object
    collective; raised on every rank. A ``ValueError`` too, as torch raises for such arguments."""


class CollectiveTimeout(TimeoutError):
    """A rank did not arrive at a collective within its timeout; names the missing rank(s)."""


class CaptureError(RuntimeError):
    """A CUDA-graph capture precondition is unmet, or the captured state was invalidated."""
