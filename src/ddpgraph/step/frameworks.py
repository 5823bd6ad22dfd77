"""TrainStep built as a framework's own objects say (Accelerate, Fabric): the constructors.

The work is in :mod:`ddpgraph.integrations`, imported only when one of these is called, so the
core import stays light and no framework is needed to use TrainStep.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .body import LossFn

__all__ = ["FromFrameworks"]


class FromFrameworks:
    """``TrainStep.from_accelerator(...)`` and ``TrainStep.from_fabric(...)``."""

    @classmethod
    def from_accelerator(
        cls: Any, accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None, **options: Any,
    ) -> Any:  # fmt: skip
        """A TrainStep set up as an Accelerate ``Accelerator`` says (mixed_precision as amp,
        gradient_accumulation_steps as accumulate_calls): :mod:`ddpgraph.integrations.accelerate`."""
        from ..integrations.accelerate import accelerator_options

        return cls(
            model, optimizer, loss_fn, **accelerator_options(accelerator, model, optimizer, options)
        )

    @classmethod
    def from_fabric(
        cls: Any, fabric: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None, **options: Any,
    ) -> Any:  # fmt: skip
        """A TrainStep set up as a Lightning ``Fabric`` says (precision as amp):
        :mod:`ddpgraph.integrations.fabric`."""
        from ..integrations.fabric import fabric_options

        return cls(model, optimizer, loss_fn, **fabric_options(fabric, model, optimizer, options))
