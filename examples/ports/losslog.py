"""Per-iteration losses of a port's run, for comparing an original script with its ddpgraph port.

The baseline and ported scripts call :func:`record` once per training iteration with the loss
(nanoGPT and imagenet pass the number they already took with ``.item()``; the tutorial, which
takes none, passes the tensor, so both of its variants gain the same host sync). When the
environment names a file in ``PORTS_LOSSES``, rank 0 rewrites ``{"losses": [...], "times": [...]}``
there after each record; ``times`` are ``time.perf_counter()`` at each record less the time
spent writing the file, for ms/iter. It writes as it goes, not at exit, because
``torch.multiprocessing.spawn``'s workers (imagenet's launch) leave with ``os._exit`` and run no
exit handlers. Without ``PORTS_LOSSES`` it does nothing.
"""

from __future__ import annotations

import json
import os
import time

import torch.distributed as dist

PATH = os.environ.get("PORTS_LOSSES")
_losses: list[float] = []
_times: list[float] = []
_writing = 0.0  # seconds spent writing PATH, left out of the times


def record(loss: float) -> None:
    if not PATH:
        return
    global _writing
    _losses.append(float(loss))
    _times.append(time.perf_counter() - _writing)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        started = time.perf_counter()
        with open(PATH, "w") as f:
            json.dump({"losses": _losses, "times": _times}, f)
        _writing += time.perf_counter() - started
