"""The feed of ``step(data)``: K training steps per call over a DeviceData, as a transaction.

:class:`DataFeed` checks a call, stages its K LRs, and on failure puts the data position, the
scheduler and the step count back, so the next call neither skips a batch nor an LR.

The LR of each of the next K training steps (:class:`StepwiseLR`): an LR scheduler is host code: inside one replay of K steps it cannot run between them. So before
the call the scheduler is stepped K times on the host, with plain floats in the param groups
(Python arithmetic: no kernel and no host sync, unlike a scheduler computing with the device LR
tensor), the K values are copied to the device once, and step j of the graph copies its value
into the optimizer's LR tensor before its update. The values are those an eager loop
``step(); scheduler.step()`` would use, so K steps per replay train as K calls of one step do.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._checks import is_int
from ..data.prefetch import upload_into
from ..errors import ConfigError
from .batch import Batch, data_batch
from .optim import hyperparameters

if TYPE_CHECKING:
    from ..data.device_data import DeviceData
    from .options import StepOptions
    from .report import StepReport

__all__ = ["DataFeed", "StepwiseLR"]

# the runner's train(batch, steps): the call's loss
Train = Callable[[Batch, int], torch.Tensor]


class DataFeed:
    """``step(data)``'s calls: checked, their LRs staged, rolled back when they fail.

    ``lr_tensors`` are the optimizer's device LR tensors where graphs read them (else None).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        lr_tensors: list[torch.Tensor] | None,
        options: StepOptions,
        device: torch.device,
    ) -> None:
        self._args = (optimizer, scheduler, lr_tensors, options.steps_per_replay)
        self.accumulate_calls = options.accumulate_calls
        self.steps_per_replay = options.steps_per_replay
        self.device = device
        self._lr: StepwiseLR | None = None  # built at the first call: the scheduler is checked
        # the DeviceData whose whole calls (steps=None) passed steps_of, and the batch of each
        # call made (per token and step count): a DeviceData's device, length and shapes are
        # fixed, so a replayed step(data) neither checks nor builds them again. The batches hold
        # their DeviceData (``source``): alive while graphs that read it may exist
        self._checked: DeviceData | None = None
        self._batches: dict[tuple[int, int], Batch] = {}

    @property
    def lr(self) -> StepwiseLR:
        if self._lr is None:
            self._lr = StepwiseLR(*self._args)
        return self._lr

    def steps_of(self, data: DeviceData, steps: int | None) -> int:
        """Check a ``step(data)`` call; the number of training steps it runs."""
        k = self.steps_per_replay
        if steps is None and data is self._checked:
            return k
        if self.accumulate_calls > 1:
            raise ConfigError(
                "step(data) runs whole training steps, but accumulate_calls="
                f"{self.accumulate_calls} takes one micro-batch per call; use accumulate=k."
            )
        if data.device != self.device:
            raise ConfigError(
                f"the DeviceData is on {data.device} but the model is on {self.device}; build it "
                "with DeviceData(..., device=runtime.device)."
            )
        n = k if steps is None else steps
        if not is_int(n) or not 1 <= n <= k:
            raise ConfigError(
                f"step(data, steps={steps!r}): steps must be an integer from 1 to "
                f"steps_per_replay={k}."
            )
        if n > len(data):
            raise ConfigError(
                f"step(data) runs {n} steps per call but the DeviceData has {len(data)} batches "
                f"per epoch on this rank; use steps_per_replay <= {len(data)} or a smaller "
                "batch_size."
            )
        if steps is None:
            self._checked = data
        return n

    def check_batch_call(self, steps: int | None) -> None:
        """A call with a batch of tensors (not a DeviceData): one training step."""
        if steps is not None:
            raise ConfigError(
                f"step(..., steps={steps!r}) takes a ddpgraph.DeviceData as its one argument; "
                "a batch of tensors is one training step."
            )
        if self.steps_per_replay > 1:
            raise ConfigError(
                f"TrainStep(steps_per_replay={self.steps_per_replay}) replays several "
                "steps on batches it gathers itself: call step(data) with a ddpgraph.DeviceData "
                "(DeviceData(x, y, batch_size=...)), or leave steps_per_replay at 1 for step(x, y)."
            )

    def full_batch(self, data: DeviceData) -> Batch:
        """A whole call's batch: a short call (a run's last steps) is the same data."""
        return data_batch(data, self.steps_per_replay)

    def run(self, data: DeviceData, steps: int, report: StepReport, train: Train) -> torch.Tensor:
        """One call of ``steps`` steps: ``train(batch, steps)``'s loss; if it raises, it is as if
        the call never happened (no batch or LR skipped by the next one, the count as it was)."""
        lr = self._lr if self._lr is not None else self.lr  # no property call once built
        batch = self._batches.get((data.token, steps))
        if batch is None:
            batch = self._batches[data.token, steps] = data_batch(data, steps)
        staged = lr.scheduler is not None  # else no LR to stage, check or put back (no call)
        if staged:
            lr.check()  # before anything is counted or stepped
            before = lr.snapshot()
        report.steps += steps
        try:
            if staged:
                lr.prepare(steps)
            loss = train(batch, steps)
        except BaseException:
            if staged:
                lr.restore(before)
            data.rewind()
            report.steps -= steps
            raise
        finally:
            if staged:
                lr.finish()
        data.advance(steps)
        return loss

    def loaded(self) -> None:
        """A checkpoint was loaded into the scheduler: take its count as it is."""
        if self._lr is not None:
            self._lr.sync_epoch()

    def close(self) -> None:
        self._batches.clear()
        self._checked = None


