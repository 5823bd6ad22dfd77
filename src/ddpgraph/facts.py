"""Facts about torch that several parts of ddpgraph state: one place, imported everywhere.

TrainStep plans its warm-up from them, ``ddpgraph lint`` (DG104) checks hand-written capture
against them, and ``explain()`` quotes them in its fixes. Measured on an H200 with torch 2.11
(REFERENCES.md); the source is torch/csrc/distributed/c10d/reducer.cpp
(``Reducer::should_collect_runtime_stats``) and logger.cpp.
"""

from __future__ import annotations

__all__ = [
    "DDP_STATS_FIRST_ITERATIONS",
    "DDP_STATS_SAMPLE_RATE",
    "DEFAULT_WARMUP",
    "WARMUP_RULE",
    "ddp_count_allows_capture",
]

# DDP's reducer times iteration i (CUDA events recorded in its forward and backward) when i is
# 1..10 or a multiple of the sample rate, and the next forward reads those timers on the host
# (Logger::set_runtime_stats_and_log, before the count is incremented). So a forward after n
# earlier ones reads iteration n's timers and records iteration n + 1's. Capturing it fails when
# n is timed (a host read inside a capture: "operation not permitted when stream is capturing"),
# and when n + 1 is timed the captured events are read by the next eager forward, which dies with
# "CUDA error: invalid argument" (a captured event cannot be timed).
DDP_STATS_FIRST_ITERATIONS = 10
DDP_STATS_SAMPLE_RATE = 100  # kDDPRuntimeLoggingSampleRate

# The 12th eager step (count 11) is the first one DDP does not time; TrainStep checks host
# syncs in one more eager step before capturing.
DEFAULT_WARMUP = 12

WARMUP_RULE = (
    "run at least 11 eager DDP iterations before capture, and a count that is not a multiple of "
    "100 (e.g. 11 or 20, not 10 or 100)"
)


def ddp_count_allows_capture(
    sync_forwards_done: int, sample_rate: int = DDP_STATS_SAMPLE_RATE
) -> bool:
    """Whether a DDP forward after ``sync_forwards_done`` earlier ones may be captured.

    True when neither iteration n (whose timers that forward reads) nor n + 1 (whose timers it
    records) is timed. ``sample_rate`` is the reducer's runtime-logging sample rate (100 unless
    changed with ``DistributedDataParallel._set_ddp_runtime_logging_sample_rate``).
    """
    n = sync_forwards_done
    return n >= DDP_STATS_FIRST_ITERATIONS + 1 and not (
        _timed(n, sample_rate) or _timed(n + 1, sample_rate)
    )


def _timed(iteration: int, sample_rate: int) -> bool:
    return 0 < iteration <= DDP_STATS_FIRST_ITERATIONS or iteration % sample_rate == 0
