"""The capture policy as a pure decision (issue 51, stage 3): ``decide(plan, state, call)`` from
tables, no model and no torch. What each row states is the rule the runner carried out before it
was a function of its own (warm-up length x accumulate_calls, a window's start, the wrapper's
readiness, the hold-off after a reset, new shapes under ``on_new_shape``, keys whose capture
failed, the phases that never capture)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpgraph.step.policy import Action, Call, Phase, Plan, PolicyState, decide

SIG, OTHER = ("args", ("0", "1"), "4x8"), ("args", ("0", "1"), "2x8")
PLAN = Plan(warmup_calls=12, on_new_shape="eager")
WAITS = Plan(warmup_calls=12, on_new_shape="eager", first_capture_wait=3)


def _call(**facts) -> Call:
    base = dict(
        signature=SIG,
        has_graph=False,
        uncapturable=False,
        eager_steps=12,
        window_open=False,
        ready=lambda: True,
    )
    base.update(facts)
    return Call(**base)


WARMUP = PolicyState()
GRAPHED = PolicyState(phase=Phase.GRAPHED, signatures=frozenset({SIG}))

ROWS = [
    # (what, plan, state, call facts, action)
    ("warm-up not done", PLAN, WARMUP, dict(eager_steps=11), Action.EAGER),
    ("warm-up done", PLAN, WARMUP, {}, Action.FIRST_CAPTURE),
    ("warm-up done inside an open window", PLAN, WARMUP, dict(window_open=True), Action.EAGER),
    ("warm-up done, the wrapper not ready", PLAN, WARMUP, dict(ready=lambda: False), Action.EAGER),
    (
        "warm-up done on a batch unlike its predecessor (an epoch's tail): wait",
        WAITS,
        WARMUP,
        dict(previous=OTHER),
        Action.EAGER,
    ),
    (
        "warm-up done on a batch like its predecessor",
        WAITS,
        WARMUP,
        dict(previous=SIG),
        Action.FIRST_CAPTURE,
    ),
    ("warm-up done, no call before", WAITS, WARMUP, dict(previous=None), Action.FIRST_CAPTURE),
    (
        "a batch like its predecessor here, not on a peer (the vote)",
        WAITS,
        WARMUP,
        dict(previous=SIG, agree=lambda mine: False),
        Action.EAGER,
    ),
    (
        "the wait over: capture whatever the batch",
        WAITS,
        WARMUP,
        dict(previous=OTHER, eager_steps=15),
        Action.FIRST_CAPTURE,
    ),
    (
        "no wait planned (on_new_shape='capture')",
        PLAN,
        WARMUP,
        dict(previous=OTHER),
        Action.FIRST_CAPTURE,
    ),
    ("graphed, the key's graph exists", PLAN, GRAPHED, dict(has_graph=True), Action.REPLAY),
    ("graphed, a new mode of a captured shape", PLAN, GRAPHED, {}, Action.CAPTURE),
    ("graphed, a new shape under 'eager'", PLAN, GRAPHED, dict(signature=OTHER), Action.EAGER),
    (
        "graphed, a new shape under 'capture'",
        Plan(12, "capture"),
        GRAPHED,
        dict(signature=OTHER),
        Action.CAPTURE,
    ),
    ("graphed, a key whose capture failed", PLAN, GRAPHED, dict(uncapturable=True), Action.EAGER),
    ("graphed, the wrapper not ready", PLAN, GRAPHED, dict(ready=lambda: False), Action.EAGER),
    (
        "graphed, two eager steps due after a reset",
        PLAN,
        PolicyState(Phase.GRAPHED, hold_off=2, signatures=frozenset({SIG})),
        {},
        Action.EAGER,
    ),
    ("eager for good", PLAN, PolicyState(Phase.EAGER), dict(has_graph=True), Action.EAGER),
    ("closed", PLAN, PolicyState(Phase.CLOSED), dict(has_graph=True), Action.EAGER),
]


@pytest.mark.parametrize(
    ("plan", "state", "facts", "action"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_decide_from_a_table(plan, state, facts, action):
    assert decide(plan, state, _call(**facts)) is action


def test_a_replay_never_asks_the_wrapper():
    def asked() -> bool:
        raise AssertionError("ready() asked on a replay")

    assert decide(PLAN, GRAPHED, _call(has_graph=True, ready=asked)) is Action.REPLAY
    # nor during warm-up before its count is reached (FSDP2's readiness raises when not idle)
    assert decide(PLAN, WARMUP, _call(eager_steps=3, ready=asked)) is Action.EAGER


def test_the_vote_is_asked_on_the_same_calls_everywhere():
    """The vote is a collective: asked at every call between the warm-up's end and the wait's,
    whatever the rank's own batch (its answer is the rank's vote), never before or after."""
    votes = []

    def agree(mine: bool) -> bool:
        votes.append(mine)
        return False

    for steps in range(10, 17):
        for previous in (SIG, OTHER):
            decide(WAITS, WARMUP, _call(eager_steps=steps, previous=previous, agree=agree))
    assert votes == [True, False] * 3  # at 12, 13 and 14 eager steps


def test_decide_changes_no_state():
    state = PolicyState(Phase.GRAPHED, hold_off=1, signatures=frozenset({SIG}))
    decide(PLAN, state, _call())
    assert state == PolicyState(Phase.GRAPHED, hold_off=1, signatures=frozenset({SIG}))
    with pytest.raises(AttributeError):
        state.phase = Phase.EAGER  # type: ignore[misc]


def test_the_policy_module_imports_no_torch():
    # the package's own __init__ imports torch: load the module file alone
    code = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('policy', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); sys.modules['policy'] = m; "
        "spec.loader.exec_module(m); "
        "print('torch' in sys.modules)"
    )
    import ddpgraph.step.policy as policy

    out = subprocess.run(
        [sys.executable, "-c", code, policy.__file__], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
