"""Module-level workers for the object-collective tests (run_distributed needs importable ones)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ddpgraph as dg
from ddpgraph.distributed import _object_exchange as exchange
from ddpgraph.distributed import objects, torch_patch


def _rank() -> int:
    return dist.get_rank()


def capture(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The result, or the exception as a value, so that a worker can go on after a failure."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return exc


def object_for(rank: int, size: int) -> dict:
    """A rank-dependent object of roughly ``size`` bytes encoded, with a tensor inside."""
    return {
        "rank": rank,
        "name": f"rank-{rank}",
        "big": 1 << (70 + rank),
        "pair": (rank, -rank),
        "t": torch.arange(max(size // 4, 1), dtype=torch.float32) * rank,
        "bf16": torch.full((3,), rank + 0.5, dtype=torch.bfloat16),
    }


def gather_all_three(sizes: list[int]) -> dict:
    """Each result compared here with what every rank sent (tensors do not travel back well)."""
    from .test_codec import same

    rank, world = _rank(), dist.get_world_size()
    expected = [object_for(r, sizes[r]) for r in range(world)]
    gathered = dg.gather_object(expected[rank], dst=world - 1)
    return {
        "all": [
            same(a, b) for a, b in zip(dg.all_gather_object(expected[rank]), expected, strict=True)
        ],
        "gather": None
        if gathered is None
        else [same(a, b) for a, b in zip(gathered, expected, strict=True)],
        "bcast": same(dg.broadcast_object(expected[1] if rank == 1 else None, src=1), expected[1]),
    }


def unsupported_on(bad: int) -> list:
    stats: list[Any] = [1, 2, 3, {"a"} if _rank() == bad else 4]
    return dg.all_gather_object({"stats": stats})


def broadcast_unsupported_from_src() -> Any:
    return dg.broadcast_object(object() if _rank() == 0 else None, src=0)


def too_large_on(bad: int, max_bytes: int) -> list:
    payload = bytes(max_bytes * 2 if _rank() == bad else 10)
    return dg.all_gather_object(payload, max_bytes=max_bytes)


def corrupt_size_on(bad: int) -> list:
    """Rank ``bad`` announces a 1 EiB object: every rank must refuse before allocating it."""
    if _rank() == bad:
        real = exchange._header
        exchange._header = lambda call, seq, status, size: real(call, seq, status, 1 << 60)  # type: ignore[assignment]
    return dg.all_gather_object("x")


def codec_differs_on(bad: int, marker: str) -> list:
    obj, codec = (Evil(marker), "pickle") if _rank() == bad else (1, "data")
    return dg.all_gather_object(obj, codec=codec)


class Evil:
    """Unpickling it creates the marker file: proof that a payload was unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.marker),))


def pickle_under_data_codec_from(bad: int, marker: str) -> list:
    """Rank ``bad`` is malicious: it sends a pickle while claiming the data codec."""
    import pickle

    if _rank() == bad:
        exchange.encode_parts = lambda obj, codec: [pickle.dumps(Evil(marker))]  # type: ignore[assignment]
    return dg.all_gather_object({"ok": True})


def skip_a_call_on(bad: int) -> list:
    if _rank() != bad:
        dg.all_gather_object("first")
    return dg.all_gather_object("second")


def _same_line(obj: Any, timeout: float | None) -> list:
    return dg.all_gather_object(obj, timeout=timeout)


def gives_up_then_mispairs() -> Any:
    """Rank 0 gives up on call #1 (timeout) and makes call #2; rank 1 makes call #1 late."""
    if _rank() == 0:
        first = capture(_same_line, "one", 1.0)
        return first, capture(_same_line, "two", None)
    time.sleep(3.0)
    return capture(_same_line, "one", None)


def never_arrives(missing: int, timeout: float, late_by: float) -> Any:
    start = time.monotonic()
    if _rank() == missing:
        time.sleep(timeout + late_by)
    result = capture(dg.all_gather_object, _rank(), timeout=timeout)
    elapsed = time.monotonic() - start
    if _rank() != missing:
        time.sleep(late_by + 1.0)  # keep rank 0's store up for the late rank
    return result, elapsed


