"""One process-wide count of every change a script or framework can make to a model's tensors
through torch's public API: what lets ``guard="events"`` (the default) know, by comparing one
integer, that nothing changed between two graphed calls, at every model size.

A change that a graph must know of is one that makes the model's tensors live elsewhere, or
makes different tensors the model's: a replay reads and writes the memory it captured, so it
cannot itself see that ``p.data``, ``p.grad`` or a module's slot now points somewhere else.
Torch moves no counter for these (a tensor's ``_version`` counts in-place writes, which a replay
makes too, and ``p.data = x`` does not move it), so each way of making them is counted where it
happens:

* a parameter, buffer or submodule set on any module (``module.weight = ...``,
  ``register_buffer``, ``load_state_dict(assign=True)``): torch's global registration hooks;
* ``t.data = ...``, ``t.grad = ...`` (``zero_grad()`` sets it to None), ``t.requires_grad = ...``,
  ``t.requires_grad_()`` and ``t.set_(...)`` on any tensor (a parameter, a gradient, a buffer):
  the setters and methods of ``torch.Tensor`` wrapped (the getters stay torch's own C
  functions);
* ``module.to()`` / ``.cuda()`` / ``.half()`` / ``to_empty()`` (``nn.Module._apply``, which also
  writes buffers straight into ``module._buffers``) and ``torch.utils.swap_tensors``;
* ``module.train()`` / ``.eval()`` on any module (``nn.Module.train``).

Each wrapper adds one to the count and calls torch's own code; installed once, on the first
:func:`count` (a step's guard takes its first baseline), for the life of the process. A change
made without any of these (a tensor put straight into a module's ``_parameters`` or
``_buffers`` dict, ``module.training = ...`` on a submodule, an optimizer state tensor replaced
by hand) moves no count: ``guard="full"`` reads every tensor and sees those.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["changes", "count"]

# how many changes the wrappers and hooks below have seen in this process (read by the guard
# as ``changes[0]``: a list item, no call, on every replayed call)
changes = [0]
_installed = [False]

_F = TypeVar("_F", bound=Callable[..., Any])


def _seen(*args: object) -> None:
    changes[0] += 1


def _counted(function: _F) -> _F:
    @functools.wraps(function)
    def counted(*args: Any, **kwargs: Any) -> Any:
        changes[0] += 1
        return function(*args, **kwargs)

    counted.__ddpgraph_counted__ = True  # type: ignore[attr-defined]
    return counted  # type: ignore[return-value]


def _counted_setter(name: str) -> property:
    """``torch.Tensor.<name>`` as torch defines it (a C getset descriptor on ``TensorBase``),
    its setter counted; reads call the C getter directly (no Python frame)."""
    torch_own = inspect.getattr_static(torch.Tensor, name)
    setter = torch_own.__set__

    def counted(tensor: torch.Tensor, value: Any) -> None:
        changes[0] += 1
        setter(tensor, value)

    return property(torch_own.__get__, counted, doc=getattr(torch_own, "__doc__", None))


def count() -> int:
    """The process's count of changes so far (the hooks and wrappers installed on the first
    call)."""
    if not _installed[0]:
        _install()
    return changes[0]


def _install() -> None:
    from torch.nn.modules import module as torch_module

    torch_module.register_module_parameter_registration_hook(_seen)
    torch_module.register_module_buffer_registration_hook(_seen)
    torch_module.register_module_module_registration_hook(_seen)
    for name in ("data", "grad", "requires_grad"):
        setattr(torch.Tensor, name, _counted_setter(name))
    torch.Tensor.requires_grad_ = _counted(torch.Tensor.requires_grad_)  # type: ignore[method-assign]
    torch.Tensor.set_ = _counted(torch.Tensor.set_)  # type: ignore[method-assign]
    nn.Module._apply = _counted(nn.Module._apply)  # type: ignore[method-assign]
    nn.Module.train = _counted(nn.Module.train)  # type: ignore[method-assign]
    torch.utils.swap_tensors = _counted(torch.utils.swap_tensors)
    _installed[0] = True
