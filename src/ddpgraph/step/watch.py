"""What a script or framework changed in the model between two calls of a TrainStep.

Frameworks touch what the step holds: transformers' evaluation loop runs ``model.to(device)``
on a model that never went through ``accelerator.prepare`` (on CPU ranks that moves every
parameter, gradient and buffer to new memory) and under bf16/fp16 replaces ``model.forward``
with an autocast wrapper; ``module.compile()`` swaps the call. A graph reads the memory and runs
the forward it captured, and DDP's gradient buckets are views of the old gradients, so each
call first asks :class:`ModelWatch` what changed; the capture policy follows it (wrapper rebuilt,
graphs captured again, with a warning) or raises naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter, is_
from typing import cast

import torch
from torch import nn

__all__ = ["ModelChanges", "ModelWatch", "address"]

# (the dict a module keeps its parameters or buffers in, the key, the name in the model)
_Slot = tuple[dict[str, torch.Tensor | None], str, str]

_grad = attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr

# guard="events": how many parameters, buffers and submodules were set on any module of the
# process (torch's global registration hooks: setattr, register_*, load_state_dict(assign=True));
# a step compares the count instead of reading every slot
_registrations = [0]
_hooks_installed = [False]


def _registered(*args: object) -> None:
    _registrations[0] += 1


def registrations() -> int:
    """The process's count of parameter, buffer and submodule registrations so far (the hooks
    installed on the first call)."""
    if not _hooks_installed[0]:
        from torch.nn.modules import module as torch_module

        torch_module.register_module_parameter_registration_hook(_registered)
        torch_module.register_module_buffer_registration_hook(_registered)
        torch_module.register_module_module_registration_hook(_registered)
        _hooks_installed[0] = True
    return _registrations[0]


def address(tensor: torch.Tensor) -> int:
    """Where a tensor's values live: a DTensor's (FSDP2's shards) are its local tensor's (its own
    ``data_ptr()`` is 0)."""
    local = getattr(tensor, "_local_tensor", None)
    return (local if local is not None else tensor).data_ptr()


def _address_or_none(tensor: torch.Tensor | None) -> int:
    return -1 if tensor is None else address(tensor)


@dataclass
class ModelChanges:
    """What :meth:`ModelWatch.check` found since the last call; empty (falsy) when nothing.

    ``moved``: parameters, gradients or buffers now in other memory (``model.to``,
    ``p.data = ...``); ``replaced``: parameters that are new ``nn.Parameter`` objects (the
    optimizer still holds the old ones); ``forwards``: modules whose ``forward`` (or compiled
    call) was replaced; ``dropped_grads``: gradients the script set to None (``zero_grad()``),
    with the tensors they were, so that a graph's can be put back.
    """

    moved: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    forwards: list[str] = field(default_factory=list)
    dropped_grads: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.moved or self.replaced or self.forwards or self.dropped_grads)

    def describe(self) -> str:
        """One line for a warning: what changed, a few names each."""
        parts = []
        for words, names in (
            ("moved to new memory", self.moved),
            ("replaced by new Parameter objects", self.replaced),
            ("forward replaced", self.forwards),
        ):
            if names:
                more = f" and {len(names) - 3} more" if len(names) > 3 else ""
                parts.append(f"{words}: {', '.join(names[:3])}{more}")
        return "; ".join(parts)


class ModelWatch:
    """The model's tensors and calls as the step left them after its last call, compared at the
    start of the next.

    ``roots()`` gives the modules the step calls (the wrapper, e.g. a DDP, and the script's
    module inside it). :meth:`settle` records, walking the modules once, a flat list of where each
    parameter, its gradient and each buffer live (read through the dict the owning module keeps
    them in, so a ``model.to()`` that replaced a buffer object is seen) and each root's
    instance ``forward`` and compiled call. While graphed, :meth:`unchanged` compares without
    walking any module and without a Python frame per tensor: one C-level ``map`` per list (the
    objects in their slots, their addresses, the gradients, the buffers), so a replayed call
    makes the same calls at every model size; :meth:`check` names what changed. With
    ``events_only`` (``guard="events"``) nothing is read per tensor: torch's global registration
    hooks count parameters, buffers and submodules set anywhere, and the count is compared (what
    that leaves unseen: :class:`~.options.StepOptions`). The step calls :meth:`settle`
    after every call that ran anything eagerly (gradients the step itself created or freed are
    then the new baseline); a replay changes no address, so a replayed call only checks.
    """

    def __init__(
        self, roots: Callable[[], tuple[nn.Module, ...]], *, events_only: bool = False
    ) -> None:
        self._roots = roots
        self._events_only = events_only  # guard="events": see StepOptions.guard
        self.settle()

    def settle(self, keep_grads: bool = False) -> None:
        """Take the model as it is now as the baseline (after the step's own work).

        ``keep_grads`` (while graphed): hold the gradient tensors, which the graphs write, so that
        a script's ``zero_grad()`` (set to None) frees no memory a graph uses and the tensors
        can be put back; eager steps hold none (they would keep a second set alive)."""
        roots = self._roots()
        self._params: list[_Slot] = []
        self._buffers: list[_Slot] = []
        seen: set[int] = set()
        for root in roots:
            for name, module in root.named_modules(remove_duplicate=True):
                if id(module) in seen:
                    continue  # the script's module inside the wrapper: walked once
                seen.add(id(module))
                prefix = f"{name}." if name else ""
                self._params += [(module._parameters, k, prefix + k) for k in module._parameters]
                self._buffers += [(module._buffers, k, prefix + k) for k in module._buffers]
        # drop slots registered as None (``bias=None``): nothing to watch there
        self._params = [slot for slot in self._params if slot[0][slot[1]] is not None]
        self._buffers = [slot for slot in self._buffers if slot[0][slot[1]] is not None]
        self._objects = [cast(torch.Tensor, slots[key]) for slots, key, _ in self._params]
        # plain tensors' data_ptr() is their address; a DTensor's is its local tensor's
        self._plain = not any(hasattr(t, "_local_tensor") for t in self._objects)
        self._param_at = self._param_addresses()
        self._grads = [p.grad if keep_grads else None for p in self._objects]
        self._grad_at = [_address_or_none(p.grad) for p in self._objects]
        self._buffer_at = self._buffer_addresses()
        self._calls = self._current_calls(roots)
        self._flat_baseline(keep_grads)

    def _flat_baseline(self, keep_grads: bool) -> None:
        """The lists :meth:`unchanged` compares with C-level ``map`` (no Python frame per tensor):
        each slot's dict and key, the objects in them, their addresses; with ``keep_grads`` the
        gradient objects and their addresses too (without, the full :meth:`check` compares)."""
        self._param_dicts = [d for d, _, _ in self._params]
        self._param_keys = [k for _, k, _ in self._params]
        self._buffer_dicts = [d for d, _, _ in self._buffers]
        self._buffer_keys = [k for _, k, _ in self._buffers]
        self._buffer_objects = [cast(torch.Tensor, d[k]) for d, k, _ in self._buffers]
        self._held = [g for g in self._grads if g is not None]
        self._held_at = [g.data_ptr() for g in self._held]
        # the fast path compares gradient objects: only while they are held (graphed) and each
        # parameter had one at the baseline (an eager or partly-None state takes the full check)
        self._fast = self._plain and keep_grads and len(self._held) == len(self._objects)
        # guard="events" while graphed: the registration count stands for the slots' reads
        self._by_events = self._events_only and keep_grads
        self._registrations = registrations() if self._events_only else 0

    def _param_addresses(self) -> list[int]:
        return self._addresses(self._params)

    def _buffer_addresses(self) -> list[int]:
        return self._addresses(self._buffers)

    def _addresses(self, slots: list[_Slot]) -> list[int]:
        if self._plain:
            try:  # the common case in one comprehension: ~0.15 µs a tensor
                return [d[k].data_ptr() for d, k, _ in slots]  # type: ignore[union-attr]
            except (KeyError, AttributeError):
                pass  # one was deleted or set to None: the slow path names it
        return [_address_or_none(d.get(k)) for d, k, _ in slots]

    def _current_grads(self) -> list[int]:
        if self._plain:
            return [-1 if (g := p.grad) is None else g.data_ptr() for p in self._objects]
        return [_address_or_none(p.grad) for p in self._objects]

    @staticmethod
    def _current_calls(roots: tuple[nn.Module, ...]) -> list[object]:
        # an instance attribute `forward` (accelerate's autocast wrapper) or a compiled call
        # (module.compile()); the class's own forward is not in __dict__
        return [
            (root.__dict__.get("forward"), root.__dict__.get("_compiled_call_impl"))
            for root in roots
        ]

    def unchanged(self) -> bool:
        """True when nothing :meth:`check` looks at changed since :meth:`settle`: the same
        parameter, gradient and buffer objects in their slots, at the same addresses, and the
        roots' calls. One C-level pass per list (``map``), no Python frame per tensor; False
        (maybe changed: ask :meth:`check`) when not graphed or the model holds DTensors."""
        if self._by_events:  # nothing read per tensor: see StepOptions.guard for what is unseen
            return (
                _registrations[0] == self._registrations
                and self._current_calls(self._roots()) == self._calls
            )
        if not self._fast:
            return False
        objects = self._objects
        return (
            all(map(is_, map(dict.get, self._param_dicts, self._param_keys), objects))
            and list(map(_data_ptr, objects)) == self._param_at
            and all(map(is_, map(_grad, objects), self._held))
            and list(map(_data_ptr, self._held)) == self._held_at
            and all(
                map(is_, map(dict.get, self._buffer_dicts, self._buffer_keys), self._buffer_objects)
            )
            and list(map(_data_ptr, self._buffer_objects)) == self._buffer_at
            and self._current_calls(self._roots()) == self._calls
        )

    def check(self) -> ModelChanges:
        """What changed since :meth:`settle`; changes nothing (the caller follows, then settles)."""
        found = ModelChanges()
        if self.unchanged():
            return found
        if self._events_only:  # what happened up to now is read below: a new count
            self._registrations = registrations()
        same_objects = map(is_, map(dict.get, self._param_dicts, self._param_keys), self._objects)
        # a new Parameter on the same storage (``nn.Parameter(p.data)``) moves no address
        if self._param_addresses() != self._param_at or not all(same_objects):
            self._find_parameters(found)
        grads = self._current_grads()
        if grads != self._grad_at:
            self._find_grads(grads, found)
        if self._buffer_addresses() != self._buffer_at:
            current = self._buffer_addresses()
            found.moved += [
                f"buffer {name!r}"
                for (_, _, name), now, then in zip(self._buffers, current, self._buffer_at)
                if now != then
            ]
        roots = self._roots()
        if len(roots) != len(self._calls) or self._current_calls(roots) != self._calls:
            found.forwards += [type(root).__name__ for root in roots]
        return found

    def _find_parameters(self, found: ModelChanges) -> None:
        for (slots, key, name), obj, then in zip(self._params, self._objects, self._param_at):
            now = slots.get(key)
            if now is not obj:
                found.replaced.append(f"parameter {name!r}")
            elif _address_or_none(now) != then:
                found.moved.append(f"parameter {name!r}")

    def _find_grads(self, grads: list[int], found: ModelChanges) -> None:
        for (_, _, name), param, kept, now, then in zip(
            self._params, self._objects, self._grads, grads, self._grad_at
        ):
            if now == then or then == -1:
                continue  # unchanged, or created since (the step's own first backward)
            if now == -1:  # set to None by the script: put back while graphed (kept)
                if kept is not None:
                    found.dropped_grads.append((param, kept))
            else:
                found.moved.append(f"gradient of {name!r}")

    def devices(self) -> set[torch.device]:
        """The devices the parameters are on now (read after a move: one pass)."""
        return {p.device for slots, key, _ in self._params if (p := slots.get(key)) is not None}
