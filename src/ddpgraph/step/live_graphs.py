"""The autograd graph of an earlier loss, still alive when the step captures.

A leaf tensor's gradient accumulator (its ``AccumulateGrad`` node) is cached weakly on the tensor
and lives as long as some autograd graph reaches it. A script that ran eager steps before the
TrainStep and still holds their last ``loss`` keeps that graph, and with it the node, alive; the
capture's backward then reuses the node. The node keeps the stream it was made on (the script's
default stream), so the capture's backward syncs with a stream outside the capture and fails
(measured with FSDP2 on an H100, torch 2.11: torch warns that "an AccumulateGrad node created
prior to the current iteration [is] being kept alive" and its stream does not match).

:func:`held_accumulators` finds such nodes (a marker on the node survives only while someone
else holds it), :func:`holders` names the live tensors whose graph reaches them (a scan of the
garbage collector's objects, run only when a node was found), and :func:`fresh_accumulators`
detaches the leaves from the old nodes, so the capture makes its own on its own stream. The old
graph stays whole (backward through it still reaches the same leaves).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.autograd.graph import Node, get_gradient_edge

__all__ = ["EarlierGraph", "find_earlier_graph", "fresh_accumulators"]

_MARK = "ddpgraph.probe"
_WALK_LIMIT = 200_000  # nodes visited per holder at most: a scan must stay cheap


@dataclass
class EarlierGraph:
    """Leaves whose gradient accumulator an earlier graph holds, and the tensors holding it."""

    leaves: list[torch.Tensor]
    holders: list[str]  # e.g. "a tensor of shape () with grad_fn=NllLossBackward0"

    def describe(self, of: str) -> str:
        held = (
            f"{', '.join(self.holders[:3])}{' and more' if len(self.holders) > 3 else ''}"
            if self.holders
            else "something outside the step (no live tensor's graph reaches it)"
        )
        return (
            f"the autograd graph of an earlier loss is still alive and holds the gradient "
            f"accumulators (AccumulateGrad nodes) of {len(self.leaves)} of {of}: {held}. Its "
            "backward ran before this TrainStep (the script's own eager steps), on another "
            "stream; a capture reusing those nodes syncs with that stream and fails. Drop the "
            "reference before the TrainStep's first call (`del loss`, or keep `loss.item()` / "
            "`loss.detach()`)"
        )


def held_accumulators(leaves: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, Node]]:
    """The leaves whose ``AccumulateGrad`` node outlives this probe (someone else holds it),
    with the node. Two ``get_gradient_edge`` calls per leaf; makes no node that lives on."""
    found = []
    for leaf in leaves:
        if not leaf.requires_grad or leaf.grad_fn is not None:
            continue
        node = get_gradient_edge(leaf).node
        _metadata(node)[_MARK] = True
        del node  # a node only this probe held dies here, its marker with it
        again = get_gradient_edge(leaf).node
        if _metadata(again).pop(_MARK, False):
            found.append((leaf, again))
    return found


def _metadata(node: Node) -> dict[str, Any]:
    # a dict kept on the C++ node (torch's stubs type the property as a method)
    return cast("dict[str, Any]", node.metadata)


def holders(nodes: Sequence[Node]) -> list[str]:
    """The live tensors whose autograd graph reaches any of ``nodes``, described."""
    wanted = {id(node) for node in nodes}
    found = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): no lazy module's __class__
            continue
        try:
            grad_fn = obj.grad_fn
        except RuntimeError:  # a custom Function's view modified in place (FSDP2's outputs)
            continue
        if grad_fn is not None and _reaches(grad_fn, wanted):
            found.append(
                f"a tensor of shape {tuple(obj.shape)} with grad_fn={type(grad_fn).__name__}"
            )
    return found


def _reaches(start: Node, wanted: set[int]) -> bool:
    # node wrappers are cached on the node while a Python reference lives (the caller holds
    # (``nodes``); the walked ones are kept in ``kept`` so that no id is reused mid-walk
    seen: set[int] = set()
    kept: list[Node] = []
    todo = [start]
    while todo and len(seen) < _WALK_LIMIT:
        node = todo.pop()
        if id(node) in wanted:
            return True
        if id(node) in seen:
            continue
        seen.add(id(node))
        kept.append(node)
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return False


def find_earlier_graph(leaves: Sequence[torch.Tensor]) -> EarlierGraph | None:
    """An earlier graph holding any of ``leaves``' accumulators, or None (the usual case: the
    probe costs two lookups per leaf; the scan for holders runs only when one is found)."""
    held = held_accumulators(leaves)
    if not held:
        return None
    return EarlierGraph([leaf for leaf, _ in held], holders([node for _, node in held]))


def fresh_accumulators(leaves: Sequence[torch.Tensor]) -> None:
    """Detach each leaf from its cached ``AccumulateGrad`` node, so the next backward makes a
    new one (on the stream it runs on). torch drops the cache when ``.data`` changes dtype
    (``VariableHooks::set_data``); the leaf gets its own data back at once: same storage, shape
    and strides, so views of it (FSDP2's all-gather buffers) stay views. Hooks registered on the
    tensor (``register_hook``, ``register_post_accumulate_grad_hook``) live on the tensor and
    keep firing; hooks registered on the old node itself stay with the old node."""
    with torch.no_grad():
        for leaf in leaves:
            data = leaf.data
            other = torch.float64 if data.dtype != torch.float64 else torch.float32
            leaf.data = torch.empty(0, dtype=other, device=data.device)
            leaf.data = data