class StepwiseLR:
    """Steps ``scheduler`` once per training step of a multi-step call; the graph reads the LRs.

    ``lr_tensors`` are the optimizer's device LR tensors (graphs possible) or None (eager, or the
    CPU stand-in engine): then step j sets the param groups' float LR on the host, which an eager
    body and the stand-in's re-run body both see.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        lr_tensors: list[torch.Tensor] | None,
        max_steps: int,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = _stepped_per_step(scheduler)
        self._lr_tensors = lr_tensors
        self._values: list[list[float]] = []  # [step][group]
        self._table: torch.Tensor | None = None  # [step, group] on the device, read by graphs
        if lr_tensors:
            shape = (max_steps, len(lr_tensors))
            self._table = torch.zeros(shape, dtype=torch.float32, device=lr_tensors[0].device)
        self._position = _position(self.scheduler)

    def snapshot(self) -> dict[str, Any] | None:
        """The scheduler's state before a call, to put back if the call fails."""
        return None if self.scheduler is None else self.scheduler.state_dict()

    def restore(self, state: dict[str, Any] | None) -> None:
        """After a failed call: the scheduler as it was, as if the call never happened."""
        if self.scheduler is None or state is None:
            return
        self.scheduler.load_state_dict(state)
        self._position = _position(self.scheduler)

    def prepare(self, steps: int) -> None:
        """Step the scheduler ``steps`` times and stage the LR of each step (one copy)."""
        if self.scheduler is None:
            return
        self.check()
        groups = self.optimizer.param_groups
        others = hyperparameters(self.optimizer)
        held = [group["lr"] for group in groups]
        for group, lr in zip(groups, self.scheduler.get_last_lr()):
            group["lr"] = _as_float(lr)
        self._floats_in_scheduler()
        values: list[list[float]] = []
        with warnings.catch_warnings():
            # stepped ahead of the optimizer on purpose: torch warns on the first call
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            for _ in range(steps):
                values.append([float(group["lr"]) for group in groups])
                self.scheduler.step()
        if hyperparameters(self.optimizer) != others:
            raise ConfigError(
                f"{type(self.scheduler).__name__} changes momentum or betas as well as the LR; "
                "step(data) stages only the LR of each step of a call, so the other values would "
                "be a call ahead. Pass cycle_momentum=False, or train with step(x, y) and "
                "scheduler.step()."
            )
        if self._lr_tensors is not None:
            for group, lr in zip(groups, held):
                group["lr"] = lr  # the tensor the graphs read
            self._stage(values)
        self._values = values
        self._position = _position(self.scheduler)

    def apply(self, step: int) -> None:
        """Step ``step``'s LR where the optimizer reads it (captured: a device copy)."""
        if self.scheduler is None:
            return
        if self._lr_tensors is None:
            for group, value in zip(self.optimizer.param_groups, self._values[step]):
                group["lr"] = value
            return
        assert self._table is not None
        for g, lr in enumerate(self._lr_tensors):
            lr.copy_(self._table[step, g])

    def finish(self) -> None:
        """After the call, the groups hold the scheduler's latest LR, as after an eager loop
        (with LR tensors: filled after the call's kernels, stream-ordered, no sync), so logs,
        checkpoints and a later ``step(x, y)`` see it."""
        if self.scheduler is None:
            return
        latest = [_as_float(lr) for lr in self.scheduler.get_last_lr()]
        if self._lr_tensors is None:
            for group, value in zip(self.optimizer.param_groups, latest):
                group["lr"] = value
            return
        for lr, value in zip(self._lr_tensors, latest):
            lr.fill_(value)

    def sync_epoch(self) -> None:
        """Accept the scheduler's count as it is now (after a checkpoint was loaded into it)."""
        self._position = _position(self.scheduler)

    # ------------------------------------------------------------- internals
    def check(self) -> None:
        """Raise if the loop stepped the scheduler itself since the last call; a count that went
        back (a state loaded into the scheduler) is accepted."""
        now = _position(self.scheduler)
        if now is None or self._position is None or now <= self._position:
            self._position = now
            return
        raise ConfigError(
            f"the LR scheduler was stepped outside the TrainStep (last_epoch "
            f"{self._position} -> {now}): with step(data) the TrainStep "
            "steps its scheduler= once per training step itself, so each of the steps in a "
            "replay gets its own LR; remove scheduler.step() from the loop."
        )

    def _floats_in_scheduler(self) -> None:
        # base LRs captured as tensors (a scheduler built after TrainStep made the LR a tensor)
        # would turn every computed LR into a tensor, and each float() into a host sync
        base = getattr(self.scheduler, "base_lrs", None)
        if base is not None and any(isinstance(b, torch.Tensor) for b in base):
            self.scheduler.base_lrs = [_as_float(b) for b in base]

    def _stage(self, values: list[list[float]]) -> None:
        assert self._table is not None
        upload_into(self._table[: len(values)], torch.tensor(values, dtype=torch.float32))


