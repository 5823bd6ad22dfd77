"""torch's untyped entry points that ddpgraph calls, each given its type once, here.

torch ships some functions without annotations (CUDA streams and events, ``Tensor.backward``,
DDP's buffer and logging helpers, DCP's re-exports, torchrun's ``run``). Calling them from typed
code is what ``mypy --strict`` refuses; each wrapper below states the type torch documents, so
the rest of the package is checked strictly without ignoring whole files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "backward",
    "child_failure_message",
    "cuda_event",
    "cuda_stream",
    "cudnn_version",
    "dcp_load",
    "ddp_remove_autograd_hooks",
    "ddp_set_logging_sample_rate",
    "ddp_sync_buffers",
    "ddp_will_sync_buffers",
    "filesystem_reader",
    "nccl_version",
    "torch_device",
    "torchrun",
]


def cuda_stream(device: torch.device | int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def cuda_event(*, enable_timing: bool = False) -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=enable_timing)  # type: ignore[no-untyped-call]


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]


def torch_device(spec: object) -> torch.device:
    """``torch.device(spec)`` for any spelling torch takes (str, int, device); raises as torch
    does (RuntimeError/TypeError) for anything else."""
    device: torch.device = torch.device(spec)  # type: ignore[call-overload]
    return device


def ddp_will_sync_buffers(ddp: DistributedDataParallel) -> bool:
    return bool(ddp.will_sync_module_buffers())  # type: ignore[no-untyped-call]


def ddp_sync_buffers(ddp: DistributedDataParallel) -> None:
    """Rank 0's buffers to every rank, as DDP's forward does first (its ``_sync_buffers`` also
    picks up buffers the module reassigned)."""
    ddp._sync_buffers()  # type: ignore[no-untyped-call]


def ddp_set_logging_sample_rate(ddp: DistributedDataParallel, rate: int) -> None:
    ddp._set_ddp_runtime_logging_sample_rate(rate)  # type: ignore[no-untyped-call]


def cudnn_version() -> int | None:
    """cuDNN's version number, None where cuDNN is not available."""
    backends = torch.backends.cudnn
    if not backends.is_available():  # type: ignore[no-untyped-call]
        return None
    version: int | None = backends.version()  # type: ignore[no-untyped-call]
    return version


def nccl_version() -> tuple[int, ...]:
    version: tuple[int, ...] = tuple(torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    return version


def torchrun(args: Any) -> None:
    """torchrun's own ``run`` (torch.distributed.run) on parsed arguments."""
    from torch.distributed.run import run

    run(args)  # type: ignore[no-untyped-call]


def child_failure_message(exc: Any) -> str:
    """torchelastic's ChildFailedError text: the ranks that failed, with their exit codes."""
    return str(exc.format_msg())


def ddp_remove_autograd_hooks(ddp: DistributedDataParallel) -> None:
    """Detach a DDP's reducer from the parameters (before building another DDP over them)."""
    ddp._remove_autograd_hooks()  # type: ignore[no-untyped-call]


def filesystem_reader(path: Any) -> FileSystemReader:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(path)


def dcp_load(state: dict[str, Any], *, checkpoint_id: Any, no_dist: bool) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    load(state, checkpoint_id=checkpoint_id, no_dist=no_dist)
