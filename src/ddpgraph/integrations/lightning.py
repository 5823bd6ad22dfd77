"""A Lightning strategy whose training step is one graphed :class:`~ddpgraph.TrainStep`:
``L.Trainer(strategy=GraphStrategy())``, for an unchanged LightningModule written for automatic
optimization.

The Trainer keeps its loops, ``global_step`` and ``max_steps``, the LR schedulers, callbacks,
loggers and checkpoints. The strategy owns DDP (Lightning's is not built; the TrainStep builds
its own on the stream it captures with) and runs, for each batch, the module's
``training_step`` with backward, ``accumulate_grad_batches`` micro-batches, ``gradient_clip_val``
clipping and the optimizer update as one TrainStep call:

* Lightning's closure calls :meth:`GraphStrategy.training_step`, which makes the TrainStep call;
  the closure's backward and the optimizer's ``step`` and ``zero_grad`` then do nothing (the
  graph did them): the optimizer Lightning holds is an :class:`~._optim.OptimizerView`.
* ``self.log`` inside ``training_step`` is recorded while the step runs and logged after it,
  with the tensors the step computed (for a replay, the values the replay wrote): the logging
  itself never runs inside a graph.
* An accumulation window ends where Lightning's loop says (``_should_accumulate``): every
  ``accumulate_grad_batches`` batches and at the epoch's last batch, whose short window steps as
  Lightning's does. Hooks Lightning calls on the gradients between backward and the step
  (``on_after_backward``, ``on_before_optimizer_step``, ...) would never run: refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ddpgraph.integrations.lightning needs Lightning; install it with "
        "pip install 'ddpgraph[lightning]'."
    ) from exc

from ..errors import ConfigError
from ..step import TrainStep
from ._optim import OptimizerView
from .fabric import amp_of

__all__ = ["GraphStrategy"]


class GraphStrategy(DDPStrategy):
    """``DDPStrategy`` with the training step as one graphed :class:`~ddpgraph.TrainStep`.

    Takes DDPStrategy's arguments (``process_group_backend``, DDP's keyword arguments, ...) and
    ``step_options``: further TrainStep options (``graph``, ``warmup``, ``on_new_shape``,
    ``compile``, ``engine``). Precision, ``accumulate_grad_batches`` and ``gradient_clip_val``
    come from the ``Trainer``. The TrainStep (:attr:`train_step`) is built at the first training
    step, after a checkpoint was restored.
    """

    strategy_name = "ddpgraph"

    def __init__(self, *, step_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_options = dict(step_options or {})
        self.train_step: TrainStep | None = None
        self._loss: _LightningLoss | None = None
        self._logs: dict[Any, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}

    # ----------------------------------------------------------------- set-up
    def configure_ddp(self) -> None:
        pass  # the TrainStep wraps the module in DDP at the first training step

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ConfigError(
                f"GraphStrategy trains with one optimizer, but configure_optimizers returned "
                f"{len(self.optimizers)}; combine their param groups into one optimizer."
            )
        if not trainer.lightning_module.automatic_optimization:
            raise ConfigError(
                "GraphStrategy graphs Lightning's automatic optimization; with "
                "automatic_optimization=False call a ddpgraph.TrainStep in training_step "
                "yourself (or leave automatic optimization on)."
            )
        self.optimizers = [OptimizerView(self.optimizers[0], own_lr=False)]

    # ----------------------------------------------------------------- the step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One micro-batch through the TrainStep (the update runs inside the window's last);
        the module's output with the loss the step returned."""
        step = self._step()
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        assert self._loss is not None
        self._loss.bind(leaves, spec)
        module = self._module()
        recorded: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        module.log = lambda *a, **kw: recorded.append((a, kw))  # type: ignore[method-assign]
        # Lightning's own loop state says where the window ends: every accumulate_grad_batches
        # batches and at the epoch's last batch (a short window steps, as Lightning's does)
        last = not module.trainer.fit_loop._should_accumulate()
        try:
            loss = step(*tensors, last=last)
        finally:
            del module.log  # the class's own again
        key = ("train" if last else "micro", tuple((t.shape, t.dtype) for t in tensors), str(spec))
        if recorded or key not in self._logs:  # the body ran (eager, capture): fresh tensors
            self._logs[key] = recorded
        for log_args, log_kwargs in self._logs[key]:
            module.log(*_cloned(log_args), **log_kwargs)
        output = step.output
        if isinstance(output, dict):
            return {**output, "loss": loss}
        return loss

    # Lightning's DDPStrategy wraps the module in DDP while fitting only, and sends the
    # validation steps of a fit through it (_forward_redirection), whose forward starts with
    # rank 0's buffers after a training step: so do these, through the TrainStep's DDP
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        with self.precision_plugin.val_step_context():
            if not fitting or self.train_step is None or self._loss is None:
                return module.validation_step(*args, **kwargs)  # no DDP there either
            self._loss.redirect = "validation_step"
            try:
                return self.train_step.model(*args, **kwargs)
            finally:
                self._loss.redirect = None

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # inside the TrainStep

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # the closure runs the TrainStep, whose graph clips and updates; Lightning's
        # on_before_optimizer_step hooks and its eager clipping are left out
        return closure()

    # ----------------------------------------------------------------- helpers
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        assert module is not None, "GraphStrategy used before the Trainer connected a module"
        return module

    def _step(self) -> TrainStep:
        if self.train_step is not None:
            _check_same_window(self.train_step, self._module().trainer)
            return self.train_step
        module = self._module()
        trainer = module.trainer
        _check_no_gradient_hooks(module, trainer)
        k = trainer.accumulate_grad_batches
        clip = trainer.gradient_clip_val
        algorithm = trainer.gradient_clip_algorithm
        algorithm = getattr(algorithm, "value", algorithm)  # Lightning keeps an enum
        if clip and algorithm not in (None, "norm"):
            raise ConfigError(
                f"gradient_clip_algorithm={algorithm!r}: the graphed step "
                "clips by the total norm; use gradient_clip_algorithm='norm'."
            )
        view = self.optimizers[0]
        assert isinstance(view, OptimizerView)
        self._loss = _LightningLoss(module)
        self.train_step = TrainStep(
            self._loss,
            view.optimizer,
            amp=amp_of(self.precision_plugin.precision),
            accumulate_calls=k,
            clip_grad_norm=float(clip) if clip else None,
            ddp_kwargs=self._ddp_kwargs,
            **self.step_options,
        )
        return self.train_step


