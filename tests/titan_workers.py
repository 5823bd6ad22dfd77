"""torchtitan's own training, side by side with TrainStep, on CPU gloo ranks (issue 48 item 2).

Everything that trains is torchtitan's (the pinned version, ``pip install 'ddpgraph[titan]'``):
its llama3 ``debugmodel`` (``train_spec.model_cls``, meta init, ``init_weights``), sharded by its
``parallelize_llama`` with its FSDP2 settings (bf16 parameters through ``MixedPrecisionPolicy``,
activation checkpointing "selective" every 2nd layer, as its debug_model.toml), its
cross-entropy loss (sum over tokens, divided by the global token count), its optimizer and LR
scheduler builders (AdamW, warm-up then linear decay), its ``Trainer.train_step`` (run on a
Trainer built without ``Trainer.__init__``, which needs CUDA, a tokenizer and a dataset: the
attributes train_step reads are set here from torchtitan's own builders), and its
``CheckpointManager`` (DCP) for the resume.

The CPU needs three changes, on both sides alike: torchtitan picks ``cuda`` as its device type
when no accelerator is found (``torchtitan.tools.utils.device_type``), so it is set to ``cpu``
before the mesh is built; gloo has no ``PREMUL_SUM``, so FSDP2's reduce-scatter is forced to the
plain SUM it stands for (:func:`_sum_on_gloo`); and the batches are synthetic tokens.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddpgraph.step.optim import make_graph_safe

STEPS = 50
WARMUP_STEPS = 5  # the LR schedule's warm-up; then linear decay over 80 % of the steps
SEQ = 32
LOCAL_BATCH = 2
SEED = 0


def _on_cpu() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type = parallel_dims.device_type = "cpu"
    utils.device_module = torch.cpu  # type: ignore[assignment]


def job_config(folder: str = "", ac: str = "selective") -> Any:
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.model.name, job.model.flavor = "llama3", "debugmodel"
    job.training.steps = STEPS
    job.training.seq_len = SEQ
    job.training.local_batch_size = LOCAL_BATCH
    job.training.max_norm = 1.0
    job.lr_scheduler.warmup_steps = WARMUP_STEPS
    job.lr_scheduler.decay_ratio = 0.8
    job.lr_scheduler.decay_type = "linear"
    job.activation_checkpoint.mode = ac
    job.activation_checkpoint.selective_ac_option = "2"
    job.parallelism.data_parallel_shard_degree = -1
    job.checkpoint.enable = bool(folder)
    job.checkpoint.folder = "checkpoint"
    job.checkpoint.interval = STEPS // 2  # torchtitan's train() saves at these steps
    job.job.dump_folder = folder or "/nonexistent"
    return job


class _Metrics:
    """torchtitan's MetricsProcessor as train_step uses it: every step logged, the values
    kept (its global average loss and its grad norm)."""

    def __init__(self) -> None:
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []
        self.logged: list[tuple[float, float]] = []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step: int, loss: float, max_loss: float, grad_norm: float, **_: Any) -> None:
        self.logged.append((loss, grad_norm))


def _sum_on_gloo(model: torch.nn.Module) -> None:
    """torchtitan sets FSDP2's gradient divide factor to 1 (it divides the loss by the global
    token count itself), for which FSDP2 reduce-scatters with ``PREMUL_SUM(1.0)``, an op gloo
    lacks; forcing a plain SUM (and no division by 1) is the same reduction, bit for bit."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def build(job: Any, device: str = "cpu", sizes: dict[str, int] | None = None) -> Any:
    """torchtitan's Trainer with the attributes train_step reads, from torchtitan's builders
    (the steps of its ``Trainer.__init__`` that train_step needs, in its order), on ``device``
    ("cpu" on gloo ranks; "cuda" for benchmarks/titan_gpu.sh); ``sizes`` replace fields of the
    flavor's model arguments (e.g. ``{"dim": 1024, "n_layers": 12}``)."""
    if device == "cpu":
        _on_cpu()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.protocols import train_spec as train_spec_module
    from torchtitan.train import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.job_config = job
    on_cuda = device == "cuda"
    trainer.device = (
        torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device(device)
    )
    trainer.parallel_dims = parallel_dims = ParallelDims(
        dp_replicate=1,
        dp_shard=-1,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        etp=1,
        world_size=dist.get_world_size(),
    )
    trainer.train_spec = spec = train_spec_module.get_train_spec(job.model.name)
    model_args = dataclasses.replace(spec.model_args[job.model.flavor], **(sizes or {}))
    model_args.update_from_config(job)
    trainer.model_args = model_args
    trainer.tokenizer = None
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    trainer.loss_fn = spec.build_loss_fn(job, parallel_dims=parallel_dims)
    trainer.gradient_accumulation_steps = 1
    model = spec.parallelize_fn(model, parallel_dims, job)
    if dist.get_backend() == "gloo":
        _sum_on_gloo(model)
    model.to_empty(device=device)
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    trainer.model_parts = [model]
    trainer.optimizers = spec.build_optimizers_fn([model], job.optimizer, parallel_dims)
    # Both sides step the AdamW TrainStep steps (capturable, the LR in a tensor), made so before
    # the schedulers are built, as on CUDA: the CPU engine takes that path too. With torchtitan's
    # float LR the runs differ by what report().optimizer_changes measures, and the schedulers'
    # _last_lr would be floats in one checkpoint and tensors in the other (DCP then refuses:
    # "Missing key in checkpoint state_dict: lr_scheduler._last_lr").
    for optimizer in trainer.optimizers.optimizers:
        make_graph_safe(optimizer, torch.device(device))
    trainer.lr_schedulers = spec.build_lr_schedulers_fn(
        trainer.optimizers, job.lr_scheduler, job.training.steps
    )
    trainer.metrics_processor = _Metrics()
    trainer.step = 0
    trainer.ntokens_seen = 0
    trainer.checkpointer = CheckpointManager(
        dataloader=None,
        model_parts=trainer.model_parts,
        optimizers=trainer.optimizers,
        lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer},
        checkpoint_config=job.checkpoint,
        sd_adapter=None,
        base_folder=job.job.dump_folder,
    )
    trainer.train_context = dist_utils.get_train_context(False)
    trainer.maybe_enable_amp = dist_utils.maybe_enable_amp(
        parallel_dims, job.training.mixed_precision_param, device
    )
    return trainer


