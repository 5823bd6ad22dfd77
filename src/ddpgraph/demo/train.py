"""The worker side of ``ddpgraph train``: one rank's training loop, metrics and report.

The loop only ever calls the TrainStep: it decides whether that is an eager step, a warm-up step,
a capture or a replay, so the same loop runs on CPU ranks and on graphed GPUs. The data set lives
on the device when it fits (it does for every built-in model): ``step(data)`` then gathers the
batches inside the graph and replays ``--steps-per-replay`` steps at once, with no host work
per step; otherwise a DataLoader feeds ``step(x, y)`` through ``prefetch``.

Checkpoints (``--checkpoint-every``) hold everything the loop's future depends on (model,
optimizer, scheduler, RNG states, data position), and the data is a pure function of the seed,
so a run resumed from step k ends bitwise identical to one that never stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

import ddpgraph

from .. import _stdout
from .._debug import REPORTED, debug_requested
from .._files import write_file
from ..checkpoint import (
    CheckpointWriteError,
    ResumableLoader,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from ..data.device_data import DeviceData, fits_on_device, nbytes_of
from ..errors import ConfigError, NonFiniteError
from ..step import TrainStep
from .data import SAMPLE_SHAPES, synthetic_patterns
from .models import build_model
from .progress import Progress

TRAIN_SAMPLES = 8192
EVAL_SAMPLES = 2048
LOG_EVERY = 20  # steps between loss read-backs: the only host syncs in the loop
KEEP_LAST = 2  # checkpoints kept: the newest, and one more in case it is damaged later
# Options a resumed run must share with the run that saved the checkpoint: each changes what
# the remaining steps compute (--steps sets the cosine schedule's length).
SAME_ON_RESUME = ("model", "steps", "batch_size", "lr", "seed", "parallel")


@dataclass(frozen=True)
class TrainConfig:
    model: str = "mlp"
    steps: int = 300
    batch_size: int = 64
    lr: float = 0.05
    seed: int = 0
    out: str = "runs/latest"
    timeout: float = 600.0  # seconds, for ddpgraph.init
    checkpoint_every: int | None = None
    resume: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) after this many steps
    max_restarts: int = 0
    data: str = "auto"  # "device" (DeviceData), "loader" (DataLoader + prefetch), "auto"
    steps_per_replay: int = 2  # with device data: steps per replay (more slows GPU-bound models)
    parallel: str = "ddp"  # "fsdp2": sharded per block with fully_shard (TrainStep(parallel=))

    @property
    def checkpoints(self) -> Path:
        return Path(self.out) / "checkpoints"

    @property
    def last_step(self) -> int:
        """The step this invocation trains up to."""
        return min(self.stop_after or self.steps, self.steps)


# What train says when standard output cannot be written (a full disk): it trains on.
RESULTS_ELSEWHERE = "training goes on, and its results go to run.json in --out"

# What a worker leaves in --out for the launcher when it stops early, read and removed there.
INTERRUPTED = ".interrupted"  # JSON {"step": N}: the last step every rank finished, from rank 0
FAILED = ".failed-rank{rank}"  # one ddpgraph error's message, per failing rank
FINISHED = ".finished"  # from rank 0 once run.json is written: a later signal stops nothing
REPORTED_EXIT = 3  # a worker that wrote FAILED exits with this: the launcher prints no traceback
# 128 + the signal, as a shell reports it: Ctrl-C (SIGINT), or the launcher's stop (SIGTERM)
INTERRUPTED_EXITS = (128 + signal.SIGINT, 128 + signal.SIGTERM)


class _Interrupt:
    """Ctrl-C in a worker: remember it, so that whatever it breaks (a peer's collective that
    loses its partner fails with gloo's error, not KeyboardInterrupt) still counts as the stop.

    SIGTERM counts too: the launcher stops the workers with it once it saw Ctrl-C, and it may
    come first. The worker starts with SIGINT ignored (ddpgraph.distributed.launch.run_local), so a Ctrl-C
    before :meth:`install` is the launcher's alone.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.step = 0  # the last step this rank finished
        self.config: TrainConfig | None = None
        self.done = False  # this rank's part is over (rank 0: run.json written)

    @property
    def seen(self) -> bool:
        return self.signum is not None

    def install(self, config: TrainConfig) -> None:
        self.config = config
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.done:
            _exit(0)  # nothing left to stop: the run's results are written
        if self.seen:
            return  # the second signal (SIGINT, then the launcher's SIGTERM): already stopping
        self.signum = signum
        if self.config is not None:
            # stop here: a KeyboardInterrupt raised in a finalizer or a weakref callback is only
            # printed ("Exception ignored ...") and the rank would go on until the launcher's
            # SIGKILL; nothing is unwound before exiting anyway (see _stop_interrupted)
            _stop_interrupted(self.config)
        raise KeyboardInterrupt


_interrupt = _Interrupt()


def launched_worker(config: TrainConfig) -> dict[str, Any]:
    """:func:`run_worker` as ``ddpgraph train``'s launcher starts it, in a process of its own.

    Ctrl-C stops it at once, without a traceback (rank 0 leaves the step for the launcher); a
    ddpgraph error is left as its message for the launcher (the traceback with --debug).
    """
    _interrupt.install(config)
    _stdout.guard("ddpgraph train", RESULTS_ELSEWHERE)  # `| head`, `> /dev/full`: train on
    try:
        return run_worker(config)
    except BaseException as exc:
        if _interrupt.seen or isinstance(exc, KeyboardInterrupt):
            _stop_interrupted(config)
        if isinstance(exc, REPORTED) and not debug_requested():
            _stop_reported(config, exc)
        raise


def _stop_interrupted(config: TrainConfig) -> None:
    """Leave the step reached (rank 0) and exit now: no traceback, no shutdown that would wait
    for peers that are stopping too (or for a store that is already gone)."""
    if os.environ.get("RANK", "0") == "0":
        _leave(Path(config.out) / INTERRUPTED, json.dumps({"step": _interrupt.step}))
    _exit(128 + (_interrupt.signum or signal.SIGINT))


def _stop_reported(config: TrainConfig, exc: BaseException) -> None:
    rank = os.environ.get("RANK", "0")
    message = reported_message(config, exc)
    report = {
        "type": type(exc).__name__,
        "message": message,
        # the caller's input: exit status 2 (a checkpoint the disk had no room for is not)
        "usage": isinstance(exc, ConfigError) and not isinstance(exc, CheckpointWriteError),
    }
    if not _leave(Path(config.out) / FAILED.format(rank=rank), json.dumps(report)):
        # --out is full or gone: the reason goes on the console, which the launcher then says
        print(f"ddpgraph train: failed on rank {rank}: {report['type']}: {message}",
              file=sys.stderr)  # fmt: skip
    _exit(REPORTED_EXIT)


def reported_message(config: TrainConfig, exc: BaseException) -> str:
    """``exc``'s message in the command line's words: its options, not the library's."""
    if isinstance(exc, NonFiniteError):
        return (
            f"training diverged at step {exc.step}: the loss or the gradients became NaN or inf "
            f"(on at least one rank); lower --lr (this run: --lr {config.lr:g})."
        )
    return str(exc).replace("raise timeout=", "raise --timeout")


def _leave(path: Path, text: str) -> bool:
    """Write ``text`` for the launcher; False where it cannot be written (a full disk)."""
    try:
        path.write_text(text)
    except OSError:
        path.unlink(missing_ok=True)  # half a report would be worse than none
        return False
    return True


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(config: TrainConfig) -> dict[str, Any]:
    """Train on this rank; return its metrics."""
    if torch.cuda.is_available():
        # the same seed gives the same bits, which exact resume (--resume) relies on
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    else:
        # each CPU rank gets its share of the cores instead of all ranks fighting over all of them
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    with ddpgraph.init(timeout=config.timeout, stall_warning=stall_warning(config.timeout)) as rt:
        metrics = _train(config, rt)
        everyone = _gather(metrics)
        if rt.is_main:
            _report(config, everyone)
        _interrupt.done = True
    return metrics


# The ranks of a healthy run reach their first collectives up to a few tenths of a second apart
# (each imports torch and builds its data on its own): no reason to warn of a stalled rank.
STARTUP_SKEW_S = 5.0


def stall_warning(timeout: float) -> float | None:
    """When the watchdog warns of a slow rank: ddpgraph.init's default (None: a quarter of the
    timeout, at most 60 s) unless that comes before :data:`STARTUP_SKEW_S`; then at 90 % of a
    short --timeout, just before the run fails, so that a run that succeeds is not warned."""
    if timeout / 4 >= STARTUP_SKEW_S:
        return None
    return min(STARTUP_SKEW_S, 0.9 * timeout)


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD with momentum; AdamW for FSDP2 (SGD on DTensor shards cannot be captured), at the
    LR that --lr means for SGD divided by 50 (Adam's steps are about that much larger)."""
    if config.parallel == "fsdp2":
        return torch.optim.AdamW(model.parameters(), lr=config.lr / 50)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)


def _train(config: TrainConfig, rt: ddpgraph.Runtime) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    model = build_model(config.model).to(rt.device)
    optimizer = _optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.steps)
    feed = _Feed(config, rt)
    step = TrainStep(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        scheduler=scheduler,
        # conv kernels run faster in NHWC; FSDP2 shards only contiguous parameters ("FSDP does
        # not support non-contiguous parameters"): its ResNet keeps NCHW weights, and the
        # batches (DeviceData below) stay NHWC, which the convolutions follow
        channels_last=config.model == "resnet" and config.parallel != "fsdp2",
        steps_per_replay=feed.steps_per_call,
        parallel="fsdp2" if config.parallel == "fsdp2" else "auto",
        check_finite=True,  # a diverged run stops with the step, never "finished" on NaN
    )
    losses = _LossLog(rt.device)
    curve: list[float] = []
    with Progress(rt.is_main, config.steps) as progress:
        progress.note(feed.description)
        if config.parallel == "fsdp2":
            progress.note(
                "parallel: FSDP2 (fully_shard per block, then the root), AdamW at "
                f"--lr/50 = {config.lr / 50:g}"
            )
        start = _interrupt.step = _resume(config, step, feed.state, progress)
        started = time.perf_counter()
        done = start
        while done < config.last_step:
            n = min(feed.steps_per_call, _next_stop(config, done) - done)
            losses.add(feed.run(step, scheduler, n))
            done = _interrupt.step = done + n
            if done // LOG_EVERY > (done - n) // LOG_EVERY or done == config.last_step:
                curve.append(losses.read())
                progress(done, curve[-1], step.mode)
            if _is_save_point(config, done):
                step.raise_if_not_finite()  # never a checkpoint of a diverged model
                # ddpgraph's logger says where it went, on rank 0
                save_checkpoint(
                    config.checkpoints,
                    step=done,
                    train_step=step,
                    loader=feed.state,
                    keep_last=KEEP_LAST,
                    config=asdict(config),
                )
    step.raise_if_not_finite()  # the last steps too (it waits for the device)
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    report = step.report()
    trained = config.last_step - start
    return {
        "rank": rt.rank,
        "device": str(rt.device),
        "backend": rt.backend,
        "mode": report.mode,
        "resumed_from": start,
        "samples_seen": trained * config.batch_size,
        "final_loss": curve[-1] if curve else float("nan"),
        "loss_curve": curve,
        "accuracy": _evaluate(step, config, rt),
        "steps_per_s": trained / seconds if trained else 0.0,
        "time_to_first_replay_s": report.time_to_first_replay,
        "fallbacks": report.fallbacks,
        "data": feed.kind,
        "steps_per_replay": feed.steps_per_call,
        "params_sha256": parameter_hash(model),
    }


