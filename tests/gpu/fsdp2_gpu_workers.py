"""FSDP2 on CUDA: models, the eager FSDP2 reference loop, and workers run in their own process
(a fake process group of 4 or 8 ranks; real NCCL ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ddpgraph import DeviceData, TrainStep

LR = 1e-3


class Blocks(nn.Module):
    """A small pre-norm transformer: embedding, a ModuleList of encoder layers, a head."""

    def __init__(self, width: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, 4, 2 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


def sharded(seed: int = 0, mp: bool = False, **kwargs: Any) -> Blocks:
    torch.manual_seed(seed)
    model = Blocks(**kwargs).cuda()
    policy = {}
    if mp:
        policy["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    return model


def adamw(model: nn.Module, kind: str, *, graph_safe: bool) -> torch.optim.Optimizer:
    """AdamW foreach or fused; ``graph_safe``: capturable with the LR on the device, as TrainStep
    makes it (the eager reference uses the same optimizer, so numbers can be equal bit for bit)."""
    options: dict[str, Any] = {"foreach": True} if kind == "foreach" else {"fused": True}
    if graph_safe:
        options |= {"capturable": True, "lr": torch.tensor(LR, device="cuda")}
    else:
        options["lr"] = LR
    return torch.optim.AdamW(model.parameters(), **options)


def batches(n: int, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed + dist.get_rank())
    return [
        (
            torch.randn(size, 12, 16, device="cuda", generator=gen),
            torch.randint(10, (size,), device="cuda", generator=gen),
        )
        for _ in range(n)
    ]


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[operator]


def eager_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list,
    *,
    calls: int = 1,
    clip: float | None = None,
    amp: bool = False,
) -> list[float]:
    """The plain FSDP2 loop (default stream): ``calls`` micro-batches per optimizer step."""
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    opt.zero_grad(set_to_none=False)
    for i, (x, y) in enumerate(data):
        last = i % calls == calls - 1
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(model(x), y)
        (loss / calls).backward()
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
        losses.append(loss.detach().float().clone())
        if last:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.grad is not None], clip, foreach=True
                )
            opt.step()
            opt.zero_grad(set_to_none=False)
    return [float(v) for v in losses]


def graphed_vs_eager(
    steps: int,
    kind: str = "foreach",
    calls: int = 1,
    clip: float | None = 1.0,
    mp: bool = False,
    amp: bool = False,
) -> dict[str, Any]:
    """TrainStep (graphed) and the eager FSDP2 loop from the same start: losses and parameters."""
    data = batches(steps * calls)
    mine = sharded(mp=mp)
    step = TrainStep(
        mine,
        adamw(mine, kind, graph_safe=False),
        nn.CrossEntropyLoss(),
        clip_grad_norm=clip,
        accumulate_calls=calls,
        amp="bf16" if amp else None,
        graph="always",
    )
    graphed = [float(step(x, y)) for x, y in data]
    ref = sharded(mp=mp)
    opt = adamw(ref, kind, graph_safe=True)
    eager = eager_loop(ref, opt, data, calls=calls, clip=clip, amp=amp)
    return {
        "graphed": graphed,
        "eager": eager,
        "graphed_params": full_params(mine),
        "eager_params": full_params(ref),
        "phase": step.phase.value,
        "replays": step.report().replays,
    }


def steps_per_replay_run(k: int, graph: str) -> list[torch.Tensor]:
    model = sharded()
    step = TrainStep(
        model,
        adamw(model, "foreach", graph_safe=graph == "never"),
        nn.CrossEntropyLoss(),
        clip_grad_norm=1.0,
        steps_per_replay=k,
        graph=graph,  # type: ignore[arg-type]
    )
    gen = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(8 * k * 2, 12, 16, device="cuda", generator=gen)
    y = torch.randint(10, (8 * k * 2,), device="cuda", generator=gen)
    data = DeviceData(x, y, batch_size=8, shuffle=False)
    for _ in range(24 // k):
        step(data)
    return full_params(model)


# ---------------------------------------------------------------------- fake process group
def fake_world(world_size: int, steps: int) -> dict[str, Any]:
    """FSDP2 sharded over a fake group of ``world_size`` ranks in one process: the sharded paths
    (padding, copy-in/out, streams, events) captured and replayed; no numerics (the fake
    collectives move nothing). Peak memory of eager FSDP2 and of the graphed TrainStep."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        data = [(x, y) for x, y in batches(4, size=16)]
        eager_peak = _peak(lambda: _eager_steps(data, steps))
        result: dict[str, Any] = {}
        graphed_peak = _peak(lambda: result.update(_graphed_steps(data, steps)))
        return {**result, "eager_peak": eager_peak, "graphed_peak": graphed_peak}
    finally:
        dist.destroy_process_group()


