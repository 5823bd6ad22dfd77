"""A scheduler's state in a graphed run is written as a plain run writes it (issue 52 follow-up):
the step puts each param group's float LR into a 0-dim tensor (the graph reads it at each
replay), and torch's schedulers copy ``group["lr"]`` into ``_last_lr`` (and, built after, into
``base_lrs``). Their state dicts still hold floats, so a checkpoint saved by the plain script
loads into the graphed port and back, with ``torch.save`` and with DCP (which keys a list of
tensors by position, ``_last_lr.0``, and a list of floats as one object: before the fix "Missing
key in checkpoint state_dict: sched._last_lr.0")."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.testing import CpuGraphs

SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.9**s
    ),  # own state_dict
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.02, total_steps=40, cycle_momentum=False
    ),
}


def _run(name: str, graphed: bool, steps: int = 16, scheduler_after: bool = False):
    """The script's loop (a plain eager loop) or its port (the TrainStep replaying on the CPU
    engine); the scheduler built before the step, or after it where ``scheduler_after``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = None if scheduler_after else SCHEDULERS[name](opt)
    x, y = torch.ones(3, 4), torch.zeros(3, 2)
    if graphed:
        step = TrainStep(model, opt, nn.MSELoss(), engine=CpuGraphs())  # captures at call 13
        sched = sched or SCHEDULERS[name](opt)
        for _ in range(steps):
            step(x, y)
            sched.step()
        assert step.report().replays > 0
    else:
        assert sched is not None
        for _ in range(steps):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    return opt, sched


def _floats(state: dict) -> bool:
    return all(type(v) is float for key in ("_last_lr", "base_lrs") for v in state[key])


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_graphed_runs_scheduler_state_holds_floats_as_the_scripts(name):
    _, plain = _run(name, graphed=False)
    _, graphed = _run(name, graphed=True)
    assert isinstance(graphed.optimizer.param_groups[0]["lr"], torch.Tensor)  # the graph's LR
    ours, theirs = graphed.state_dict(), plain.state_dict()
    assert _floats(ours) and _floats(theirs), (ours, theirs)
    assert sorted(ours) == sorted(theirs)
    # the float32 tensor's value, as the graph steps with it
    assert ours["_last_lr"] == [float(torch.tensor(v)) for v in theirs["_last_lr"]]


def test_a_scheduler_built_after_the_step_writes_float_base_lrs():
    _, graphed = _run("StepLR", graphed=True, scheduler_after=True)
    assert _floats(graphed.state_dict()), graphed.state_dict()


@pytest.mark.parametrize("name", ["StepLR", "LambdaLR"])
@pytest.mark.parametrize("direction", ["plain_to_graphed", "graphed_to_plain"])
def test_a_dcp_checkpoint_of_either_run_loads_into_the_other(tmp_path, name, direction):
    _, plain = _run(name, graphed=False)
    _, graphed = _run(name, graphed=True, steps=15)
    source, target = (plain, graphed) if direction == "plain_to_graphed" else (graphed, plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: single process" notice
        dcp.save({"lr_scheduler": source.state_dict()}, checkpoint_id=str(tmp_path))
        state = {"lr_scheduler": target.state_dict()}
        dcp.load(state, checkpoint_id=str(tmp_path))
    target.load_state_dict(state["lr_scheduler"])
    assert target.last_epoch == source.last_epoch == (16 if direction == "plain_to_graphed" else 15)
    assert target.state_dict()["_last_lr"] == source.state_dict()["_last_lr"]


@pytest.mark.parametrize("direction", ["plain_to_graphed", "graphed_to_plain"])
def test_a_torch_save_checkpoint_of_either_run_loads_into_the_other(tmp_path, direction):
    _, plain = _run("StepLR", graphed=False)
    _, graphed = _run("StepLR", graphed=True, steps=15)
    source, target = (plain, graphed) if direction == "plain_to_graphed" else (graphed, plain)
    torch.save(source.state_dict(), tmp_path / "sched.pt")
    state = torch.load(tmp_path / "sched.pt", weights_only=True)  # floats: no tensor in it
    assert _floats(state), state
    target.load_state_dict(state)
    target.step()  # the run goes on from the loaded count, and its next checkpoint
    assert target.last_epoch == source.last_epoch + 1
    assert _floats(target.state_dict()), target.state_dict()  # loads into the other run again