def _stepped_per_step(scheduler: Any) -> Any:
    """The scheduler TrainStep steps once per training step, or None.

    ReduceLROnPlateau steps on a metric the script computes (``scheduler.step(val_loss)`` after
    evaluating), so the script keeps stepping it; its LR holds for every step of a call.
    """
    if scheduler is None or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    if not all(hasattr(scheduler, name) for name in ("step", "get_last_lr", "state_dict")):
        raise ConfigError(
            f"scheduler={type(scheduler).__name__} is not a torch.optim.lr_scheduler.LRScheduler "
            "(it needs step(), get_last_lr() and state_dict()), so step(data) cannot step it per "
            "training step; use one of torch's schedulers or leave it out of scheduler=."
        )
    if getattr(scheduler, "cycle_momentum", False):
        raise ConfigError(
            f"{type(scheduler).__name__}(cycle_momentum=True) changes the momentum every step, "
            "which step(data) cannot stage per step inside a call; pass cycle_momentum=False, or "
            "train with step(x, y) and scheduler.step()."
        )
    return scheduler


def _position(scheduler: Any) -> Any:
    """How far the scheduler has stepped: ``last_epoch``, or its children's for a
    ChainedScheduler; None where neither exists (no check)."""
    if scheduler is None:
        return None
    if hasattr(scheduler, "last_epoch"):
        return scheduler.last_epoch
    children = getattr(scheduler, "_schedulers", None)
    if children and all(hasattr(c, "last_epoch") for c in children):
        return tuple(c.last_epoch for c in children)
    return None


def _as_float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
