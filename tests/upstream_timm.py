"""timm's ``train.py`` (pinned in ../shared/upstream/timm_train/, timm v1.0.28), run as written and
as the graphed-training guide ports it, on 2 gloo CPU ranks (the worker of
tests/test_upstream_timm.py).

The script runs unchanged through ``runpy`` on a folder of small JPEGs in ``train/`` and
``validation/`` class folders, with ``--device cpu``: its ``init_distributed_device`` starts the
process group from the launcher's environment (``run_distributed(init=False)``) with gloo, its
backend for any device but cuda, xpu, hpu and npu, so that needs no patch. Its snags on the CPU are patched outside
the script, in the worker, before it runs (the README of ../shared/upstream names both):

- ``ClassificationTask.prepare_distributed(device_ids=[device])`` with ``device`` the CPU: DDP
  refuses ``device_ids`` for a CPU module ("DistributedDataParallel device_ids and output_device
  arguments only work with single-device/multiple-device GPU modules or CPU modules, but got
  device_ids [device(type='cpu')]..."), so the CPU's ``device_ids`` become ``None`` (what DDP
  asks for a CPU module);
- timm's ``create_loader`` asks ``persistent_workers=True`` (its default) with ``-j 0``, which
  torch's DataLoader refuses ("persistent_workers option needs num_workers > 0"): with no
  workers it is passed ``False`` (a no-op there: nothing persists without workers). ``-j 0``
  because the ranks are daemonic processes, which may have no children.

Recorded from outside the script: each training micro-batch's loss (``ClassificationTask``'s
``result['loss']`` in the script, the TrainStep's return in the port), at each scheduler
``step_update`` (the script calls it after every optimizer update) every parameter and then the
LR it set, the LR after each per-epoch ``step``, each validation forward's output (a hook on the
model ``create_model`` made: validation runs through ``task.get_eval_model()``, that bare
module, in both), the lines the script logs ("Train: ...", "Test: ..." with their times cut
out), and every file the ``--output`` folder holds. The script's optimizer is made graph-safe
(``"graph_safe"``) where the port's TrainStep makes it, at ``prepare_distributed``, or left as
it is (``"original"``); the port's TrainStep runs on the CPU engine (``CpuGraphs``).
"""

from __future__ import annotations

import logging
import os
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

from .upstream import (
    final_report,
    graphs_on_the_cpu_engine,
    loader_workers_allowed,
    ported,
    record_step_losses,
    stamp_updates,
)

FOLDER, NAME = "timm_train", "train.py"
CLASSES, TRAIN, VALIDATION = 8, 80, 24  # 10 batches of 4 a rank an epoch; 3 to validate

# the port (docs/guides/graphed-training.md, "timm's train.py"): the TrainStep built where the
# script wraps DDP, its DDP put in the task (``task.no_sync()`` enters it), and each micro-batch
# one ``step`` call dividing by the window's length as the script's ``_forward`` does
PORT = [
    (
        "from timm.utils import NativeScaler\n",
        "from timm.utils import NativeScaler\nfrom ddpgraph import TrainStep\n",
    ),
    (
        "    if args.distributed:\n"
        "        if utils.is_primary(args):\n"
        '            _logger.info("Preparing task for distributed training")\n'
        "        task.prepare_distributed(device_ids=[device], broadcast_buffers=not args.no_ddp_bb)\n"
        "        model = task.get_trainable_module()\n",
        "    step = TrainStep(\n"
        "        model, optimizer, train_loss_fn,\n"
        "        accumulate_calls=args.grad_accum_steps, clip_grad_norm=args.clip_grad,\n"
        "        amp=amp_dtype if args.amp else None,\n"
        "        ddp_kwargs=dict(broadcast_buffers=not args.no_ddp_bb),\n"
        "    )\n"
        "    task.trainable_module = model = step.model\n",
    ),
    (
        "                task=task,\n                device=device,\n",
        "                task=task,\n                step=step,\n                device=device,\n",
    ),
    (
        "        task=None,\n        device=torch.device('cuda'),\n",
        "        task=None,\n        step=None,\n        device=torch.device('cuda'),\n",
    ),
    (
        "            if has_no_sync and not need_update:\n"
        "                with task.no_sync():\n"
        "                    loss, result = _forward()\n"
        "                    _backward(loss)\n"
        "            else:\n"
        "                loss, result = _forward()\n"
        "                _backward(loss)\n",
        "            if has_no_sync and not need_update:\n"
        "                with task.no_sync():\n"
        "                    loss = step(input, target, window=accum_steps) / accum_steps\n"
        "            else:\n"
        "                loss = step(input, target, window=accum_steps) / accum_steps\n",
    ),
    (
        "        num_updates += 1\n        optimizer.zero_grad()\n",
        "        num_updates += 1\n",
    ),
]


