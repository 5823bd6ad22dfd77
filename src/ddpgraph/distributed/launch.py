"""``ddpgraph launch``: torchrun with guard rails for scripts you do not want to (or cannot) edit.

Every torchrun option is parsed by torch's own parser and the job is run by torch's own launcher
(``torch.distributed.run.run``); the only change is the command each worker runs. Instead of
``python -u SCRIPT ARGS`` a worker runs ``python -u -m ddpgraph.distributed.launch_worker path SCRIPT ARGS``,
which, before the script starts:

1. binds the device from ``LOCAL_RANK`` (``torch.cuda.set_device``; nothing on the CPU), so an
   unmodified script that never calls ``set_device`` does not put every rank on ``cuda:0``;
2. calls :func:`ddpgraph.compat.patch_torch`, so torch's object collectives check their
   arguments on every rank and fail on every rank instead of hanging one of them;
3. prints one summary line on rank 0.

The script then runs as ``__main__`` with ``sys.argv == [SCRIPT, *ARGS]``, as under torchrun. No
process group is created: the script creates its own, as it does under torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch

from ..errors import ConfigError

WORKER_MODULE = "ddpgraph.distributed.launch_worker"
# The first argument of the worker module: how to run the target.
RUN_PATH = "path"
RUN_MODULE = "module"

USAGE_EXAMPLE = "ddpgraph launch --nproc-per-node 2 train.py --lr 0.1"


CPU_PROCESSES = 2  # without a GPU: two gloo ranks, so that collectives really talk


def default_nproc() -> int:
    """One process per local GPU, or :data:`CPU_PROCESSES` (gloo) where there is none."""
    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_PROCESSES


RANKS_PER_CORE = 4  # CPU ranks beyond this many per core only wait on each other (gloo)


def local_capacity() -> tuple[int, str]:
    """How many worker processes this machine can run at once, and why: one per visible GPU
    (each rank binds its own), else a few per CPU core this process may use (CPU tests run 2-3
    gloo ranks on 2 cores; thousands would exhaust the memory before the first step)."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return count, f"{count} visible GPU(s), and each rank needs its own"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    why = (
        f"{cores} CPU core(s) and no GPU, and {RANKS_PER_CORE} ranks per core at most: more "
        "only wait on each other"
    )
    return max((cores or 1) * RANKS_PER_CORE, CPU_PROCESSES), why