class _Feed:
    """Where the training batches come from: a DeviceData (``step(data)``, K steps per call,
    the TrainStep steps the scheduler) or a DataLoader through prefetch (``step(x, y)``)."""

    def __init__(self, config: TrainConfig, rt: ddpgraph.Runtime) -> None:
        data = _dataset(config, split="train")
        nbytes = nbytes_of(data.tensors)
        wanted = config.data
        if wanted == "auto":
            # every rank takes the same feed: free memory can differ between GPUs
            fits = ddpgraph.all_gather_object(fits_on_device(nbytes, rt.device), timeout=60.0)
            wanted = "device" if all(fits) else "loader"
        self.kind = wanted
        self.data: DeviceData | None = None
        self.batches: ResumableLoader | None = None
        self._iterator: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
        if wanted == "device":
            self.data = DeviceData(
                *data.tensors,
                batch_size=config.batch_size,
                shuffle=True,
                seed=config.seed,
                channels_last=config.model == "resnet",  # as the model: no copy per step
            )
            self.steps_per_call = min(config.steps_per_replay, len(self.data))
            self.description = (
                f"data held on {rt.device} ({len(data)} samples, {nbytes / 2**20:.1f} MiB); "
                f"{self.steps_per_call} steps per call"
            )
        else:
            loader = _loader(data, config, rt, split="train")
            # prefetch inside: the loader counts what the step consumed, not what was copied ahead
            self.batches = ResumableLoader(
                ddpgraph.prefetch(loader, rt.device), sampler=_sampler_of(loader)
            )
            self.steps_per_call = 1
            why = "--data loader" if config.data == "loader" else "too large for the device"
            self.description = (
                f"data read by a DataLoader with prefetch ({why}, {nbytes / 2**20:.1f} MiB)"
            )

    @property
    def state(self) -> Any:
        """What checkpoints hold for the data position."""
        return self.data if self.data is not None else self.batches

    def run(self, step: TrainStep, scheduler: Any, n: int) -> torch.Tensor:
        """``n`` training steps; their losses (graph-owned)."""
        if self.data is not None:
            return step(self.data, steps=n)  # steps the scheduler once per training step
        assert self.batches is not None and n == 1
        if self._iterator is None:
            self._iterator = _forever(self.batches)
        x, y = next(self._iterator)
        loss = step(x, y)  # already on the device (prefetch), or CPU tensors on CPU
        scheduler.step()
        return loss