def batches(n: int, vocab: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Synthetic token batches, this rank's part of the same global stream on both sides."""
    gen = torch.Generator().manual_seed(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for _ in range(n):
        tokens = torch.randint(vocab, (LOCAL_BATCH * world, SEQ + 1), generator=gen)
        mine = tokens[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        out.append(({"input": mine[:, :-1].clone()}, mine[:, 1:].clone()))
    return out


def _params(trainer: Any) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in trainer.model_parts[0].parameters()]


def titan_run(folder: str = "", resume: bool = False) -> dict:
    """torchtitan's loop (its ``Trainer.train``, less logging and profiling): ``train_step`` on
    its data iterator (the LR schedulers step inside it), then ``checkpointer.save`` after every
    step (it saves at the interval, step 25, and the last step). ``resume``: load step 25 from
    ``folder`` first and train the rest, saving nothing."""
    trainer = build(job_config(folder))
    data = batches(STEPS, trainer.model_args.vocab_size)
    if resume:
        trainer.checkpointer.load(step=STEPS // 2)
    iterator: Iterator[Any] = trainer.batch_generator(data[trainer.step :])
    while trainer.step < STEPS:
        trainer.step += 1
        trainer.train_step(iterator)
        if folder and not resume:
            trainer.checkpointer.save(trainer.step, last_step=trainer.step == STEPS)
    trainer.checkpointer.close()
    return {
        "logged": trainer.metrics_processor.logged,
        "params": _params(trainer),
        "lr": trainer.lr_schedulers.schedulers[0].get_last_lr()[0],
    }


def train_step_run(folder: str = "", resume: bool = False) -> dict:
    """The same through TrainStep: torchtitan's model, sharding, loss (its sum over tokens over
    the global token count, as its forward_backward_step divides), optimizer and schedulers;
    its grad norm clipping (max_norm) as ``clip_grad_norm``; the LR schedulers stepped by the
    loop after each call, as torchtitan's train_step steps them; its checkpointer as above."""
    from torchtitan.distributed import utils as dist_utils

    from ddpgraph import TrainStep
    from ddpgraph.testing import CpuGraphs

    trainer = build(job_config(folder))
    data = batches(STEPS, trainer.model_args.vocab_size)
    if resume:
        trainer.checkpointer.load(step=STEPS // 2)
    mesh = trainer.parallel_dims.get_mesh("batch")
    global_tokens = dist_utils.dist_sum(torch.tensor(LOCAL_BATCH * SEQ), mesh)

    def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return trainer.loss_fn(pred, labels) / global_tokens

    (optimizer,) = trainer.optimizers.optimizers
    step = TrainStep(
        trainer.model_parts[0],
        optimizer,
        loss_fn,
        clip_grad_norm=trainer.job_config.training.max_norm,
        engine=CpuGraphs(),
        warmup=3,
    )
    logged = []
    for input_dict, labels in data[trainer.step :]:
        trainer.step += 1
        loss = step(input_dict["input"], labels)
        trainer.lr_schedulers.step()
        norm = step.grad_norm
        assert norm is not None
        logged.append((dist_utils.dist_sum(loss.detach(), mesh), norm.item()))
        if folder and not resume:
            trainer.checkpointer.save(trainer.step, last_step=trainer.step == STEPS)
    trainer.checkpointer.close()
    report = step.report()
    return {
        "logged": logged,
        "params": _params(trainer),
        "lr": trainer.lr_schedulers.schedulers[0].get_last_lr()[0],
        "phase": step.phase.value,
        "replays": report.replays,
        "fallbacks": list(report.fallbacks),
    }


def titan_side(folder: str) -> dict:
    """torchtitan's 50 steps (saving at 25), then torchtitan resumed from its step 25."""
    return {"full": titan_run(folder), "resumed": titan_run(folder, resume=True)}


def train_step_side(titan_folder: str, folder: str) -> dict:
    """TrainStep's 50 steps (saving at 25), resumed from torchtitan's checkpoint, and from its
    own."""
    return {
        "full": train_step_run(folder),
        "from_titan": train_step_run(titan_folder, resume=True),
        "resumed": train_step_run(folder, resume=True),
    }


def versions() -> dict:
    import torchtitan

    return {"torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", "?")}


if __name__ == "__main__":  # a quick look: python -m tests.titan_workers
    from ddpgraph.testing import run_distributed

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    a = run_distributed(titan_run, 2, timeout=600)
    b = run_distributed(train_step_run, 2, timeout=600)
    print(a[0]["logged"] == b[0]["logged"], a[0]["logged"][-1], b[0]["logged"][-1])