def run_local(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int,
    name: str,
    max_restarts: int = 0,
    reported_exits: Sequence[int] = (),
) -> dict[int, Any]:
    """``fn(*args)`` on ``nproc`` local processes, as ``torchrun --standalone`` would start them.

    torch's elastic agent does the process management (no home-made launcher); the result maps
    each local rank to ``fn``'s return value. A failed worker raises torch's ``ChildFailedError``
    once ``max_restarts`` restarts of all workers (torchrun's ``--max-restarts``) are used up.
    A worker exiting with a status in ``reported_exits`` has said why itself: the agent's
    traceback of its exit is not printed.

    Ctrl-C raises ``KeyboardInterrupt`` here once the agent has stopped the workers (SIGTERM);
    the workers start with SIGINT ignored, so one still importing torch dies without a traceback
    (a worker that wants Ctrl-C installs its own handler). Other signals torch's agent turns into
    its ``SignalException``.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every rendezvous step at INFO; the caller prints what matters.
    for logger in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(logger).setLevel(logging.WARNING)
    # ... and on Ctrl-C three warnings about closing the workers, which the caller reports itself
    for agent_logger in map(logging.getLogger, _SHUTDOWN_LOGGERS):
        for old in [f for f in agent_logger.filters if isinstance(f, _ShutdownNoise)]:
            agent_logger.removeFilter(old)
        agent_logger.addFilter(_ShutdownNoise(reported_exits))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ddpgraph-{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        **_sigint_left_to_python(LaunchConfig),
    )
    with _workers_ignore_sigint():
        result: dict[int, Any] = elastic_launch(config, fn)(*args)
    return result


def _sigint_left_to_python(config_type: type) -> dict[str, Any]:
    """LaunchConfig's option that keeps SIGINT Python's KeyboardInterrupt in this process (see
    :func:`_workers_ignore_sigint`); an older torch has no such option and always takes it."""
    if "signals_to_handle" not in {f.name for f in dataclasses.fields(config_type)}:
        return {}
    return {"signals_to_handle": "SIGTERM,SIGHUP,SIGQUIT"}


@contextlib.contextmanager
def _workers_ignore_sigint() -> Iterator[None]:
    """Spawn the agent's workers with SIGINT ignored, this process keeping its own handler.

    A terminal's Ctrl-C reaches every process of the group: a worker still importing torch would
    die in the middle of it with a KeyboardInterrupt traceback. An ignored signal is inherited
    through exec, a handler is not, so SIGINT is ignored only while the workers are spawned (a
    few milliseconds); torch's agent has no hook there, hence the wrapped function.
    """
    from torch.distributed.elastic.agent.server import local_elastic_agent

    agent: Any = local_elastic_agent  # start_processes is its import of torch's function

    spawn = agent.start_processes

    def start_processes(*args: Any, **kwargs: Any) -> Any:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return spawn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, previous)

    agent.start_processes = start_processes
    try:
        yield
    finally:
        agent.start_processes = spawn


_SHUTDOWN_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.multiprocessing.spawn",
)


class _ShutdownNoise(logging.Filter):
    """Drops the agent's "death signal, shutting down workers", "Closing process" and
    "Terminating process" lines, and its traceback of a worker's exit with a status in
    ``reported_exits``."""

    def __init__(self, reported_exits: Sequence[int]) -> None:
        super().__init__()
        self.reported_exits = set(reported_exits)

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith("failed (exitcode: ") and isinstance(record.args, tuple):
            if record.args and record.args[0] not in self.reported_exits:
                # a worker that died without a word (killed, or a crash): one line, not the
                # agent's traceback of its own poll loop; the job's end or restart follows
                code, local_rank = record.args[:2]
                print(f"ddpgraph: worker {local_rank} ended ({_how(code)}); stopping the others",
                      file=sys.stderr, flush=True)  # fmt: skip
            return False
        return not any(
            noise in text for noise in ("death signal", "Closing process", "Terminating process")
        )


def _how(code: object) -> str:
    """A worker's exit code in words: a negative one is the signal that killed it."""
    if isinstance(code, int) and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def launch(argv: Sequence[str]) -> int:
    """Run ``torchrun ARGV`` with the guards above in every worker; return an exit status.

    Raises :class:`ConfigError` (before anything starts) for a missing or unreadable script or an
    option ddpgraph cannot guard. A failed worker is reported by torch's launcher and gives 1.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .._typed_torch import child_failure_message, torchrun

    args = torchrun_args(argv)
    target = args.training_script_args[1]
    try:
        torchrun(args)
    except (ValueError, AssertionError) as exc:
        # raised by torch's launcher itself (a rendezvous backend or configuration it cannot
        # use) before or while it starts the workers: the options, not the script
        raise ConfigError(f"torchrun refused the options: {exc} (see torchrun -h)") from None
    except ChildFailedError as exc:
        # The workers' tracebacks went to their own stderr already; this names rank and exit
        # code, under the user's script rather than our worker module.
        exc.name = target
        print(f"ddpgraph launch: the job failed.\n{child_failure_message(exc)}", file=sys.stderr)
        return 1
    return 0


def torchrun_args(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's parsed options for ``argv``, with the worker command replaced by ours."""
    args = _parse(argv)
    _check_nproc_per_node(args.nproc_per_node)
    _check_nnodes(args.nnodes)
    _check_world_size(args)
    _check_numbers(args)
    if args.no_python:
        raise ConfigError(
            "ddpgraph launch cannot guard --no-python: the workers would not run Python, so "
            "nothing could bind the device or check the collectives before the program. Drop "
            "--no-python to run a Python script, or use torchrun itself for other programs."
        )
    if args.module:
        target = [RUN_MODULE, args.training_script]
    else:
        _check_script(args.training_script)
        target = [RUN_PATH, args.training_script]
    # --run-path would run torch's own in-interpreter runner, skipping ours; the script runs the
    # same way under our worker module, so it is simply turned off.
    args.run_path = False
    args.module = True
    args.training_script = WORKER_MODULE
    args.training_script_args = [*target, *args.training_script_args]
    return args


_NPROC_WORDS = ("gpu", "cpu", "auto", "xpu")  # what torch's launcher takes besides a count


def _check_nproc_per_node(value: str) -> None:
    """torch's launcher takes any text here and fails later: int() with a traceback, or its
    agent's bare ``assert nproc_per_node > 0`` after the rendezvous."""
    if value in _NPROC_WORDS:
        return
    try:
        count = int(value)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node {value}: not a number of worker processes; pass an integer of 1 "
            f"or more (or {' / '.join(_NPROC_WORDS)}), e.g. `{USAGE_EXAMPLE}`."
        ) from None
    if count < 1:
        raise ConfigError(
            f"--nproc-per-node {value}: each node needs at least 1 worker process; pass "
            f"--nproc-per-node 1 or more (or gpu / cpu / auto), e.g. `{USAGE_EXAMPLE}`."
        )


