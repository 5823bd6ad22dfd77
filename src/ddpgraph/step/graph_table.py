"""The bookkeeping both graph engines share: one TrainStep's graphs by key, the keys whose
capture failed, the optimizer made graph-safe, and dropping graphs by role.

No CUDA here: :class:`~.graphs.CudaGraphSet` adds the pool, the capture stream and the replay
hooks, :class:`~.cpu_graphs.CpuGraphSet` the recorded programs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batch import GraphKey, Role
from .engine import CapturedGraph
from .optim import GraphSafeOptimizer, make_graph_safe

__all__ = ["GraphTable"]


class GraphTable:
    """The captured graphs of one TrainStep by key (``captured``, insertion order: oldest
    first), the keys whose capture failed (``uncapturable``) and the graph-safe ``plan`` of the
    optimizer on ``device``. An engine's set keeps each graph in ``captured`` and hears of each
    drop through :meth:`_forget`."""

    def __init__(self, plan: GraphSafeOptimizer, device: torch.device) -> None:
        self.captured: dict[GraphKey, CapturedGraph] = {}
        self.uncapturable: set[GraphKey] = set()
        self.plan = plan
        self.device = device

    def keys_of(self, role: Role) -> list[GraphKey]:
        """The keys of ``role`` ("train", "micro" or "eval"), oldest first."""
        return [key for key in self.captured if key.role == role]

    def make_optimizer_safe_again(self) -> None:
        """After a reload: a loaded param group may say capturable=False or foreach SGD."""
        make_graph_safe(self.plan.optimizer, self.device)

    def drop(self, role: Role) -> int:
        """Drop the graphs of ``role`` (e.g. every training graph before a re-capture)."""
        keys = self.keys_of(role)
        for key in keys:
            del self.captured[key]
        self._forget(keys)
        self.uncapturable = {k for k in self.uncapturable if k.role != role}
        return len(keys)

    def _forget(self, keys: Sequence[GraphKey]) -> None:
        """What the engine keeps beside ``captured`` for ``keys``, just dropped (none here)."""

    def drop_training(self) -> int:
        """Drop every training graph (every role but "eval"): they read what changed."""
        return sum(self.drop(role) for role in ("train", "micro", "sync", "update"))

    def drop_all(self) -> int:
        """Drop every graph, evaluation's too (the model's memory or forward changed)."""
        return self.drop_training() + self.drop("eval")