def straggler_then_recover(timeout: float) -> Any:
    if _rank() == 1:
        time.sleep(timeout + 2.0)
    first = capture(_same_line, "first", timeout)
    return first, _same_line(f"again-{_rank()}", 30.0)


def many_calls_with_timeout(n: int) -> list:
    return [dg.all_gather_object((i, _rank()), timeout=30)[1 - _rank()] for i in range(n)]


def fake_nccl_on_shared_gpu() -> Any:
    """NCCL seen by objects.py, every rank on cuda:0 of one host: must fail before any NCCL call."""
    from ddpgraph.distributed import runtime

    objects.dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    runtime.device_identity = lambda device: "GPU-same"  # type: ignore[assignment]

    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective ran before the device check")

    exchange._all_gather_single = no_collective
    return capture(dg.all_gather_object, 1)


def subgroup_gather() -> Any:
    group = dist.new_group([1, 2])
    if _rank() == 0:
        return capture(dg.all_gather_object, 0, group=group)
    return dg.all_gather_object(_rank() * 10, group=group), dg.broadcast_object(
        "from-2" if _rank() == 2 else None, src=2, group=group
    )


# ---- torch_patch ----


def torch_patch_matches_torch(size: int) -> Any:
    rank, world = _rank(), dist.get_world_size()
    obj = {"rank": rank, "data": list(range(size)), "set": {rank}}
    theirs: list[Any] = [None] * world
    dist.all_gather_object(theirs, obj)
    torch_patch.patch_torch()
    try:
        assert dist.all_gather_object is torch_patch.all_gather_object
        ours: list[Any] = [None] * world
        dist.all_gather_object(ours, obj)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(obj, gathered, dst=0)
        blist = [obj, rank] if rank == 1 else [None, None]
        dist.broadcast_object_list(blist, src=1)
    finally:
        torch_patch.unpatch()
    assert dist.all_gather_object is not torch_patch.all_gather_object
    return theirs, ours, gathered, blist


def torch_patch_bad_length(kind: str, bad: int) -> Any:
    rank, world = _rank(), dist.get_world_size()
    n = world + 1 if rank == bad else world
    torch_patch.patch_torch()
    try:
        if kind == "all_gather":
            return capture(dist.all_gather_object, [None] * n, rank)
        if kind == "gather":
            return capture(dist.gather_object, rank, [None] * n if rank == 0 else None, dst=0)
        return capture(dist.broadcast_object_list, [rank] * n, src=0)
    finally:
        torch_patch.unpatch()


def torch_patch_unpicklable_on(bad: int) -> Any:
    torch_patch.patch_torch()
    try:
        obj = (lambda: 0) if _rank() == bad else 0
        return capture(dist.all_gather_object, [None] * dist.get_world_size(), obj)
    finally:
        torch_patch.unpatch()


def env_rank() -> int:
    return int(os.environ["RANK"])


def on_a_group_torch_made() -> Any:
    """No ddpgraph.init: the application made the group itself (env:// from the launcher vars)."""
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        return dg.all_gather_object({"rank": rank}), dg.broadcast_object(rank or "zero", src=0)
    finally:
        dist.destroy_process_group()


class Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("x" * 40_000 + " END")


def long_error_on(bad: int) -> list:
    return dg.all_gather_object(Unpicklable() if _rank() == bad else 1, codec="pickle")


def straggler_within_timeout(delay: float, timeout: float) -> Any:
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ddpgraph").addHandler(handler)
    if _rank() == 1:
        time.sleep(delay)
    return _same_line(_rank(), timeout), records