def _check_numbers(args: argparse.Namespace) -> None:
    """What torch's launcher asserts without a message, or meets only once it runs."""
    from torch.distributed.run import config_from_args

    if not (math.isfinite(args.monitor_interval) and 0 < args.monitor_interval < MAX_SECONDS):
        raise ConfigError(
            f"--monitor-interval {args.monitor_interval}: pass a positive number of seconds "
            f"below {MAX_SECONDS:.0e} (torchrun's default is 0.1)."
        )
    _check_range("--max-restarts", args.max_restarts, MAX_RESTARTS, "more is a crash loop")
    _check_range("--shutdown-timeout", args.shutdown_timeout, MAX_SECONDS, "seconds")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port {args.master_port}: pass a TCP port, 1 to 65535.")
    if args.node_rank < 0:
        raise ConfigError(f"--node-rank {args.node_rank}: pass 0 or more (this node's rank).")
    nodes = int(str(args.nnodes).split(":")[-1])  # checked by _check_nnodes: N or MIN:MAX
    if args.node_rank >= nodes:
        # the rendezvous would wait for nodes that never come instead of failing
        raise ConfigError(
            f"--node-rank {args.node_rank} is outside a job of --nnodes {args.nnodes} (node "
            f"ranks 0 to {nodes - 1}); pass this node's rank in that range, or a larger --nnodes."
        )
    try:
        config_from_args(args)  # its own checks: --max-restarts, --rdzv-conf, ...
    except (ValueError, AssertionError) as exc:
        raise ConfigError(
            f"{exc} (ddpgraph launch takes torchrun's options; see torchrun -h)"
        ) from None


MAX_SECONDS = 10**9  # as ddpgraph.init's timeout: longer is a typo, and timers overflow
MAX_RESTARTS = 1000


def _check_range(flag: str, value: int | None, most: int, why: str) -> None:
    if value is not None and not 0 <= value <= most:
        raise ConfigError(f"{flag} {value}: pass 0 to {most} ({why}).")


def _check_world_size(args: argparse.Namespace) -> None:
    """Ranks are 32-bit ints in torch's c10d, and more local workers than GPUs (or cores) can run
    only contend; both found before the rendezvous, which would wait or fail deep in torch."""
    nodes = int(args.nnodes.split(":")[-1])
    if args.nproc_per_node.isdigit():
        most, what = local_capacity()
        if int(args.nproc_per_node) > most:
            raise ConfigError(
                f"--nproc-per-node {args.nproc_per_node}: more worker processes than this "
                f"machine runs ({what}); pass --nproc-per-node {most} or fewer."
            )
        nodes *= int(args.nproc_per_node)
    if nodes > 2**31 - 1:
        raise ConfigError(
            f"--nnodes {args.nnodes}: a job of more than 2**31 - 1 ranks (torch's limit); pass "
            "the number of nodes the job really has."
        )


def _check_nnodes(value: str) -> None:
    """``--nnodes N`` or ``MIN:MAX``: torch's launcher asserts ``0 < MIN <= MAX`` (no message)
    or fails in int() with a traceback."""
    parts = value.split(":")
    try:
        counts = [int(part) for part in parts]
    except ValueError:
        counts = []
    if len(counts) not in (1, 2) or counts[0] < 1 or counts[-1] < counts[0]:
        raise ConfigError(
            f"--nnodes {value}: pass the number of nodes (1 or more), or MIN:MAX with "
            "1 <= MIN <= MAX for an elastic job, e.g. --nnodes 1 or --nnodes 1:4."
        )


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ddpgraph launch"

    def error(message: str) -> NoReturn:
        # argparse would print and exit; raise instead, so the CLI reports it like its own errors.
        if "training_script" in message:
            raise ConfigError(
                f"missing SCRIPT: give the Python script to run after the torchrun options, "
                f"e.g. `{USAGE_EXAMPLE}`."
            )
        raise ConfigError(f"{message} (ddpgraph launch takes torchrun's options; see torchrun -h)")

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(list(argv))


def _check_script(script: str) -> None:
    if not os.path.exists(script):
        raise ConfigError(
            f"script {script!r} does not exist (looked in {os.getcwd()}); pass the path of a "
            f"Python file, e.g. `{USAGE_EXAMPLE}`, or -m MODULE to run a module."
        )
    if os.path.isdir(script) and not os.path.exists(os.path.join(script, "__main__.py")):
        raise ConfigError(
            f"script {script!r} is a directory without __main__.py; pass the Python file to run."
        )
    if os.path.isfile(script):
        _check_compiles(script)


def _check_compiles(script: str) -> None:
    """A file that is not Python (a text file, a shell script) would fail in every worker with
    a SyntaxError traceback per rank; found once, here. A zip application runs as it is."""
    import tokenize
    import zipfile

    if zipfile.is_zipfile(script):
        return
    try:
        with tokenize.open(script) as file:  # its coding line or UTF-8, as Python reads it
            compile(file.read(), script, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f" at line {exc.lineno}" if exc.lineno else ""
        raise ConfigError(
            f"script {script!r} is not Python ({type(exc).__name__}{where}: {exc.msg}); pass "
            f"the Python file to run, e.g. `{USAGE_EXAMPLE}`."
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:  # binary, or NUL bytes
        raise ConfigError(
            f"script {script!r} is not Python source ({exc}); pass the Python file to run."
        ) from None
    except OSError as exc:
        raise ConfigError(f"script {script!r} cannot be read ({exc.strerror or exc}).") from None
