"""TrainStep built as a framework's own objects say (Accelerate, Fabric): the constructors, and
the framework's loop state a call follows (where an accumulation window ends).

The work is in :mod:`ddpgraph.integrations`, imported only when one of these is called, so the
core import stays light and no framework is needed to use TrainStep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .body import LossFn
from .window import Window

__all__ = ["FromFrameworks"]


class FromFrameworks:
    """``TrainStep.from_accelerator(...)`` and ``TrainStep.from_fabric(...)``."""

    # where the framework's own loop says an accumulation window ends (Accelerate's
    # sync_gradients), given whether the script says it itself (last= passed, or its own
    # no_sync() in use); None, or a None answer: the window counts its calls, last= and the
    # script's sync control alone
    loop_syncs: Callable[[bool], bool | None] | None = None

    @classmethod
    def from_accelerator(
        cls: Any, accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None, **options: Any,
    ) -> Any:  # fmt: skip
        """A TrainStep set up as an Accelerate ``Accelerator`` says (mixed_precision as amp,
        gradient_accumulation_steps as accumulate_calls), whose windows end where Accelerate's
        ``sync_gradients`` says (an epoch's leftover micro-batches step the optimizer, as
        Accelerate's do) and whose model and optimizer ``accelerator.save_state`` /
        ``load_state`` save and load. A loop that accumulates by hand on a plain
        ``Accelerator()`` passes ``accumulate_calls=k`` and ``last=`` its own condition (each
        micro-batch then syncs, as its prepared DDP did): :mod:`ddpgraph.integrations.accelerate`."""
        from ..integrations.accelerate import accelerator_options, attach

        said = "accumulate_calls" in options  # else a script accumulating by hand is refused
        step = cls(
            model, optimizer, loss_fn, **accelerator_options(accelerator, model, optimizer, options)
        )
        attach(accelerator, step, model, window_said=said)
        return step

    @classmethod
    def from_fabric(
        cls: Any, fabric: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None, **options: Any,
    ) -> Any:  # fmt: skip
        """A TrainStep set up as a Lightning ``Fabric`` says (precision as amp):
        :mod:`ddpgraph.integrations.fabric`."""
        from ..integrations._optim import refuse_script_steps
        from ..integrations.fabric import fabric_options, keep_precision

        step = cls(model, optimizer, loss_fn, **fabric_options(fabric, model, optimizer, options))
        refuse_script_steps(optimizer, "the TrainStep built by from_fabric")
        keep_precision(fabric, model)  # the script's forwards through step.model: Fabric's
        return step

    def _loop_ends_window(self, window: Window, last: bool | None, parallel: Any) -> bool:
        """``last``, or where the framework's loop state says this call syncs and steps; the
        state is told whether the script says where its windows end itself (``last=`` passed,
        or its DDP's ``no_sync()`` in use: ``parallel.script_sync()`` not None). A loop
        that says "accumulate" on the window's last call would take more micro-batches per
        update than the graphs hold: refused, naming both counts."""
        assert self.loop_syncs is not None
        says = last is not None or parallel.script_sync() is not None
        last = bool(last)
        syncs = self.loop_syncs(says)
        if syncs is None:
            return last
        if not syncs and not last and window.micro_batches == window.calls - 1:
            raise ConfigError(
                f"Accelerate says this call only accumulates (sync_gradients=False), but it "
                f"is call {window.calls} of the TrainStep's window (accumulate_calls="
                f"{window.calls}), which syncs and steps: call the step once inside each "
                "`with accelerator.accumulate(model):` block, the same number of times as "
                "gradient_accumulation_steps says."
            )
        return last or syncs