def _peak(run: Any) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _eager_steps(data: list, steps: int) -> None:
    model = sharded(width=256, layers=4)
    opt = adamw(model, "foreach", graph_safe=True)
    eager_loop(model, opt, [data[i % len(data)] for i in range(steps)], clip=1.0)


def _graphed_steps(data: list, steps: int) -> dict[str, Any]:
    model = sharded(width=256, layers=4)
    step = TrainStep(
        model,
        adamw(model, "foreach", graph_safe=False),
        nn.CrossEntropyLoss(),
        clip_grad_norm=1.0,
        graph="always",
    )
    replays = 0
    for i in range(steps):
        if step.phase.value == "graphed":
            # a replay must not synchronize with the host: torch raises on any sync here
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(*data[i % len(data)])
            finally:
                torch.cuda.set_sync_debug_mode(0)
            replays += 1
        else:
            step(*data[i % len(data)])
    report = step.report()
    return {
        "phase": step.phase.value,
        "replays": report.replays,
        "checked_replays": replays,
        "fallbacks": list(report.fallbacks),
        "sharded_numel": sum(p.to_local().numel() for p in model.parameters()),  # type: ignore[attr-defined]
        "numel": sum(p.numel() for p in model.parameters()),
    }


# ---------------------------------------------------------------------- real NCCL ranks
def nccl_graphed_vs_eager(steps: int) -> dict[str, Any]:
    """On every rank (one GPU each): TrainStep graphed vs the eager FSDP2 loop, real all-gathers
    and reduce-scatters inside the graph."""
    return graphed_vs_eager(steps, "foreach", calls=2, clip=1.0)


def script_habits_graphed_vs_eager(steps: int, calls: int) -> dict[str, Any]:
    """Issue 31 item 5 on CUDA: the script's explicit prefetch (``model.unshard()`` before each
    step, pytorch/examples' FSDP2 example) and its own ``set_requires_gradient_sync`` kept around
    ``step()`` with ``accumulate_calls=calls``; TrainStep graphed vs the plain loop doing the same
    (the same graph-safe optimizer, so equality is bitwise)."""
    data = batches(steps * calls)
    mine = sharded()
    step = TrainStep(
        mine,
        adamw(mine, "foreach", graph_safe=False),
        nn.CrossEntropyLoss(),
        clip_grad_norm=1.0,
        accumulate_calls=calls,
        graph="always",
    )
    graphed = []
    eager_calls = []  # (call index, phase after it): the calls that did not replay
    for i, (x, y) in enumerate(data):
        mine.unshard()  # type: ignore[operator]
        mine.set_requires_gradient_sync(i % calls == calls - 1)  # type: ignore[operator]
        replays = step.report().replays
        graphed.append(float(step(x, y)))
        if step.report().replays == replays:
            eager_calls.append((i, step.phase.value))
    ref = sharded()
    opt = adamw(ref, "foreach", graph_safe=True)
    # the plain loop without the prefetch: an all-gather copies the same shards either way
    eager = eager_loop(ref, opt, data, calls=calls, clip=1.0)
    return {
        "graphed": graphed,
        "eager": eager,
        "graphed_params": full_params(mine),
        "eager_params": full_params(ref),
        "phase": step.phase.value,
        "replays": step.report().replays,
        "eager_steps": step.report().eager_steps,
        "eager_calls": eager_calls,
        "report": str(step.report()),
    }
