"""DG103: a DDP model built on the default stream is captured in a CUDA graph.

Measured on an H200 (REFERENCES.md): DDP built on the default stream fails in backward with
"operation would make the legacy stream depend on a capturing blocking stream". DDP built on any
side stream captures fine, also on ``torch.cuda.graph``'s own stream or a second side stream
(the PyTorch docs' recipe, NVIDIA's BERT): that is not a finding.
"""

from __future__ import annotations

from .astutil import DEFAULT_STREAM, Module, ddp_called, made_for
from .core import Report

_FIX = (
    "create s = torch.cuda.Stream(); construct DDP (and the optimizer and the warm-up) under "
    "`with torch.cuda.stream(s):` and capture with `torch.cuda.graph(g, stream=s)` "
    "(ddpgraph.TrainStep does this)"
)


def check_capture_stream(mod: Module, report: Report) -> None:
    for capture in mod.captures:
        for called in ddp_called(mod, capture.node):
            made = made_for(mod.ddp, called.target, mod, capture.node) or called
            if made.stream != DEFAULT_STREAM:
                continue
            message = (
                f"DDP model {made.target!r} was constructed on the default stream (line "
                f"{made.call.lineno}) and is captured here; capture fails in backward with "
                "'operation would make the legacy stream depend on a capturing blocking stream'"
            )
            if made.scope is mod.tree or made.scope is mod.scope_of(capture.node):
                report.finding(capture.node, "DG103", message, _FIX)
            else:  # built in another function: the stream its caller had is not visible here
                report.note(capture.node, "DG103", message, _FIX)
