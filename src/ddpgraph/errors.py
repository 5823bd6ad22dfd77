"""The exception types every ddpgraph module raises.

Each message says what broke, the value seen and the fix. Types subclass the builtin that fits
(`ValueError` for bad input or configuration, `RuntimeError` for a bad state at run time) so that
existing ``except`` clauses keep working.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .facts import WARMUP_RULE

__all__ = [
    "CaptureError",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceConflictError",
    "DistributedStateError",
    "Explanation",
    "ObjectArgumentError",
    "ObjectCollectiveError",
    "explain",
    "with_explanation",
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
    """A rank did not arrive at a collective within its timeout; names the missing rank(s).

    ``missing`` lists the ranks that had not arrived or were behind (empty where unknown).
    """

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message, tuple(missing))
        self.missing: tuple[int, ...] = tuple(missing)

    def __str__(self) -> str:
        return str(self.args[0])


class CaptureError(RuntimeError):
    """A CUDA-graph capture precondition is unmet, or the captured state was invalidated."""


# --- explain(): known error texts -> cause and fix -------------------------------------------
# Kept here (not in doctor/) so that the core can attach explanations to what it raises without
# importing the CLI side; only ``re`` and ``dataclasses`` are needed.


@dataclass(frozen=True)
class Explanation:
    """What a known error text means: a short ``title``, its ``cause`` and the ``fix``.

    ``pattern`` is the regular expression that matched, ``matched`` the text it matched.
    """

    title: str
    cause: str
    fix: str
    pattern: str = ""
    matched: str = ""

    def render(self) -> str:
        return f"{self.title}\ncause: {self.cause}\nfix: {self.fix}"


@dataclass(frozen=True)
class _Known:
    pattern: re.Pattern[str]
    title: str
    cause: str
    fix: str


def _known(pattern: str, title: str, cause: str, fix: str) -> _Known:
    return _Known(re.compile(pattern, re.IGNORECASE), title, cause, fix)


_WARMUP_FIX = f"{WARMUP_RULE}; ddpgraph.TrainStep does this for you"

# Ordered root cause first: a traceback often holds both the first CUDA error and the
# "previous error during capture" that follows it, and the first one is the one to fix.
_KNOWN: tuple[_Known, ...] = (
    _known(
        r"would make the legacy stream depend on a capturing blocking stream",
        "DDP (or other work) on the default stream while capturing",
        "the captured code synchronised with the legacy default stream; with DDP this happens "
        "when the DistributedDataParallel model was constructed on the default stream, so its "
        "reducer's all-reduce and copies are ordered after it, or the capture stream differs "
        "from the stream DDP was built on",
        "create a side stream s = torch.cuda.Stream(), build DDP, the optimizer and the warm-up "
        "under `with torch.cuda.stream(s):`, and capture with `torch.cuda.graph(g, stream=s)`; "
        "ddpgraph.TrainStep does this for you",
    ),
    _known(
        r"Attempting (?:CUDA|XPU) graph capture of step\(\).*capturable is False"
        r"|If capturable=False, state_steps should not be CUDA tensors"
        r"|capturable=False",
        "optimizer not capturable",
        "the optimizer keeps its step counters on the CPU and reads them on the host, which a "
        "CUDA graph cannot capture (Adam, AdamW, NAdam, RAdam, Adamax, ASGD, ...); or state "
        "built by a capturable optimizer was loaded into a non-capturable one",
        "construct the optimizer with capturable=True (e.g. torch.optim.AdamW(params, lr=..., "
        "capturable=True)) before the warm-up, and keep the same setting when loading its state",
    ),
    _known(
        r"operation not permitted when stream is capturing",
        "a host synchronisation inside CUDA-graph capture",
        "something in the captured region waited for the GPU: .item(), .cpu(), .tolist(), "
        "print(tensor), torch.cuda.synchronize(), a CUDA event query - or DDP's runtime-stats "
        "logging, which records CUDA-event timers at iterations 0..10 and every 100th "
        "(DistributedDataParallel._pre_forward -> set_runtime_stats_and_log)",
        _WARMUP_FIX
        + "; move every .item()/.cpu()/print of a tensor out of the captured region (read "
        "the static output after g.replay())",
    ),
    _known(
        r"operation failed due to a previous error during capture",
        "capture aborted by an earlier error",
        "an earlier operation in the same capture failed (often 'operation would make the legacy "
        "stream depend on a capturing blocking stream' or 'operation not permitted when stream "
        "is capturing'); this message is only the consequence",
        "scroll up to the first CUDA error of the capture and fix that one; run `ddpgraph lint` "
        "on the script to find the usual causes (DDP stream, warm-up count, .item() in capture)",
    ),
    _known(
        r"Duplicate GPU detected|ncclInvalidUsage",
        "two ranks on one GPU",
        "two ranks of a host use the same GPU, nearly always because torch.cuda.set_device("
        "LOCAL_RANK) was never called so every rank defaults to cuda:0 (or two ranks were given "
        "the same CUDA_VISIBLE_DEVICES)",
        "call ddpgraph.init() - or torch.cuda.set_device(local_rank) and "
        "init_process_group('nccl', device_id=torch.device('cuda', local_rank)) - before any "
        "CUDA work or collective; run `ddpgraph doctor` to check the devices",
    ),
    _known(
        r"Watchdog caught collective operation timeout|collective operation timeout"
        r"|ProcessGroupNCCL.*timed? ?out",
        "a collective timed out",
        "one rank did not reach a collective the others entered: a rank crashed or is slower, "
        "ranks call collectives in a different order or a different number of times (e.g. a "
        "collective behind `if rank == 0`), or an object collective hung because ranks use the "
        "same GPU",
        "check the other ranks' logs for the first error; make every rank issue the same "
        "collectives in the same order; bind each rank to its own GPU (ddpgraph.init()); raise "
        "the timeout only if a rank is legitimately slow (init_process_group(timeout=...))",
    ),
    _known(
        r"all_gather_object|gather_object|broadcast_object_list|scatter_object_list",
        "object collective failure or hang",
        "torch's object collectives pickle on the *current* CUDA device and need every rank to "
        "call them with an output list of exactly world_size entries; without set_device all "
        "ranks use cuda:0 and hang or fail, and a wrong-sized list raises or keeps silent Nones",
        "bind the device first (ddpgraph.init() or torch.cuda.set_device(local_rank)), size the "
        "output list with [None] * dist.get_world_size(), and call on every rank; "
        "ddpgraph.all_gather_object returns a correctly sized list and names the failing rank",
    ),
    _known(
        r"Connection (?:closed|reset) by peer|Broken pipe|NCCL error.*remote process exited",
        "a peer rank is gone",
        "another rank exited or crashed (or destroyed its process group) while this rank was "
        "still inside a collective with it; this rank's error is only the consequence",
        "find the first error in the other ranks' logs (torchrun prints the root-cause rank); "
        "make every rank reach the same collectives, and call ddpgraph.shutdown() on all ranks "
        "at the end",
    ),
    _known(
        r"an illegal memory access was encountered|illegal memory access",
        "illegal memory access",
        "a kernel read or wrote memory it does not own; with CUDA graphs usually a replay after "
        "the static inputs/outputs or the graph's memory pool were freed or re-allocated, a "
        "tensor from another device, or an out-of-range index; the error is sticky and can be "
        "reported by a later, innocent call",
        "rerun with CUDA_LAUNCH_BLOCKING=1 to find the real call; keep the static tensors of a "
        "graph alive and update them with .copy_() instead of re-binding; check index ranges",
    ),
    _known(
        r"CUDA out of memory|OutOfMemoryError",
        "GPU out of memory",
        "the allocation did not fit; a CUDA graph keeps a private memory pool alive, and several "
        "ranks on one GPU multiply the usage",
        "reduce the batch size, capture once (not per shape), make sure each rank uses its own "
        "GPU (ddpgraph.init()), and free old graphs before capturing new ones",
    ),
    _known(
        r"Expected all tensors to be on the same device",
        "tensors on different devices",
        "an input or parameter is on another device than the model - often cuda:0 on every rank "
        "because the device was never bound",
        "bind the device with ddpgraph.init() (or torch.cuda.set_device(local_rank)) and move "
        "inputs with .to(device)",
    ),
)


def explain(text: str) -> Explanation | None:
    """The explanation of the first known error in ``text`` (an exception message or a log), or None."""
    for known in _KNOWN:
        match = known.pattern.search(text)
        if match:
            return Explanation(
                known.title, known.cause, known.fix, known.pattern.pattern, match.group(0)
            )
    return None


def with_explanation(exc: BaseException) -> str:
    """``str(exc)`` followed by the explanation of its text when one is known (for the core to attach)."""
    message = str(exc)
    found = explain(f"{type(exc).__name__}: {message}")
    if found is None:
        return message
    return f"{message}\n\nddpgraph explains: {found.render()}"
