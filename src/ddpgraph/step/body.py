"""The step itself: zero_grad, k x (forward, loss, backward), clip, optimizer update, buffer sync.

What runs eagerly in warm-up and what a capture records are the same :meth:`StepBody.run`, so a
replay does what an eager step does. Precision (autocast, fp16 loss scaling) and the
data-parallel wrapper (gradient sync, buffer sync, the grad norm) are objects it calls; it reads
no flag of theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from .batch import Batch, Role, gathered_batch
from .feed import DataFeed
from .finite import FiniteCheck
from .options import StepOptions
from .parallel import GradSync
from .precision import Precision
from .window import Window

__all__ = ["LossFn", "StepBody", "StepOut", "model_loss"]

LossFn = Callable[[Any, Any], torch.Tensor]


class StepOut(NamedTuple):
    """What one run of the body gives (a graph's outputs, once captured): the loss, the
    model's output and the update's gradient norm (None where the call did not update, or
    nothing measured it)."""

    loss: torch.Tensor
    output: Any
    grad_norm: torch.Tensor | None


class StepBody:
    """One training step (or micro-step) of a model, and the evaluation forward.

    ``accumulate`` splits one batch into k micro-batches; ``accumulate_calls`` makes a "micro"
    call run forward and backward without the gradient sync and the "train" call sync, clip,
    step and zero the gradients for the next window. With ``defer_update`` the window's last
    call is a "sync" (forward, backward, gradient sync) and :meth:`update` runs on its own.
    Which calls sync their gradients, and what an ``accumulate_calls`` micro-batch divides its
    loss by, are the :class:`~.window.Window`'s (``sync_every_call``: a "micro" call syncs too,
    and starts with rank 0's buffers, as a script's DDP does when it accumulates without
    ``no_sync``). Everything it reads is given at construction; a run returns a
    :class:`StepOut`.
    """

    def __init__(
        self,
        parallel: GradSync,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None,
        precision: Precision,
        options: StepOptions,
        *,
        window: Window,
        feed: DataFeed | None = None,
        finite: FiniteCheck | None = None,
    ) -> None:
        self.parallel = parallel  # its optimizer taken (FSDP2's sharding replaced the params)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.precision = precision
        self.window = window  # which calls sync; a micro-batch's loss divisor (its length)
        self.accumulate = options.accumulate
        self.accumulate_calls = options.accumulate_calls
        self.clip_grad_norm = options.clip_grad_norm
        self.measure_grad_norm = options.grad_norm
        self.channels_last = options.channels_last
        # False while graphs are possible: a graph reads and writes the same .grad tensors on
        # every replay; True once the step is eager for good (as a plain loop's zero_grad)
        self.set_to_none = False
        self.feed = feed  # step(data): each step's LR
        self._zeroed = False  # accumulate_calls: gradients zeroed before the first window
        self.finite = finite  # check_finite

    def run(self, batch: Batch, role: Role = "train") -> StepOut:
        """The loss (the mean over ``accumulate``'s micro-batches; with ``accumulate_calls``
        this call's micro-batch loss, as scripts log it), the (last micro-batch's) output and,
        for a "train" call, the update's grad norm.

        Runs eagerly or under capture; it must not touch the LR (a fill_ captured here would
        reset the LR on every replay), so callers sync the LR tensors first.
        """
        if batch.source is not None:
            return self._steps_from(batch)
        calls = self.accumulate_calls
        if calls == 1 or not self._zeroed:
            self.optimizer.zero_grad(set_to_none=self.set_to_none)
            self._zeroed = True
        total: torch.Tensor | None = None
        output: Any = None
        micros = batch.split(self.accumulate)
        window = self.window
        syncs, divisor = window.syncs(role), self.accumulate * window.length
        for i, micro in enumerate(micros):
            sync = syncs and i == len(micros) - 1
            # DDP's semantics: rank 0's buffers at the start of a window's first forward only
            # (later ones run under no_sync, which keeps each rank's own); a window of
            # accumulate_calls starts with the runner's sync_buffers, outside any graph; with
            # sync_every_call no forward runs under no_sync, so each call starts with them
            first = i == 0 and (calls == 1 or window.sync_every_call)
            with self.parallel.forward_context(sync_grads=sync, sync_buffers=first):
                with self.precision.autocast():
                    loss, output = self._loss(micro)
                _check_scalar_loss(loss)
                seeded = loss if self.finite is None else self.finite.seed(loss)
                self.precision.backward(seeded / divisor)
            # one micro-batch: its loss in its own dtype, as the script's run has it (bf16 under
            # the CPU's autocast; timm's train.py averages its log in it, ``loss.new([avg])``);
            # accumulate's mean of several: in float32
            if self.accumulate == 1:
                part = loss.detach()
            else:
                part = loss.detach().float() / self.accumulate
            total = part if total is None else total + part
        assert total is not None
        return StepOut(total, output, self.update() if role == "train" else None)

    def eager_for_good(self) -> None:
        """No graph will read the gradients again: zero them as a plain loop does (set to
        None), freeing their memory between steps."""
        self.set_to_none = True

    def update(self) -> torch.Tensor | None:
        """The update on the gradients a window accumulated: clip or measure, the optimizer
        step (fp16: unscaled, skipped on inf/NaN), and zero gradients for the next window. Part
        of the "train" run, or on its own (role "update": the script's ``step.update()``); the
        grad norm it measured (None: none)."""
        grad_norm = self.precision.update(self.optimizer, self._norm_step())
        if self.finite is not None:  # before zero_grad: it reads the window's gradients
            norm = grad_norm
            if norm is None and self.parallel.shards_gradients:
                norm = self.parallel.grad_norm()  # all-reduced: a shard's NaN seen by every rank
            self.finite.record(_grads(self.optimizer), norm)
        if self.accumulate_calls > 1:
            self.optimizer.zero_grad(set_to_none=self.set_to_none)  # for the next window
        return grad_norm

    def _steps_from(self, batch: Batch) -> StepOut:
        """``batch.steps`` whole training steps, each on the next batch gathered from the
        DeviceData on the device with its own LR; their losses as one tensor, and the last
        step's output. The LR is copied from the device table a replay re-reads."""
        assert self.feed is not None
        data = batch.source
        losses: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        output: Any = None
        for j, tensors in enumerate(data.next_batches(batch.steps)):
            self.feed.lr.apply(j)
            # channels_last, if asked (a no-op for data stored channels_last)
            gathered = gathered_batch(data, tensors).to(
                data.device, channels_last=self.channels_last
            )
            loss, output, grad_norm = self.run(gathered)
            losses.append(loss)
            if grad_norm is not None:
                norms.append(grad_norm)
        return StepOut(torch.stack(losses), output, torch.stack(norms) if norms else None)

    def _norm_step(self) -> Callable[[], torch.Tensor] | None:
        """What runs before the update on unscaled gradients: the clipping (its result is the
        norm), the norm alone, or nothing."""
        if self.clip_grad_norm is not None:
            return self._clip
        return self.parallel.grad_norm if self.measure_grad_norm else None

    def _clip(self) -> torch.Tensor:
        assert self.clip_grad_norm is not None
        return self.parallel.clip_grad_norm_(self.clip_grad_norm)

    def _loss(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        output = self.forward(self.parallel.module, batch)
        if self.loss_fn is None:
            return model_loss(output), output
        target = batch.as_mapping() if batch.kind == "mapping" else batch.tensors[-1]
        if batch.kind == "mapping" and isinstance(self.loss_fn, nn.modules.loss._Loss):
            # torch's loss modules take tensors: theirs would be "must be Tensor, not dict"
            raise TypeError(
                f"loss_fn={type(self.loss_fn).__name__}() with a mapping batch gets (output, "
                "batch), the whole mapping as its target, which it cannot take. Pass "
                "loss_fn=lambda output, batch: nn.functional.cross_entropy(output, "
                "batch['labels']) (your keys), or loss_fn=None for a model that returns its loss."
            )
        return self.loss_fn(output, target), output

    def forward(self, model: nn.Module, batch: Batch, *, target: bool = True) -> Any:
        """``model`` called as the batch says: ``model(**batch)``, ``model(*inputs)``, or with a
        ``loss_fn`` and ``target``, every tensor but the last (the target)."""
        if batch.kind == "mapping":
            return model(**batch.as_mapping())
        if target and self.loss_fn is not None:
            return model(*batch.tensors[:-1])
        return model(*batch.tensors)

    def forward_eval(self, batch: Batch) -> Any:
        # the module inside the wrapper: evaluation needs no gradient sync, and DDP's forward
        # would count an iteration; its buffer broadcast is the policy's sync_buffers, run before
        # the first evaluation after a training step (as DDP's eval forward sends them then)
        with torch.no_grad(), self.precision.autocast():
            return self.forward(self.parallel.inner, batch, target=False)


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: a scalar output, ``output.loss``, ``output["loss"]``, or
    the one 0-dim floating tensor of a tuple or list output (nanoGPT's ``(logits, loss)``)."""
    if _is_scalar(output):
        return cast(torch.Tensor, output)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and not hasattr(output, "_fields"):
        scalars = [i for i, item in enumerate(output) if _is_scalar(item)]
        if len(scalars) == 1:
            return cast(torch.Tensor, output[scalars[0]])
        if scalars:
            raise ValueError(
                f"TrainStep(loss_fn=None) cannot tell the loss in the model's output: "
                f"{_kind_of(output)} with scalar tensors at positions {scalars}; pass "
                f"loss_fn=lambda output, target: output[{scalars[-1]}] (or the right index) and "
                "call step(*inputs, target)."
            )
    raise ValueError(
        f"TrainStep(loss_fn=None) needs the model to return its loss (a scalar tensor, .loss, "
        f"['loss'], or one scalar in a tuple), but it returned {_kind_of(output)}; pass labels "
        "or targets in the batch (HF models and nanoGPT compute the loss from them) or give a "
        "loss_fn."
    )


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _is_scalar(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _kind_of(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, (tuple, list)):
        items = ", ".join(
            f"tensor{tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            for x in output
        )
        return f"a {type(output).__name__} ({items})"
    return f"a {type(output).__name__}"


def _check_scalar_loss(loss: object) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean())."
        )
