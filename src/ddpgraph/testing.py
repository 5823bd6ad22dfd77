"""Run a function on N local processes, as the ranks of one job, for tests (yours and ours).

``run_distributed(fn, 2)`` starts two processes with torchrun's environment variables set, runs
``fn`` inside ``ddpgraph.init()`` on each, and returns the ranks' results in rank order. A worker's
exception comes back with its rank and traceback; a hang is killed at ``timeout``.

``TrainStep(..., engine=CpuGraphs())`` runs a TrainStep's real capture policy (warm-up, capture,
agreement, replay, fallback, the replay guard) on the CPU with a CUDA graph's semantics: a capture
records the call's tensor operations and refuses what CUDA capture refuses (host reads,
data-dependent shapes) with CUDA's error; a replay runs only those operations, on the same
tensors, with the optimizer on its CUDA path. A CPU test of a training loop then takes the path
the GPU run takes. ``CpuGraphs(fail=lambda key: ...)`` makes chosen captures fail.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .step.cpu_graphs import CpuGraphs

__all__ = ["CpuGraphs", "WorkerError", "WorkerTimeout", "run_distributed"]

# Time the other workers get to finish on their own once one has failed; most then fail too,
# and their errors are worth reporting, but a peer blocked in a collective must not stall the test.
_FAILURE_GRACE_S = 3.0


class WorkerError(RuntimeError):
    """A worker raised. ``rank`` is the first rank that failed; ``errors`` maps every failed rank to
    its exception (or None if it could not be sent back) and ``tracebacks`` to its formatted text."""

    def __init__(
        self, rank: int, errors: dict[int, BaseException | None], tracebacks: dict[int, str]
    ) -> None:
        self.rank = rank
        self.errors = errors
        self.tracebacks = tracebacks
        others = sorted(set(errors) - {rank})
        also = f" (ranks {others} failed too)" if others else ""
        super().__init__(f"rank {rank} raised{also}:\n{tracebacks[rank]}")


class WorkerTimeout(TimeoutError):
    """Some workers did not finish within the timeout; all workers were killed."""

    def __init__(self, pending: list[int], timeout: float) -> None:
        self.pending = pending
        super().__init__(
            f"ranks {pending} did not finish within {timeout:g}s; all workers were killed"
        )


@dataclass(frozen=True)
class _Outcome:
    rank: int
    ok: bool
    # The pickled result or exception. Plain pickle, not the queue's own: torch's reducers would
    # send tensors as shared-memory handles, which die with the worker before the parent reads.
    value: bytes | None = None
    text: str = ""  # the formatted traceback on failure
    failed_at: float = 0.0  # wall-clock time of the failure, to find the first one


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    args: Sequence[Any] = (),
    init: bool = True,
    env: Mapping[str, str] | None = None,
    return_exceptions: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local processes and return the results by rank.

    ``fn`` must be a module-level function and its results picklable. With ``init=True`` each
    worker runs ``fn`` inside ``ddpgraph.init(backend=backend)``; with ``init=False`` it only gets
    the launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) plus ``env``, which overrides per-job values.

    If a worker raises, the others get a short grace period and are then killed, and
    :class:`WorkerError` names the first rank that failed, with its traceback. With
    ``return_exceptions=True`` the call waits for every worker and returns each failed rank's
    exception in its slot instead (useful to assert that *every* rank raised). If the workers are
    not all done within ``timeout`` seconds, all are killed and :class:`WorkerTimeout` names the
    ranks still running.
    """
    qualname = getattr(fn, "__qualname__", "")  # a partial or a callable instance has none
    if "<lambda>" in qualname or "<locals>" in qualname:
        # the workers import fn by module and name: a lambda or nested function has no such name
        raise ValueError(
            f"run_distributed: fn={qualname} cannot be imported by the workers; pass a "
            "function defined at the top level of a module (not a lambda or a nested function)."
        )
    _check_main_guard()
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be positive")
    ctx = _context()
    results: mp.Queue[_Outcome] = ctx.Queue()
    base_env = _launcher_env(world_size, env)
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, tuple(args), rank, base_env, backend, init, results),
            name=f"ddpgraph-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = _collect(procs, results, timeout, wait_all=return_exceptions)
    finally:
        _kill(procs)
    failed = {o.rank: o for o in outcomes.values() if not o.ok}
    if failed and not return_exceptions:
        first = min(failed.values(), key=lambda o: o.failed_at).rank  # the root cause
        raise WorkerError(
            first,
            {r: _loads(o.value) for r, o in failed.items()},
            {r: o.text for r, o in failed.items()},
        )
    return [_loads(outcomes[rank].value) for rank in range(world_size)]


