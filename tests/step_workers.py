"""Module-level workers for TrainStep's multi-process tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ddpgraph import TrainStep


def as_the_step_steps(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` made graph-safe on the CPU as a graphed TrainStep makes it (capturable, the LR in a
    tensor, SGD fused): the eager reference a CPU-engine run is compared with bit for bit, as
    tests/gpu compare theirs. What else differs is the graph's doing."""
    from ddpgraph.step.optim import make_graph_safe

    make_graph_safe(opt, torch.device("cpu"))
    return opt


def float_lr_step_as_the_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """``opt`` made graph-safe as by :func:`as_the_step_steps`, and the function to call instead
    of ``opt.step()`` in an eager reference whose loop or scheduler sets the LR as a float: the
    float is filled into the graph's float32 LR tensor before each step, as the graphed step
    does (``sync_lr``; step(data)'s StepwiseLR computes the schedule on floats). A scheduler
    stepping the LR tensor itself would compute in float32 and differ in the last bit."""
    floats = [group["lr"] for group in opt.param_groups]  # before they become tensors
    lr_tensors = [group["lr"] for group in as_the_step_steps(opt).param_groups]
    for group, value in zip(opt.param_groups, floats):
        group["lr"] = value

    def step() -> None:
        values = [group["lr"] for group in opt.param_groups]
        for group, lr, value in zip(opt.param_groups, lr_tensors, values):
            lr.fill_(value)
            group["lr"] = lr
        opt.step()
        for group, value in zip(opt.param_groups, values):
            group["lr"] = value

    return step


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(n: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=gen), torch.randint(4, (size,), generator=gen))
        for _ in range(n)
    ]


def ddp_train(steps: int) -> dict:
    """Each rank trains on its half of every global batch; returns its parameters."""
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, opt, nn.CrossEntropyLoss())
    losses = []
    for x, y in batches(steps, 8):
        shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
        losses.append(float(step(x[shard], y[shard])))
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "is_ddp": type(step.model).__name__,
        "losses": losses,
    }


class ComputesItsLoss(nn.Module):
    """An HF-style model: keyword inputs, returns an object whose ``.loss`` is computed."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.net = make_model(seed)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.net(inputs)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return _Output(loss=loss, logits=logits)


class _Output(dict):
    """Like transformers' ModelOutput: attribute and key access."""

    __getattr__ = dict.get


def mapping_vs_tuple(steps: int) -> dict:
    """Each rank trains on its shard twice: step(batch) with model-computed loss, and step(x, y)."""
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
    data = [(x[shard], y[shard]) for x, y in batches(steps, 8)]
    hf = ComputesItsLoss()
    by_mapping = TrainStep(hf, torch.optim.SGD(hf.parameters(), lr=0.1, momentum=0.9))
    for x, y in data:
        by_mapping({"inputs": x, "labels": y})
    plain = make_model()
    by_tuple = TrainStep(
        plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss()
    )
    for x, y in data:
        by_tuple(x, y)
    return {
        "mapping": [p.detach().clone() for p in hf.parameters()],
        "tuple": [p.detach().clone() for p in plain.parameters()],
        "ddp": type(by_mapping.model).__name__,
    }


