"""Following what a script or framework changed in the model between two TrainStep calls.

:class:`~.guard.Guard` finds it (one check at the start of every call, eager or graphed);
:class:`Follower` decides what each change means for the wrapper, the optimizer and the graphs,
before anything of the call runs, called only when the guard found something.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from .._log import get_logger
from ..errors import ConfigError
from .engine import GraphSet
from .guard import Guard, Seen
from .optim import hyperparameters
from .options import warn_at_user_line
from .parallel import Recovery
from .report import StepReport
from .streams import on_stream

__all__ = ["Follower"]


class Follower:
    """The model's changes between calls, followed:

    * storage moved (``model.to()``, ``p.data = ...``): the wrapper follows at the next training
      call (rebuilding DDP is a collective; an evaluation may be rank-local) and every graph is
      dropped, so the step captures again after the wrapper's warm-up; a warning says so;
    * a replaced ``forward`` (accelerate's autocast wrapper) or compiled call: every graph is
      dropped and captured again, with a warning;
    * gradients the script set to None (``optimizer.zero_grad()``) while graphed: the captured
      tensors are put back, zeroed (what the eager step would start from);
    * a new ``nn.Parameter`` object (the optimizer holds the old one), or the model moved to
      another device: :class:`~ddpgraph.ConfigError` naming it;
    * the optimizer (once graphed): a reload is already copied into the captured tensors (the
      optimizer made graph-safe again: a loaded group may say ``capturable=False``); a changed
      param-group value or ``requires_grad`` drops the training graphs (captured again, with a
      warning); a changed ``requires_grad`` is followed by the next training call
      (:attr:`trainable_changed`); a baked-in value that changes before every update holds the
      step eager until it holds still (:attr:`values_held`, :meth:`still_changing`; not under
      ``graph="always"``).
    """

    def __init__(
        self,
        parallel: Callable[[], Recovery],
        graphs: GraphSet | None,
        report: StepReport,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        *,
        events_only: bool = False,
        calls_per_update: int = 1,
        hold_changing_values: bool = True,
    ) -> None:
        self._parallel = parallel
        self._graphs = graphs
        self._report = report
        self._device = device
        self._stream = stream
        self.guard = Guard(self._roots, events_only=events_only)
        self.storage_moved = False  # seen moved (maybe in an evaluation): follow at training
        # a requires_grad changed: the wrapper follows at the next training call (rebuilding
        # it is a collective; an evaluation may be rank-local)
        self.trainable_changed = False
        # a baked-in value rewritten before every update (OneCycleLR's momentum or betas): the
        # step runs eagerly while it keeps changing (see :meth:`still_changing`)
        self.values_held: list[dict[str, Hashable]] | None = None
        self._held_at = 0  # the call that found it changing at every update
        self._values_recaptured_at: int | None = None  # the call whose graphs such a change dropped
        self._calls_per_update = calls_per_update
        self._hold_changing_values = hold_changing_values  # False: graph="always" re-captures

    def _roots(self) -> tuple[nn.Module, ...]:
        """The modules a call runs: the script's module, and the wrapper around it."""
        parallel = self._parallel()
        inner, outer = parallel.inner, parallel.module
        return (inner,) if outer is inner else (inner, outer)

    def follow_storage(self) -> None:
        """At a training call after storage moved (:attr:`storage_moved`): the wrapper follows
        the model's new memory (rebuilding DDP is a collective)."""
        self.storage_moved = False
        with on_stream(self._stream):
            done = self._parallel().follow_storage()
        if done is not None:
            get_logger().info("TrainStep: %s", done)

    def drop_training(self) -> int:
        """Drop every training graph: the guard takes the optimizer's baseline at the next
        capture."""
        self.guard.forget_optimizer()
        return self._graphs.drop_training() if self._graphs is not None else 0

    def follow(self, found: Seen, graphed: bool) -> None:
        """What :meth:`Guard.check` found, followed (or refused), before the call runs."""
        if found.model_changed:
            self._follow_model(found, graphed)
        if found.optimizer:
            self._follow_optimizer(found)

    def _follow_optimizer(self, found: Seen) -> None:
        if self._graphs is not None:
            self._graphs.make_optimizer_safe_again()
        if found.trainable_changed:
            self.trainable_changed = True
        news = found.optimizer
        if not found.recapture:
            get_logger().info("TrainStep: %s", "; ".join(news))
            return
        if self._graphs is not None:
            for param in self._parallel().module.parameters():
                if not param.requires_grad:
                    param.grad = None  # eager zero_grad(set_to_none=True) would leave it None
        dropped = self.drop_training()
        if found.values_changed and self._hold_changing_values and self._changed_every_update():
            self._hold_while_changing(found.values_changed)
            return
        if found.values_changed:
            self._values_recaptured_at = self._report.steps
        warn_at_user_line(
            f"TrainStep re-captures its {dropped} training graph(s): {'; '.join(news)}."
        )
        self._report.recaptures.extend(news)

    def _changed_every_update(self) -> bool:
        """The graphs this change drops were captured for the last one, an update ago."""
        last = self._values_recaptured_at
        return last is not None and self._report.steps - last <= self._calls_per_update

    def _hold_while_changing(self, names: list[str]) -> None:
        """Run eagerly while the baked-in values change at every update: a capture costs more
        than the eager step it would replace once (on an H100, complete_cv_example.py under
        OneCycleLR: 13-17 ms a capture against a 23 ms step; captured each step the port ran at
        0.59x the script), so a capture per update is never worth it."""
        assert self._graphs is not None  # only graphs re-capture
        self.values_held = hyperparameters(self._graphs.plan.optimizer)
        self._held_at = self._report.steps
        warn_at_user_line(
            f"TrainStep runs eagerly while the optimizer's {', '.join(names)}, which its "
            "graphs bake in, changes before every update (a scheduler rewriting it, as "
            "OneCycleLR(cycle_momentum=True) does SGD's momentum or Adam's betas): a capture "
            "per update costs more than the eager step; it captures again once the values "
            "hold still for an update. To keep the step graphed, keep them fixed "
            "(OneCycleLR(..., cycle_momentum=False), CyclicLR(..., cycle_momentum=False))."
        )
        self._report.recaptures.append(
            "held eager: an optimizer param-group value changes before every update"
        )

    def still_changing(self) -> bool:
        """After an eager call while :attr:`values_held`: whether the baked-in values changed
        since the last call (the step then stays eager for the next); False ends the hold, and
        the next call captures again."""
        if self.values_held is None or self._graphs is None:
            return False
        if self._report.steps - self._held_at < self._calls_per_update:
            return True  # the update that found them changing: compared from the next on
        now = hyperparameters(self._graphs.plan.optimizer)
        if now != self.values_held:
            self.values_held = now
            self._held_at = self._report.steps
            return True
        self.values_held = None
        get_logger().info(
            "TrainStep: the optimizer's param-group values held still for an update: it "
            "captures again"
        )
        return False

    def _follow_model(self, found: Seen, graphed: bool) -> None:
        if found.moved or found.replaced:
            self._check_devices()  # a move to another device replaces Parameters (meta, XLA)
        if found.replaced:
            raise ConfigError(
                f"the model's {', '.join(found.replaced[:3])} became new nn.Parameter objects "
                "since the last TrainStep call, but the optimizer (and the wrapper) hold the old "
                "ones, which would keep training unseen; change values in place "
                "(param.data.copy_(new)), or build the optimizer and TrainStep again."
            )
        if found.moved:
            self.storage_moved = True
        if found.moved or found.forwards:
            self._drop_graphs(found)
        elif found.dropped_grads and graphed:
            with on_stream(self._stream), torch.no_grad():
                for param, grad in found.dropped_grads:
                    param.grad = grad.zero_()

    def _drop_graphs(self, found: Seen) -> None:
        graphs = self._graphs
        self.guard.forget_optimizer()
        dropped = graphs.drop_all() if graphs is not None else 0
        then = f"; it drops its {dropped} graph(s) and captures again" if dropped else ""
        warn_at_user_line(
            f"TrainStep follows a model changed outside it ({found.describe()}): its wrapper "
            f"and graphs read the model as it is now{then}."
        )
        if dropped:
            self._report.recaptures.append(found.describe())

    def _check_devices(self) -> None:
        devices = self.guard.devices()
        moved_to = {d for d in devices if d.type != self._device.type}
        if self._device.type == "cuda":
            moved_to |= {d for d in devices if d.index != self._device.index}
        if moved_to:
            raise ConfigError(
                f"the model was moved to {sorted(map(str, moved_to))} since the last TrainStep "
                f"call, but the step trains on {self._device} (its batches, graphs and wrapper "
                "are there); keep the model where the TrainStep was built, or build a new one."
            )
