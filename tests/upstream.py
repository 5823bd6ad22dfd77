"""The pinned public scripts in ``../shared/upstream/`` (beside the checkout; never copied into
the repository): where they are, each file checked against the SHA-256 its ``SOURCE.md`` lists,
and the port a guide tells a user to write, made from the script's own text by replacing the
lines the guide's diff names (each must be found exactly once, so a guide that no longer fits
the pinned script fails here)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# DDPGRAPH_UPSTREAM: a copy of the folder where ../shared does not travel (the GPU machine gets
# the checkout alone: copy it into a folder .git/info/exclude ignores and carry that)
UPSTREAM = Path(os.environ.get("DDPGRAPH_UPSTREAM") or REPO_ROOT.parent / "shared" / "upstream")


def script(folder: str, name: str) -> Path:
    """``../shared/upstream/<folder>/<name>`` (or under ``$DDPGRAPH_UPSTREAM``), its SHA-256
    checked; skipped (with the reason) only where that folder is absent."""
    if not UPSTREAM.is_dir():
        pytest.skip(
            f"no {UPSTREAM} (../shared/upstream beside the checkout, or $DDPGRAPH_UPSTREAM)"
        )
    path = UPSTREAM / folder / name
    listed = dict(
        re.findall(r"^\| (\S+) \| ([0-9a-f]{64}) \|$", _read(UPSTREAM / folder / "SOURCE.md"), re.M)
    )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert listed.get(name) == digest, f"{path} is not the pinned file (sha256 {digest})"
    return path


def ported(text: str, edits: list[tuple[str, str]]) -> str:
    """``text`` with each ``(old, new)`` replaced; each ``old`` must occur exactly once."""
    for old, new in edits:
        count = text.count(old)
        assert count == 1, f"the guide's line occurs {count} times in the script: {old!r}"
        text = text.replace(old, new)
    return text


def graph_safe_at_prepare(device: str = "cpu") -> None:
    """Make the optimizer a script passes to ``accelerator.prepare`` graph-safe there (outside
    the script), where the port's TrainStep makes it (after the script built its scheduler): the
    script's run then steps the arithmetic the graph steps (capturable, foreach, the LR in a
    tensor), which differs from its own AdamW's by the rounding ``report()`` names."""
    import torch
    from accelerate import Accelerator

    from ddpgraph.step.optim import make_graph_safe

    prepare = Accelerator.prepare

    def prepared(self: object, *objects: object, **kwargs: object) -> object:
        for item in objects:
            if isinstance(item, torch.optim.Optimizer):
                make_graph_safe(item, torch.device(device))
        return prepare(self, *objects, **kwargs)

    Accelerator.prepare = prepared  # type: ignore[method-assign]


