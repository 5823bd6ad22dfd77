"""Moved to :mod:`ddpgraph.step.optim`; this path works for one more release (0.2)."""

from __future__ import annotations

import sys
import warnings

from .step import optim as _moved

warnings.warn(
    "ddpgraph.optim moved to ddpgraph.step.optim; import it from there (this path goes in 0.3).",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
