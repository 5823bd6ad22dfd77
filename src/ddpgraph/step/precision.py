"""Mixed precision for TrainStep as one object: the ``amp`` spellings people use, autocast, and
fp16 loss scaling that never leaves the device, so it can live inside the captured step.

:func:`precision_for` gives the step body a :class:`Precision` (fp32 or bf16: autocast alone) or
a :class:`Fp16` (autocast plus :class:`LossScaler`); the body calls the same four methods either
way (``autocast``, ``backward``, ``update``, ``state_dict``), so no ``if fp16`` is spread over it.

torch.amp.GradScaler checks for inf/NaN on the device but, for an optimizer without
``_step_supports_amp_scaling``, skips the update with ``found_inf.item()`` (a host sync). The
fused Adam/AdamW/SGD kernels take ``grad_scale`` and ``found_inf`` and skip on the device, and
``torch._amp_update_scale_`` backs the scale off or grows it there. :class:`LossScaler` does what
GradScaler does, op for op (so a run is bitwise equal to an eager GradScaler loop with the same
fused optimizer), with its state in device tensors that a graph reads and writes. Where the
script's optimizer was built unfused, GradScaler unscales the gradients before its step; the
step does too (its fused kernel then gets ``found_inf`` alone), since on CUDA the kernel's own
unscaling rounds the update differently (:func:`~.optim.unscales_in_kernel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._typed_torch import backward
from ..errors import ConfigError
from .optim import skips_on_device, unscales_in_kernel

__all__ = [
    "AMP_SPELLINGS",
    "Fp16",
    "LossScaler",
    "Precision",
    "amp_dtype",
    "check_scaler_options",
    "precision_for",
]

AMP_SPELLINGS = '"bf16", "bfloat16", torch.bfloat16, "fp16", "float16", torch.float16 or None'
_BF16 = ("bf16", "bfloat16", torch.bfloat16)
_FP16 = ("fp16", "float16", torch.float16)
_SCALER_DEFAULTS: dict[str, float] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}


def amp_dtype(amp: object) -> torch.dtype | None:
    """The autocast dtype ``amp`` names; a ConfigError listing the spellings otherwise."""
    if amp is None:
        return None
    if any(amp is s or (isinstance(amp, str) and amp == s) for s in _BF16):
        return torch.bfloat16
    if any(amp is s or (isinstance(amp, str) and amp == s) for s in _FP16):
        return torch.float16
    raise ConfigError(f"amp={amp!r} is not a precision TrainStep knows; use {AMP_SPELLINGS}.")


def check_scaler_options(options: Mapping[str, Any] | None) -> dict[str, float]:
    """GradScaler's options (``init_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``) with its defaults filled in."""
    merged = dict(_SCALER_DEFAULTS)
    for key, value in (options or {}).items():
        if key not in _SCALER_DEFAULTS:
            raise ConfigError(
                f"grad_scaler={dict(options or {})!r}: unknown option {key!r}; use "
                f"{', '.join(_SCALER_DEFAULTS)} (torch.amp.GradScaler's)."
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"grad_scaler option {key}={value!r} must be a positive number.")
        merged[key] = value
    if merged["growth_factor"] <= 1.0 or not 0 < merged["backoff_factor"] < 1.0:
        raise ConfigError(
            f"grad_scaler needs growth_factor > 1 and 0 < backoff_factor < 1, got "
            f"{merged['growth_factor']} and {merged['backoff_factor']}."
        )
    if int(merged["growth_interval"]) != merged["growth_interval"]:
        raise ConfigError(
            f"grad_scaler growth_interval={merged['growth_interval']!r} must be an int."
        )
    return merged


