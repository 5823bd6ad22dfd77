"""Following what a script or framework changed in the model between two TrainStep calls.

:class:`~.watch.ModelWatch` finds it; :class:`Follower` decides what each change means for the
wrapper and the graphs, before anything of the call runs (on every call, eager or graphed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .._log import get_logger
from ..errors import ConfigError
from .graphs import Graphs, on_stream
from .options import warn_at_user_line
from .parallel import DataParallel
from .report import StepReport
from .watch import ModelChanges, ModelWatch

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
      another device: :class:`~ddpgraph.ConfigError` naming it.
    """

    def __init__(
        self,
        parallel: Callable[[], DataParallel],
        graphs: Graphs | None,
        report: StepReport,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        *,
        events_only: bool = False,
    ) -> None:
        self._parallel = parallel
        self._graphs = graphs
        self._report = report
        self._device = device
        self._stream = stream
        self.watch = ModelWatch(self._roots, events_only=events_only)
        self.settle_due = False  # the call ran eagerly: the watch takes a new baseline after it
        self._storage_moved = False  # seen moved (maybe in an evaluation): follow at training

    def _roots(self) -> tuple[nn.Module, ...]:
        """The modules a call runs: the script's module, and the wrapper around it."""
        parallel = self._parallel()
        inner, outer = parallel.inner, parallel.module
        return (inner,) if outer is inner else (inner, outer)

    def before_call(self, *, training: bool, graphed: bool) -> None:
        """At the start of a call (``training``: one that may run the wrapper's collectives),
        after the wrapper's own :meth:`~.parallel.DataParallel.before_call`."""
        if not self.watch.unchanged():  # the common case: one C-level read, nothing to follow
            found = self.watch.check()
            if found:
                self._follow(found, graphed)
        if training and self._storage_moved:
            parallel = self._parallel()
            self._storage_moved = False
            with on_stream(self._stream):
                done = parallel.follow_storage()
            if done is not None:
                get_logger().info("TrainStep: %s", done)
            self.settle_due = True

    def settle(self, *, graphed: bool) -> None:
        """After a call that ran anything eagerly: the model as the step left it is the watch's
        new baseline (a replay changes no address, so replayed calls skip this)."""
        if self.settle_due:
            self.settle_due = False
            self.watch.settle(keep_grads=graphed)

    def _follow(self, found: ModelChanges, graphed: bool) -> None:
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
            self._storage_moved = True
        if found.moved or found.forwards:
            self._drop_graphs(found)
        elif found.dropped_grads and graphed:
            with on_stream(self._stream), torch.no_grad():
                for param, grad in found.dropped_grads:
                    param.grad = grad.zero_()
        self.settle_due = True

    def _drop_graphs(self, found: ModelChanges) -> None:
        graphs = self._graphs
        dropped = graphs.drop_all() if graphs is not None else 0
        if graphs is not None:
            graphs.parameters_changed()
        then = f"; it drops its {dropped} graph(s) and captures again" if dropped else ""
        warn_at_user_line(
            f"TrainStep follows a model changed outside it ({found.describe()}): its wrapper "
            f"and graphs read the model as it is now{then}."
        )
        if dropped:
            self._report.recaptures.append(found.describe())

    def _check_devices(self) -> None:
        devices = self.watch.devices()
        moved_to = {d for d in devices if d.type != self._device.type}
        if self._device.type == "cuda":
            moved_to |= {d for d in devices if d.index != self._device.index}
        if moved_to:
            raise ConfigError(
                f"the model was moved to {sorted(map(str, moved_to))} since the last TrainStep "
                f"call, but the step trains on {self._device} (its batches, graphs and wrapper "
                "are there); keep the model where the TrainStep was built, or build a new one."
            )
