"""The precision context a framework gives the model it prepares, kept for the model the
TrainStep trains, so that the script's own forwards through ``step.model`` (its evaluation loop)
run as they did through the prepared model.

``accelerator.prepare(model)`` makes the model's ``forward`` run under Accelerate's autocast and
return float32 outputs (``Accelerator.prepare_model``, ``native_amp``); Fabric's ``_FabricModule``
runs each forward inside its precision plugin's ``forward_context()`` with ``convert_input`` /
``convert_output`` around it. The step's own forward already runs under its ``amp``; inside it
the framework's context is the same autocast again, so training is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["forward_under"]


def forward_under(
    model: nn.Module,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
    convert_output: Callable[[Any], Any],
    convert_input: Callable[[Any], Any] | None = None,
) -> None:
    """Make ``model.forward`` run inside ``context()``, its inputs through ``convert_input`` and
    its outputs through ``convert_output``, as the framework's prepared model did; the forward
    as built stays as ``model._original_forward`` (Accelerate's ``unwrap_model`` restores it)."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if convert_input is not None:
            args, kwargs = convert_input((args, kwargs))
        with context():
            output = original(*args, **kwargs)
        return convert_output(output)

    model._original_forward = original  # type: ignore[assignment]  # Module's __setattr__ types
    model.forward = forward
