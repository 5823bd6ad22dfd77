"""Old module paths of 0.1 that still import, with a DeprecationWarning, until 0.3.

A module moved in 0.2 (``ddpgraph.runtime`` → ``ddpgraph.distributed.runtime``, …) leaves a
file at its old path whose only line is ``moved(__name__, NEW)``: importing it imports the new
module, puts that very module under the old name (so ``ddpgraph.runtime.init is
ddpgraph.distributed.runtime.init``, private names and monkeypatching included) and warns once
with the new path.
"""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["moved"]


def moved(old: str, new: str) -> None:
    module = importlib.import_module(new)
    warnings.warn(
        f"{old} moved to {new} in ddpgraph 0.2; import it from there (the old path goes in 0.3).",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = module
