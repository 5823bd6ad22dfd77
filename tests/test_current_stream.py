"""ddpgraph.step.graphs._current_stream: the Stream object a replayed call hands the watchdog,
rebuilt only when torch's current stream changed (a CPU test: torch's two calls are stood in
for, as the ids a CUDA build returns; tests/gpu replays under the watchdog on a real stream)."""

from __future__ import annotations

import torch

from ddpgraph.step import graphs


def test_the_stream_object_is_built_again_only_when_the_current_stream_changed(monkeypatch):
    ids = {"now": (3, 0, 1)}  # (stream_id, device_index, device_type), as torch returns them
    built: list[tuple[int, int, int]] = []

    def built_stream(index: int) -> object:
        built.append(ids["now"])
        return object()

    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: ids["now"], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", built_stream)
    monkeypatch.setattr(graphs._CURRENT_STREAMS, "value", {})
    first = graphs._current_stream(0)
    assert graphs._current_stream(0) is first and built == [(3, 0, 1)]
    ids["now"] = (7, 0, 1)  # a script entered `with torch.cuda.stream(s):`
    second = graphs._current_stream(0)
    assert second is not first and built == [(3, 0, 1), (7, 0, 1)]
    ids["now"] = (3, 0, 1)  # and left it
    assert graphs._current_stream(0) is not second and len(built) == 3
