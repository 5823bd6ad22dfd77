"""Module-level workers for tests/test_cpu_graphs.py's multi-process tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.testing import CpuGraphs

from .step_workers import batches


def _batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _script_ddp_loop(data: list[tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    """The script's own DDP loop over ``data`` with the graph-safe AdamW the step steps; the
    model it trained."""
    ref = _batchnorm_model()
    ddp = nn.parallel.DistributedDataParallel(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    make_graph_safe(opt, torch.device("cpu"))
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return ref


def ddp_batchnorm_replays() -> dict:
    """TrainStep with the CPU engine against the script's own DDP loop (the same graph-safe
    AdamW): every rank's own data, BatchNorm's buffers broadcast from rank 0 each forward."""
    rank = dist.get_rank()
    data = batches(20, 8, seed=1 + rank)
    model = _batchnorm_model()
    step = TrainStep(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
        engine=CpuGraphs(),
    )  # fmt: skip
    for x, y in data:
        step(x, y)
    ref = _script_ddp_loop(data)
    params = zip(model.parameters(), ref.parameters(), strict=True)
    buffers = zip(model.buffers(), ref.buffers(), strict=True)
    return {
        "replays": step.report().replays,
        "max_param_diff": max(float((a - b).abs().max()) for a, b in params),
        "max_buffer_diff": max(float((a - b).abs().max().float()) for a, b in buffers),
        "checksum": float(sum(p.double().sum() for p in model.parameters())),
    }


def fsdp2_replays() -> dict:
    """TrainStep on a model the script sharded with fully_shard (each block, then the root)
    against the script's own FSDP2 loop with the same graph-safe AdamW: the replays run the
    recorded all-gathers and reduce-scatters, and the storage FSDP2 frees and allocates again."""
    from .fsdp2_workers import batches as fsdp2_batches
    from .fsdp2_workers import make_model, shard

    data = fsdp2_batches(16)
    model = shard(make_model())
    step = TrainStep(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
        engine=CpuGraphs(), warmup=3,
    )  # fmt: skip
    ours = [step(x, y) for x, y in data]
    ref = shard(make_model())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    make_graph_safe(opt, torch.device("cpu"))
    theirs = []
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        theirs.append(loss.detach())
    return {
        "replays": step.report().replays,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)),
        "params_equal": all(
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(model.parameters(), ref.parameters(), strict=True)
        ),
    }


def functional_all_reduce_replays() -> list[list[float]]:
    """A recorded functional all-reduce (DTensor's and FSDP2's norms use one) replayed on new
    inputs: each replay's result, which must be the sum over the ranks of that replay's input."""
    import torch.distributed._functional_collectives as funcol

    from ddpgraph.step.recording import record

    x = torch.zeros(4)
    out, program = record(lambda: funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1)
    got = []
    for i in (1, 2, 3):
        x.fill_(float(i * (dist.get_rank() + 1)))
        program.replay()
        got.append(out.tolist())
    return got


def ddp_ranks_disagree_on_the_short_batch() -> dict:
    """Rank 0 meets a short batch right after the warm-up, rank 1 does not: the first capture,
    a collective, waits on both ranks until both batches repeat their predecessors' shape
    (agreed), and the run equals the script's own DDP loop on the same data."""
    rank = dist.get_rank()
    full = batches(16, 8, seed=1 + rank)
    data = full[:12] + ([batches(1, 4, seed=9)[0]] if rank == 0 else []) + full[12:]
    model = _batchnorm_model()
    step = TrainStep(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
        engine=CpuGraphs(),
    )  # fmt: skip
    for x, y in data[:16]:
        step(x, y)
    ref = _script_ddp_loop(data[:16])
    report = step.report()
    return {
        "captured_at": [c.at_step for c in report.captures],
        "replays": report.replays,
        "params_equal": all(
            torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True)
        ),
    }