class LossScaler:
    """Dynamic loss scaling with all of its state on ``device`` (graph-safe).

    Per step: ``scale(loss)`` before backward; ``check(grads, unscale)`` zeroes ``found_inf``
    and checks the gradients (unscaling them first when clipping follows); ``step(optimizer,
    unscaled)`` lets the fused optimizer skip on the device; ``update()`` backs the scale off
    after an overflow, grows it after ``growth_interval`` clean steps, and counts skipped steps.
    """

    def __init__(self, device: torch.device, options: Mapping[str, float]) -> None:
        self.options = dict(options)
        self.scale_tensor = torch.full((), float(options["init_scale"]), device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((), device=device)
        self.skipped = torch.zeros((), device=device)  # read by report(): a sync only then
        self._one = torch.ones((), device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_tensor

    def check(self, grads: list[torch.Tensor], *, unscale: bool) -> None:
        self.found_inf.zero_()
        # GradScaler.unscale_: the reciprocal in double, then float
        inv = self.scale_tensor.double().reciprocal().float() if unscale else self._one
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv)

    def step(self, optimizer: torch.optim.Optimizer, *, unscaled: bool) -> None:
        if not skips_on_device(optimizer):
            # torch's own CPU path for optimizers without on-device skipping (a sync, as in
            # GradScaler.step); TrainStep refuses this on CUDA, where it would break capture
            if not self.found_inf.item():
                optimizer.step()
            return
        opt: Any = optimizer
        opt.grad_scale = None if unscaled else self.scale_tensor
        opt.found_inf = self.found_inf
        try:
            optimizer.step()
        finally:
            del opt.grad_scale
            del opt.found_inf

    def update(self) -> None:
        torch._amp_update_scale_(
            self.scale_tensor,
            self.growth_tracker,
            self.found_inf,
            float(self.options["growth_factor"]),
            float(self.options["backoff_factor"]),
            int(self.options["growth_interval"]),
        )
        self.skipped.add_(self.found_inf)

    def state_dict(self) -> dict[str, float | int]:
        """GradScaler's keys (a host read: call between steps)."""
        return {
            "scale": float(self.scale_tensor),
            "_growth_tracker": int(self.growth_tracker),
            "skipped": int(self.skipped),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """In place: graphs keep reading the same tensors."""
        self.scale_tensor.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state.get("_growth_tracker", 0)))
        self.skipped.fill_(int(state.get("skipped", 0)))


class Precision:
    """fp32, or bf16 autocast (no loss scaling): backward and update as a plain loop writes them.

    ``update(optimizer, clip)`` runs ``clip()`` (the gradient clipping, or None) and the step.
    """

    loss_scale: torch.Tensor | None = None

    def __init__(self, device: torch.device, dtype: torch.dtype | None) -> None:
        self.device = device
        self.dtype = dtype

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        # no weight-cast cache: a cache filled during capture would point at freed memory
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        backward(loss)

    def update(
        self, optimizer: torch.optim.Optimizer, clip: Callable[[], torch.Tensor] | None
    ) -> torch.Tensor | None:
        """``clip()`` (clipping, or only measuring the grad norm; None: neither), then the
        optimizer's step; what ``clip()`` returned (the total norm of the unscaled gradients)."""
        norm = clip() if clip is not None else None
        optimizer.step()
        return norm

    def skipped_steps(self) -> int | None:
        return None

    def update_skipped(self) -> bool:
        """Whether the latest optimizer update was skipped (fp16 overflow only)."""
        return False

    def state_dict(self) -> dict[str, float | int] | None:
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class Fp16(Precision):
    """fp16 autocast with dynamic loss scaling on the device, op for op as GradScaler."""

    def __init__(self, device: torch.device, options: Mapping[str, float]) -> None:
        super().__init__(device, torch.float16)
        self.scaler = LossScaler(device, options)
        self.loss_scale = self.scaler.scale_tensor

    def backward(self, loss: torch.Tensor) -> None:
        backward(self.scaler.scale(loss))

    def update(
        self, optimizer: torch.optim.Optimizer, clip: Callable[[], torch.Tensor] | None
    ) -> torch.Tensor | None:
        """Clip (on unscaled gradients) and step; skip an overflowed step on the device and
        update the scale, as GradScaler does."""
        # GradScaler unscales before clipping, and for an optimizer it does not hand the scale
        # (one the script built unfused): the fused kernel then only skips on found_inf
        unscale = clip is not None or not unscales_in_kernel(optimizer)
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        self.scaler.check(grads, unscale=unscale)
        norm = clip() if clip is not None else None
        self.scaler.step(optimizer, unscaled=unscale)
        self.scaler.update()
        return norm

    def skipped_steps(self) -> int | None:
        return int(self.scaler.skipped.item())  # a host read: report() only

    def update_skipped(self) -> bool:
        # found_inf keeps the latest update's verdict until the next update's check
        return bool(self.scaler.found_inf.item())  # a host read

    def state_dict(self) -> dict[str, float | int] | None:
        return self.scaler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scaler.load_state_dict(state)


def precision_for(
    amp: str | None, device: torch.device, scaler_options: Mapping[str, float] | None
) -> Precision:
    """The precision object for a validated ``amp`` ("bf16", "fp16" or None)."""
    if amp == "fp16":
        return Fp16(device, scaler_options or check_scaler_options(None))
    return Precision(device, amp_dtype(amp))
