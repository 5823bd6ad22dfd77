"""TrainStep's options and the checks of what it is given, all run when it is built, so a bad
combination fails before the first step, not in the middle of training."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._checks import is_int, is_number
from .._frames import PACKAGE_DIR, frame_outside, in_directories
from ..errors import ConfigError, DeviceConflictError
from .parallel import PARALLEL_CHOICES, ParallelMode, check_not_wrapped
from .precision import amp_dtype, check_scaler_options

__all__ = [
    "GraphMode",
    "GuardMode",
    "NewShapePolicy",
    "StepOptions",
    "check_arguments",
    "check_compile_fits",
    "check_loss_fn",
    "check_model",
    "check_optimizer",
    "model_device",
    "warn_at_user_line",
]

GraphMode = Literal["auto", "always", "never"]
NewShapePolicy = Literal["eager", "capture", "error"]
GuardMode = Literal["full", "events"]


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """TrainStep's options, validated when the TrainStep is built (keyword-only there).

    Attributes:
        graph: "auto" captures where CUDA is available, else eager with the reason in
            ``report().fallbacks`` (and a warning where CUDA is there but capture is not);
            "always" raises :class:`CaptureError` instead; "never" stays eager.
        amp: None, bf16 (``"bf16"``, ``"bfloat16"``, ``torch.bfloat16``) or fp16 (``"fp16"``,
            ``"float16"``, ``torch.float16``): autocast around forward and loss. fp16 adds dynamic
            loss scaling inside the graph, op for op as ``torch.amp.GradScaler`` with a fused
            optimizer (switched on for Adam/AdamW/SGD); :attr:`TrainStep.loss_scale` is the scale.
        grad_scaler: fp16's ``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, as ``torch.amp.GradScaler`` takes them.
        accumulate: k micro-batches per step (every batch tensor split along dim 0).
        accumulate_calls: k calls per optimizer step, one micro-batch each.
        clip_grad_norm: max total gradient norm, clipped on the device without a host sync.
        grad_norm: True measures the total gradient norm of every update without clipping
            (with ``clip_grad_norm`` it is always measured): ``TrainStep.grad_norm``.
        on_new_shape: a batch unlike every captured one: "eager" runs it eagerly, "capture"
            records another graph in the same pool (pad with :func:`ddpgraph.pad_batch`),
            "error" raises ``ValueError`` naming the entry that changed.
        warmup: eager steps before capture (default 12; under DDP raised to a count DDP allows).
        compile: True or ``torch.compile`` arguments: Inductor kernels inside the one graph.
        channels_last: the model and 4-d batch tensors in channels_last.
        steps_per_replay: training steps per call of ``step(data)``, captured as one graph.
        defer_update: the script keeps its ``optimizer.step()`` line, as ``step.update()``: the
            window's last call (every call with ``accumulate_calls=1``) runs forward, backward
            and the gradient sync, and ``step.update()`` clips and steps the optimizer with the
            param-group values (the LR) the script set in between, as llm.c's loop sets the LR
            after its micro-steps. A graph of its own; ``TrainStep.grad_norm`` is set by it.
        parallel: "auto" (DDP with a process group; FSDP2 for a model sharded with
            ``fully_shard``), "ddp", "fsdp2": shard a plain model with FSDP2 here
            (``fully_shard`` each block with parameters of every ``nn.ModuleList`` /
            ``nn.Sequential``, then the model; see ``ddpgraph.step.parallel.fsdp2.shard_blocks``),
            or "none": the module unwrapped, on a process group of one rank too (what
            ``accelerator.prepare`` does on one process: no DDP bucket copies or one-rank
            all-reduce); refused with more ranks, a sharded model or ``ddp_kwargs``.
        check_finite: stop at the first update whose loss or gradients are NaN or inf with a
            :class:`~ddpgraph.NonFiniteError` naming that step, raised alike on every rank (a
            call or two later on CUDA: the flag is read back without a host sync per step; at
            once on the CPU). Not with fp16, whose loss scaler skips overflowed steps by design.
        sync_every_call: with ``accumulate_calls=k``, every call syncs its gradients (and starts
            with rank 0's buffers), not the window's last only: what a script's DDP does when
            the script accumulates without ``no_sync`` (``if step % k == 0: optimizer.step()``
            on a prepared model), bit for bit; k gradient syncs per update instead of one.
        guard: how each call learns what the script changed since the last one. "events"
            (the default) reads, while graphed, only what does not grow with the model (the
            roots' forward and mode, the optimizer's state dict and param-group values) and one
            process-wide count that every public way of changing a tensor moves
            (:mod:`ddpgraph.step.events`): a parameter, buffer or submodule set on a module,
            ``t.data = ...``, ``t.grad = ...`` (``zero_grad()``), ``requires_grad`` /
            ``requires_grad_()``, ``t.set_()``, ``model.to()`` and ``torch.utils.swap_tensors``, any
            module's ``train()`` / ``eval()``; when the count moved it reads everything, as
            "full" does, so it reports the same changes. "full" reads every parameter's,
            gradient's and buffer's object and address, each ``requires_grad``, each optimizer
            state tensor's address and each submodule's mode on every graphed call: one
            C-level pass per list, a cost that grows with the number of tensors; it also sees
            what moves no count: a tensor put straight into a module's ``_parameters`` or
            ``_buffers`` dict, ``submodule.training = ...`` set as an attribute, an optimizer
            state tensor replaced by hand (``opt.state[p]["exp_avg"] = t``).
            Eager calls (warm-up, fallbacks) read everything in both.
    """

    graph: GraphMode = "auto"
    amp: Any = None  # normalised to "bf16", "fp16" or None
    accumulate: int = 1
    clip_grad_norm: float | None = None
    on_new_shape: NewShapePolicy = "eager"
    warmup: int | None = None
    compile: bool | Mapping[str, Any] = False
    channels_last: bool = False
    grad_scaler: Mapping[str, float] | None = None
    accumulate_calls: int = 1
    steps_per_replay: int = 1
    grad_norm: bool = False
    defer_update: bool = False
    parallel: ParallelMode = "auto"
    check_finite: bool = False
    sync_every_call: bool = False
    guard: GuardMode = "events"

    def __post_init__(self) -> None:
        _check_choice("parallel", self.parallel, PARALLEL_CHOICES)
        if self.parallel == "fsdp2" and self.compile:
            raise ConfigError(
                f"compile={self.compile!r} with parallel='fsdp2': torch.compile around FSDP2's "
                "root does not compose with its hooks inside one graph; compile each block "
                "before fully_shard (torchtitan's way: block.compile()) and pass compile=False."
            )
        if self.defer_update not in (True, False):
            raise ConfigError(f"defer_update={self.defer_update!r} must be True or False.")
        if self.defer_update and self.steps_per_replay > 1:
            raise ConfigError(
                f"defer_update=True leaves each optimizer step to the script's step.update(), "
                f"but steps_per_replay={self.steps_per_replay} runs whole steps inside one "
                "replay; use one or the other."
            )
        if not is_int(self.accumulate_calls) or self.accumulate_calls < 1:
            raise ConfigError(
                f"accumulate_calls={self.accumulate_calls!r} must be an integer >= 1."
            )
        if not is_int(self.steps_per_replay) or self.steps_per_replay < 1:
            raise ConfigError(
                f"steps_per_replay={self.steps_per_replay!r} must be an integer >= 1 (e.g. 8: "
                "eight training steps per graph replay, fed by a ddpgraph.DeviceData)."
            )
        if self.steps_per_replay > 1 and self.accumulate_calls > 1:
            raise ConfigError(
                f"steps_per_replay={self.steps_per_replay} and accumulate_calls="
                f"{self.accumulate_calls}: a multi-step replay takes whole steps from a "
                "DeviceData; accumulate within each step with accumulate=k instead."
            )
        if self.accumulate_calls > 1 and self.accumulate != 1:
            raise ConfigError(
                f"accumulate={self.accumulate} and accumulate_calls={self.accumulate_calls} both "
                "accumulate gradients; use accumulate=k to split one batch per call, or "
                "accumulate_calls=k to take one micro-batch per call."
            )
        dtype = amp_dtype(self.amp)
        name = None if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        object.__setattr__(self, "amp", name)
        if self.grad_scaler is not None and self.amp != "fp16":
            raise ConfigError(
                f"grad_scaler={dict(self.grad_scaler)!r} scales fp16 losses, but amp={self.amp!r}; "
                "pass amp='fp16' or drop grad_scaler (bf16 needs no loss scaling)."
            )
        object.__setattr__(self, "grad_scaler", check_scaler_options(self.grad_scaler))
        _check_compile(self.compile)
        _check_choice("graph", self.graph, ("auto", "always", "never"))
        _check_choice("on_new_shape", self.on_new_shape, ("eager", "capture", "error"))
        _check_choice("guard", self.guard, ("full", "events"))
        if not is_int(self.accumulate) or self.accumulate < 1:
            raise ConfigError(f"accumulate={self.accumulate!r} must be an integer >= 1.")
        if self.clip_grad_norm is not None and not (
            is_number(self.clip_grad_norm) and 0 < self.clip_grad_norm < math.inf
        ):
            raise ConfigError(
                f"clip_grad_norm={self.clip_grad_norm!r} must be a positive, finite number or None."
            )
        if self.warmup is not None and (not is_int(self.warmup) or self.warmup < 1):
            raise ConfigError(f"warmup={self.warmup!r} must be an integer >= 1 or None.")
        if not isinstance(self.grad_norm, bool):
            raise ConfigError(
                f"grad_norm={self.grad_norm!r} must be True or False (True: step.grad_norm holds "
                "each update's total gradient norm)."
            )
        if not isinstance(self.channels_last, bool):
            raise ConfigError(f"channels_last={self.channels_last!r} must be True or False.")
        if not isinstance(self.sync_every_call, bool):
            raise ConfigError(
                f"sync_every_call={self.sync_every_call!r} must be True or False (True: every "
                "accumulate_calls micro-batch syncs its gradients, as a script without no_sync)."
            )
        if self.sync_every_call and self.accumulate_calls == 1:
            raise ConfigError(
                "sync_every_call=True with accumulate_calls=1 changes nothing (every call already "
                "syncs); pass accumulate_calls=k for the script's own accumulation, or drop it."
            )
        if not isinstance(self.check_finite, bool):
            raise ConfigError(f"check_finite={self.check_finite!r} must be True or False.")
        if self.check_finite and self.amp == "fp16":
            raise ConfigError(
                "check_finite=True with amp='fp16': fp16's loss scaler expects overflowed (inf) "
                "gradients and skips those steps, which the check would stop at; pass "
                "check_finite=False with fp16, or use amp='bf16'."
            )


def check_compile_fits(model: nn.Module, compile: bool | Mapping[str, Any]) -> None:
    """``compile`` on a model the script sharded with ``fully_shard``, named as it was given."""
    from .parallel.fsdp2 import find_fsdp2

    if compile and find_fsdp2(model):
        raise ConfigError(
            f"compile={compile!r} with a model sharded by fully_shard (FSDP2): torch.compile "
            "around FSDP2's root does not compose with its hooks inside one graph; compile each "
            "block before fully_shard (torchtitan's way: block.compile()) and pass compile=False."
        )


def _check_compile(value: object) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"compile={value!r} must be True, False or a dict of torch.compile arguments."
        )
    mode = value.get("mode")
    options = value.get("options") or {}
    if mode in ("reduce-overhead", "max-autotune") or options.get("triton.cudagraphs"):
        raise ConfigError(
            f"compile={dict(value)!r} asks Inductor for CUDA graphs of its own, but TrainStep "
            "captures the whole step as one graph; use mode='default' or "
            "'max-autotune-no-cudagraphs'."
        )


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} must be one of {', '.join(map(repr, choices))}.")


def model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ConfigError(
            f"TrainStep got a model with no parameters ({type(model).__name__}): there is "
            "nothing to train. Pass the module that holds the trainable parameters (the whole "
            "network, not one of its parameter-free layers)."
        )
    if len(devices) != 1:
        found = sorted(map(str, devices)) or ["no parameters"]
        raise ConfigError(
            f"TrainStep needs a model whose parameters are on one device, found {found}; "
            "move it with model.to(runtime.device)."
        )
    device = devices.pop()
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        raise DeviceConflictError(
            f"the model is on {device} but this rank is bound to cuda:{torch.cuda.current_device()}; "
            "call ddpgraph.init() first and move the model with model.to(runtime.device)."
        )
    return device


def check_arguments(model: object, optimizer: object, loss_fn: object) -> None:
    """TrainStep's positional arguments: a bare module, an optimizer over it, a callable."""
    check_model(model)
    assert isinstance(model, nn.Module)
    check_trainable(model)
    check_optimizer(optimizer, model)
    check_loss_fn(loss_fn)


def check_loss_fn(loss_fn: object) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r} is not callable.")
    if isinstance(loss_fn, type):
        # callable, but calling it builds a loss object: the first step would fail in torch
        name = loss_fn.__name__
        raise ConfigError(
            f"loss_fn={name} is the class, not a loss; pass an instance: loss_fn={name}()."
        )


