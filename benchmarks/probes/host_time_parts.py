"""Where the host time of a replayed ``step(x, y)`` goes on a GPU machine, part by part.

The model, batch and timing of ``host_time_probe.py`` (MLP 8x1024, batch 64, AdamW, a
``torch.cuda.synchronize()`` every ``--every`` calls outside the timed region). Once the step
replays, each part of its call is timed on its own, ``--calls`` times, on the step's own objects
(the replay is a real replay of the step's graph, so the parts that write its static tensors run
as the call runs them):

  step_call       the whole ``step(x, y)``
  make_batch      naming and checking the arguments, the signature (``step/batch.py``)
  guard           the replay guard's check that nothing changed (``step/guard.py``)
  watchdog        the watchdog's ``enter`` and ``leave`` around the call
  key_decide      the graph key, its one lookup, the ``Call`` and ``decide`` (``step/policy.py``)
  engine_replay   the engine's replay: LR test, the inputs copied in, the graph, the replay hooks
  copies          the inputs copied in alone (one ``torch._foreach_copy_``)
  graph_replay    ``CUDAGraph.replay()`` alone (the bare replay)
  hooks           the replay hooks alone (the watchdog's ``cudaEventRecord``)
  clone           ``loss.clone()`` (the copy of the loss a call returns)
  tokens_*        an LLM's three int64 inputs copied in by a loop of ``copy_`` and by one
                  ``torch._foreach_copy_`` (what the step does): the launches a batch of one
                  dtype saves

The parts do not add up to ``step_call`` exactly (each is timed in a loop of its own; the rest is
the runner's attribute tests). World size 1: no communication. Internal names of this tree: a
probe, not an API.

    python benchmarks/probes/host_time_parts.py [--calls 2000] [--out parts.json]

Without CUDA it runs on the CPU engine (``--width 32 --calls 5``: a check that the probe still
reaches this tree's objects; the figures are not the GPU's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
from host_time_probe import _mlp, _timed  # this folder: run as a script, as the probes are
from torch import nn

import ddpgraph
from ddpgraph.distributed import watchdog as _watchdog
from ddpgraph.step.batch import GraphKey, make_batch
from ddpgraph.step.graphs import _current_stream
from ddpgraph.step.policy import Call, decide


def _median_us(fn: Callable[[], Any], calls: int, every: int) -> float:
    return round(statistics.median(_timed(fn, calls, every)) * 1e6, 2)


def parts(calls: int, every: int, width: int = 1024) -> dict[str, float]:
    rt = ddpgraph.init()
    torch.manual_seed(0)
    model = _mlp(width).to(rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if rt.device.type == "cuda":
        step = ddpgraph.TrainStep(model, opt, nn.CrossEntropyLoss())
    else:  # a dry run of the probe on the CPU engine (hooks: none; figures not the GPU's)
        from ddpgraph.testing import CpuGraphs

        step = ddpgraph.TrainStep(model, opt, nn.CrossEntropyLoss(), engine=CpuGraphs())
    x = torch.randn(64, width, device=rt.device)
    y = torch.randint(10, (64,), device=rt.device)
    for _ in range(30):
        step(x, y)
    assert step.report().replays > 0, str(step.report())
    runner = step._runner
    engine = runner.graphs
    (key,) = [k for k in engine.captured if k.role == "train"]
    captured = engine.captured[key]
    batch = make_batch((x, y), min_positional=2)
    loss = step(x, y)
    wd = _watchdog.active()

    def watchdog() -> None:
        if wd is not None:
            wd.enter("replay", 1)
            wd.leave()

    def key_decide() -> Any:
        made = tuple.__new__(GraphKey, (key.role, key.modes, batch.signature, key.divisor))
        found = engine.captured.get(made)
        facts = (made.signature, found is not None, False, 0, False, bool, None, bool)
        return decide(runner.plan, runner.state, tuple.__new__(Call, facts))

    def hooks() -> None:
        if not torch.cuda.is_available():
            return
        stream = _current_stream(torch.cuda.current_device())
        for hook in getattr(engine, "_hooks", ()):
            hook(stream)

    statics, tensors = list(captured.static_inputs), list(batch.tensors)
    timed = {
        "step_call": lambda: step(x, y),
        "make_batch": lambda: make_batch((x, y), min_positional=2),
        "guard": runner.follower.guard.check,
        "watchdog": watchdog,
        "key_decide": key_decide,
        "engine_replay": lambda: engine.replay(captured, batch),
        "copies": lambda: torch._foreach_copy_(statics, tensors, non_blocking=True),
        "graph_replay": captured.graph.replay,
        "hooks": hooks,
        "clone": loss.clone,
        **_token_batch_copies(rt.device),
    }
    return {name: _median_us(fn, calls, every) for name, fn in timed.items()}


def _token_batch_copies(device: torch.device) -> dict[str, Callable[[], Any]]:
    """An LLM's batch (input_ids, attention_mask, labels: three int64 tensors of 64x512) copied
    into static tensors as a loop of ``copy_`` does it and as one ``torch._foreach_copy_`` does
    (on CUDA one launch for tensors of one dtype, where the MLP's float and int64 inputs take
    one each)."""
    batch = [torch.randint(0, 1000, (64, 512), device=device) for _ in range(3)]
    statics = [torch.empty_like(t) for t in batch]

    def loop() -> None:
        for static, tensor in zip(statics, batch):
            static.copy_(tensor, non_blocking=True)

    return {
        "tokens_copy_loop": loop,
        "tokens_foreach_copy": lambda: torch._foreach_copy_(statics, batch, non_blocking=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", help="write the medians (us) as JSON here")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's width (CPU dry run)")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"torch": torch.__version__, "device": device}
    result["median_host_us"] = parts(args.calls, args.every, args.width)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
