"""Whether the command line shows tracebacks: ``--debug`` or ``DDPGRAPH_DEBUG=1``.

Without it, a ddpgraph error (whose message names what broke, the value seen and the fix) is
printed as one message; with it, the whole traceback too. The flag travels to worker processes
through the environment, which they inherit.
"""

from __future__ import annotations

import os

from ._files import OutputWriteError
from .errors import (
    CaptureError,
    CollectiveTimeout,
    ConfigError,
    DeviceConflictError,
    DistributedStateError,
    NonFiniteError,
    ObjectCollectiveError,
)

DEBUG_ENV = "DDPGRAPH_DEBUG"

# What ddpgraph raises with a message that is the whole story: worth no traceback by default.
# ConfigError (CheckpointError too) is the caller's input: a usage error; OutputWriteError (a
# result file a full disk or a read-only folder refused) is not.
REPORTED = (
    ConfigError,
    DistributedStateError,
    DeviceConflictError,
    ObjectCollectiveError,
    CollectiveTimeout,
    CaptureError,
    NonFiniteError,
    OutputWriteError,
)


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def request_debug() -> None:
    """Turn tracebacks on for this process and the workers it starts."""
    os.environ[DEBUG_ENV] = "1"
