"""Module-level workers for tests/test_finite.py: the finite check, and option checks on 2 ranks."""

from __future__ import annotations

import torch
from torch import nn

from ddpgraph import NonFiniteError, TrainStep
from ddpgraph.testing import CpuGraphs

from .step_workers import batches, make_model


class PoisonedLoss(nn.Module):
    """Computes its loss and adds ``poison`` to it: a NaN there reaches the loss but, having no
    gradient path, none of this rank's gradients (only the check's backward seed carries it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor, y: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y) + poison.sum()


def nan_at_step(
    bad_step: int,
    bad_rank: int,
    engine: str,
    where: str,
    calls: int = 1,
    clip: float | None = None,
) -> None:
    """Train with check_finite until it raises; a NaN enters rank ``bad_rank``'s step
    ``bad_step`` (1-based optimizer steps) through the input (``where="input"``) or the loss
    alone (``"loss"``). Returns only if no error came (the test then fails)."""
    rank = torch.distributed.get_rank()
    own = where == "loss"
    model = PoisonedLoss() if own else make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        None if own else nn.CrossEntropyLoss(),
        check_finite=True,
        accumulate_calls=calls,
        clip_grad_norm=clip,  # the check then probes the clipping's total norm
        engine=CpuGraphs() if engine == "fake" else None,
        graph="never" if engine == "never" else "auto",
    )
    for call, (x, y) in enumerate(batches(40 * calls, 8, seed=3), start=1):
        x, y = x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
        poison = torch.zeros(1)
        if rank == bad_rank and (call - 1) // calls + 1 == bad_step and call % calls == 0:
            if own:
                poison[0] = float("nan")
            else:
                x[0, 0] = float("inf")
        try:
            step(x, y, poison) if own else step(x, y)
        except NonFiniteError as exc:
            # on the CPU the check reads the flag at once: the call of the bad step raises
            assert call == bad_step * calls, (call, exc.step)
            if engine == "fake":
                assert step.report().replays > 0 and step.mode == "graphed", step.report()
            raise
    return None


def compile_dict_on_a_sharded_model() -> None:
    """TrainStep(compile={...}) on a model the script sharded with fully_shard: refused."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model)
    TrainStep(model, torch.optim.AdamW(model.parameters()), nn.CrossEntropyLoss(),
              compile={"mode": "default"})  # fmt: skip


def nan_in_one_shard(bad_step: int, bad_rank: int, engine: str) -> None:
    """FSDP2 (issue 42): at update ``bad_step`` a NaN appears in one element of rank
    ``bad_rank``'s shard of a gradient (the last element of its shard of the head's weight, put
    there by an optimizer pre-step hook, after the reduce-scatter), which no other rank holds.
    Every rank must name that step; the check reads the all-reduced norm. Returns only if no
    error came (the test then fails)."""
    from .fsdp2_workers import batches as shard_batches
    from .fsdp2_workers import make_model as shard_model
    from .fsdp2_workers import shard

    rank = torch.distributed.get_rank()
    model = shard(shard_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The hook is Python: inside a graph it runs at capture only, so it cannot count the updates
    # (a counter in it stopped at the capture on CUDA, and the NaN never came; the old CPU stand-in
    # re-ran it on replay). It multiplies the element by a tensor the loop sets instead: 1 (exact)
    # until the bad step, NaN on the bad rank for that step; eager and replayed alike.
    poison = torch.ones(())

    def multiply_by_poison(optimizer: object, args: object, kwargs: object) -> None:
        local = model.head.weight.grad._local_tensor  # type: ignore[union-attr]
        local.view(-1)[-1:].mul_(poison)

    opt.register_step_pre_hook(multiply_by_poison)
    step = TrainStep(
        model,
        opt,
        nn.CrossEntropyLoss(),
        check_finite=True,
        warmup=3,
        engine=CpuGraphs() if engine == "fake" else None,
        graph="never" if engine == "never" else "auto",
    )
    for call, (x, y) in enumerate(shard_batches(12), start=1):
        poison.fill_(float("nan") if rank == bad_rank and call == bad_step else 1.0)
        try:
            step(x, y)
        except NonFiniteError:
            assert call == bad_step, call
            if engine == "fake":
                assert step.report().replays > 0 and step.mode == "graphed", step.report()
            raise
    return None
