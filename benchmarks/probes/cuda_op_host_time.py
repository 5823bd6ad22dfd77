"""Host time of each CUDA call a replayed ``step(x, y)`` makes besides the replay itself: the
floor under ``host_time_probe.py``'s figure that no Python can remove.

A replayed call copies each batch tensor into the graph's static input, replays, records the
watchdog's event on the current stream and copies the loss out (the script keeps each call's
loss). Each of those is timed here alone, on the probe's own shapes (a 64x1024 float32 batch,
64 int64 labels, a 0-dim loss), as the median over blocks of ``--calls`` launches with a
``torch.cuda.synchronize()`` between blocks (outside the timed region), beside the cheap reads
the guard makes (``data_ptr``, ``_version``) for scale.

    python benchmarks/probes/cuda_op_host_time.py --out cuda-op-host-time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch


def _host_us(fn: Callable[[], object], calls: int, blocks: int = 7) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    per_block = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_block.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(per_block), 2)


def _one_kernel_graph(target: torch.Tensor) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        target.mul_(1.0)  # warm-up off the default stream, as torch's docs ask before a capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        target.mul_(1.0)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device("cuda")
    x, y = torch.randn(64, 1024, device=dev), torch.randint(0, 10, (64,), device=dev)
    x_static, y_static = torch.empty_like(x), torch.empty_like(y)
    loss, lr = torch.zeros((), device=dev), torch.zeros((), device=dev)
    event = torch.cuda.Event()
    stream = torch.cuda.current_stream()
    graph = _one_kernel_graph(x_static)
    ops: dict[str, Callable[[], object]] = {
        "copy_ batch x into its static input (64x1024 float32)": lambda: x_static.copy_(x),
        "copy_ batch y into its static input (64 int64)": lambda: y_static.copy_(y),
        "loss.clone() (0-dim)": loss.clone,
        "replay of a one-kernel graph": graph.replay,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch._C._cuda_getCurrentStream(index)": lambda: torch._C._cuda_getCurrentStream(0),
        "event.record(stream)": lambda: event.record(stream),
        "event.record() (looks the stream up)": event.record,
        "lr.fill_(float)": lambda: lr.fill_(1e-3),
        "torch._foreach_copy_ of both inputs": lambda: torch._foreach_copy_(
            [x_static, y_static], [x, y]
        ),
        "x.data_ptr()": x.data_ptr,
        "x._version": lambda: x._version,
    }
    result = {
        "what": "host time of one call of each CUDA operation a replayed step makes, in us "
        "(median of 7 blocks)",
        "command": "python benchmarks/probes/cuda_op_host_time.py",
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "calls_per_block": args.calls,
        "host_us": {name: _host_us(fn, args.calls) for name, fn in ops.items()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