def check_trainable(model: nn.Module) -> None:
    """A model whose parameters are all frozen has nothing to train: its first step would fail
    in backward ("element 0 of tensors does not require grad")."""
    params = list(model.parameters())
    if params and not any(p.requires_grad for p in params):
        raise ConfigError(
            f"every parameter of the model ({type(model).__name__}, {len(params)} tensors) has "
            "requires_grad=False: there is nothing to train. Unfreeze the ones to train "
            "(p.requires_grad_(True)) before building the TrainStep."
        )


def check_model(model: object) -> None:
    check_not_wrapped(model)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"TrainStep's model is {model!r} ({type(model).__name__}), not a torch.nn.Module; "
            "build the model first, e.g. torchvision.models.resnet50().to(runtime.device)."
        )


def check_optimizer(optimizer: object, model: nn.Module) -> None:
    """The optimizer must update this model: none of its parameters is a silent no-op."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"TrainStep's optimizer is {optimizer!r} ({type(optimizer).__name__}), not a "
            "torch.optim.Optimizer; pass e.g. torch.optim.AdamW(model.parameters(), lr=3e-4)."
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if id(p) not in held]
    if trainable and len(missing) == len(trainable):
        raise ConfigError(
            f"the optimizer holds none of the model's {len(trainable)} trainable parameters "
            "(built over another model, or before the model was replaced or moved?); build it "
            "from this model: torch.optim.AdamW(model.parameters(), ...)."
        )
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        warn_at_user_line(
            f"the optimizer does not hold {len(missing)} of the model's trainable parameters "
            f"({shown}): they get gradients but are never updated; add them to a param group or "
            "set requires_grad=False."
        )


def warn_at_user_line(message: str) -> None:
    """Warn with the location of the user's call into ddpgraph, not a line of ddpgraph."""
    import warnings

    _, level = frame_outside(in_directories(PACKAGE_DIR))
    warnings.warn(message, stacklevel=level)