# hooks Lightning calls between backward and the optimizer step, on gradients that exist only
# inside the graph: a module or callback that overrides one is refused, never skipped silently
_GRADIENT_HOOKS = (
    "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "configure_gradient_clipping",
)  # fmt: skip


def _check_no_gradient_hooks(module: pl.LightningModule, trainer: pl.Trainer) -> None:
    owners: list[tuple[str, object, type]] = [("the LightningModule", module, pl.LightningModule)]
    owners += [(type(c).__name__, c, pl.Callback) for c in trainer.callbacks]  # type: ignore[attr-defined]
    for owner, obj, base in owners:
        for hook in _GRADIENT_HOOKS:
            if hasattr(base, hook) and getattr(type(obj), hook) is not getattr(base, hook):
                raise ConfigError(
                    f"{owner} overrides {hook}, which Lightning calls between backward and the "
                    "optimizer step; under GraphStrategy backward, clipping and the step run "
                    "inside one graph, so it would never run. Remove the override (clip with "
                    "Trainer(gradient_clip_val=...)) or train this module with strategy='ddp'."
                )


def _check_same_window(step: TrainStep, trainer: pl.Trainer) -> None:
    k = step.options.accumulate_calls
    if trainer.accumulate_grad_batches != k:
        raise ConfigError(
            f"accumulate_grad_batches changed to {trainer.accumulate_grad_batches} during "
            f"training (a GradientAccumulationScheduler?); GraphStrategy's step was built for "
            f"{k}, and its loss divisor and graphs with it. Keep accumulate_grad_batches fixed."
        )


class _LightningLoss(nn.Module):
    """What the TrainStep wraps in DDP: ``forward(*tensors)`` rebuilds the call's arguments and
    returns ``training_step``'s output (a loss, or a mapping with ``"loss"``)."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module
        self._leaves: list[Any] = []
        self._spec: Any = None
        self.redirect: str | None = None  # a validation step sent through the DDP

    def bind(self, leaves: list[Any], spec: Any) -> None:
        """The call's non-tensor arguments (``batch_idx``) and its structure; a graph keeps the
        values of its capture."""
        self._leaves, self._spec = leaves, spec

    def forward(self, *tensors: Any, **kwargs: Any) -> Any:
        if self.redirect is not None:  # the step's arguments as Lightning passed them
            return getattr(self.module, self.redirect)(*tensors, **kwargs)
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self._leaves]
        args, kwargs = tree_unflatten(leaves, self._spec)
        output = self.module.training_step(*args, **kwargs)
        if output is None:
            raise ConfigError(
                "training_step returned None (a skipped batch); a graphed step needs a loss "
                "every batch."
            )
        return output


def _cloned(values: tuple[Any, ...]) -> tuple[Any, ...]:
    # a replay overwrites the graph's tensors: what was logged keeps its value
    return tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values)
