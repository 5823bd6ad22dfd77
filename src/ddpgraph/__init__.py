"""ddpgraph: fast PyTorch data-parallel training that never fails silently.

Public names are exactly those in ``__all__`` (pinned by a test); everything else is internal.
"""

from __future__ import annotations

from . import _cli_start  # noqa: F401  # first: Ctrl-C while the command line imports torch
from .checkpoint import (
    CheckpointError,
    ResumableLoader,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_async,
)
from .data import pad_batch, prefetch
from .data.device_data import DeviceData
from .distributed.metrics import gather_for_metrics
from .distributed.objects import all_gather_object, broadcast_object, gather_object
from .distributed.runtime import Runtime, get_runtime, init, shutdown
from .errors import (
    CaptureError,
    CollectiveTimeout,
    ConfigError,
    DeviceConflictError,
    DistributedStateError,
    Explanation,
    NonFiniteError,
    ObjectCollectiveError,
    explain,
)
from .step import StepReport, TrainStep

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "CheckpointError",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceConflictError",
    "DeviceData",
    "DistributedStateError",
    "Explanation",
    "NonFiniteError",
    "ObjectCollectiveError",
    "ResumableLoader",
    "Runtime",
    "StepReport",
    "TrainStep",
    "__version__",
    "all_gather_object",
    "broadcast_object",
    "explain",
    "gather_for_metrics",
    "gather_object",
    "get_runtime",
    "init",
    "latest_checkpoint",
    "load_checkpoint",
    "pad_batch",
    "prefetch",
    "save_checkpoint",
    "save_checkpoint_async",
    "shutdown",
]
