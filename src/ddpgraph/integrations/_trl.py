"""TRL's ``SFTTrainer`` inside a graphed step: its loss at a fixed shape, its metrics after the step.

Two things in ``SFTTrainer.compute_loss`` (trl 1.16) cannot be captured in a CUDA graph:

* **The loss's compact path.** The fused LM head (``trl.trainer.utils.add_fused_lm_head``)
  scores only the tokens that count where ``_use_triton(device)`` is true (CUDA, XPU):
  ``hidden_states[mask] if compact else ...`` is a boolean-mask index, a data-dependent shape.
  TRL's other path (taken on the CPU and on Neuron, where a changing shape would recompile)
  scores every position with the labels clamped and the ignored ones zeroed afterwards: the
  same per-token values, at a fixed shape. :func:`fixed_shape_loss` makes TRL take that path
  while the graphed step computes the loss (TRL's name is rebound for that call and restored).
* **The metrics.** ``compute_loss`` gathers the valid-token count, the entropy sum, the
  top-1 count and the batch's token count with ``accelerator.gather_for_metrics`` and reads
  them on the host (``.item()``, ``if num_valid > 0``) at every micro-batch. Inside the step
  :class:`SFTMetrics` takes those local tensors instead of gathering them (they become outputs
  of the graph, so each replay refreshes them), and after each step call it gathers them with
  the Trainer's own ``gather_for_metrics`` (no host read) and keeps them on the device;
  :meth:`SFTMetrics.flush` turns them into TRL's logged numbers (``entropy``,
  ``mean_token_accuracy``, ``num_tokens``, ``aux_loss``) with TRL's own expressions when the
  Trainer logs, in the order TRL appends them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["SFTMetrics", "fixed_shape_loss", "is_sft_trainer"]

# what SFTTrainer.compute_loss (trl 1.16) passes to gather_for_metrics in training, in order
_SFT_GATHERED = ("num_valid", "entropy_sum", "num_correct", "num_tokens")


def is_sft_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is TRL's SFTTrainer (asked without importing TRL)."""
    trl = sys.modules.get("trl")
    sft = getattr(trl, "SFTTrainer", None) if trl is not None else None
    return isinstance(sft, type) and isinstance(trainer, sft)


@contextlib.contextmanager
def fixed_shape_loss() -> Iterator[None]:
    """TRL's fused LM head on its fixed-shape path (every position scored, ignored ones zeroed)
    for the duration: ``trl.trainer.utils._use_triton``, which chooses the compact path, answers
    False. The kernel's own choice (``trl.kernels.chunked_logprob._use_triton``, Triton tiles on
    CUDA) is left as it is."""
    utils = sys.modules.get("trl.trainer.utils")
    chooser = getattr(utils, "_use_triton", None)
    if chooser is None:  # no fused head in this TRL (or not imported): nothing to choose
        yield
        return
    utils._use_triton = _never_compact  # type: ignore[union-attr]
    try:
        yield
    finally:
        utils._use_triton = chooser  # type: ignore[union-attr]


def _never_compact(device: torch.device) -> bool:
    return False


class _NotYet:
    """What ``gather_for_metrics`` returns inside the graphed step: TRL's host reads of it
    (``.sum()``, ``> 0``, ``.item()``) cost nothing and log nothing (its entries are taken back
    afterwards); the real numbers come from the graph's outputs after the step."""

    def sum(self, *args: Any, **kwargs: Any) -> _NotYet:
        return self

    mean = sum

    def item(self) -> int:
        return 0

    def __gt__(self, other: Any) -> bool:
        return False

    def __truediv__(self, other: Any) -> _NotYet:
        return self


class SFTMetrics:
    """SFTTrainer's training metrics for a graphed step (see the module's docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.pending: list[tuple[torch.Tensor, ...]] = []  # gathered, per micro-batch

    @contextlib.contextmanager
    def taken(self, real_tokens: torch.Tensor | None = None) -> Iterator[list[torch.Tensor]]:
        """Around ``compute_loss`` inside the step: yields the list that receives the local
        tensors TRL hands to ``gather_for_metrics``; TRL's own entries of this call (its
        ``_metrics`` lists, ``_total_train_tokens``) are taken back afterwards. A packed batch
        padded to a fixed capacity counts its ``real_tokens`` (TRL counts the row's length)."""
        trainer = self.trainer
        accelerator = trainer.accelerator
        taken: list[torch.Tensor] = []

        def gather_later(tensor: Any, use_gather_object: bool = False) -> _NotYet:
            taken.append(tensor)
            return _NotYet()

        metrics = trainer._metrics["train"]
        lengths = {key: len(values) for key, values in metrics.items()}
        saved_num_tokens = list(metrics.get("num_tokens", []))
        tokens = trainer._total_train_tokens
        accelerator.gather_for_metrics = gather_later  # an instance attribute, deleted below
        try:
            yield taken
        finally:
            del accelerator.gather_for_metrics
            for key in list(metrics):
                if key not in lengths:
                    del metrics[key]
                else:
                    del metrics[key][lengths[key] :]
            if "num_tokens" in lengths:
                metrics["num_tokens"] = saved_num_tokens
            trainer._total_train_tokens = tokens
        self._check(taken)
        if real_tokens is not None:
            taken[_SFT_GATHERED.index("num_tokens")] = real_tokens.to(taken[0].device)

    def _check(self, taken: list[torch.Tensor]) -> None:
        expected = len(_SFT_GATHERED) + bool(self.trainer.aux_loss_enabled)
        if len(taken) != expected or not all(isinstance(t, torch.Tensor) for t in taken):
            import trl

            raise ConfigError(
                f"GraphTrainer computes SFTTrainer's metrics as trl 1.16 does ({expected} "
                f"tensors gathered per micro-batch: {', '.join(_SFT_GATHERED)}"
                f"{', aux_loss' if expected > len(_SFT_GATHERED) else ''}), but trl "
                f"{trl.__version__} gathered {[type(t).__name__ for t in taken]}; install "
                "trl 1.16 or train with the plain SFTTrainer."
            )

    def after_step(self, local: tuple[torch.Tensor, ...]) -> None:
        """After a step call (eager, captured or replayed): gather this micro-batch's local
        tensors (graph outputs) as TRL does, on the device; nothing is read on the host."""
        gather = self.trainer.accelerator.gather_for_metrics
        self.pending.append(tuple(gather(tensor) for tensor in local))

    def flush(self) -> None:
        """TRL's numbers for each micro-batch since the last flush, appended as TRL appends them
        (``SFTTrainer.compute_loss``, trl 1.16): host reads, made when the Trainer logs."""
        trainer = self.trainer
        metrics = trainer._metrics["train"]
        for gathered in self.pending:
            num_valid = gathered[0].sum()
            entropy_sum = gathered[1].sum()
            num_correct = gathered[2].sum()
            metrics["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
            metrics["mean_token_accuracy"].append(
                (num_correct / num_valid).item() if num_valid > 0 else 0.0
            )
            num_tokens_in_batch = gathered[3].sum().item()
            trainer._total_train_tokens += num_tokens_in_batch // trainer._tp_size
            metrics["num_tokens"] = [trainer._total_train_tokens]
            if len(gathered) > len(_SFT_GATHERED):
                metrics["aux_loss"].append(gathered[4].mean().item())
        self.pending.clear()