def ready_to_run(base: Path, path: Path, text: str, device: str = "cpu") -> None:
    """On every rank: ``text`` (the script, or its port) written to ``path`` by rank 0, the
    working directory ``base``, no hub (offline), and on the CPU Accelerate there (the README's
    snag: else accelerate wants a GPU)."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("RANK", "0")) == 0:
        path.write_text(text)
    dist.barrier()
    os.chdir(base)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"
    if device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"


def record_updates(record: dict[str, Any]) -> None:
    """At each prepared scheduler's ``step()`` (a script steps it after each optimizer step):
    the LR (as floats) into ``record["lrs"]``, every parameter into ``record["updates"]``."""
    from accelerate.scheduler import AcceleratedScheduler

    from .framework_workers import tensors_of

    scheduler_step = AcceleratedScheduler.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = scheduler_step(self, *args, **kwargs)
        record["lrs"].append([float(lr) for lr in self.get_last_lr()])
        params = [p for g in self.scheduler.optimizer.param_groups for p in g["params"]]
        record["updates"].append(tensors_of(params))
        return result

    AcceleratedScheduler.step = step  # type: ignore[method-assign]


def record_step_losses(record: dict[str, Any]) -> None:
    """Each TrainStep call's returned loss into ``record["losses"]``, its report as
    ``record["report"]``."""
    import ddpgraph

    call = ddpgraph.TrainStep.__call__

    def train_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        loss = call(self, *args, **kwargs)
        record["losses"].append(loss.detach().clone())
        record["report"] = str(self.report())
        return loss

    ddpgraph.TrainStep.__call__ = train_call  # type: ignore[method-assign]


# the line every Accelerate script prepares its objects with, and what the guides' ports put in
# its place before building the step (the model and optimizer go to from_accelerator)
PREPARE_ALL = (
    "    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(\n"
    "        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler\n"
    "    )\n"
)
PREPARE_THE_REST = (
    "    train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(\n"
    "        train_dataloader, eval_dataloader, lr_scheduler\n"
    "    )\n"
)


def graphs_on_the_cpu_engine() -> None:
    """Every TrainStep the script builds captures and replays on the CPU engine ("The CPU
    judges like the GPU"), the script unchanged."""
    from ddpgraph.step import assembly
    from ddpgraph.testing import CpuGraphs

    build = assembly.build_graphs  # where TrainStep's parts are built (step/assembly.py)

    def build_graphs(engine: Any, *args: Any) -> Any:
        return build(engine or CpuGraphs(), *args)

    assembly.build_graphs = build_graphs  # type: ignore[assignment]


def stamp_updates(
    record: dict[str, Any], owner: Any, name: str, after: Any = lambda *args, **kwargs: True
) -> None:
    """In place of the recording (what benchmarks/upstream_ports.py times): after each call of
    ``owner.name`` for which ``after(self, *args, **kwargs)`` holds (the script's update point)
    a host timestamp behind a device sync into ``record["times"]``, and nothing else; the
    TrainStep a port calls kept, for :func:`final_report`."""
    import time

    method = getattr(owner, name)

    def stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if after(self, *args, **kwargs):
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            record.setdefault("times", []).append(time.perf_counter())
        return result

    setattr(owner, name, stamped)
    keep_the_step()


def keep_the_step() -> None:
    """Keep the TrainStep a port calls (the last one called), for :func:`final_report`."""
    import ddpgraph

    call = ddpgraph.TrainStep.__call__

    def kept(self: Any, *args: Any, **kwargs: Any) -> Any:
        _STEPS[:] = [self]
        return call(self, *args, **kwargs)

    ddpgraph.TrainStep.__call__ = kept  # type: ignore[method-assign]


_STEPS: list[Any] = []  # the TrainStep a port called last (keep_the_step)


def final_report() -> str:
    """``str(step.report())`` of the TrainStep a port called (empty for the script)."""
    return str(_STEPS[-1].report()) if _STEPS else ""


def loader_workers_allowed() -> None:
    """Let a script's DataLoader start worker processes from a ``run_distributed`` rank, as
    from a torchrun rank."""
    import multiprocessing

    # run_distributed's workers are daemonic processes, which multiprocessing allows no children,
    # and the script's DataLoaders start workers (e.g. num_workers=4), as under a launcher, where
    # the rank is no daemon (on the H100 at c4107d2: "daemonic processes are not allowed to have
    # children" at the first batch)
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    # and they start with the default method, fork, as from a torchrun rank; run_distributed's
    # forkserver made itself the default here, and a forkserver worker imports torch, timm and
    # Accelerate anew at each epoch's loader (on the H100 a run took 79 s instead of 13)
    multiprocessing.set_start_method("fork", force=True)


def timed_run(module: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``tests.<module>.run(*args, **kwargs, keep="times")`` on this rank (the worker of
    benchmarks/upstream_ports.py): its timestamps, the lines it printed, the port's report."""
    import importlib

    worker = importlib.import_module(f"tests.{module}")
    record = worker.run(*args, **kwargs, keep="times")
    return {key: record.get(key) for key in ("times", "printed", "report")}


def sha256_of(tensor: torch.Tensor) -> torch.Tensor:
    """The SHA-256 of the tensor's dtype, shape and bytes, as 32 uint8s: equal exactly when the
    tensor is (the test compares it with ``torch.equal``, as it would the tensor)."""
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    digest = hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
    digest.update(data.tobytes())
    return torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")
