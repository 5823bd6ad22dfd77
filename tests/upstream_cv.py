"""Accelerate's ``complete_cv_example.py`` (pinned in ../shared/upstream/), run as written and as
the Accelerate guide's first diff ports it: the worker of tests/gpu/test_upstream_scripts_gpu.py
and of tests/test_upstream_scripts.py. The script fixes its run in its ``main()`` (ResNet-50d,
224 px, batches of 64), too heavy for the 2-core CPU suite: there a timm model named by
``model`` (``test_resnet``) is built in its place, on 2 gloo ranks with the script's ``--cpu``.

The script runs unchanged through ``runpy``, with a folder of JPEGs named as the Oxford pets
(``<label>_<n>.jpg``, its ``extract_label``) and timm's ``create_model`` called with
``pretrained=False`` (no hub on the GPU machine: patched outside the script). Recorded from
outside it: each training loss (``accelerator.backward``'s argument in the original, the step's
return in the port), at each prepared scheduler's ``step()`` the LR and every parameter (as its
SHA-256), each evaluation forward's logits, and the lines it prints ("epoch 0: 51.00")."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

from .upstream import (
    PREPARE_ALL,
    PREPARE_THE_REST,
    final_report,
    graphs_on_the_cpu_engine,
    loader_workers_allowed,
    ported,
    record_step_losses,
    record_updates,
    sha256_of,
    stamp_updates,
)

FOLDER, NAME = "accelerate_complete_cv_example", "complete_cv_example.py"
IMAGES = 500  # 400 to train: 7 batches of 64 an epoch, 21 steps in its 3 epochs (12 warm-up)

# the Accelerate guide's first diff ("What changes"), for a loop without accumulate(): the loss
# function goes to the step, `model = train_step.model` evaluates through the step's model
PORT = [
    (
        "from accelerate import Accelerator, DataLoaderConfiguration\n",
        "from accelerate import Accelerator, DataLoaderConfiguration\n"
        "from ddpgraph.integrations.accelerate import from_accelerator\n",
    ),
    (
        PREPARE_ALL,
        PREPARE_THE_REST + "    train_step = from_accelerator(\n"
        "        accelerator, model, optimizer, torch.nn.functional.cross_entropy\n"
        "    )\n"
        "    model = train_step.model\n",
    ),
    (
        "            outputs = model(inputs)\n"
        '            loss = torch.nn.functional.cross_entropy(outputs, batch["label"])\n',
        '            loss = train_step(inputs, batch["label"])\n',
    ),
    (
        "            accelerator.backward(loss)\n"
        "            optimizer.step()\n"
        "            lr_scheduler.step()\n"
        "            optimizer.zero_grad()\n",
        "            lr_scheduler.step()\n",
    ),
]


def make_images(folder: Path, count: int = IMAGES) -> None:
    """``count`` small JPEGs of two labels, each label's images brighter in one channel."""
    from PIL import Image

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for n in range(count):
        label = n % 2
        pixels = torch.randint(0, 160, (48, 48, 3), generator=gen, dtype=torch.uint8)
        pixels[..., label] += 90
        name = ("Abyssinian", "beagle")[label]
        Image.fromarray(pixels.numpy()).save(folder / f"{name}_{n}.jpg")


