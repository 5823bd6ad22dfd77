"""``TrainStep``: the whole data-parallel training step, captured once as a CUDA graph and replayed.

A thin front over named parts: the options (:mod:`.options`), the step body (:mod:`.body`) with
its precision (:mod:`.precision`) and data-parallel wrapper (:mod:`.parallel`), the capture
policy (:mod:`.policy`), the graphs (:mod:`.graphs`) and the ``step(data)`` feed (:mod:`.feed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..data.device_data import DeviceData
from ..dist import watchdog
from ..errors import CaptureError, ConfigError
from .batch import make_batch
from .body import LossFn, StepBody
from .feed import DataFeed
from .graphs import GraphEngine, Graphs, capture_stream
from .optim import restore_identities, tensor_slots
from .options import (
    GraphMode,
    NewShapePolicy,
    StepOptions,
    check_model,
    check_optimizer,
    model_device,
)
from .parallel import unwrap, wrap
from .policy import CapturePolicy, build_graphs
from .precision import precision_for
from .report import Phase, StepReport

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

    The returned loss and :attr:`output` (the model's output of the latest step) are owned by
    the graph once captured: the next call overwrites them. ``loss.clone()`` keeps a value.

    Phases (:attr:`phase`): ``WARMUP`` runs eager steps (DDP needs 11 before it can be captured);
    then every rank captures and agrees that all succeeded, and ``GRAPHED`` replays, capturing
    one more graph per new input signature (``on_new_shape="capture"``) or module mode (a step
    after ``model.eval()`` has its own graph). A capture that fails falls back to ``EAGER``
    (the reason in ``report().fallbacks``), naming a host sync seen in warm-up as the likely
    cause; ``CLOSED`` after :meth:`close`. :meth:`evaluate` runs the forward only, graphed after
    its own warm-up. Before each replay, changes a script made are found:
    ``optimizer.load_state_dict(...)`` (copied into the tensors the graph reads), a param-group
    value or ``requires_grad`` (re-captured, with a warning); a replaced parameter raises
    :class:`CaptureError`.

    Options (keyword-only, validated here):
        graph: "auto" captures where CUDA is available, else eager with a warning saying why;
            "always" raises :class:`CaptureError` instead; "never" stays eager.
        amp: None, bf16 (``"bf16"``, ``"bfloat16"``, ``torch.bfloat16``) or fp16 (``"fp16"``,
            ``"float16"``, ``torch.float16``): autocast around forward and loss. fp16 adds dynamic
            loss scaling inside the graph, op for op as ``torch.amp.GradScaler`` with a fused
            optimizer (switched on for Adam/AdamW/SGD); :attr:`loss_scale` is the scale.
        grad_scaler: fp16's ``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, as ``torch.amp.GradScaler`` takes them.
        accumulate: k micro-batches per step (every batch tensor split along dim 0).
        accumulate_calls: k calls per optimizer step, one micro-batch each.
        clip_grad_norm: max total gradient norm, clipped on the device without a host sync.
        grad_norm: True measures the total gradient norm of every update without clipping
            (with ``clip_grad_norm`` it is always measured): :attr:`grad_norm`.
        on_new_shape: a batch unlike every captured one: "eager" runs it eagerly, "capture"
            records another graph in the same pool (pad with :func:`ddpgraph.pad_batch`),
            "error" raises ``ValueError`` naming the entry that changed.
        warmup: eager steps before capture (default 12, raised to a count DDP allows).
        ddp_kwargs: extra ``DistributedDataParallel`` arguments (``gradient_as_bucket_view=True``
            is the default: it made graphed steps 2-7% faster).
        scheduler: an LR scheduler for :meth:`state_dict`; with ``step(data)`` also stepped per
            training step (ReduceLROnPlateau excepted: the script steps it on its metric).
        compile: True or ``torch.compile`` arguments: Inductor kernels inside the one graph.
        channels_last: the model and 4-d batch tensors in channels_last.
        steps_per_replay: training steps per call of ``step(data)``, captured as one graph.
        engine: what makes the graphs: CUDA graphs by default; ``ddpgraph.testing.CpuGraphs()``
            runs the real capture policy on the CPU (tests, dry runs).

    With a process group the model is wrapped in DDP (``step.model``), on the capture stream;
    pass the bare module. With DDP's ``broadcast_buffers`` each step ends by broadcasting rank
    0's buffers, so :meth:`evaluate` sees on every rank what DDP's own eval forward would.
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
        scheduler: Any = None,
        compile: bool | Mapping[str, Any] = False,
        channels_last: bool = False,
        grad_scaler: Mapping[str, float] | None = None,
        accumulate_calls: int = 1,
        steps_per_replay: int = 1,
        grad_norm: bool = False,
        engine: GraphEngine | None = None,
    ) -> None:
        options = StepOptions(
            graph, amp, accumulate, clip_grad_norm, on_new_shape, warmup, compile,
            channels_last, grad_scaler, accumulate_calls, steps_per_replay, grad_norm,
        )  # fmt: skip
        check_model(model)
        check_optimizer(optimizer, model)
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"loss_fn={loss_fn!r} is not callable.")
        self.options, self.optimizer, self.loss_fn = options, optimizer, loss_fn
        self.scheduler = scheduler
        self.device = device = model_device(model)
        stream = capture_stream(device) if device.type == "cuda" else None
        if channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        kwargs = dict(ddp_kwargs or {})
        self._precision = precision_for(options.amp, device, options.grad_scaler)
        self._body = StepBody(
            wrap(_compiled(model, compile) if compile else model, device, stream, kwargs),
            optimizer,
            loss_fn,
            self._precision,
            accumulate=accumulate,
            accumulate_calls=accumulate_calls,
            clip_grad_norm=clip_grad_norm,
            measure_grad_norm=grad_norm,
            channels_last=channels_last,
        )
        self._report = StepReport(mode="eager", steps_per_replay=steps_per_replay)
        graphs = build_graphs(engine, options, device, self._parameters, optimizer)
        self._policy = CapturePolicy(
            options,
            self._body,
            graphs if isinstance(graphs, Graphs) else None,
            device=device,
            stream=stream,
            submodules=list(model.modules()),
            rewrap=lambda: wrap(model, device, stream, kwargs),
            report=self._report,
        )
        self._module = model
        lr_tensors = graphs.plan.lr_tensors if isinstance(graphs, Graphs) else []
        self._feed = DataFeed(optimizer, scheduler, lr_tensors or None, steps_per_replay, device)
        self._body.feed = self._feed
        if isinstance(graphs, Graphs) and stream is not None:
            graphs.register_replay_hook(self._watch_replay)
        if isinstance(graphs, str):
            self._policy.enter_eager(graphs, warn=stream is not None)
        self._report.mode = self.mode

    # ----------------------------------------------------------------- framework front-ends
    @classmethod
    def from_accelerator(
        cls, accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None, **options: Any,
    ) -> TrainStep:  # fmt: skip
        """A TrainStep set up as an Accelerate ``Accelerator`` says (mixed_precision as amp,
        gradient_accumulation_steps as accumulate_calls): :mod:`ddpgraph.integrations.accelerate`."""
        from ..integrations.accelerate import from_accelerator

        return from_accelerator(accelerator, model, optimizer, loss_fn, **options)

    @classmethod
    def from_fabric(
        cls, fabric: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None, **options: Any,
    ) -> TrainStep:  # fmt: skip
        """A TrainStep set up as a Lightning ``Fabric`` says (precision as amp):
        :mod:`ddpgraph.integrations.fabric`."""
        from ..integrations.fabric import from_fabric

        return from_fabric(fabric, model, optimizer, loss_fn, **options)

    # ----------------------------------------------------------------- public
    @property
    def model(self) -> nn.Module:
        """The module the step trains: the DDP around the user's module where there is one."""
        return self._body.parallel.module

    @property
    def output(self) -> Any:
        """The model's output of the latest step (graph-owned once captured)."""
        return self._policy.output

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total norm of the latest update's (unscaled) gradients, as ``clip_grad_norm_``
        returns it in an eager loop: a 0-dim device tensor (``[k]`` for a ``step(data)`` call of
        k steps), graph-owned like the loss; None after a call that did not step the optimizer
        (an ``accumulate_calls`` micro-batch) or without ``clip_grad_norm`` and ``grad_norm``."""
        return self._policy.grad_norm

    @property
    def phase(self) -> Phase:
        return self._policy.phase

    @property
    def mode(self) -> str:
        """ "graphed" once a graph exists, "warmup" while heading for one, else "eager"."""
        return self._policy.phase.value

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """fp16's current loss scale (a device tensor the graph updates); None without fp16."""
        return self._precision.loss_scale

    def report(self) -> StepReport:
        """Warm-up steps, captures (with time), replays, eager steps and every fallback's reason;
        with fp16 the steps skipped for inf/NaN gradients (read from the device: a sync)."""
        self._report.mode = self.mode
        self._report.skipped_steps = self._precision.skipped_steps()
        return self._report

    def __call__(self, *args: Any, steps: int | None = None) -> torch.Tensor:
        self._check_open("step()")
        if len(args) == 1 and isinstance(args[0], DeviceData):
            return self._run_data(args[0], steps)
        self._check_batch_call(args, steps)
        batch = make_batch(args, min_positional=1 if self.loss_fn is None else 2)
        self._report.steps += 1
        self._policy.check_shape(batch)
        return self._watched(self._policy.watch_phase(), lambda: self._policy.train(batch, 1))

    def _run_data(self, data: DeviceData, steps: int | None) -> torch.Tensor:
        """``steps`` training steps on batches gathered from ``data`` on the device."""
        if self.options.accumulate_calls > 1:
            raise ConfigError(
                "step(data) runs whole training steps, but accumulate_calls="
                f"{self.options.accumulate_calls} takes one micro-batch per call; use accumulate=k."
            )
        n = self._feed.steps_of(data, steps)
        self._policy.check_shape(self._feed.full_batch(data))
        with self._feed.call(data, n, self._report) as batch:
            phase = self._policy.watch_phase()
            return self._watched(phase, lambda: self._policy.train(batch, n))

    def _check_batch_call(self, args: tuple[Any, ...], steps: int | None) -> None:
        if steps is not None:
            raise ConfigError(
                f"step(..., steps={steps!r}) takes a ddpgraph.DeviceData as its one argument; "
                "a batch of tensors is one training step."
            )
        if self.options.steps_per_replay > 1:
            raise ConfigError(
                f"TrainStep(steps_per_replay={self.options.steps_per_replay}) replays several "
                "steps on batches it gathers itself: call step(data) with a ddpgraph.DeviceData "
                "(DeviceData(x, y, batch_size=...)), or leave steps_per_replay at 1 for step(x, y)."
            )

    def evaluate(self, *args: Any) -> Any:
        """The model's forward in eval mode without gradients: ``step.evaluate(x)`` or
        ``step.evaluate(batch)`` (a mapping, passed as ``model(**batch)``); no target.

        Rank-local (no collective: uneven evaluation sets cannot hang); every rank holds rank
        0's buffers after each step, so the result is what DDP's own eval forward gives. On CUDA
        it is captured after two eager calls per input signature and replayed; the output is
        then graph-owned like the loss. Every module's own mode is restored when this returns.
        """
        self._check_open("evaluate()")
        batch = make_batch(args, min_positional=1)
        self._report.evaluations += 1
        with self._eval_mode():
            return self._watched("eval", lambda: self._policy.evaluate(batch))

    def close(self) -> None:
        """Free every captured graph and their memory pool; later calls raise. Call on every
        rank; follow with ``torch.cuda.empty_cache()`` to hand the memory back to the driver."""
        if self._policy.graphs is not None:
            self._policy.graphs.close()
        self._policy.output = None
        self._feed.close()
        self._policy.phase = Phase.CLOSED

    def bare_graph(self) -> torch.cuda.CUDAGraph | None:
        """The first training graph of a batch of tensors, for benchmarks that time a bare
        replay; None if none. (A ``step(data)`` graph is left out: it gathers at a device cursor
        that only ``step(data)`` keeps inside the data's window.)"""
        graphs = self._policy.graphs
        keys = [] if graphs is None else graphs.keys_of("train")
        captured = [graphs.get(k) for k in keys if not k.reads_device_data] if graphs else []
        return captured[0].graph if captured and captured[0] is not None else None

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
        if self._policy.micro_batches:
            raise ConfigError(
                f"state_dict() after {self._policy.micro_batches} of "
                f"{self.options.accumulate_calls} micro-batches (accumulate_calls): their "
                "gradients are not in any state dict; save after the call that steps the "
                "optimizer (calls % accumulate_calls == 0)."
            )
        state: dict[str, Any] = {"steps": self._report.steps}
        scaler = self._precision.state_dict()
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`extra_state`'s values after model, optimizer and scheduler were
        loaded in place (by :meth:`load_state_dict` or a checkpoint): the graphs re-read the
        optimizer's LR tensors, the feed the scheduler's count. Call on every rank."""
        if self._policy.graphs is not None:
            self._policy.graphs.make_optimizer_safe_again()
        self._feed.loaded()
        if "scaler" in state:
            self._precision.load_state_dict(state["scaler"])
        self._report.steps = int(state.get("steps", self._report.steps))

    # ----------------------------------------------------------------- helpers
    def _parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def _watched(self, phase: str, run: Callable[[], Any]) -> Any:
        """``run()`` as a watched call: a hang in it becomes the watchdog's verdict."""
        wd = watchdog.active()
        if wd is None:
            return run()
        wd.enter(phase, self._report.steps)
        try:
            result = run()
        except BaseException as exc:
            wd.leave()
            wd.on_error(exc)
            raise
        wd.leave()
        return result

    def _watch_replay(self, stream: torch.cuda.Stream) -> None:
        # a graph's collectives are invisible to NCCL's watchdog: this event is what shows a hang
        wd = watchdog.active()
        if wd is not None:
            wd.after_replay(stream, self._report.steps)

    def _check_open(self, what: str) -> None:
        if self._policy.phase is Phase.CLOSED:
            raise CaptureError(
                f"{what} on a TrainStep after close(): its graphs and their memory are gone; "
                "build a new TrainStep to keep training."
            )

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        modules = list(self._module.modules())
        modes = [m.training for m in modules]
        self._module.eval()
        try:
            yield
        finally:
            for module, training in zip(modules, modes):
                module.training = training


def _compiled(model: nn.Module, options: bool | Mapping[str, Any]) -> nn.Module:
    # Inductor's default mode: its kernels, no CUDA graphs of its own (TrainStep captures the
    # whole step). DDP goes around the compiled module: torch.compile(DDP(m)) compiles nothing.
    kwargs = dict(options) if isinstance(options, Mapping) else {}
    return torch.compile(model, **kwargs)  # type: ignore[return-value]