def evaluate_sees_rank0_buffers(steps: int) -> dict:
    """Each rank trains a BatchNorm model on its own data, then evaluates: TrainStep's evaluate
    (no collective) against DDP's own eval forward (which broadcasts rank 0's buffers)."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    for x, y in batches(steps, 8, seed=10 + rank):  # different data: different BN statistics
        step(x, y)
    probe = batches(1, 5, seed=99)[0][0]
    ours = step.evaluate(probe).clone()
    ddp = step.model
    ddp.eval()
    with torch.no_grad():
        theirs = ddp(probe)
    return {"ours": ours, "ddp": theirs, "mean": model[1].running_mean.clone()}


def one_rank_fails_capture(steps: int) -> dict:
    """Rank 1's first capture fails (the fake engine): every rank must end eager, in step."""
    from ddpgraph.testing import CpuGraphs

    rank = torch.distributed.get_rank()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(
        model, opt, nn.CrossEntropyLoss(), engine=CpuGraphs(fail=lambda key: rank == 1)
    )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(steps, 8, seed=3):
            step(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
    report = step.report()
    return {
        "mode": report.mode,
        "fallbacks": report.fallbacks,
        "eager_steps": report.eager_steps,
        "warnings": [str(w.message) for w in caught],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def every_rank_replays_with_the_fake_engine(steps: int) -> dict:
    from ddpgraph.testing import CpuGraphs

    rank = torch.distributed.get_rank()
    out = {}
    for engine in ("fake", "never"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if engine == "fake":
            step = TrainStep(model, opt, nn.CrossEntropyLoss(), engine=CpuGraphs())
        else:
            step = TrainStep(model, as_the_step_steps(opt), nn.CrossEntropyLoss(), graph="never")
        for x, y in batches(steps, 8, seed=3):
            step(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
        out[engine] = {
            "mode": step.mode,
            "replays": step.report().replays,
            "params": [p.detach().clone() for p in model.parameters()],
        }
    return out


class Dropout(nn.Module):
    """make_model with dropout: the random draws between calls must match too."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.net(self.drop(x))


def accumulate_calls_vs_no_sync(k: int, steps: int, fake: bool) -> dict:
    """TrainStep(accumulate_calls=k) against the eager no_sync loop scripts write."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpgraph.testing import CpuGraphs

    rank = torch.distributed.get_rank()
    data = batches(steps * k, 4, seed=20 + rank)
    torch.manual_seed(0)
    model = Dropout()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        nn.CrossEntropyLoss(),
        accumulate_calls=k,
        clip_grad_norm=1.0,
        engine=CpuGraphs() if fake else None,
    )
    torch.manual_seed(5)
    ours = [float(step(x, y)) for x, y in data]

    torch.manual_seed(0)
    reference = Dropout()
    ddp = DDP(reference)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    if fake:
        as_the_step_steps(opt)
    torch.manual_seed(5)
    theirs = []
    for i, (x, y) in enumerate(data):
        last = (i + 1) % k == 0
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = nn.functional.cross_entropy(ddp(x), y)
            (loss / k).backward()
        theirs.append(float(loss))
        if last:
            torch.nn.utils.clip_grad_norm_(list(ddp.parameters()), 1.0, foreach=True)
            opt.step()
            opt.zero_grad()
    return {
        "ours": ours,
        "theirs": theirs,
        "mode": step.mode,
        "replays": step.report().replays,
        "params": [p.detach().clone() for p in model.parameters()],
        "reference": [p.detach().clone() for p in reference.parameters()],
    }


def compile_fails_on_rank_1(steps: int) -> dict:
    """torch.compile fails on rank 1 only (its backend raises): every rank must agree to run
    uncompiled before any rank rebuilds DDP (a collective)."""
    import warnings

    rank = torch.distributed.get_rank()

    def backend(gm, example_inputs):
        if rank == 1:
            raise RuntimeError("injected backend failure")
        return gm.forward

    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning; the report is checked
        step = TrainStep(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            compile={"backend": backend},
        )
        for x, y in batches(steps, 8, seed=4):
            step(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
    return {
        "inner": type(step.model.module).__name__,
        "fallbacks": step.report().fallbacks,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def batchnorm_vs_eager_ddp(steps: int, accumulate: int) -> dict:
    """A BatchNorm model, different data on each rank: TrainStep against the plain DDP loop
    (whose every forward broadcasts rank 0's buffers)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = torch.distributed.get_rank()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    data = batches(steps, 8, seed=30 + rank)
    model = build()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        accumulate=accumulate,
    )
    for x, y in data:
        step(x, y)
    reference = build()
    ddp = DDP(reference)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            last = i == accumulate - 1
            with ddp.no_sync() if not last else torch.enable_grad():
                (nn.functional.cross_entropy(ddp(xs), ys) / accumulate).backward()
        opt.step()
    return {
        "ours": {k: v.clone() for k, v in model.state_dict().items()},
        "theirs": {k: v.clone() for k, v in reference.state_dict().items()},
    }


def grad_norm_vs_ddp(steps: int) -> dict:
    """step.grad_norm (clipping at 0.5) against the DDP loop's clip_grad_norm_, per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpgraph.testing import CpuGraphs

    rank = torch.distributed.get_rank()
    data = batches(steps, 8, seed=7 + rank)
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        nn.CrossEntropyLoss(),
        clip_grad_norm=0.5,
        engine=CpuGraphs(),
    )
    ours = []
    for x, y in data:
        step(x, y)
        ours.append(step.grad_norm.clone())
    reference = make_model()
    ddp = DDP(reference)
    # the SGD the graphed step steps (fused, the LR in a tensor)
    opt = as_the_step_steps(torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    theirs = []
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        theirs.append(torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5))
        opt.step()
    return {"ours": ours, "theirs": theirs, "replays": step.report().replays}


def uneven_calls(graphed: bool) -> str:
    """Rank 1 has one batch fewer and finishes while rank 0 is in its last step's all-reduce."""
    from ddpgraph.testing import CpuGraphs

    rank = torch.distributed.get_rank()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = {"engine": CpuGraphs(), "warmup": 2} if graphed else {}
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), **engine)
    for x, y in batches(6 if rank == 0 else 5, 8):
        step(x, y)
    return "finished"


def planned_warmups(requested: list[int | None]) -> list[int]:
    """The eager steps a TrainStep plans before its capture, for each ``warmup=`` asked."""
    planned = []
    for warmup in requested:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = TrainStep(model, opt, nn.CrossEntropyLoss(), warmup=warmup)
        planned.append(step._runner.warmup)
    return planned


def norm_paths() -> dict[str, tuple[int, int]]:
    """For each ``ddp_kwargs`` (none; ``gradient_as_bucket_view`` True; False): how many times
    two clipped steps and two measured ones took ``norm_as_unbucketed`` (a group of one rank)."""
    from ddpgraph.step.parallel import ddp

    calls = [0]
    unbucketed = ddp.norm_as_unbucketed

    def counted(grads):
        calls[0] += 1
        return unbucketed(grads)

    ddp.norm_as_unbucketed = counted
    seen = {}
    for name, kwargs in (
        ("default", {}),
        ("bucket_views_said", {"gradient_as_bucket_view": True}),
        ("copies_said", {"gradient_as_bucket_view": False}),
    ):
        counts = []
        for options in ({"clip_grad_norm": 1.0}, {"grad_norm": True}):
            calls[0] = 0
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph="never", ddp_kwargs=kwargs,
                             **options)  # fmt: skip
            for x, y in batches(2, 8):
                step(x, y)
            counts.append(calls[0])
        seen[name] = (counts[0], counts[1])
    ddp.norm_as_unbucketed = unbucketed
    return seen
