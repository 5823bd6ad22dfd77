"""The exception types every ddpgraph module raises.

Each message says what broke, the value seen and the fix. Types subclass the builtin that fits
(`ValueError` for bad input or configuration, `RuntimeError` for a bad state at run time) so that
existing ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceConflictError",
    "DistributedStateError",
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
    """An object collective failed on at least one rank; raised identically on every rank."""


class CollectiveTimeout(TimeoutError):
    """A rank did not arrive at a collective within its timeout; names the missing rank(s)."""


class CaptureError(RuntimeError):
    """A CUDA-graph capture precondition is unmet, or the captured state was invalidated."""
