"""Host time of one ``step(x, y)`` call once the step replays: what ddpgraph adds on the CPU.

Each call is timed on the host alone (``perf_counter`` around the call, no sync inside), with a
``torch.cuda.synchronize()`` every ``--every`` calls outside the timed region so the launch queue
never fills (a full queue would make a call wait for the GPU). Reports the median and p90 over
``--calls`` calls, the bare ``graph.replay()`` host time for comparison, and a hand-written
replay doing the CUDA work a replayed call cannot skip (the batch's two copies into static
inputs, the replay, a copy of the loss the script keeps): the floor no guard can go under. Then
the same model fed by a ``DeviceData`` (``step(data)``: no copies in; ``data_call_host_us``).
Works against any ddpgraph version with ``TrainStep`` and ``bare_graph()`` (so an older checkout
on PYTHONPATH gives the "before" numbers in the same session).

    python benchmarks/probes/host_time_probe.py --out host-time.json
    python benchmarks/probes/host_time_probe.py --guard events --out host-time-events.json
    python benchmarks/probes/host_time_probe.py --profile host-profile.txt  # + cProfile of calls

``--profile FILE`` then profiles ``--calls`` more replayed calls with cProfile (every function's
own time, sorted) into FILE: where the host time above the hand-written floor goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import ddpgraph


def _mlp(width: int = 1024) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _timed(fn, calls: int, every: int) -> list[float]:
    """Host seconds of each of ``calls`` calls of ``fn``, the device synchronized every
    ``every`` calls outside the timed region (not at all without CUDA: host_time_parts.py's
    CPU dry run)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    times = []
    for i in range(calls):
        if i % every == 0:
            sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    sync()
    return times


def _hand_replay(graph, x: torch.Tensor, y: torch.Tensor):
    """What a hand-written replay of the step must do: copy the batch into static inputs,
    replay, copy the loss out (a script keeps each call's loss). Separate tensors of the same
    shapes stand in for the graph's own static ones: the launches cost the same."""
    x_static, y_static = torch.empty_like(x), torch.empty_like(y)
    loss = torch.zeros((), device=x.device)

    def call() -> torch.Tensor:
        x_static.copy_(x, non_blocking=True)
        y_static.copy_(y, non_blocking=True)
        graph.replay()
        return loss.clone()

    return call


def _profile(fn, calls: int, every: int, path: str) -> None:
    """cProfile of ``calls`` calls of ``fn`` as :func:`_timed` makes them, the functions sorted
    by their own time, written to ``path``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(_timed, fn, calls, every)  # its syncs are a line of their own in the table
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    with open(path, "w") as f:
        f.write(f"cProfile of {calls} replayed step(x, y) calls, own time per function\n")
        f.write(text.getvalue())


def _data_call(device: torch.device, chosen: dict, calls: int, every: int) -> dict | None:
    """The same model fed by a ``DeviceData`` (``step(data)``: the graph gathers its batch on
    the device, so a replayed call copies nothing in): median and p90 host time of a call, one
    step per replay. None where this ddpgraph has no DeviceData; the error where it failed."""
    if not hasattr(ddpgraph, "DeviceData"):
        return None
    try:
        torch.manual_seed(0)
        model = _mlp().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = ddpgraph.TrainStep(model, opt, nn.CrossEntropyLoss(), **chosen)
        data = ddpgraph.DeviceData(
            torch.randn(64 * 50, 1024), torch.randint(10, (64 * 50,)), batch_size=64,
            device=device,
        )  # fmt: skip
        for _ in range(30):
            step(data)
        assert step.report().replays > 0, str(step.report())
        times = _timed(lambda: step(data), calls, every)
    except Exception as exc:  # the main figures above still count
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return {
        "median": statistics.median(times) * 1e6,
        "p90": statistics.quantiles(times, n=10)[-1] * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--label", default="")
    parser.add_argument("--out")
    parser.add_argument("--guard", default="default", choices=["default", "full", "events"])
    parser.add_argument("--profile", help="also write a cProfile table of --calls calls here")
    args = parser.parse_args()
    rt = ddpgraph.init()
    torch.manual_seed(0)
    model = _mlp().to(rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    chosen = {} if args.guard == "default" else {"guard": args.guard}  # the tree's own default
    step = ddpgraph.TrainStep(model, opt, nn.CrossEntropyLoss(), **chosen)
    x = torch.randn(64, 1024, device=rt.device)
    y = torch.randint(10, (64,), device=rt.device)
    for _ in range(30):
        step(x, y)
    assert step.report().replays > 0, str(step.report())
    call = _timed(lambda: step(x, y), args.calls, args.every)
    graph = step.bare_graph()
    bare = _timed(graph.replay, args.calls, args.every) if graph is not None else []
    hand = _timed(_hand_replay(graph, x, y), args.calls, args.every) if graph is not None else []
    result = {
        "label": args.label,
        "guard": args.guard,
        "ddpgraph_file": ddpgraph.__file__,
        "torch": torch.__version__,
        "step_call_host_us": {
            "median": statistics.median(call) * 1e6,
            "p90": statistics.quantiles(call, n=10)[-1] * 1e6,
        },
        "bare_replay_host_us": {
            "median": statistics.median(bare) * 1e6,
            "p90": statistics.quantiles(bare, n=10)[-1] * 1e6,
        }
        if bare
        else None,
        "hand_replay_host_us": {
            "median": statistics.median(hand) * 1e6,
            "p90": statistics.quantiles(hand, n=10)[-1] * 1e6,
        }
        if hand
        else None,
    }
    result["data_call_host_us"] = _data_call(rt.device, chosen, args.calls, args.every)
    print(json.dumps(result))
    if args.profile:
        _profile(lambda: step(x, y), args.calls, args.every, args.profile)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    ddpgraph.shutdown()


if __name__ == "__main__":
    main()
