"""torchvision's ``references/classification/train.py`` (pinned in ../shared/upstream/), run as
written and as the real-loops guide ports it, on 2 gloo CPU ranks (workers of
tests/test_upstream_torchvision.py).

The script runs unchanged through ``runpy`` (its folder, with ``utils.py``, ``presets.py``,
``transforms.py`` and ``sampler.py``, each SHA-256 checked, first on ``sys.path``) on an
ImageFolder of small JPEGs the test makes. Its CPU snags are patched outside it, in this worker:

- ``utils.init_distributed_mode`` calls ``torch.cuda.set_device(args.gpu)`` (no CUDA device
  here: made a no-op) and hard-codes the "nccl" backend: the script still makes its own process
  group from torchrun's environment (``run_distributed(init=False)`` gives it, as torchrun
  would), only the backend is turned into "gloo". Chosen over letting ``run_distributed`` make
  the group and skipping the script's ``init_process_group``: the script's own call (its
  ``init_method``, rank, world size, the barrier after it) still runs.
- ``utils.reduce_across_processes`` (evaluation's sample count and every meter's
  ``synchronize_between_processes``) puts its tensor on "cuda": the same function on the CPU.
- The original's ``DistributedDataParallel(model, device_ids=[args.gpu])`` names a device for a
  CPU module, which DDP refuses: the original's DDP is built without ``device_ids`` (the port
  has no such line).
- The script seeds nothing (:func:`seed_as_unseeded_script`): torch's default generator
  (the model's init, every crop and flip) starts at a seed of its own in each interpreter
  (torch 2.14.1: ``python -c "import torch; print(torch.initial_seed())"`` prints another
  number each time), which ``run_distributed``'s workers inherit from its forkserver: the
  original and the port of one test session saw the same data, but each session other data
  (so a difference that only some data show came and went). Python's ``random``, from which
  mixup/cutmix's ``RandomChoice`` picks, is seeded by the OS at each fork. Both seeded before
  the script runs, in both runs alike: torch's with 0, ``random`` with the rank.
- ``--resume``: ``torch.load(..., weights_only=True)`` refuses the ``argparse.Namespace`` the
  script saved (torch >= 2.6, the original too): that class allowed with
  ``torch.serialization.add_safe_globals``, as the guide says.
- ``--sync-bn`` is not patched: torch's DDP refuses SyncBatchNorm in a CPU module
  ("SyncBatchNorm layers only work with GPU modules"), for the original and the port alike.
- ``--amp``: on the CPU the script's ``torch.cuda.amp.GradScaler()`` disables itself and
  ``torch.cuda.amp.autocast`` leaves CPU ops in float32 (a no-op), while the port's
  ``amp="fp16"`` is real fp16 on the CPU too. So under ``--amp`` the two names are the CPU's
  own: ``torch.amp.GradScaler("cpu")`` and ``torch.autocast("cpu", dtype=torch.float16)``,
  the same loss scaling and fp16 autocast on the CPU's kernels (the first steps overflow and
  are skipped, as on a GPU). On a GPU (``device="cuda"``: nothing of the above patched)
  tests/gpu/test_upstream_torchvision_gpu.py compares the script's CUDA amp.

The original's optimizer is made graph-safe (``plan_graph_safety``: fused SGD, capturable
foreach AdamW / RMSprop, the LR in a tensor; under ``--amp`` fused AdamW and SGD's momentum
buffers made before the first, skipped, step) where the port's TrainStep makes it, at the line
that wraps the model (its DDP), after the scheduler was built: the graph steps that arithmetic,
which differs from the untouched optimizer's by rounding (measured against the untouched one:
SGD's second loss 1.6368067 vs the script's 1.6368057, AdamW's 18th apart). The port's TrainStep runs on the CPU
engine (``CpuGraphs``), capturing and replaying.

Recorded from outside the script, at the same points in both: at each training batch's
``metric_logger.update(loss=..., lr=...)`` (after the update) the loss, every param group's LR
and the SHA-256 of every tensor of the model's state dict (parameters and BatchNorm buffers);
each evaluation forward's logits (a forward hook on the model, which the EMA's deep copy keeps);
the lines the script prints with "Acc@1"; and every checkpoint file it wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

from ddpgraph.step.optim import GraphSafeOptimizer, plan_graph_safety

from .upstream import (
    final_report,
    graphs_on_the_cpu_engine,
    keep_the_step,
    loader_workers_allowed,
    ported,
    sha256_of,
    stamp_updates,
)

FOLDER, NAME = "torchvision_classification", "train.py"
MODULES = ("utils.py", "presets.py", "transforms.py", "sampler.py")
CLASSES = 5  # the script's accuracy takes the top 5
TRAIN, VAL = 54, 20  # 27 images a rank: batches of 4, 4, 4, 4, 4, 4, 3; evaluation 4, 4, 2

# the guide's port (docs/guides/real-loops.md, "A classic recipe's own evaluation loop")
_SCRIPT_STEP = (
    "        with torch.cuda.amp.autocast(enabled=scaler is not None):\n"
    "            output = model(image)\n"
    "            loss = criterion(output, target)\n"
    "\n"
    "        optimizer.zero_grad()\n"
    "        if scaler is not None:\n"
    "            scaler.scale(loss).backward()\n"
    "            if args.clip_grad_norm is not None:\n"
    "                # we should unscale the gradients of optimizer's assigned params if do gradient clipping\n"
    "                scaler.unscale_(optimizer)\n"
    "                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)\n"
    "            scaler.step(optimizer)\n"
    "            scaler.update()\n"
    "        else:\n"
    "            loss.backward()\n"
    "            if args.clip_grad_norm is not None:\n"
    "                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)\n"
    "            optimizer.step()\n"
)
PORT = [
    ("import presets\n", "import ddpgraph\nimport presets\n"),
    (
        "def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema=None, scaler=None):\n",
        "def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema=None, scaler=None, step=None):\n",
    ),
    (
        _SCRIPT_STEP,
        "        # forward, backward, all-reduce, clipping, update\n"
        "        loss = step(image, target)\n"
        "        output = step.output\n",
    ),
    (
        "    scaler = torch.cuda.amp.GradScaler() if args.amp else None\n",
        "    scaler = None  # fp16's loss scaling is the step's (amp=)\n",
    ),
    (
        "    if args.distributed:\n"
        "        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])\n"
        "        model_without_ddp = model.module\n",
        "    step = ddpgraph.TrainStep(\n"
        "        model,\n"
        "        optimizer,\n"
        "        criterion,\n"
        "        amp=\"fp16\" if args.amp else None,\n"
        "        clip_grad_norm=args.clip_grad_norm,\n"
        "    )\n"
        "    model = step.model  # the DDP (the module itself on one process)\n",
    ),
    (
        "        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema, scaler)\n",
        "        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema, scaler, step)\n",
    ),
]  # fmt: skip


_COLOURS = torch.tensor(
    [[0, 0, 0], [159, 0, 0], [0, 159, 0], [0, 0, 159], [159, 159, 159]], dtype=torch.uint8
)


def make_images(folder: Path, train: int = TRAIN) -> None:
    """``train/`` (``train`` images) and ``val/`` ImageFolders of 40x40 JPEGs of noise,
    ``CLASSES`` classes, each class's images lifted by a colour of its own."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, count in (("train", train), ("val", VAL)):
        for n in range(count):
            label = n % CLASSES
            pixels = torch.randint(0, 96, (40, 40, 3), generator=gen, dtype=torch.uint8)
            pixels += _COLOURS[label]
            (folder / split / f"c{label}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels.numpy()).save(folder / split / f"c{label}" / f"{n}.jpg")


def run(
    folder: str,
    script: str,
    variant: str,
    flags: list[str],
    out: str,
    device: str = "cpu",
    keep: str = "all",
) -> dict[str, Any]:
    """One rank of the script ("original": its optimizer made graph-safe where the port's
    TrainStep makes it; "untouched": not) or of its port ("port"), with ``flags``, writing its
    checkpoints into ``folder/out``, on the CPU (its snags patched, the port on the CPU engine)
    or on this rank's GPU ("cuda": the script's own nccl group and CUDA graphs; nothing patched
    but the resume's ``Namespace`` and the seed; its loader may start workers); what it
    recorded (``keep="times"``: only a timestamp after each update and the port's final
    report, for benchmarks/upstream_ports.py)."""
    import torch.distributed as dist

    base = Path(folder)
    text = Path(script).read_text(encoding="utf-8")
    if variant == "port":
        text = ported(text, PORT)
    path = base / f"{variant}_{NAME}"
    written = path.with_suffix(f".{os.environ['RANK']}")  # each rank the same text, whole
    written.write_text(text)
    os.replace(written, path)
    sys.path.insert(0, str(Path(script).parent))  # its utils, presets, transforms, sampler
    os.chdir(base)
    record: dict[str, Any] = {"losses": [], "lrs": [], "updates": [], "logits": [], "report": ""}
    amp = "--amp" in flags
    if device == "cpu":
        _cpu_snags(variant, amp)
    else:
        loader_workers_allowed()
    if variant == "port" and os.environ.get("DDPGRAPH_PROBE_NO_SYNC_RECORD"):
        _no_sync_recording()
    torch.serialization.add_safe_globals([argparse.Namespace])
    if keep == "times":
        import utils

        stamp_updates(record, utils.MetricLogger, "update", lambda _, **kwargs: "lr" in kwargs)
        _script_ddp(variant, device, _optimizers_made(), amp)
    else:
        _record(record, variant, device, amp)
    sys.argv = [
        str(path), "--data-path", str(base / "images"), "--device", device, "--model",
        "shufflenet_v2_x0_5", "-b", "4", "--workers", "0", "--train-crop-size", "32",
        "--val-resize-size", "36", "--val-crop-size", "32", "--print-freq", "100",
        "--output-dir", str(base / out), *flags,
    ]  # fmt: skip
    seed_as_unseeded_script(int(os.environ["RANK"]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(path), run_name="__main__")
    record["printed"] = [line for line in printed.getvalue().splitlines() if "Acc@1" in line]
    record["report"] = final_report()  # the port's step's (empty for the script)
    dist.barrier()  # every rank's checkpoints written before the test reads them
    dist.destroy_process_group()
    return record


def seed_as_unseeded_script(rank: int) -> None:
    """The seeds a script that seeds nothing runs with here, the same in every test session:
    torch's default generator (CPU and CUDA) 0 (or ``$DDPGRAPH_SCRIPT_SEED``, to run the same
    comparison on other data), Python's ``random`` the rank (the docstring)."""
    torch.manual_seed(int(os.environ.get("DDPGRAPH_SCRIPT_SEED", "0")))
    random.seed(rank)


def _cpu_snags(variant: str, amp: bool) -> None:
    """The module docstring's patches, outside the script."""
    import torch.distributed as dist
    import utils

    if amp:
        torch.cuda.amp.GradScaler = lambda: torch.amp.GradScaler("cpu")  # type: ignore[assignment,misc]
        torch.cuda.amp.autocast = lambda enabled: torch.autocast(  # type: ignore[assignment,misc]
            "cpu", dtype=torch.float16, enabled=enabled
        )

    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    init_process_group = dist.init_process_group

    def gloo_group(*args: Any, backend: str | None = None, **kwargs: Any) -> None:
        init_process_group(*args, backend="gloo", **kwargs)

    dist.init_process_group = gloo_group  # type: ignore[assignment]

    def reduce_across_processes(val: Any) -> torch.Tensor:
        if not utils.is_dist_avail_and_initialized():
            return torch.tensor(val)
        t = torch.tensor(val)  # the script's, on the CPU
        dist.barrier()
        dist.all_reduce(t)
        return t

    utils.reduce_across_processes = reduce_across_processes
    if variant == "port":
        graphs_on_the_cpu_engine()


def _record(record: dict[str, Any], variant: str, device: str, amp: bool) -> None:
    """What the module docstring lists into ``record``; the port's step report; the original's
    DDP built without ``device_ids`` on the CPU, its optimizer made graph-safe there."""
    import utils

    held: dict[str, Any] = {"optimizers": _optimizers_made()}
    set_weight_decay = utils.set_weight_decay
    # after which updates benchmarks/probes/torchvision_amp_updates.py saves the states
    save_at = {int(n) for n in os.environ.get("DDPGRAPH_PROBE_STATES_AT", "").split(",") if n}

    def weight_decay_of(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        held["model"] = model  # the bare module, before any wrapper

        def hook(module: Any, inputs: Any, output: torch.Tensor) -> None:
            if not module.training:
                record["logits"].append(output.detach().cpu().clone())

        model.register_forward_hook(hook)  # the EMA's deep copy keeps it
        return set_weight_decay(model, *args, **kwargs)

    utils.set_weight_decay = weight_decay_of
    update = utils.MetricLogger.update

    def logged(self: Any, **kwargs: Any) -> None:
        if "lr" in kwargs:  # a training batch, after its update
            record["losses"].append(kwargs["loss"])
            groups = held["optimizers"][0].param_groups
            record["lrs"].append([float(group["lr"]) for group in groups])
            record["updates"].append([sha256_of(t) for t in held["model"].state_dict().values()])
            if len(record["losses"]) in save_at:
                _save_states(held["model"], held["optimizers"][0], len(record["losses"]))
        update(self, **kwargs)

    utils.MetricLogger.update = logged  # type: ignore[method-assign]
    if variant == "port":
        keep_the_step()
    _script_ddp(variant, device, held["optimizers"], amp)


def _save_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, updates: int) -> None:
    """After the ``updates``-th update, for benchmarks/probes/torchvision_amp_updates.py: the
    model, the optimizer's per-parameter state and the gradients by parameter name, and the
    param groups' values, into ``$DDPGRAPH_PROBE_STATES/{$DDPGRAPH_PROBE_NAME}-{updates}.pt``."""
    names = {id(p): name for name, p in model.named_parameters()}

    def cpu(value: Any) -> Any:
        return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value

    states = {
        "model": {key: cpu(value) for key, value in model.state_dict().items()},
        "state": {
            names[id(p)]: {key: cpu(value) for key, value in state.items()}
            for p, state in optimizer.state.items()
            if id(p) in names
        },
        "grads": {name: cpu(p.grad) for name, p in model.named_parameters() if p.grad is not None},
        "groups": [
            {key: cpu(value) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups
        ],
    }
    folder, name = os.environ["DDPGRAPH_PROBE_STATES"], os.environ["DDPGRAPH_PROBE_NAME"]
    torch.save(states, os.path.join(folder, f"{name}-{updates}.pt"))


def _no_sync_recording() -> None:
    """The port's last warm-up step run without the host-sync recording that names a failed
    capture's cause (``torch.cuda.set_sync_debug_mode("warn")`` around it): the probe's control."""
    from ddpgraph.step import eager
    from ddpgraph.step.syncs import SyncReport

    eager.record_host_syncs = lambda fn: SyncReport(fn(), [])  # type: ignore[assignment]


def _optimizers_made() -> list[torch.optim.Optimizer]:
    """Every optimizer made from now on, in order (the script's is the first)."""
    made: list[torch.optim.Optimizer] = []
    optimizer_init = torch.optim.Optimizer.__init__

    def init(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        optimizer_init(self, *args, **kwargs)
        made.append(self)

    torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign]
    return made


def _script_ddp(
    variant: str, device: str, optimizers: list[torch.optim.Optimizer], amp: bool
) -> None:
    """The script's DDP built without ``device_ids`` on the CPU; for "original" its optimizers
    made graph-safe there (where the port's TrainStep makes them)."""
    if variant == "port" or (variant == "untouched" and device != "cpu"):
        return
    ddp = torch.nn.parallel.DistributedDataParallel

    def wrapped(module: torch.nn.Module, device_ids: Any = None, **kwargs: Any) -> Any:
        if variant == "original":
            # where the port's TrainStep makes it graph-safe (a copy: the plan's probes add more)
            for optimizer in list(optimizers):
                plan = plan_graph_safety(optimizer, torch.device(device), fp16=amp)
                assert isinstance(plan, GraphSafeOptimizer), plan
        if device == "cpu":
            return ddp(module, **kwargs)  # no device_ids for a CPU module
        return ddp(module, device_ids=device_ids, **kwargs)

    torch.nn.parallel.DistributedDataParallel = wrapped  # type: ignore[misc]


def comparable(value: Any) -> Any:
    """``value`` with every tensor cloned and every ``argparse.Namespace`` a dict without the
    paths naming a run's own folders (``output_dir``, ``resume``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, argparse.Namespace):
        return {
            k: comparable(v) for k, v in vars(value).items() if k not in ("output_dir", "resume")
        }
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    return value


def saved(out: Path) -> dict[str, Any]:
    """Every checkpoint file the script wrote under ``out`` (``model_<epoch>.pth``,
    ``checkpoint.pth``), loaded, by name (read once every rank has finished)."""
    return {
        p.name: comparable(torch.load(p, map_location="cpu", weights_only=False))
        for p in sorted(out.glob("*.pth"))
    }