def run(
    folder: str,
    script: str,
    variant: str,
    flags: list[str],
    device: str = "cuda",
    model: str = "",
    keep: str = "all",
) -> dict[str, Any]:
    """The script ("graph_safe": its Adam made graph-safe at ``accelerator.prepare`` as the
    port's TrainStep makes it, outside the script; "original": untouched) or its port ("port"),
    with ``flags``, on this process's GPU; what it recorded (``keep="times"``: only a
    timestamp after each update and the port's final report, for benchmarks/upstream_ports.py).
    ``device="cpu"`` (``flags`` then hold the script's ``--cpu``) and ``model``, a timm model
    built in place of the script's ResNet-50d, are for a smoke run on the CPU only: the port on
    ``CpuGraphs``."""
    import timm

    base = Path(folder)
    text = Path(script).read_text(encoding="utf-8")
    if variant == "port":
        text = ported(text, PORT)
    path = base / f"{variant}_{'_'.join(f.lstrip('-') for f in flags)}_{NAME}"
    path.write_text(text)
    os.chdir(base)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"
    record: dict[str, Any] = {"losses": [], "lrs": [], "updates": [], "logits": []}
    if keep == "times":
        from accelerate.scheduler import AcceleratedScheduler

        stamp_updates(record, AcceleratedScheduler, "step")
    else:
        record_updates(record)
    create_model = timm.create_model

    def created(name: str, pretrained: bool = False, **kwargs: Any) -> Any:
        built = create_model(model or name, pretrained=False, **kwargs)  # no hub here

        def hook(module: Any, inputs: Any, output: torch.Tensor) -> None:
            if not module.training:
                record["logits"].append(output.detach().float().cpu())

        if keep != "times":
            built.register_forward_hook(hook)
        return built

    timm.create_model = created  # the script imports it by name after this
    if variant == "port" and keep != "times":
        record_step_losses(record)
    elif variant != "port":
        _graph_safe_original(record, variant == "graph_safe", keep != "times", device)
    if device == "cpu" and variant == "port":
        graphs_on_the_cpu_engine()
    loader_workers_allowed()  # the script's DataLoaders start 4 workers each (num_workers=4)
    count_ddp_wrappers(record)
    out = base / f"out_{variant}"
    sys.argv = [str(path), "--data_dir", str(base / "images"), "--output_dir", str(out), *flags]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(path), run_name="__main__")
    record["printed"] = [line for line in printed.getvalue().splitlines() if "epoch" in line]
    record["losses"] = [loss.float().cpu() for loss in record["losses"]]
    # every parameter after each of the 21 updates is ~2 GB of ResNet-50d: its SHA-256 compares
    # as exactly and travels back from the worker in kilobytes
    record["updates"] = [[sha256_of(t) for t in update] for update in record["updates"]]
    record["report"] = final_report() if keep == "times" else record.get("report", "")
    return record


def count_ddp_wrappers(record: dict[str, Any]) -> None:
    """``record["ddp_wrappers"]``: the DistributedDataParallel wrappers the run builds (the
    script's ``accelerator.prepare``: one on several processes, none on one GPU process; the
    port's step: as many)."""
    from torch.nn.parallel import DistributedDataParallel

    record["ddp_wrappers"] = 0
    built = DistributedDataParallel.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        record["ddp_wrappers"] += 1
        built(self, *args, **kwargs)

    DistributedDataParallel.__init__ = counted  # type: ignore[method-assign]


def _graph_safe_original(
    record: dict[str, Any], graph_safe: bool, losses: bool, device: str = "cuda"
) -> None:
    """The script's Adam made graph-safe where the port's TrainStep makes it (``graph_safe``),
    and each loss it backpropagates recorded (``losses``)."""
    from accelerate import Accelerator

    from ddpgraph.step.optim import make_graph_safe

    prepare, backward = Accelerator.prepare, Accelerator.backward

    def prepared(self: Any, *objects: Any, **kwargs: Any) -> Any:
        for item in objects:
            if isinstance(item, torch.optim.Optimizer):
                make_graph_safe(item, torch.device(device))
        return prepare(self, *objects, **kwargs)

    def backward_recorded(self: Any, loss: torch.Tensor, **kwargs: Any) -> Any:
        record["losses"].append(loss.detach().clone())
        return backward(self, loss, **kwargs)

    if graph_safe:
        Accelerator.prepare = prepared  # type: ignore[method-assign]
    if losses:
        Accelerator.backward = backward_recorded  # type: ignore[method-assign]
