"""When a training call is captured, replayed or run eagerly: a pure decision over explicit state.

:func:`decide` reads a :class:`Plan` fixed at construction, the :class:`PolicyState` of the step
(frozen: a change is a new state, made by the runner) and the facts of one :class:`Call`; it
returns an :class:`Action` and changes nothing. No torch, no model: ``tests/test_policy.py``
checks it from tables. :class:`~ddpgraph.step.runner.Runner` carries the action out.

Phases (:class:`Phase`): ``WARMUP`` runs eager steps (the warm-up rule of ``ddpgraph.facts``,
at the wrapper's sample rate); then, on the first call whose batch is shaped like the call's
before it on every rank (:func:`batch_settled`), every rank captures and agrees that all
succeeded, and
``GRAPHED`` replays, capturing one more graph per new input signature
(``on_new_shape="capture"``) or module mode; ``EAGER`` for the reason in the report; ``CLOSED``
after ``close()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["Action", "Call", "Phase", "Plan", "PolicyState", "batch_settled", "decide"]


class Phase(enum.Enum):
    """Where a TrainStep is: heading for a graph, graphed, eager for good, or closed."""

    WARMUP = "warmup"
    GRAPHED = "graphed"
    EAGER = "eager"
    CLOSED = "closed"


class Action(enum.Enum):
    """What a training call does."""

    REPLAY = "replay"  # the key's graph exists
    FIRST_CAPTURE = "first capture"  # the warm-up is done: capture on every rank, then agree
    CAPTURE = "capture"  # graphed, a new key: capture it (no agreement), then replay
    EAGER = "eager"


@dataclass(frozen=True)
class Plan:
    """What the options fix at construction."""

    warmup_calls: int  # warm-up optimizer steps x accumulate_calls: eager calls before capture
    on_new_shape: str  # "eager", "capture" or "error" (refused before the decision)
    # eager steps past the warm-up the first capture may wait for a batch shaped like the one
    # before it (0: none; on_new_shape="eager" waits, where a graph of the wrong shape is final)
    first_capture_wait: int = 0


@dataclass(frozen=True)
class PolicyState:
    """The step's decision state; frozen (the runner makes a new one on each change)."""

    phase: Phase = Phase.WARMUP
    hold_off: int = 0  # eager steps the wrapper needs before the next capture (after a reset)
    signatures: frozenset[Hashable] = field(default_factory=frozenset)  # every one captured


class Call(NamedTuple):
    """The facts of one training call. ``ready()`` is the wrapper's answer to "may the next
    forwards be captured?" (the warm-up rule at its sample rate; FSDP2 raises naming what is
    pending when it is not idle): asked only where a capture would follow, as the rule says."""

    signature: Hashable
    has_graph: bool  # the engine holds this call's key
    uncapturable: bool  # a capture of this key failed before
    eager_steps: int  # eager training steps so far
    window_open: bool  # accumulate_calls: micro-batches taken since the last update
    ready: Callable[[], bool]
    previous: Hashable = None  # the signature of the call before this one (None: none yet)
    # every rank's vote, agreed (a collective: asked on every rank at the same call); alone: its own
    agree: Callable[[bool], bool] = bool


def decide(plan: Plan, state: PolicyState, call: Call) -> Action:
    """The action of one training call (pure: reads its arguments, changes nothing)."""
    if state.phase is Phase.GRAPHED:
        if call.has_graph:
            return Action.REPLAY
        if call.uncapturable or not call.ready() or state.hold_off > 0:
            return Action.EAGER
        # a new mode of a captured shape is always captured; a new shape as the option says
        if call.signature in state.signatures or plan.on_new_shape == "capture":
            return Action.CAPTURE
        return Action.EAGER
    if (
        state.phase is Phase.WARMUP
        and call.eager_steps >= plan.warmup_calls
        and not call.window_open
        and call.ready()
        and batch_settled(plan, call)
    ):
        return Action.FIRST_CAPTURE
    return Action.EAGER


def batch_settled(plan: Plan, call: Call) -> bool:
    """Whether the first capture may take this call's batch: on every rank it has the shape of
    the call's before it, or the wait is over.

    The first graph fixes the shape every later batch replays at (``on_new_shape="eager"`` runs
    the others eagerly). A warm-up that ends on an epoch's short last batch would otherwise
    capture that one and run every full batch eagerly; a batch like its predecessor is not an
    epoch's tail unless epochs are one batch long. Agreed because the capture is collective
    (with dynamic padding, shapes differ by rank); bounded because some runs never repeat.
    """
    if call.eager_steps - plan.warmup_calls >= plan.first_capture_wait:
        return True
    return call.agree(call.previous in (None, call.signature))