def _check_main_guard() -> None:
    """Refuse a call from the unguarded top level of the script being run, before any worker.

    The workers start (spawn or forkserver) by importing that script, so an unguarded call runs
    again in each of them, and Python fails every worker with its long "bootstrapping phase"
    error. Found from the script's own frame: its line must lie in ``if __name__ == "__main__":``.
    """
    import ast
    import sys

    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file:
        return  # python -c, a REPL or a notebook: no script for the workers to import
    frame = sys._getframe(1)
    line = None
    while frame is not None:  # the outermost frame of the script's top-level code
        if frame.f_code.co_name == "<module>" and frame.f_code.co_filename == main_file:
            line = frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    if line is None:
        return
    try:
        with open(main_file, encoding="utf-8") as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        guarded = isinstance(node, ast.If) and _is_main_test(node.test)
        if guarded and node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    raise ConfigError(
        f"run_distributed is called at the top level of {main_file} (line {line}) without "
        '`if __name__ == "__main__":`; each worker starts by importing that script and would '
        "call it again. Put the call (or the code that leads to it) under that guard."
    )


def _is_main_test(test: Any) -> bool:
    import ast

    return (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and {ast.unparse(test.left), ast.unparse(test.comparators[0])}
        in ({"__name__", "'__main__'"}, {"__name__", '"__main__"'})
    )


def _loads(payload: bytes | None) -> Any:
    return None if payload is None else pickle.loads(payload)


def _context() -> Any:  # a ForkServerContext or SpawnContext
    # forkserver with torch preloaded starts each worker in a fraction of spawn's time and, unlike
    # fork, never inherits a CUDA context or the parent's threads.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        return ctx
    return mp.get_context("spawn")


def _launcher_env(world_size: int, extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_AGENT_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_")  # torchrun's own, besides RANK & co.


def _worker(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    base_env: dict[str, str],
    backend: str,
    init: bool,
    results: mp.Queue[_Outcome],
) -> None:
    for name in [n for n in os.environ if n.startswith(_AGENT_PREFIXES)]:
        # called under torchrun: the agent's variables would send this job's rendezvous to the
        # agent's store (TORCHELASTIC_USE_AGENT_STORE), where no one answers
        del os.environ[name]
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    os.environ.update(base_env)  # a caller's env may override RANK / LOCAL_RANK on purpose
    _apply_thread_count(os.environ.get("OMP_NUM_THREADS"))
    try:
        if init:
            import ddpgraph

            with ddpgraph.init(backend=backend):
                # report inside the group: its shutdown makes blocked peers fail, and their
                # errors must not look like the first one
                results.put(_run(fn, args, rank))
        else:
            results.put(_run(fn, args, rank))
    except BaseException as exc:  # init itself failed
        results.put(_failure(rank, exc))


def _apply_thread_count(value: str | None) -> None:
    # The forkserver preloaded torch, whose OpenMP and MKL read OMP_NUM_THREADS before this
    # worker set it: without this each rank runs one thread per core, as torchrun's children do
    # not (oversubscribed; a float reduction split across threads may round differently).
    if value and value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))


def _run(fn: Callable[..., Any], args: tuple[Any, ...], rank: int) -> _Outcome:
    try:
        return _Outcome(rank, True, pickle.dumps(fn(*args)))
    except BaseException as exc:
        return _failure(rank, exc)


def _failure(rank: int, exc: BaseException) -> _Outcome:
    return _Outcome(rank, False, _dumps_or_none(exc), traceback.format_exc(), time.time())


def _dumps_or_none(obj: object) -> bytes | None:
    try:
        payload = pickle.dumps(obj)
        pickle.loads(payload)
    except Exception:
        return None
    return payload


def _collect(
    procs: list[Any], results: mp.Queue[_Outcome], timeout: float, *, wait_all: bool
) -> dict[int, _Outcome]:
    outcomes: dict[int, _Outcome] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < len(procs):
        now = time.monotonic()
        if now >= deadline:
            if any(not o.ok for o in outcomes.values()):
                break  # the peers of a failed rank are stuck; report the failure, not the hang
            pending = [r for r in range(len(procs)) if r not in outcomes]
            raise WorkerTimeout(pending, timeout)
        try:
            outcome = results.get(timeout=min(0.2, deadline - now))
        except queue.Empty:
            _note_silent_deaths(procs, results, outcomes)
            continue
        outcomes[outcome.rank] = outcome
        if not outcome.ok and not wait_all:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    return outcomes


def _note_silent_deaths(
    procs: list[Any], results: mp.Queue[_Outcome], outcomes: dict[int, _Outcome]
) -> None:
    """A worker killed by a signal or os._exit sends nothing: record it as a failure."""
    dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
    if not dead:
        return
    # A worker that put its result just before exiting may still have it in the pipe.
    try:
        while True:
            outcome = results.get(timeout=1.0)
            outcomes[outcome.rank] = outcome
    except queue.Empty:
        pass
    for rank in dead:
        if rank not in outcomes:
            code = procs[rank].exitcode
            outcomes[rank] = _Outcome(
                rank,
                False,
                None,
                f"rank {rank} exited with code {code} without a result",
                time.time(),
            )


def _kill(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
