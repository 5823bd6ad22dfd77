"""``TrainStep``: the whole data-parallel training step, captured once as a CUDA graph and replayed.

A thin front over named parts: the options (:mod:`.options`), the step body (:mod:`.body`) with
its precision (:mod:`.precision`) and data-parallel wrapper (:mod:`.parallel`), the capture
policy (:mod:`.policy`: a pure decision) and its runner (:mod:`.runner`), the graphs
(:mod:`.graphs`) and the ``step(data)`` feed (:mod:`.feed`), built and wired by
:mod:`.assembly`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..data.device_data import DeviceData
from ..errors import ConfigError, DistributedStateError, explain_exception, first_line
from .assembly import assemble
from .batch import make_batch
from .body import LossFn
from .engine import GraphEngine
from .optim import restore_identities, tensor_slots
from .options import (
    GraphMode,
    GuardMode,
    NewShapePolicy,
    StepOptions,
    check_arguments,
    check_compile_fits,
    model_device,
)
from .parallel import ParallelMode, unwrap
from .report import Phase, StepReport
from .window import WindowEnds, check_window_ends

__all__ = ["TrainStep"]


class TrainStep:
    """The whole training step as one callable: ``loss = step(x, y)`` or ``loss = step(batch)``.

    Batches (call it on every rank, the same number of times):
        ``step(*inputs, target)``: ``loss_fn(model(*inputs), target)``.
        ``step(*inputs)`` with ``loss_fn=None``: ``model(*inputs)`` computes its own loss, as
            scripts call it (nanoGPT's ``logits, loss = model(X, Y)`` becomes ``step(X, Y)``):
            a scalar output, ``output.loss``, ``output["loss"]`` or the one 0-dim floating tensor
            of a tuple; anything else is a ``ValueError`` naming what was found.
        ``step(batch)`` with one mapping (dict, HF ``BatchEncoding``): ``model(**batch)``; with a
            ``loss_fn`` the loss is ``loss_fn(output, batch)``.
        ``step(data)`` with a :class:`~ddpgraph.DeviceData`: ``steps_per_replay`` whole training
            steps on batches gathered on the device; their losses as one tensor. The TrainStep
            steps its ``scheduler=`` once per training step (the loop must not);
            ``step(data, steps=n)`` runs ``n <= steps_per_replay`` (a run's last few). A call
            that raises leaves the data position, the scheduler and the step count as they were.

    The returned loss is a tensor of the call's own that a script may keep (a replay copies it
    out of the graph, as an eager step returns a new one). :attr:`output` (the model's output of
    the latest step) and :attr:`grad_norm` are owned by the graph once captured: the next call
    overwrites them; ``.clone()`` keeps a value.

    Phases (:attr:`phase`: warm-up, graphed, eager for a stated reason, closed), what is checked
    before each call and what is re-captured: :mod:`ddpgraph.step.runner`. :meth:`evaluate` runs
    the forward only, graphed after its own warm-up.

    Options (keyword-only, validated here; each documented on
    :class:`~ddpgraph.step.options.StepOptions`), and ``ddp_kwargs`` (extra DDP arguments;
    ``gradient_as_bucket_view=True`` by default), ``scheduler`` (in :meth:`state_dict`; stepped per
    step by ``step(data)``), ``engine`` (CUDA graphs, or ``ddpgraph.testing.CpuGraphs()``),
    ``window_ends`` (a framework's loop state, asked on each call whether it ends the
    ``accumulate_calls`` window: ``ddpgraph.integrations.accelerate.from_accelerator`` sets
    Accelerate's ``sync_gradients``).

    With a process group the model is wrapped in DDP (``step.model``) on the capture stream;
    pass the bare module. Buffers follow DDP (rank 0's at each step's first forward, and at the
    first forward the script makes through ``step.model`` after a training step); a freeze or
    unfreeze (``requires_grad``) rebuilds the DDP over the new trainable set and graphs again.
    A model sharded with ``fully_shard`` is used as it is (FSDP2: :mod:`.parallel.fsdp2`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None,
        *,
        graph: GraphMode = "auto",
        amp: str | torch.dtype | None = None,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        on_new_shape: NewShapePolicy = "eager",
        warmup: int | None = None,
        ddp_kwargs: Mapping[str, Any] | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        compile: bool | Mapping[str, Any] = False,
        channels_last: bool = False,
        grad_scaler: Mapping[str, float] | None = None,
        accumulate_calls: int = 1,
        steps_per_replay: int = 1,
        grad_norm: bool = False,
        engine: GraphEngine | None = None,
        defer_update: bool = False,
        parallel: ParallelMode = "auto",
        check_finite: bool = False,
        sync_every_call: bool = False,
        guard: GuardMode = "events",
        window_ends: WindowEnds | None = None,
    ) -> None:
        options = StepOptions(
            graph=graph, amp=amp, accumulate=accumulate, clip_grad_norm=clip_grad_norm,
            on_new_shape=on_new_shape, warmup=warmup, compile=compile,
            channels_last=channels_last, grad_scaler=grad_scaler,
            accumulate_calls=accumulate_calls, steps_per_replay=steps_per_replay,
            grad_norm=grad_norm, defer_update=defer_update, parallel=parallel,
            check_finite=check_finite, sync_every_call=sync_every_call, guard=guard,
        )  # fmt: skip
        check_arguments(model, optimizer, loss_fn)
        check_window_ends(window_ends)
        check_compile_fits(model, compile)
        self.options, self.optimizer, self.loss_fn = options, optimizer, loss_fn
        self.scheduler = scheduler
        self.device = model_device(model)
        parts = assemble(
            model, optimizer, loss_fn, options, self.device,
            ddp_kwargs=ddp_kwargs, scheduler=scheduler, engine=engine, window_ends=window_ends,
        )  # fmt: skip
        self._precision, self._body, self._finite = parts.precision, parts.body, parts.finite
        self._report, self._runner, self._feed = parts.report, parts.runner, parts.feed
        # what __call__ tests as attributes (fixed at construction)
        self._data_only = steps_per_replay > 1  # step(x, y) refused: step(data) only
        self._shape_rule = on_new_shape == "error"

    # ----------------------------------------------------------------- public
    @property
    def model(self) -> nn.Module:
        """The module the step trains: the DDP around the user's module where there is one."""
        return self._body.parallel.module

    @property
    def output(self) -> Any:
        """The model's output of the latest step (graph-owned once captured)."""
        return self._runner.output

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total norm of the latest update's (unscaled) gradients, as ``clip_grad_norm_``
        returns it in an eager loop: a 0-dim device tensor (``[k]`` for a ``step(data)`` call of
        k steps), graph-owned like the loss; None after a call that did not step the optimizer
        (an ``accumulate_calls`` micro-batch) or without ``clip_grad_norm`` and ``grad_norm``."""
        return self._runner.grad_norm

    @property
    def phase(self) -> Phase:
        return self._runner.phase

    @property
    def mode(self) -> str:
        """ "graphed" once a graph exists, "warmup" while heading for one, else "eager"."""
        return self._runner.phase.value

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """fp16's current loss scale (a device tensor the graph updates); None without fp16."""
        return self._precision.loss_scale

    @property
    def update_skipped(self) -> bool:
        """fp16: whether the latest optimizer update was skipped for inf/NaN gradients (a host
        read of the device's flag, as GradScaler's callers make); False without fp16."""
        return self._precision.update_skipped()

    def report(self) -> StepReport:
        """Warm-up steps, captures (with time), replays, eager steps and every fallback's reason;
        with fp16 the steps skipped for inf/NaN gradients (read from the device: a sync)."""
        self._report.mode = self.mode
        self._report.skipped_steps = self._precision.skipped_steps()
        return self._report

    def __call__(
        self,
        *args: Any,
        steps: int | None = None,
        last: bool | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """One training step, or with ``accumulate_calls=k`` one micro-batch: the k-th call of a
        window syncs the gradients and steps the optimizer. ``last=True`` ends the window early
        on the micro-batches taken (as accelerate does at the end of its data; each still divides
        its loss by k); the script's own ``require_backward_grad_sync`` / ``no_sync()`` is read
        the same way, its sync turned back on as the window's end (:mod:`.window`). A script
        that passes ``last=`` (True or False) on its calls says where its windows end itself,
        which a framework's loop state (Accelerate's ``accumulate()`` blocks) then leaves to it.
        ``window=n`` (1 <= n <= k, the same on each call of a window) says this window has n
        micro-batches, each dividing its loss by n, as timm's ``train.py`` divides an epoch's
        short last window (``step(x, y, window=accum_steps)``)."""
        # attribute tests only: a helper is called where there is something to check or say
        policy = self._runner
        if policy.state.phase is Phase.CLOSED:
            policy.check_open("step()")
        if len(args) == 1 and isinstance(args[0], DeviceData):
            if window is not None or last:
                raise ConfigError(
                    "step(data, window=/last=): a DeviceData call runs whole training steps "
                    "(steps_per_replay), no accumulate_calls window; drop them."
                )
            return self._run_data(args[0], steps)
        if steps is not None or self._data_only:
            self._feed.check_batch_call(steps)
        batch = make_batch(args, min_positional=1 if self.loss_fn is None else 2)
        self._report.steps += 1
        if self._shape_rule:
            policy.check_shape(batch)
        if policy.window.ends is not None:  # a framework's loop state (Accelerate's) has a say
            last = policy.window.loop_ends(last, policy.gate.script_sync())
        try:  # no frame of its own: this is the replayed path
            loss = policy.train(batch, 1, last=bool(last), window=window)
        except RuntimeError as exc:
            _raise_if_peer_gone(exc, self._report.steps)
            raise
        if self._finite is not None:
            self._finite.check()
        return loss

    def update(self) -> None:
        """``defer_update=True``: the optimizer step on the synced window, in place of the script's
        ``optimizer.step()``, with the LR the script set since. On every rank, once per window."""
        self._runner.check_open("update()")
        self._runner.update()
        if self._finite is not None:
            self._finite.check()

    def raise_if_not_finite(self) -> None:
        """``check_finite=True``: wait for the device and raise :class:`~ddpgraph.NonFiniteError`
        if any update so far was not finite (a host sync: call it at the end of training, or
        before saving a checkpoint, which then never holds a diverged model). Without the
        option, nothing. Call on every rank."""
        if self._finite is not None:
            self._finite.check(wait=True)

    def _run_data(self, data: DeviceData, steps: int | None) -> torch.Tensor:
        """``steps`` training steps on batches gathered from ``data`` on the device."""
        feed = self._feed
        n = feed.steps_of(data, steps)
        if self._shape_rule:
            self._runner.check_shape(feed.full_batch(data))
        try:
            loss = feed.run(data, n, self._report, self._runner.train)
        except RuntimeError as exc:
            _raise_if_peer_gone(exc, self._report.steps)
            raise
        return self._checked(loss)

    def evaluate(self, *args: Any) -> Any:
        """The model's forward in eval mode without gradients: ``step.evaluate(x)`` or
        ``step.evaluate(batch)`` (a mapping, passed as ``model(**batch)``); no target.

        What DDP's own eval forward gives: the first evaluation after a training step sends rank
        0's buffers first, as DDP's does (a collective: call it on every rank); later ones until
        the next step are rank-local. On CUDA it is captured after two eager calls per input
        signature and replayed; the output is then graph-owned like the loss. Every module's own
        mode is restored when this returns.
        """
        self._runner.check_open("evaluate()")
        batch = make_batch(args, min_positional=1)
        self._report.evaluations += 1
        return self._runner.evaluate(batch)

    def close(self) -> None:
        """Free every captured graph and their memory pool; later calls raise. Call on every
        rank; follow with ``torch.cuda.empty_cache()`` to hand the memory back to the driver."""
        self._runner.close()
        self._feed.close()

    def bare_graph(self) -> torch.cuda.CUDAGraph | None:
        """The first training graph of a batch of tensors, for benchmarks that time a bare
        replay; None if none."""
        graphs = self._runner.graphs
        return None if graphs is None else graphs.bare_graph()

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Model (unwrapped), optimizer, scheduler and step count; safe to save after any call
        except between the micro-batches of ``accumulate_calls`` (refused: the partial
        gradients would be lost)."""
        state: dict[str, Any] = {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self.extra_state(),
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load in place (the same tensors, new values), so captured graphs stay valid.

        Call on every rank. ``optimizer.load_state_dict`` alone works too: the next replay copies
        its values into the tensors the graph reads.
        """
        missing = {"model", "optimizer"} - set(state)
        if missing:
            raise ConfigError(f"state dict lacks {sorted(missing)}; pass TrainStep.state_dict()'s.")
        kept = tensor_slots(self.optimizer)
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(dict(state["optimizer"]))
        restore_identities(self.optimizer, kept)
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.load_extra_state(state)

    def extra_state(self) -> dict[str, Any]:
        """What the TrainStep holds besides model, optimizer and scheduler (the step count;
        fp16's loss scale): what :func:`ddpgraph.save_checkpoint` saves of it."""
        self._runner.window.check_closed("state_dict()")
        state: dict[str, Any] = {"steps": self._report.steps}
        scaler = self._precision.state_dict()
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`extra_state`'s values after model, optimizer and scheduler were
        loaded in place (by :meth:`load_state_dict` or a checkpoint): the graphs re-read the
        optimizer's LR tensors, the feed the scheduler's count. Call on every rank."""
        if self._runner.graphs is not None:
            self._runner.graphs.make_optimizer_safe_again()
        self._feed.loaded()
        if "scaler" in state:
            self._precision.load_state_dict(state["scaler"])
        self._report.steps = int(state.get("steps", self._report.steps))
        if self._finite is not None:  # step counts are calls: accumulate_calls per update
            self._finite.start_at(self._report.steps // self.options.accumulate_calls)

    # ----------------------------------------------------------------- helpers
    def _checked(self, loss: torch.Tensor) -> torch.Tensor:
        """``check_finite``: raise if a finished update was not finite (no host sync on CUDA)."""
        if self._finite is not None:
            self._finite.check()
        return loss


def _raise_if_peer_gone(exc: RuntimeError, calls: int) -> None:
    """A collective of the step whose peer is gone (gloo: "Connection closed by peer") raises
    what it most often means. A rank that crashed shows its own error; one that simply finished
    made fewer calls than this one, which nothing else names."""
    known = explain_exception(exc)
    if known is None or known.id != "peer-gone":
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    raise DistributedStateError(
        f"TrainStep call {calls} on rank {rank}: a peer rank left the step's gradient "
        f"all-reduce ({first_line(exc)}). Either it crashed (its log shows the first error) or "
        "it finished its loop after fewer calls: every rank must call step() the same number "
        "of times; give each rank the same number of batches (DistributedSampler(..., "
        "drop_last=True), or stop every rank at the same step) and call ddpgraph.shutdown() on "
        "every rank only after its loop."
    ) from exc
