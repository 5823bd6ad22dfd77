"""Lightning Fabric with a graphed :class:`~ddpgraph.TrainStep`: :func:`from_fabric`.

Fabric keeps launching, the device, the data loaders (``fabric.setup_dataloaders``: sampler,
device moves) and logging; the TrainStep owns model, optimizer and DDP (Fabric would build its
DDP on the default stream, where its backward cannot be captured).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..step.body import LossFn
from ..step.train_step import TrainStep
from ._forward import forward_under
from ._optim import refuse_script_steps

__all__ = ["amp_of", "fabric_options", "from_fabric", "keep_precision"]

_AMP = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}
_STRATEGIES = ("DDPStrategy", "SingleDeviceStrategy")


def from_fabric(
    fabric: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None = None,
    **options: Any,
) -> TrainStep:
    """A TrainStep set up as a Lightning ``Fabric`` says (precision as amp), whose forwards
    through ``step.model`` run in Fabric's precision (:func:`fabric_options`). ``options`` are
    TrainStep's; call on every rank, after ``fabric.launch()``, with the model and optimizer as
    built (not through ``fabric.setup``)."""
    if not hasattr(fabric, "strategy"):
        raise TypeError(
            f"from_fabric(fabric, model, optimizer, ...): the first argument is the script's "
            f"lightning.Fabric, got {type(fabric).__name__}; pass "
            "from_fabric(fabric, model, optimizer)."
        )
    chosen = fabric_options(fabric, model, optimizer, options)
    # the script's forwards through step.model run in Fabric's precision; wrapped before the
    # step is built, which captures the forward it is given
    keep_precision(fabric, model)
    step = TrainStep(model, optimizer, loss_fn, **chosen)
    refuse_script_steps(optimizer, "the TrainStep built by from_fabric")
    return step


def fabric_options(
    fabric: Any, model: nn.Module, optimizer: Any, options: dict[str, Any]
) -> dict[str, Any]:
    """:func:`from_fabric`'s work: the TrainStep options ``fabric`` says: its precision (``"bf16-mixed"``, ``"16-mixed"``,
    ``"32-true"``) as ``amp``, the model moved to ``fabric.device``; accumulate with
    ``accumulate_calls=k`` (it replaces ``fabric.no_backward_sync``), and pass ``last=True`` with
    an epoch's last batch where the loop steps on the epoch's leftover micro-batches (Fabric
    leaves the loop to the script: the step cannot see where an epoch ends). ``fabric.save`` /
    ``fabric.load`` of the model and optimizer as built work as in any Fabric loop.

    Pass the model and optimizer as built, not through ``fabric.setup`` (set up the data
    loaders only). Call on every rank, after ``fabric.launch()``.
    """
    _check_not_set_up(model, optimizer)
    strategy = type(fabric.strategy).__name__
    if strategy not in _STRATEGIES:
        raise ConfigError(
            f"from_fabric runs data-parallel training with DDP, but Fabric's strategy "
            f"is {strategy}; use Fabric(strategy='ddp') (or one device)."
        )
    if "amp" in options:
        raise ConfigError(
            "from_fabric(..., amp=...) is set by Fabric(precision=...); set it there."
        )
    model.to(fabric.device)
    ddp_kwargs = dict(getattr(fabric.strategy, "_ddp_kwargs", None) or {})
    ddp_kwargs.update(options.pop("ddp_kwargs", None) or {})
    return {"amp": amp_of(fabric.strategy.precision.precision), "ddp_kwargs": ddp_kwargs, **options}


def keep_precision(fabric: Any, model: nn.Module) -> None:
    """The model's forward inside Fabric's precision plugin (``forward_context``, with
    ``convert_input`` / ``convert_output``), as ``fabric.setup(model)``'s ``_FabricModule``
    runs it: the script's evaluation through ``step.model`` is Fabric's under "bf16-mixed" and
    "16-mixed" ("32-true" changes nothing)."""
    precision = fabric.strategy.precision
    if amp_of(precision.precision) is None:
        return
    forward_under(
        model, precision.forward_context, precision.convert_output, precision.convert_input
    )


def amp_of(precision: str) -> str | None:
    """Fabric's (or Lightning's) ``precision`` as TrainStep's ``amp``."""
    value = str(precision)
    if value not in _AMP:
        raise ConfigError(
            f"precision={value!r} has no graphed equivalent; use 'bf16-mixed', '16-mixed' or "
            "'32-true' (a model cast to bf16 trains with precision='32-true')."
        )
    return _AMP[value]


def _check_not_set_up(model: object, optimizer: object) -> None:
    from lightning.fabric.wrappers import is_wrapped

    for what, obj in (("model", model), ("optimizer", optimizer)):
        if is_wrapped(obj):
            raise ConfigError(
                f"from_fabric got a {what} fabric.setup() already wrapped "
                f"({type(obj).__name__}); pass the model and optimizer as built and set up only "
                "the data loaders: loader = fabric.setup_dataloaders(loader). The TrainStep wraps "
                "the model in DDP itself, on the stream it captures with."
            )