def nccl_uses_the_bound_device() -> Any:
    """NCCL as seen by objects.py, ranks bound to cuda:RANK but current device 0 (a thread's
    default): the bound device is used, also from a worker thread; the bytes move over gloo."""
    import threading
    from types import SimpleNamespace

    from ddpgraph.distributed import runtime

    rank = _rank()
    exchange.get_runtime = lambda: SimpleNamespace(device=torch.device("cuda", rank))  # type: ignore[assignment]
    objects.dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    runtime.device_identity = lambda device: f"GPU-{device.index}"  # type: ignore[assignment]
    seen: list[str] = []

    def gather_on_cpu(call: Any, device: Any, slot: Any, size: int) -> Any:
        seen.append(str(device))
        out = torch.empty(call.world_size * size, dtype=torch.uint8)
        exchange._all_gather_single(out, slot, group=call.group)
        return out

    exchange._gather_slots = gather_on_cpu
    first = dg.all_gather_object(rank)
    from_thread: list[Any] = []
    thread = threading.Thread(target=lambda: from_thread.append(dg.all_gather_object(-rank)))
    thread.start()
    thread.join(30)
    return first, from_thread, seen


def bad_argument_on(bad: int, op: str, argument: str) -> Any:
    """Rank ``bad`` passes one bad argument; the others call correctly."""
    kwargs: dict[str, Any] = {"timeout": 20}
    if _rank() == bad:
        kwargs.update({"codec": {"codec": "json"}, "max_bytes": {"max_bytes": 0}}.get(argument, {}))
        root = {"root": 5, "float_root": 1.0, "str_root": "0"}.get(argument)
        if root is not None:
            kwargs["dst" if op == "gather_object" else "src"] = root
    return getattr(dg, op)({"rank": _rank()}, **kwargs)


def timeout_after_reinit(late_by: float, timeout: float) -> list:
    """Two init/shutdown rounds on one store; in round 2 rank 1 is late for its third call.

    Round 1 leaves the arrival keys of its last call (#3) in the store: round 2 must not take
    them for its own call #3.
    """
    rounds = []
    for round_ in (1, 2):
        dg.init(backend="gloo")
        outcomes = []
        for call in range(3):
            if round_ == 2 and call == 2 and _rank() == 1:
                time.sleep(late_by)
            outcomes.append(capture(dg.all_gather_object, call, timeout=timeout))
            if isinstance(outcomes[-1], Exception):
                break
        rounds.append(outcomes)
        dg.shutdown()
    return rounds


def peer_exits_before(bad: int) -> Any:
    """Rank ``bad`` dies without a word; the others' gather meets a closed connection."""
    if _rank() == bad:
        os._exit(3)
    return capture(dg.all_gather_object, {"rank": _rank()})


# ---- the learned slot (one round for repeated calls) ----


