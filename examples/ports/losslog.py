"""Per-iteration losses of a port's run, for comparing an original script with its ddpgraph port.

The baseline and ported scripts call :func:`record` once per training iteration with the loss
they already turn into a Python number (a host sync the scripts make anyway). When the
environment names a file in ``PORTS_LOSSES``, rank 0 rewrites ``{"losses": [...], "times":
[...]}`` there after each record (``times``: ``time.perf_counter()`` at each record, for ms/iter).
It writes as it goes, not at exit, because ``torch.multiprocessing.spawn``'s workers (imagenet's
launch) leave with ``os._exit`` and run no exit handlers. Without ``PORTS_LOSSES`` it does nothing.
"""

from __future__ import annotations

import json
import os
import time

import torch.distributed as dist

PATH = os.environ.get("PORTS_LOSSES")
_losses: list[float] = []
_times: list[float] = []


def record(loss: float) -> None:
    if not PATH:
        return
    _losses.append(float(loss))
    _times.append(time.perf_counter())
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        with open(PATH, "w") as f:
            json.dump({"losses": _losses, "times": _times}, f)
