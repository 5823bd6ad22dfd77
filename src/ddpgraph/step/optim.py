"""Making an optimizer safe to step inside a CUDA graph: the one home of that rule.

The step (:func:`plan_graph_safety`), precision (:func:`skips_on_device`) and the replay guard
(:func:`tensor_slots`, :func:`restore_identities`, :func:`hyperparameters`) read it from here.

Inside a graph every kernel argument is frozen at capture. Two things therefore have to live on
the device: the optimizer's step counters (``capturable=True`` where the optimizer has it) and
the learning rate (a 0-dim device tensor), so that an LR scheduler's change between replays is
seen by the replayed kernels without a re-capture. A value torch's optimizer takes only as a
number is baked in: SGD's ``momentum``, and Adam's ``betas`` (every Adam path reads them on the
host: ``addcmul_(value=1 - beta2)``, ``_foreach_lerp_``, the fused kernel's floats; the H100
refused a capture of each with tensor betas). Each change re-captures, and
:func:`describe_group_changes` says so once, with the value and the fix.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, TypeGuard

import torch

from ..errors import CaptureError
from .optim_diff import LR_CHANGE, describe_changes, step_options

__all__ = [
    "GraphSafeOptimizer",
    "TensorSlots",
    "changed_values",
    "describe_group_changes",
    "graph_safety_problem",
    "hyperparameters",
    "keep_scheduler_lrs_floats",
    "lr_of",
    "make_graph_safe",
    "plan_graph_safety",
    "restore_identities",
    "seed_momentum_buffers",
    "skips_on_device",
    "take_the_foreach_path",
    "tensor_slots",
    "unscales_in_kernel",
]

# a param group's LR: each replay tests ``lr_of(group) is lr_tensor`` in one C-level pass and
# calls GraphSafeOptimizer.sync_lr only when a float was set since
lr_of = itemgetter("lr")

# (parameter index, state key) for state tensors; (-1 - group index, "lr") for LR tensors
TensorSlots = dict[tuple[int, str], torch.Tensor]


@dataclass
class GraphSafeOptimizer:
    """What :func:`make_graph_safe` changed, and the LR tensors it installed (one per group)."""

    optimizer: torch.optim.Optimizer
    changes: list[str]
    lr_tensors: list[torch.Tensor]
    # each change that changes the numbers, with its measured size (report().optimizer_changes)
    described: list[str] = field(default_factory=list)

    def sync_lr(self) -> None:
        """Pick up an LR a scheduler or the user assigned as a float: copy it into the tensor.

        ``fill_`` with a Python number is a kernel launch with the value as an argument, not a
        host sync, so this is cheap enough for every step.
        """
        for group, lr in zip(self.optimizer.param_groups, self.lr_tensors):
            value = group["lr"]
            if value is not lr:
                lr.fill_(float(value))
                group["lr"] = lr


def make_graph_safe(optimizer: torch.optim.Optimizer, device: torch.device) -> GraphSafeOptimizer:
    """Turn on ``capturable`` (Adam, AdamW, …) or ``fused`` (SGD) and put the LR on ``device``.

    A capturable optimizer also steps with ``foreach=True``, CUDA's default path: torch's
    for-loop capturable paths give NaN at LR 0 (Adam, AdamW) or read the LR tensor on the host
    (Adadelta, RMSprop); see :func:`take_the_foreach_path`.

    Raises :class:`CaptureError` naming the optimizer when it cannot be captured. Call before the
    optimizer's first step so its state is created on the device.
    """
    problem = graph_safety_problem(optimizer)
    if problem is not None:
        raise CaptureError(problem)
    if device.type == "cpu":
        allow_capturable_on_cpu()  # the CPU graph engine steps the optimizer as CUDA does
    changes: list[str] = []
    for group in optimizer.param_groups:
        if "capturable" in group:
            if not group["capturable"]:
                group["capturable"] = True
                changes.append("capturable=True")
            if take_the_foreach_path(group) and "foreach=True" not in changes:
                changes.append("foreach=True")
        else:  # SGD (graph_safety_problem allows no other)
            # foreach SGD turns a tensor LR into `alpha=-lr`, an implicit .item() that breaks
            # capture; the fused kernel takes the LR tensor itself.
            group["fused"] = True
            group["foreach"] = False
            if "fused=True" not in changes:
                changes.append("fused=True")
    _move_step_counters(optimizer, device)
    if not all(_is_lr_tensor(group["lr"], device) for group in optimizer.param_groups):
        changes.append(LR_CHANGE)  # a script that gave a device tensor LR keeps it
        _LR_MADE_TENSOR.add(optimizer)
        keep_scheduler_lrs_floats()
    lr_tensors = [_lr_tensor(group, device) for group in optimizer.param_groups]
    return GraphSafeOptimizer(optimizer, changes, lr_tensors)


# optimizers whose float LR make_graph_safe turned into a tensor: their schedulers' state dicts
# write the LRs as the floats the script's own run writes
_LR_MADE_TENSOR: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_FLOATS_WRITTEN = "_ddpgraph_writes_float_lrs"  # marks a state_dict already wrapped


def keep_scheduler_lrs_floats() -> None:
    """Make torch's LR schedulers write an optimizer's LRs as floats in their state dicts where
    :func:`make_graph_safe` put a tensor in place of the script's float (once per process).

    A scheduler copies ``group["lr"]`` into ``_last_lr`` at each ``step()`` and, built after
    the change, into ``base_lrs``: 0-dim tensors then, where the same script's float-LR run has
    floats. ``torch.save`` would then write tensors into a script's checkpoint, and DCP keys a
    list of tensors by position (``_last_lr.0``) but a list of floats as one object
    (``_last_lr``), so neither run's checkpoint would load into the other ("Missing key in
    checkpoint state_dict: lr_scheduler._last_lr.0"). Each ``state_dict`` defined in
    ``torch.optim.lr_scheduler`` (LRScheduler's and the subclasses' own, e.g. LambdaLR's) is
    wrapped to write those lists as floats for such an optimizer only: one host read per LR, at
    save time. Each ``load_state_dict`` is wrapped to give ``base_lrs`` back the type the loading
    scheduler holds (a float32 tensor where a scheduler built after the step computes its LRs on
    tensors), so a resumed run computes its LRs as the uninterrupted run does, bit for bit
    (float32 -> float -> float32 is exact); ``_last_lr`` stays as loaded until the next step."""
    from torch.optim import lr_scheduler

    for cls in vars(lr_scheduler).values():
        if not (isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler)):
            continue
        own = cls.__dict__.get("state_dict")
        if own is not None and not getattr(own, _FLOATS_WRITTEN, False):
            cls.state_dict = _writing_float_lrs(own)  # type: ignore[method-assign]
        load = cls.__dict__.get("load_state_dict")
        if load is not None and not getattr(load, _FLOATS_WRITTEN, False):
            cls.load_state_dict = _reading_lrs_as_held(load)  # type: ignore[method-assign]


def _writing_float_lrs(state_dict: Any) -> Any:
    @functools.wraps(state_dict)
    def wrapped(self: Any) -> dict[str, Any]:
        state: dict[str, Any] = state_dict(self)
        if getattr(self, "optimizer", None) in _LR_MADE_TENSOR:
            for key in ("_last_lr", "base_lrs"):
                values = state.get(key)
                if isinstance(values, list):
                    state[key] = [_as_float(v) for v in values]
        return state

    setattr(wrapped, _FLOATS_WRITTEN, True)
    return wrapped


def _reading_lrs_as_held(load_state_dict: Any) -> Any:
    @functools.wraps(load_state_dict)
    def wrapped(self: Any, state_dict: dict[str, Any]) -> None:
        before = getattr(self, "base_lrs", None)  # what its LRs are computed from
        load_state_dict(self, state_dict)
        after = getattr(self, "base_lrs", None)
        if getattr(self, "optimizer", None) not in _LR_MADE_TENSOR:
            return
        if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
            self.base_lrs = [_as_held(b, a) for b, a in zip(before, after)]

    setattr(wrapped, _FLOATS_WRITTEN, True)
    return wrapped


def _as_held(held: Any, loaded: Any) -> Any:
    if isinstance(held, torch.Tensor) and held.dim() == 0 and isinstance(loaded, float):
        return torch.tensor(loaded, dtype=held.dtype, device=held.device)
    return loaded


def _as_float(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return float(value)
    return value


def take_the_foreach_path(group: dict[str, Any]) -> bool:
    """Move a capturable optimizer off torch's for-loop path; True where that changes the path.

    The foreach path is the one CUDA takes by default; the CPU's default is the for-loop, which
    is wrong inside a graph for some optimizers: Adam/AdamW's divides by ``-lr /
    bias_correction1`` before adding eps, so at LR 0 (a linear warm-up's first step, a decay's
    last, torch's own state-creating step) every element with a zero second moment becomes NaN
    (pytorch#126514); Adadelta's and RMSprop's take a tensor LR as ``alpha=-lr``, a host read
    that a capture refuses. So the CPU engine steps as a GPU does only with ``foreach=True``. A
    group torch would already step with foreach is no change (torch's own choice is asked).
    """
    if "foreach" not in group or group.get("fused") or group.get("foreach"):
        return False
    chose_foreach = group.get("foreach") is None and _torch_defaults_to_foreach(group["params"])
    group["foreach"] = True
    return not chose_foreach


def _torch_defaults_to_foreach(params: list[torch.Tensor]) -> bool:
    from torch.optim.optimizer import _default_to_fused_or_foreach

    _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(foreach)


@functools.cache
def allow_capturable_on_cpu() -> None:
    """Let the CPU into torch's capturable device list, once per process.

    The list is torch's only gate on the CPU (the capturable arithmetic is device-independent
    code), and the CPU graph engine must step the optimizer as a CUDA graph does. Every optimizer
    module imported the function by name, so each reference is replaced."""
    from torch.optim import optimizer as base

    original = base._get_capturable_supported_devices

    def with_cpu(supports_xla: bool = True) -> list[str]:
        return [*original(supports_xla), "cpu"]

    # a snapshot: another thread (a DataLoader's, a Trainer's) may import while this runs
    modules = list(sys.modules.items())
    optimizers = [m for name, m in modules if name.startswith("torch.optim.")]
    for module in optimizers:
        if getattr(module, "_get_capturable_supported_devices", None) is original:
            module._get_capturable_supported_devices = with_cpu  # type: ignore[attr-defined]


def graph_safety_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be stepped inside a CUDA graph, or None; changes nothing, so
    it also runs on CPU (a dry run names what the GPU run would refuse)."""
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        if "capturable" not in group and not isinstance(optimizer, torch.optim.SGD):
            return (
                f"{name} cannot be stepped inside a CUDA graph (it has no `capturable` option); "
                "use SGD, Adam or AdamW, or pass graph='never' to TrainStep."
            )
        if group.get("differentiable"):
            return f"{name}(differentiable=True) cannot be captured; turn it off."
        if "capturable" not in group and any(
            p.is_sparse or not p.is_floating_point() for p in group["params"]
        ):
            return f"{name} with sparse or non-float parameters cannot be captured."
    return None


def plan_graph_safety(
    optimizer: torch.optim.Optimizer, device: torch.device, *, fp16: bool
) -> GraphSafeOptimizer | str:
    """Make ``optimizer`` graph-safe for a step on ``device``; or, changing nothing, why not.

    fp16 inside a graph also needs a fused kernel that skips an overflowed step on the device
    (Adam/AdamW/SGD are switched to it). Each change is measured against the script's settings
    (:func:`~.optim_diff.describe_changes`): ``plan.described``, the report's
    ``optimizer_changes``, lists those that change the numbers (``plan.changes`` every one).
    """
    problem = graph_safety_problem(optimizer)
    if problem is None and fp16:
        problem = _fused_problem_for_fp16(optimizer)
    if problem is not None:
        return problem
    before = step_options(optimizer)
    plan = make_graph_safe(optimizer, device)
    if fp16 and not skips_on_device(optimizer):
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
        plan.changes.append("fused=True (fp16 skips overflowed steps on the device)")
    plan.described = describe_changes(optimizer, before, plan.changes, device)
    if fp16 and seed_momentum_buffers(optimizer):
        plan.changes.append(MOMENTUM_SEEDED)
        plan.described += _dampened_first_update(optimizer)
    return plan


MOMENTUM_SEEDED = "SGD momentum buffers made zeros before the first step (fp16)"


def seed_momentum_buffers(optimizer: torch.optim.Optimizer) -> bool:
    """Give fused SGD zero momentum buffers before its first step; True where any was missing.

    torch's fused SGD makes its buffers with ``empty_like`` on the step that finds none and
    leaves them as they are when ``found_inf`` skips that step: fp16's first steps routinely
    overflow, so the first real update would add uninitialized memory to its gradient (NaN, or
    garbage the script never had). With zeros that first real update computes ``momentum * 0 +
    (1 - dampening) * grad``: the ``grad`` torch's first step takes where ``dampening`` is 0 (its
    default; the report names any other value: :func:`_dampened_first_update`).
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    seeded = False
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        for p in group["params"]:
            # a frozen parameter never gets a gradient, so torch never gives it a buffer: neither
            # do we (a LoRA script passing every parameter would pay a model's size in zeros)
            if p.requires_grad and "momentum_buffer" not in optimizer.state[p]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format
                )
                seeded = True
    return seeded


def _dampened_first_update(optimizer: torch.optim.Optimizer) -> list[str]:
    dampening = {group.get("dampening", 0) for group in optimizer.param_groups} - {0}
    if not dampening:
        return []
    return [
        f"{MOMENTUM_SEEDED}: with dampening={min(dampening)!r} the first update's momentum "
        "is (1 - dampening) * grad where torch's own first step takes grad undamped (a skipped "
        "fp16 step cannot leave the choice to the host; dampening=0 makes the two equal)"
    ]


def unscales_in_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``torch.amp.GradScaler`` hands ``optimizer``'s step the scale to unscale in its
    kernel (``_step_supports_amp_scaling``: an optimizer built fused) rather than unscaling the
    gradients before it. Ask it of the optimizer as the script built it: the step's switch to a
    fused kernel sets only the param groups' ``"fused"``. On CUDA the two give different
    updates (fused SGD: 804 of 1M parameters 1 ulp apart on an H100,
    ``benchmarks/probes/fused_sgd_grad_scale.py``), so the step follows the script's choice."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every param group steps through a fused kernel that takes ``found_inf``."""
    return all(group.get("fused") for group in optimizer.param_groups)


def _fused_problem_for_fp16(optimizer: torch.optim.Optimizer) -> str | None:
    if all("fused" in group for group in optimizer.param_groups):
        return None
    return (
        f"amp='fp16' inside a graph needs an optimizer with a fused kernel (Adam, AdamW, SGD) "
        f"that skips an overflowed step on the device; {type(optimizer).__name__} would need "
        "found_inf.item(), a host sync. Use one of those, or amp='bf16' (no loss scaling)."
    )


def _move_step_counters(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    # State created before capturable was turned on keeps its step counter on the CPU.
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != device:
            state["step"] = step.to(device=device, dtype=torch.float32)


def _is_lr_tensor(lr: object, device: torch.device) -> TypeGuard[torch.Tensor]:
    return isinstance(lr, torch.Tensor) and lr.device == device and lr.dim() == 0


def _lr_tensor(group: dict[str, Any], device: torch.device) -> torch.Tensor:
    lr = group["lr"]
    if _is_lr_tensor(lr, device):
        return lr
    # a scheduler built after this takes ``group["lr"]`` as its base LR: torch's copies a tensor,
    # timm's (``group.setdefault("initial_lr", group["lr"])``) keeps the tensor itself, whose
    # value each LR the step copies in would then overwrite (its cosine fell to 1e-4 of the
    # script's in one epoch): it finds the script's own number here instead, as without the step
    group.setdefault("initial_lr", lr if isinstance(lr, float) else float(lr))
    tensor = torch.tensor(float(lr), dtype=torch.float32, device=device)
    group["lr"] = tensor
    return tensor


def tensor_slots(optimizer: torch.optim.Optimizer) -> TensorSlots:
    """The optimizer's state and LR tensors by slot: what a captured graph reads and writes."""
    found: TensorSlots = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, param in enumerate(params):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                found[(i, key)] = value
    for g, group in enumerate(optimizer.param_groups):
        if isinstance(group.get("lr"), torch.Tensor):
            found[(-1 - g, "lr")] = group["lr"]
    return found


def restore_identities(optimizer: torch.optim.Optimizer, kept: TensorSlots) -> list[str]:
    """Put an optimizer's new values back into the tensors in ``kept`` (the one in-place load).

    ``Optimizer.load_state_dict`` (alone, or inside DCP's ``set_state_dict``) replaces the state
    tensors and deep-copies the param groups, so a graph captured before it would keep updating
    the old tensors. This copies each new value into the kept tensor and points the optimizer
    back at it (``copy_`` converts dtype and device, e.g. a CPU step counter). Returns the slots
    it could not restore (missing, or another shape): a graph that reads them has to be captured
    again.
    """
    lost: list[str] = []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    current = tensor_slots(optimizer)
    for (index, key), old in kept.items():
        if index < 0:
            continue
        new = current.get((index, key))
        if new is old:
            continue
        if new is None or new.shape != old.shape:
            lost.append(f"parameter {index} {key!r}")
            continue
        old.copy_(new)
        optimizer.state[params[index]][key] = old
    for g, group in enumerate(optimizer.param_groups):
        lr = kept.get((-1 - g, "lr"))
        if lr is not None and group["lr"] is not lr:
            lr.fill_(float(group["lr"]))
            group["lr"] = lr
    return lost


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Hashable]]:
    """Each param group's plain values (betas, weight decay, ...) that a capture bakes in.

    The LR is a device tensor (read at replay) and the parameters are checked by pointer, so
    neither is included; a tensor value counts by identity, an unhashable one by its repr.
    """
    return [
        {key: _frozen(value) for key, value in group.items() if key not in ("params", "lr")}
        for group in optimizer.param_groups
    ]


# (optimizer, group, key) already described with its value: later changes say "again"
_DESCRIBED: weakref.WeakKeyDictionary[torch.optim.Optimizer, set[tuple[int, str]]] = (
    weakref.WeakKeyDictionary()
)


def describe_group_changes(
    optimizer: torch.optim.Optimizer,
    before: list[dict[str, Hashable]],
    after: list[dict[str, Hashable]],
) -> str:
    """What changed between two :func:`hyperparameters` readings, for the re-capture warning:
    the first time a value changes, its group, key, both values, that a change re-captures
    and a change before every update keeps the step eager (:class:`~.follow.Follower`), and
    the fix; later changes of the same value in a stable line (Python shows a warning once per
    text)."""
    described = _DESCRIBED.setdefault(optimizer, set())
    lines = []
    for g, key, old, new in _differing(before, after):
        if (g, key) in described:  # one stable text: Python shows it once
            lines.append(
                f"optimizer param group {g}'s {key!r} changed again, and each change "
                f"re-captures; {_fix_for(key)}"
            )
        else:
            described.add((g, key))
            lines.append(_baked_value_changed(optimizer, g, key, old, new))
    return "; ".join(lines) or "an optimizer param-group value changed"


def changed_values(
    before: list[dict[str, Hashable]], after: list[dict[str, Hashable]]
) -> list[str]:
    """The values that differ between two :func:`hyperparameters` readings, named."""
    return [f"param group {g}'s {key!r}" for g, key, _, _ in _differing(before, after)]


def _differing(
    before: list[dict[str, Hashable]], after: list[dict[str, Hashable]]
) -> Iterator[tuple[int, str, Hashable, Hashable]]:
    """(group, key, old value, new value) of each value that differs, by group and key."""
    for g, (old, new) in enumerate(zip(before, after)):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                yield g, key, old.get(key), new.get(key)


def _baked_value_changed(
    optimizer: torch.optim.Optimizer, g: int, key: str, old: Hashable, new: Hashable
) -> str:
    name = type(optimizer).__name__
    whose = "Adam's betas" if key == "betas" else "SGD's momentum"
    example = (
        f"as OneCycleLR(cycle_momentum=True) does {whose}"
        if key in ("momentum", "betas")
        else "as a hyperparameter scheduler does"
    )
    return (
        f"optimizer param group {g}'s {key!r} changed from {old!r} to {new!r}; torch's {name} "
        f"takes it only as a number, which a graph bakes in, so the step re-captures at a "
        f"change of it, and runs eagerly while it changes before every update (a scheduler "
        f"rewriting it, {example}: a capture per update costs more than the eager step); "
        f"{_fix_for(key)}"
    )


def _fix_for(key: str) -> str:
    if key in ("momentum", "betas"):
        return (
            "keep it fixed (OneCycleLR(..., cycle_momentum=False), CyclicLR(..., "
            "cycle_momentum=False)), or pass graph='never'"
        )
    return "change it less often, or pass graph='never'"


def _frozen(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value if isinstance(value, Hashable) else repr(value)
