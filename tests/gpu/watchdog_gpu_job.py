"""GPU hang jobs for the watchdog, one process per rank (``python -m tests.gpu.watchdog_gpu_job``).

``sleep``: one process captures ``torch.cuda._sleep`` far longer than the timeout and replays
it with ``wd.after_replay``; the host then blocks in ``torch.cuda.synchronize()``.
``nccl_hang``: two ranks each capture an NCCL all-reduce; rank 1 stops replaying (alive, busy
elsewhere), so rank 0's replayed all-reduce never completes and NCCL's own watchdog never sees it.
Prints ``REPLAYED <step> <time>`` when the hanging replay was launched.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import ddpgraph
from ddpgraph.distributed import watchdog

HANG_STEP = 3


def _replay(graph: torch.cuda.CUDAGraph, step: int) -> None:
    dog = watchdog.active()
    assert dog is not None
    dog.enter("replay", step, "watchdog_gpu_job.py:replay")
    graph.replay()
    dog.leave()
    dog.after_replay(torch.cuda.current_stream(), step)


def sleep_job(timeout: float) -> None:
    ddpgraph.init(timeout=timeout, stall_warning=1.0)
    cycles_per_s = torch.cuda.get_device_properties(0).clock_rate * 1000  # kHz -> Hz
    short, long = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(short, stream=stream):
            torch.cuda._sleep(int(cycles_per_s * 0.001))
        with torch.cuda.graph(long, stream=stream):
            torch.cuda._sleep(int(cycles_per_s * timeout * 20))  # ~20x the timeout
    torch.cuda.synchronize()
    for step in range(HANG_STEP):
        _replay(short, step)
        torch.cuda.synchronize()
    _replay(long, HANG_STEP)
    print(f"REPLAYED {HANG_STEP} {time.time()}", flush=True)
    torch.cuda.synchronize()  # blocks (releasing the GIL) until the watchdog ends the process
    print("SYNCHRONIZE RETURNED", flush=True)
    with watchdog.watch("eager", step=HANG_STEP + 1):  # raises the verdict if the sync returned
        pass


def nccl_hang_job(timeout: float) -> None:
    rt = ddpgraph.init(timeout=timeout, stall_warning=1.0)
    buf = torch.ones(1 << 20, device=rt.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # NCCL's communicator is set up before capture
            dist.all_reduce(buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    for step in range(HANG_STEP):
        _replay(graph, step)
        torch.cuda.synchronize()
    if rt.rank == 1:
        time.sleep(120)  # stops replaying: alive, out of any watched call
        return
    _replay(graph, HANG_STEP)
    print(f"REPLAYED {HANG_STEP} {time.time()}", flush=True)
    torch.cuda.synchronize()
    print("SYNCHRONIZE RETURNED", flush=True)
    with watchdog.watch("eager", step=HANG_STEP + 1):
        pass


class _Sleepy(torch.nn.Module):
    """A linear layer whose forward also sleeps on the GPU for ``cycles`` (baked in at capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.cycles = 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return self.linear(x)


def trainstep_sleep_job(timeout: float) -> None:
    """TrainStep's own hooks: the graph captured for a new shape sleeps ~20x the timeout."""
    rt = ddpgraph.init(timeout=timeout, stall_warning=1.0)
    model = _Sleepy().to(rt.device)
    step = ddpgraph.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.CrossEntropyLoss(),
        graph="always",
        on_new_shape="capture",
    )
    y = torch.zeros(4, dtype=torch.long, device=rt.device)
    for _ in range(14):  # warm-up, capture, replays of the short graph
        step(torch.randn(4, 8, device=rt.device), y)
    torch.cuda.synchronize()
    cycles_per_s = torch.cuda.get_device_properties(0).clock_rate * 1000
    model.cycles = int(cycles_per_s * timeout * 20)
    step(torch.randn(2, 8, device=rt.device), y[:2])  # step 15: captured and replayed: hangs
    print(f"REPLAYED {step.report().steps} {time.time()}", flush=True)
    torch.cuda.synchronize()
    print("SYNCHRONIZE RETURNED", flush=True)
    step(torch.randn(4, 8, device=rt.device), y)  # raises the verdict if the sync returned


if __name__ == "__main__":
    jobs = {"sleep": sleep_job, "nccl_hang": nccl_hang_job, "trainstep_sleep": trainstep_sleep_job}
    jobs[sys.argv[1]](float(sys.argv[2]))
    os._exit(0)