# the port with a piece left out (refused, on every rank, before its first update runs short):
# without window= the step cannot tell timm's divisor of a short window (its length) from k;
# without accumulate_calls every call must step, and the script's no_sync says it does not
_STEP_CALL = "step(input, target, window=accum_steps)"
UNFINISHED = {
    "port_no_window": [(_STEP_CALL, "step(input, target)")] * 2,
    "port_no_accumulate_calls": [
        ("accumulate_calls=args.grad_accum_steps, ", ""),
        *[(_STEP_CALL, "step(input, target)")] * 2,
    ],
}


def make_images(folder: Path) -> None:
    """``TRAIN`` and ``VALIDATION`` 40x40 JPEGs of ``CLASSES`` classes in class folders, each
    class brighter in its own stripe of rows (learnable in a few epochs)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, count in (("train", TRAIN), ("validation", VALIDATION)):
        for n in range(count):
            label = n % CLASSES
            pixels = torch.randint(0, 120, (40, 40, 3), generator=gen, dtype=torch.uint8)
            pixels[label * 5 : label * 5 + 5] += 120
            path = folder / split / f"class{label}"
            path.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels.numpy()).save(path / f"{n}.jpg")


def run(
    folder: str,
    script: str,
    variant: str,
    flags: list[str],
    out: str = "",
    device: str = "cpu",
    keep: str = "all",
) -> dict[str, Any]:
    """One rank of the script (``variant`` "original", or "graph_safe": its optimizer made
    graph-safe at ``prepare_distributed``) or of its port ("port", or one of ``UNFINISHED``),
    with ``flags``, writing into ``folder/out`` (``folder/variant`` by default); what it
    recorded. On ``device`` "cuda" (``flags`` then name ``--device cuda``) nothing of the CPU's
    snags is patched, the script's loader may start workers and the port captures real CUDA
    graphs; ``keep="times"``: only a timestamp after each update and the port's final report
    (benchmarks/upstream_ports.py)."""
    base = Path(folder)
    text = Path(script).read_text(encoding="utf-8")
    if variant.startswith("port"):
        text = ported(text, PORT)
    for old, new in UNFINISHED.get(variant, []):
        text = text.replace(old, new, 1)
    path = base / f"{variant}_{NAME}"
    if int(os.environ["RANK"]) == 0:
        path.write_text(text)
    os.chdir(base)
    record: dict[str, Any] = {"losses": [], "lrs": [], "updates": [], "outputs": []}
    record["epoch_lrs"], record["printed"] = [], []
    if device == "cpu":
        _cpu_snags()
        graphs_on_the_cpu_engine()
    else:
        loader_workers_allowed()
    if keep == "times":
        from timm.scheduler.scheduler import Scheduler

        stamp_updates(record, Scheduler, "step_update")
        logging.getLogger("train").addHandler(_Printed(record["printed"]))
    else:
        _record(record, variant)
    if variant == "graph_safe":
        _graph_safe_at_prepare_distributed(device)
    sys.argv = [
        str(path), "--data-dir", str(base / "data"), "--model", "test_resnet",
        "--num-classes", str(CLASSES), "--input-size", "3", "32", "32", "-b", "4", "-j", "0",
        "--device", "cpu", "--seed", "0", "--log-interval", "1", "--experiment", "run",
        "--output", str(base / (out or variant)), *flags,
    ]  # fmt: skip
    runpy.run_path(str(path), run_name="__main__")
    if keep == "times":
        record["report"] = final_report()
    return record


def _cpu_snags() -> None:
    """The two refusals of the script's CPU run, patched outside it (module docstring)."""
    import timm.data
    from timm.task import ClassificationTask

    prepare = ClassificationTask.prepare_distributed

    def prepare_distributed(self: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        if device_ids and all(torch.device(d).type == "cpu" for d in device_ids):
            device_ids = None  # DDP refuses device_ids for a CPU module
        return prepare(self, device_ids=device_ids, **kwargs)

    ClassificationTask.prepare_distributed = prepare_distributed  # type: ignore[method-assign]
    create_loader = timm.data.create_loader

    def created(*args: Any, num_workers: int = 1, **kwargs: Any) -> Any:
        if num_workers == 0:
            kwargs["persistent_workers"] = False  # torch refuses True without workers
        return create_loader(*args, num_workers=num_workers, **kwargs)

    timm.data.create_loader = created  # the script imports it by name after this


def _graph_safe_at_prepare_distributed(device: str = "cpu") -> None:
    """The optimizer ``create_optimizer_v2`` made, made graph-safe at ``prepare_distributed``
    (after a resume loaded it, before the scheduler is built), where the port builds its
    TrainStep: the script then steps the arithmetic the graph steps (fused SGD, capturable
    AdamW on the foreach path, the LR read from a float32 tensor)."""
    import timm.optim
    from timm.task import ClassificationTask

    from ddpgraph.step.optim import make_graph_safe

    made: list[torch.optim.Optimizer] = []
    create = timm.optim.create_optimizer_v2

    def created(*args: Any, **kwargs: Any) -> Any:
        made.append(create(*args, **kwargs))
        return made[-1]

    timm.optim.create_optimizer_v2 = created
    prepare = ClassificationTask.prepare_distributed

    def prepare_distributed(self: Any, *args: Any, **kwargs: Any) -> Any:
        plan = make_graph_safe(made[-1], torch.device(device))
        # timm's scheduler assigns each LR as a number; the step copies it into the tensor
        # before each optimizer step, and so does the script here
        made[-1].register_step_pre_hook(lambda *_: plan.sync_lr())
        return prepare(self, *args, **kwargs)

    ClassificationTask.prepare_distributed = prepare_distributed  # type: ignore[method-assign]


def _record(record: dict[str, Any], variant: str) -> None:
    import timm.models
    from timm.scheduler.scheduler import Scheduler
    from timm.task import ClassificationTask

    from .framework_workers import tensors_of

    create_model = timm.models.create_model

    def created(*args: Any, **kwargs: Any) -> Any:
        model = create_model(*args, **kwargs)

        def hook(module: Any, inputs: Any, output: torch.Tensor) -> None:
            if not module.training:
                record["outputs"].append(output.detach().clone())

        model.register_forward_hook(hook)
        return model

    timm.models.create_model = created  # the script imports it by name after this
    if variant.startswith("port"):
        record_step_losses(record)
    else:
        forward = ClassificationTask.forward

        def task_forward(self: Any, input: Any, target: Any) -> Any:
            result = forward(self, input, target)
            record["losses"].append(result["loss"].detach().clone())
            return result

        ClassificationTask.forward = task_forward  # type: ignore[method-assign]
    step_update, step = Scheduler.step_update, Scheduler.step

    def lrs(scheduler: Any) -> list[float]:
        return [float(group["lr"]) for group in scheduler.optimizer.param_groups]

    def updated(self: Any, num_updates: int, metric: Any = None) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        record["updates"].append(tensors_of(params))
        step_update(self, num_updates, metric)
        record["lrs"].append(lrs(self))

    def stepped(self: Any, epoch: int, metric: Any = None) -> None:
        step(self, epoch, metric)
        record["epoch_lrs"].append(lrs(self))

    Scheduler.step_update, Scheduler.step = updated, stepped  # type: ignore[method-assign]
    logging.getLogger("train").addHandler(_Printed(record["printed"]))


class _Printed(logging.Handler):
    """The lines the script logs on rank 0 with each update and validation batch ("Train: 0
    [ 0/10 ( 10%)]  Loss: ...  LR: ...", "Test: [ 0/2]  Loss: ... Acc@1: ... Acc@5: ...") and
    its best metric, their times cut out."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if line.startswith(("Train:", "Test", "*** Best")):
            line = re.sub(r"Time: [^L]*(?=Loss)|Time: .*?(?=LR:)|\s*Data: .*$", "", line)
            self.lines.append(line)


def saved(out: Path) -> dict[str, Any]:
    """Every file under ``out``: each checkpoint (``*.pth.tar``) loaded, without its ``args``
    (the command line, which names each run's own output folder); ``summary.csv`` as text."""
    found: dict[str, Any] = {}
    for path in sorted(out.rglob("*")):
        name = str(path.relative_to(out))
        if name.endswith(".pth.tar"):
            state = torch.load(path, map_location="cpu", weights_only=False)
            state.pop("args")
            found[name] = state
        elif path.name == "summary.csv":
            found[name] = path.read_text()
    return found