class RoundCounter:
    """Counts the all-gathers of each object collective and checks, in every first round, that
    each rank's slot holds zeros after its payload (never bytes of an earlier call)."""

    def __init__(self) -> None:
        self.calls = 0
        self.stale = 0
        real = exchange._all_gather_single

        def counting(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
            self.calls += 1
            done = real(out, inp, group=group)
            self._check_tails(out, inp.numel())
            return done

        exchange._all_gather_single = counting

    def _check_tails(self, out: torch.Tensor, width: int) -> None:
        data = out.numpy().data
        for r in range(out.numel() // width):
            slot = data[r * width : (r + 1) * width]
            header = exchange._parse_header(slot)
            if isinstance(header, str):
                return  # a second round: payload bytes only
            end = exchange._HEADER.size + header.size
            if header.size <= width - exchange._HEADER.size and any(bytes(slot[end:])):
                self.stale += 1


def _site_a(obj: Any) -> list:
    return dg.all_gather_object(obj)


def _site_b(obj: Any) -> list:
    return dg.all_gather_object(obj)


def sizes_that_change(plan: list[tuple[str, list[int]]]) -> list[tuple[bool, int]]:
    """Each step of ``plan`` is (site "a" or "b", each rank's size): whether every rank's object
    came back intact, and how many all-gathers the call took."""
    from .test_codec import same

    rank, world = _rank(), dist.get_world_size()
    counter = RoundCounter()
    log = []
    for site, sizes in plan:
        before = counter.calls
        got = (_site_a if site == "a" else _site_b)(object_for(rank, sizes[rank]))
        expected = [object_for(r, sizes[r]) for r in range(world)]
        ok = all(same(g, e) for g, e in zip(got, expected, strict=True))
        log.append((ok, counter.calls - before))
    assert counter.stale == 0, f"{counter.stale} slots carried bytes of an earlier call"
    return log


def mismatch_after_learning() -> list:
    """Both ranks repeat a 200 kB call (the slot grows); then rank 1 calls from another line.
    Both ranks must still gather slots of one size and report the mismatch."""
    rank = _rank()
    for _ in range(4):
        _site_a(object_for(rank, 200_000))
    outcome = capture(_site_a if rank == 0 else _site_b, object_for(rank, 200_000))
    after = capture(_site_a, object_for(rank, 200_000))
    return [outcome, after]


def failures_after_learning(max_bytes: int) -> list:
    """After the slot has grown: an object over max_bytes, an announced size of 1 EiB and a
    header that is not ddpgraph's, each on one rank; then a good call."""
    rank = _rank()
    outcomes: list[Any] = []

    def repeat(make: Any, times: int) -> None:
        for _ in range(times):
            outcomes.append(capture(dg.all_gather_object, make(), max_bytes=max_bytes))

    repeat(lambda: bytes(200_000), 4)
    repeat(lambda: bytes(max_bytes + 1 if rank == 1 else 200_000), 1)
    real = exchange._header
    if rank == 0:
        exchange._header = lambda call, seq, status, size: real(call, seq, status, 1 << 60)  # type: ignore[assignment]
    repeat(lambda: bytes(200_000), 1)
    exchange._header = real  # type: ignore[assignment]
    if rank == 1:
        exchange._header = lambda call, seq, status, size: (
            b"XXXX" + real(call, seq, status, size)[4:]
        )  # type: ignore[assignment]
    repeat(lambda: bytes(200_000), 1)
    exchange._header = real  # type: ignore[assignment]
    repeat(lambda: bytes(200_000), 3)
    return outcomes


def arrays_of_every_shape(size: int) -> dict:
    """Tensors and arrays that travel as raw bytes after the msgpack header, of every awkward
    shape, through all three collectives, three times each (cold, then learned slots)."""
    import numpy as np

    from .test_codec import same

    def arrays(rank: int) -> dict:
        base = torch.arange(size, dtype=torch.float32).reshape(-1, 4) + rank
        return {
            "t": base.t(),  # not contiguous
            "bf16": torch.full((5, 3), rank + 0.25, dtype=torch.bfloat16)[:, 1],
            "zero_d": torch.tensor(rank - 7, dtype=torch.int64),
            "empty": torch.empty((0, 3), dtype=torch.float16),
            "bool": torch.tensor([True, False, rank == 1]),
            "complex": torch.full((2,), complex(rank, -1), dtype=torch.complex64),
            "np_fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4) * rank),
            "np_zero_d": np.array(rank, dtype=np.uint16),
            "np_empty": np.zeros((2, 0), dtype=np.int8),
            "np_strided": np.arange(20, dtype=np.int32)[::3] + rank,
        }

    rank, world = _rank(), dist.get_world_size()
    expected = [arrays(r) for r in range(world)]
    checks: dict[str, list[bool]] = {"all": [], "gather": [], "bcast": []}
    for _ in range(3):
        got = dg.all_gather_object(expected[rank])
        checks["all"].append(all(same(g, e) for g, e in zip(got, expected, strict=True)))
    for _ in range(3):
        gathered = dg.gather_object(expected[rank], dst=0)
        if rank == 0:
            checks["gather"].append(
                all(same(g, e) for g, e in zip(gathered, expected, strict=True))
            )
    for _ in range(3):
        got = dg.broadcast_object(expected[1] if rank == 1 else None, src=1)
        checks["bcast"].append(same(got, expected[1]))
    return checks