def _next_stop(config: TrainConfig, done: int) -> int:
    """The next step a call must end at: a checkpoint or the end of this invocation."""
    stop = config.last_step
    every = config.checkpoint_every
    if every is not None:
        stop = min(stop, (done // every + 1) * every)
    return stop


def _resume(config: TrainConfig, step: TrainStep, batches: Any, progress: Progress) -> int:
    """The step to start from: the newest checkpoint's with --resume or after a restart, else 0.

    torch's elastic agent restarts every worker of a job whose rank died (``--max-restarts``)
    and counts the restarts in TORCHELASTIC_RESTART_COUNT: a restarted worker resumes on its own.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not config.resume and not (restarted and latest_checkpoint(config.checkpoints)):
        if restarted:
            progress.note("restarted before the first checkpoint: training from step 0")
        return 0
    state = load_checkpoint(config.checkpoints, train_step=step, loader=batches)
    why = "after a restart" if restarted else "with --resume"
    progress.note(f"resuming {why} from step {state['step']} ({state['path']})")
    progress.start_at(int(state["step"]))
    return int(state["step"])


def _is_save_point(config: TrainConfig, done: int) -> bool:
    if done == config.last_step:
        # stopped early on purpose: save what --resume continues; finished with checkpoints on:
        # save the end, so that a --resume has nothing left to train
        return done < config.steps or config.checkpoint_every is not None
    return config.checkpoint_every is not None and done % config.checkpoint_every == 0


def parameter_hash(model: nn.Module) -> str:
    """SHA-256 over the model's state_dict: each key, dtype, shape and the tensor's bytes on CPU.

    Equal hashes mean bitwise-equal parameters and buffers (memory layout aside). FSDP2's
    DTensor shards are gathered whole (a collective: every rank calls this).
    """
    digest = hashlib.sha256()
    for key, tensor in model.state_dict().items():
        whole = getattr(tensor, "full_tensor", None)
        tensor = whole() if whole is not None else tensor
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{key}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _dataset(config: TrainConfig, *, split: str) -> TensorDataset:
    size = TRAIN_SAMPLES if split == "train" else EVAL_SAMPLES
    return synthetic_patterns(
        SAMPLE_SHAPES[config.model], num_samples=size, seed=config.seed, split=split
    )


def _loader(
    data: TensorDataset, config: TrainConfig, rt: ddpgraph.Runtime, *, split: str
) -> DataLoader[Any]:
    sampler: DistributedSampler[Any] = DistributedSampler(
        data,
        num_replicas=rt.world_size,
        rank=rt.rank,
        shuffle=split == "train",
        seed=config.seed,
        drop_last=split == "train",  # equal batch shapes on every rank: one graph serves all
    )
    if split == "train":
        # Batch-level sampling: TensorDataset gathers a whole batch with one indexing call, where
        # per-sample __getitem__ plus collate cost ~0.5 ms a batch, as long as a graphed step.
        # The same DistributedSampler order, so the same batches.
        return DataLoader(
            data,
            sampler=BatchSampler(sampler, config.batch_size, drop_last=True),
            batch_size=None,
            pin_memory=False,  # prefetch pins the whole batch in one copy
            generator=torch.Generator().manual_seed(config.seed),
        )
    return DataLoader(
        data,
        batch_size=config.batch_size,
        sampler=sampler,
        drop_last=False,
        pin_memory=rt.device.type == "cuda",
        # its own generator: making an iterator draws a seed, and drawn from the global RNG it
        # would shift every later random number by when the (resumed) run started an epoch
        generator=torch.Generator().manual_seed(config.seed),
    )


def _sampler_of(loader: DataLoader[Any]) -> Any:
    """The DistributedSampler (its epoch sets the shuffle), also under a BatchSampler."""
    sampler: Any = loader.sampler
    return sampler.sampler if isinstance(sampler, BatchSampler) else sampler


def _forever(batches: ResumableLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:  # ResumableLoader sets the sampler's epoch and skips what a checkpoint consumed
        yield from batches


class _LossLog:
    """Sums losses on the device; :meth:`read` (a host sync) averages the ones since the last."""

    def __init__(self, device: torch.device) -> None:
        self._sum = torch.zeros((), device=device)
        self._count = 0
        self._last = float("nan")

    def add(self, loss: torch.Tensor) -> None:
        """One step's loss, or a call's losses (step(data): one per step)."""
        values = loss.detach()  # the graph overwrites `loss` next call: fold it in now
        self._sum += values.sum() if values.dim() else values  # no extra kernel for one loss
        self._count += values.numel()

    def read(self) -> float:
        if self._count:
            self._last = float(self._sum) / self._count
            self._sum.zero_()
            self._count = 0
        return self._last


def _evaluate(step: TrainStep, config: TrainConfig, rt: ddpgraph.Runtime) -> float:
    """Accuracy on this rank's share of the eval split, through the step's (graphed) evaluate."""
    correct = torch.zeros((), dtype=torch.long, device=rt.device)
    total = 0
    loader = _loader(_dataset(config, split="eval"), config, rt, split="eval")
    for x, y in ddpgraph.prefetch(loader, rt.device):
        logits = step.evaluate(x)  # graph-owned: use it before the next evaluate
        correct += (logits.argmax(dim=1) == y).sum()
        total += len(y)
    return int(correct) / max(total, 1)


def _gather(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    # ddpgraph's checked collective: safe codec, every rank fails alike, no hang on a bad rank
    return ddpgraph.all_gather_object(metrics, timeout=60.0)


def _report(config: TrainConfig, everyone: list[dict[str, Any]]) -> None:
    from rich.console import Console

    console = Console()
    for line in report_lines(config, everyone):
        console.print(line)
    path = write_run_json(Path(config.out), config, everyone)
    # before a word is said: the launcher reads it if a signal comes while the workers exit
    _leave(Path(config.out) / FINISHED, json.dumps({"step": config.last_step}))
    _interrupt.done = True  # a signal from here on stops nothing: the results are written
    console.print(f"wrote {path}")


def report_lines(config: TrainConfig, everyone: list[dict[str, Any]]) -> list[Any]:
    """The per-rank table, then the mode on a line of its own: its reason is long ("eager (cpu:
    no CUDA graphs)"), and as a column it would not fit 80 columns."""
    from rich.table import Table

    table = Table(title=f"ddpgraph train: {config.model}, {config.steps} steps")
    for column in ("rank", "device", "first replay", "samples", "loss", "accuracy", "steps/s"):
        table.add_column(column, justify="right", no_wrap=True)
    for m in everyone:
        table.add_row(
            str(m["rank"]),
            m["device"],
            "-" if m["time_to_first_replay_s"] is None else f"{m['time_to_first_replay_s']:.2f} s",
            str(m["samples_seen"]),
            f"{m['final_loss']:.4f}",
            f"{m['accuracy']:.1%}",
            f"{m['steps_per_s']:.1f}",
        )
    modes = [mode_text(m) for m in everyone]
    if len(set(modes)) == 1:
        return [table, f"mode: {modes[0]}, on every rank"]
    return [table, "mode: " + "; ".join(f"rank {m['rank']} {t}" for m, t in zip(everyone, modes))]


def mode_text(metrics: dict[str, Any]) -> str:
    """The table's mode cell: an eager rank says why (the whole reason is in run.json)."""
    if metrics["mode"] != "eager":
        return str(metrics["mode"])
    if not str(metrics["device"]).startswith("cuda"):
        return "eager (cpu: no CUDA graphs)"
    return "eager (fallback: see run.json)" if metrics["fallbacks"] else "eager"


def write_run_json(out: Path, config: TrainConfig, everyone: list[dict[str, Any]]) -> Path:
    """Write ``out/run.json`` atomically: a crash or a full disk leaves the old file or none, never
    half of one (:class:`~ddpgraph._files.OutputWriteError` says which)."""
    path = out / "run.json"
    accuracy = sum(m["accuracy"] for m in everyone) / len(everyone)
    payload = {
        "config": asdict(config),
        "world_size": len(everyone),
        "torch": torch.__version__,
        "steps_done": config.last_step,
        "accuracy": accuracy,
        # rank 0's replica; DDP keeps every rank's equal, and each rank's own is under "ranks"
        "params_sha256": everyone[0]["params_sha256"],
        "ranks": everyone,
    }
    return write_file(
        path,
        json.dumps(payload, indent=2) + "\n",
        fix="pass another --out (the metrics are in the table above)",
    )
