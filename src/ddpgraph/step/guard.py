"""What a script or framework changed between two calls of a TrainStep: one guard, one check.

Frameworks touch what the step holds: transformers' evaluation loop runs ``model.to(device)``
on a model that never went through ``accelerator.prepare`` (on CPU ranks that moves every
parameter, gradient and buffer to new memory) and under bf16/fp16 replaces ``model.forward``
with an autocast wrapper; ``module.compile()`` swaps the call; a resume calls
``optimizer.load_state_dict``; a script freezes a layer or sets a param-group value. A graph reads
the memory it captured and runs the forward and the values it captured, so each call first asks
:meth:`Guard.check`; the step follows what it found (:class:`~.follow.Follower`: the wrapper
rebuilt, the optimizer's values copied back in place, graphs captured again, with a warning) or
raises naming it.

The guard reports; it never calls the engine or the wrapper. Its two baselines keep their own
rhythm: the model's is re-taken by :meth:`Guard.settle` after every call that ran something
eagerly; the optimizer's is taken when the first graph is captured
(:meth:`Guard.watch_optimizer`) and kept until the training graphs go
(:meth:`Guard.forget_optimizer`): the graphs read those tensors, and a reload is copied back
into them, never made the new baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter, is_
from typing import cast

import torch
from torch import nn

from . import events
from .events import changes as _changes
from .optim import (
    changed_values,
    describe_group_changes,
    hyperparameters,
    restore_identities,
    tensor_slots,
)
from .parallel.dtensor import address

__all__ = ["Guard", "Seen"]

# (the dict a module keeps its parameters or buffers in, the key, the name in the model)
_Slot = tuple[dict[str, torch.Tensor | None], str, str]

_grad = attrgetter("grad")
_requires_grad = attrgetter("requires_grad")
_module_dict = attrgetter("__dict__")
_data_ptr = torch.Tensor.data_ptr


def _address_or_none(tensor: torch.Tensor | None) -> int:
    return -1 if tensor is None else address(tensor)


@dataclass
class Seen:
    """What :meth:`Guard.check` found since the last call (it returns None when nothing).

    The model: ``moved``: parameters, gradients or buffers now in other memory (``model.to``,
    ``p.data = ...``); ``replaced``: parameters that are new ``nn.Parameter`` objects (the
    optimizer still holds the old ones); ``forwards``: modules whose ``forward`` (or compiled
    call) was replaced; ``dropped_grads``: gradients the script set to None (``zero_grad()``),
    with the tensors they were, so that a graph's can be put back. The optimizer (once a graph
    is captured): ``optimizer``: what changed, in words (a reload is already copied back into
    the captured tensors); ``recapture``: the graphs read something that changed (a param-group
    value, ``requires_grad``, a state tensor that cannot be put back); ``trainable_changed``:
    a parameter's ``requires_grad`` (the wrapper follows it); ``values_changed``: the param-group
    values the graphs bake in that changed, named (``momentum``, ``betas``; not the LR, which
    they read from a tensor).
    """

    moved: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    forwards: list[str] = field(default_factory=list)
    dropped_grads: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    optimizer: list[str] = field(default_factory=list)
    recapture: bool = False
    trainable_changed: bool = False
    values_changed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.moved or self.replaced or self.forwards or self.dropped_grads or self.optimizer
        )

    @property
    def model_changed(self) -> bool:
        return bool(self.moved or self.replaced or self.forwards or self.dropped_grads)

    def describe(self) -> str:
        """One line for a warning: what changed in the model, a few names each."""
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


class Guard:
    """Everything a script or framework can change between calls, as one flat baseline, and one
    :meth:`check` of it.

    ``roots()`` gives the modules the step calls (the wrapper, e.g. a DDP, and the script's
    module inside it). :meth:`settle` records, walking the modules once, where each parameter,
    its gradient and each buffer live (read through the dict the owning module keeps them in,
    so a ``model.to()`` that replaced a buffer object is seen) and each root's instance
    ``forward`` and compiled call. :meth:`watch_optimizer` adds the optimizer as the graphs
    captured it (:class:`OptimizerBaseline`). While graphed, :meth:`check` compares without
    walking any module and without a Python frame per tensor: one C-level ``map`` per list, one
    Python frame in all, so a replayed call makes the same calls at every model size. With
    ``events_only`` (``guard="events"``, the default) nothing is read per tensor while graphed:
    every public way of changing a tensor's memory, gradient, ``requires_grad``, a module's
    slots or mode moves one process-wide count (:mod:`~.events`), and the count is compared;
    when it moved, the whole baseline is read as with ``"full"`` (the slow path), so what is
    reported is the same.
    """

    def __init__(
        self, roots: Callable[[], tuple[nn.Module, ...]], *, events_only: bool = False
    ) -> None:
        self._roots = roots
        self._events_only = events_only  # guard="events": see StepOptions.guard
        self.optimizer: OptimizerBaseline | None = None
        self.settle()

    # ----------------------------------------------------------------- baselines
    def settle(self, keep_grads: bool = False) -> None:
        """Take the model as it is now as the baseline (after the step's own work).

        ``keep_grads`` (while graphed): hold the gradient tensors, which the graphs write, so that
        a script's ``zero_grad()`` (set to None) frees no memory a graph uses and the tensors
        can be put back; eager steps hold none (they would keep a second set alive)."""
        self._root_list = roots = self._roots()
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
        self._param_at = self._addresses(self._params)
        self._grads = [p.grad if keep_grads else None for p in self._objects]
        self._grad_at = [_address_or_none(p.grad) for p in self._objects]
        self._buffer_at = self._addresses(self._buffers)
        self._forward_keys = ["forward"] * len(roots)
        self._compiled_keys = ["_compiled_call_impl"] * len(roots)
        self._calls = _calls_of(roots)
        self._flat_baseline(keep_grads)

    def _flat_baseline(self, keep_grads: bool) -> None:
        """The lists :meth:`check` compares with C-level ``map`` (no Python frame per tensor):
        each slot's dict and key, the objects in them, their addresses; with ``keep_grads`` the
        gradient objects and their addresses too."""
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
        # guard="events" while graphed: the count of changes stands for the per-tensor reads
        self._by_events = self._events_only and keep_grads
        self._events_at = events.count() if self._events_only else 0

    def watch_optimizer(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        """Once a graph is captured: the optimizer as the graphs read it (kept until
        :meth:`forget_optimizer`; a second call changes nothing)."""
        if self.optimizer is None:
            self.optimizer = OptimizerBaseline(params, optimizer, events_only=self._events_only)

    def forget_optimizer(self) -> None:
        """The training graphs are gone: the next capture takes the optimizer's baseline."""
        self.optimizer = None

    # ----------------------------------------------------------------- the check
    def check(self) -> Seen | None:
        """What changed since the baselines, or None. Reads everything in one frame (C-level
        ``map`` per list) and builds a :class:`Seen` only when something differs. Changes
        nothing in the model; an optimizer reload is copied back into the captured tensors.

        The roots are the ones of the baseline: the step rebuilds its wrapper only inside a
        call that settles after it (a freeze followed, storage followed, compile's fallback, a
        failed capture's reset), so a new root is always in the next call's baseline."""
        opt = self.optimizer
        try:
            if self.unchanged():
                return None
        except (KeyError, TypeError):
            pass  # a slot deleted or no longer a tensor: the slow path below names it
        seen = self._find()
        if opt is not None:
            opt.find(seen)
        return seen if seen or seen.recapture else None

    def unchanged(self) -> bool:
        """The fast path: the same objects in their slots, at the same addresses, the roots'
        calls, and (once watched) the optimizer's state, state tensors, param-group values and
        ``requires_grad`` flags (one C-level pass per list); False when not graphed (or
        DTensors). Raises KeyError/TypeError on a deleted or non-tensor optimizer state slot,
        which :meth:`check` sends to the slow path."""
        dicts = list(map(_module_dict, self._root_list))
        calls = zip(
            map(dict.get, dicts, self._forward_keys), map(dict.get, dicts, self._compiled_keys)
        )
        if list(calls) != self._calls:
            return False
        if self._by_events:  # nothing read per tensor: see step/events.py for what is counted
            if _changes[0] != self._events_at:
                return False
        elif not (
            self._fast
            and all(map(is_, map(dict.get, self._param_dicts, self._param_keys), self._objects))
            and list(map(_data_ptr, self._objects)) == self._param_at
            and all(map(is_, map(_grad, self._objects), self._held))
            and list(map(_data_ptr, self._held)) == self._held_at
            and all(
                map(is_, map(dict.get, self._buffer_dicts, self._buffer_keys), self._buffer_objects)
            )
            and list(map(_data_ptr, self._buffer_objects)) == self._buffer_at
        ):
            return False
        opt = self.optimizer
        if opt is None:
            return True
        groups = opt.optimizer.param_groups
        return (
            opt.optimizer.state is opt.state
            and (
                opt.events_only
                or (
                    list(map(_requires_grad, opt.params)) == opt.params_seen
                    and (
                        list(map(_data_ptr, map(dict.__getitem__, opt.slot_dicts, opt.slot_keys)))
                        if opt.plain
                        else opt.slot_pointers()
                    )
                    == opt.slot_at
                )
            )
            and groups is opt.group_list
            and all(map(is_, groups, opt.group_dicts))
            and list(map(len, groups)) == opt.group_sizes
            and all(map(is_, map(dict.get, opt.value_dicts, opt.value_keys), opt.values))
        )

    def _find(self) -> Seen:
        """The model's changes, named (the slow path: something differs, or not graphed)."""
        found = Seen()
        if self._events_only:  # what happened up to now is read below: a new count
            self._events_at = events.count()
        same_objects = map(is_, map(dict.get, self._param_dicts, self._param_keys), self._objects)
        # a new Parameter on the same storage (``nn.Parameter(p.data)``) moves no address
        if self._addresses(self._params) != self._param_at or not all(same_objects):
            self._find_parameters(found)
        grads = self._current_grads()
        if grads != self._grad_at:
            self._find_grads(grads, found)
        current = self._addresses(self._buffers)
        if current != self._buffer_at:
            found.moved += [
                f"buffer {name!r}"
                for (_, _, name), now, then in zip(self._buffers, current, self._buffer_at)
                if now != then
            ]
        roots = self._roots()
        if len(roots) != len(self._calls) or _calls_of(roots) != self._calls:
            found.forwards += [type(root).__name__ for root in roots]
        return found

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

    def _find_parameters(self, found: Seen) -> None:
        for (slots, key, name), obj, then in zip(self._params, self._objects, self._param_at):
            now = slots.get(key)
            if now is not obj:
                found.replaced.append(f"parameter {name!r}")
            elif _address_or_none(now) != then:
                found.moved.append(f"parameter {name!r}")

    def _find_grads(self, grads: list[int], found: Seen) -> None:
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


def _calls_of(roots: tuple[nn.Module, ...]) -> list[tuple[object, object]]:
    # an instance attribute `forward` (accelerate's autocast wrapper) or a compiled call
    # (module.compile()); the class's own forward is not in __dict__. C-level: no frame per root
    dicts = list(map(_module_dict, roots))
    return list(
        zip(
            map(dict.get, dicts, ["forward"] * len(dicts)),
            map(dict.get, dicts, ["_compiled_call_impl"] * len(dicts)),
        )
    )


class OptimizerBaseline:
    """The optimizer and the trainable set as the graphs captured them (:meth:`Guard.check`
    reads its flat lists): the ``requires_grad`` flags of the parameters, the identity of the
    optimizer's state dict, its state tensors' data pointers and the param groups' plain values
    (by identity; by value only when an object differs). With ``events_only``
    (``guard="events"``) the fast path reads only the state dict's identity and the param groups
    (a reload replaces the state dict; ``requires_grad`` moves the events' count); the slow path
    reads everything.

    * optimizer state replaced (``optimizer.load_state_dict``): the new values are copied into
      the tensors the graphs read (:func:`ddpgraph.optim.restore_identities`), never a new
      baseline; a slot that cannot be restored asks for a re-capture;
    * a param-group value changed (weight decay, betas), or a parameter's ``requires_grad``:
      re-capture (the graph baked the old value in).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        *,
        events_only: bool = False,
    ) -> None:
        self.params = params
        self.optimizer = optimizer
        self.events_only = events_only
        self.params_seen = list(map(_requires_grad, params))
        self._kept = tensor_slots(optimizer)  # what the graphs read: never re-baselined
        self._groups = hyperparameters(optimizer)
        self._index_groups()
        self._index_slots()

    def _index_slots(self) -> None:
        self.state = self.optimizer.state
        self._slots = [
            (state, key)
            for state in self.state.values()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        ]
        self.slot_dicts = [state for state, _ in self._slots]
        self.slot_keys = [key for _, key in self._slots]
        self.plain = not any(hasattr(state[key], "_local_tensor") for state, key in self._slots)
        self.slot_at = self.slot_pointers()

    def _index_groups(self) -> None:
        """The param groups' plain values as flat lists, compared by identity on every call (the
        values themselves only when an object differs: :func:`hyperparameters`)."""
        groups = self.optimizer.param_groups
        self.group_list = groups
        self.group_dicts = list(groups)
        self.group_sizes = list(map(len, groups))
        items = [(g, k, v) for g in groups for k, v in g.items() if k not in ("params", "lr")]
        self.value_dicts = [g for g, _, _ in items]
        self.value_keys = [k for _, k, _ in items]
        self.values = [v for _, _, v in items]

    def slot_pointers(self) -> list[int]:
        if self.plain:
            try:  # one C-level pass: no Python frame per state tensor
                return list(map(_data_ptr, map(dict.__getitem__, self.slot_dicts, self.slot_keys)))
            except (KeyError, TypeError):
                pass  # a slot deleted or no longer a tensor: the slow path below names it
        return [address(state[key]) if key in state else -1 for state, key in self._slots]

    def groups_unchanged(self) -> bool:
        groups = self.optimizer.param_groups
        return (
            groups is self.group_list
            and all(map(is_, groups, self.group_dicts))
            and list(map(len, groups)) == self.group_sizes
            and all(map(is_, map(dict.get, self.value_dicts, self.value_keys), self.values))
        )

    def find(self, found: Seen) -> None:
        """What changed, into ``found``; a reload is copied back into the captured tensors."""
        # the slow path reads everything, whatever the guard (it runs when something moved)
        if list(map(_requires_grad, self.params)) != self.params_seen:
            found.optimizer.append("a parameter's requires_grad changed")
            found.recapture = True
            found.trainable_changed = True
        if self.optimizer.state is not self.state or self.slot_pointers() != self.slot_at:
            self._restore(found)
        if not self.groups_unchanged():
            groups = hyperparameters(self.optimizer)
            if groups != self._groups:
                found.optimizer.append(describe_group_changes(self.optimizer, self._groups, groups))
                found.recapture = True
                found.values_changed = changed_values(self._groups, groups)
            else:  # new objects of equal values (a scheduler writing momentum): the new baseline
                self._index_groups()

    def _restore(self, found: Seen) -> None:
        lost = restore_identities(self.optimizer, self._kept)
        self._index_slots()
        kept = {address(t) for t in self._kept.values()}
        if lost:
            found.optimizer.append(
                f"the optimizer's state was replaced ({', '.join(lost[:3])} lost)"
            )
            found.recapture = True
        elif any(pointer not in kept for pointer in self.slot_at):
            found.optimizer.append("the optimizer holds state tensors the graphs never saw")
            found.recapture = True
        else:
            found.optimizer.append(
                "optimizer state loaded: values copied into the captured tensors"
            )
