"""``ddpgraph doctor``: a copy-pasteable environment report and a live multi-rank self-test.

The self-test starts one rank per GPU (two CPU ranks on gloo without one) with torch's own
elastic launcher, so it exercises the same rendezvous and environment a torchrun job gets. Each
rank runs the checks below in order; a check that raises becomes a failure carrying the
exception text and, where one is known, :func:`ddpgraph.errors.explain`'s fix.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._typed_torch import cuda_stream, cudnn_version, nccl_version
from ..distributed.launch import default_nproc, run_local
from ..distributed.objects import all_gather_object
from ..distributed.runtime import Runtime, device_identity
from ..errors import explain, explain_exception

__all__ = [
    "CHECKS",
    "CheckOutcome",
    "CheckResult",
    "EnvReport",
    "GpuInfo",
    "SelfTestFailure",
    "collect_env",
    "merge",
    "render",
    "run_checks",
    "run_selftest",
    "selftest_worker",
    "to_json",
]

_ENV_PREFIXES = ("TORCH_NCCL_", "NCCL_", "OMP_", "TORCH_DISTRIBUTED_")
DEFAULT_TIMEOUT_S = 60.0  # per collective; a broken set-up fails the test instead of hanging it


# --- the report -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_gib: float


@dataclass(frozen=True)
class EnvReport:
    python: str
    platform: str
    torch: str
    ddpgraph: str
    cuda: str | None  # the CUDA torch was built with, None for a CPU build
    cuda_available: bool
    cudnn: str | None
    nccl: str | None
    gpus: tuple[GpuInfo, ...]
    cuda_visible_devices: str | None
    variables: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """``key: value`` lines, plain text so that they paste into an issue unchanged."""
        out = [
            f"python: {self.python}",
            f"platform: {self.platform}",
            f"torch: {self.torch}",
            f"ddpgraph: {self.ddpgraph}",
            f"cuda (build): {self.cuda or 'none (CPU build)'}",
            f"cuda available: {self.cuda_available}",
            f"cudnn: {self.cudnn or '-'}",
            f"nccl: {self.nccl or '-'}",
            f"CUDA_VISIBLE_DEVICES: {_unset(self.cuda_visible_devices)}",
            f"gpus: {len(self.gpus)}",
        ]
        out += [f"  gpu {g.index}: {g.name}, {g.uuid}, {g.memory_gib:.1f} GiB" for g in self.gpus]
        out += [f"{name}={value}" for name, value in sorted(self.variables.items())]
        return out


def _unset(value: str | None) -> str:
    return "<unset>" if value is None else repr(value)


def collect_env(environ: Mapping[str, str] | None = None) -> EnvReport:
    """What this machine runs: versions, every visible GPU with its UUID, the relevant variables."""
    from .. import __version__

    env = os.environ if environ is None else environ
    available = torch.cuda.is_available()
    return EnvReport(
        python=sys.version.split()[0],
        platform=platform.platform(),
        torch=torch.__version__,
        ddpgraph=__version__,
        cuda=torch.version.cuda,
        cuda_available=available,
        cudnn=_cudnn_version(),
        nccl=_nccl_version() if available else None,
        gpus=tuple(_gpus()) if available else (),
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        variables={k: v for k, v in env.items() if k.startswith(_ENV_PREFIXES)},
    )


def _cudnn_version() -> str | None:
    try:
        version = cudnn_version()
    except RuntimeError:
        return None
    return str(version) if version is not None else None


def _nccl_version() -> str | None:
    try:
        version = nccl_version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _gpus() -> list[GpuInfo]:
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(GpuInfo(index, props.name, f"GPU-{props.uuid}", props.total_memory / 2**30))
    return gpus


# --- the checks (run on every rank) -----------------------------------------------------------


class SelfTestFailure(RuntimeError):
    """A check saw a wrong result; ``fix`` says what to do about it."""

    def __init__(self, message: str, fix: str) -> None:
        self.fix = fix
        super().__init__(message)


class _Skipped(Exception):
    """The check does not apply here (e.g. CUDA graphs without a GPU)."""


def check_device(rt: Runtime) -> str:
    """Each rank bound to its own device; init() already raised if two ranks shared a GPU."""
    if rt.device.type == "cuda" and torch.cuda.current_device() != rt.device.index:
        raise SelfTestFailure(
            f"rank {rt.rank} is bound to {rt.device} but the current CUDA device is "
            f"cuda:{torch.cuda.current_device()}",
            "call torch.cuda.set_device(local_rank) before any CUDA work (ddpgraph.init() does)",
        )
    if rt.device.type != "cuda":
        return "CPU ranks (nothing to bind)"
    return f"one GPU per rank (rank {rt.rank}: {rt.device}, {device_identity(rt.device)})"


def check_all_reduce(rt: Runtime) -> str:
    tensor = torch.full((4,), float(rt.rank + 1), device=rt.device)
    dist.all_reduce(tensor)
    expected = rt.world_size * (rt.world_size + 1) / 2
    if not torch.all(tensor == expected):
        raise SelfTestFailure(
            f"all_reduce of rank+1 gave {tensor.tolist()} on rank {rt.rank}, expected "
            f"{expected:g} everywhere",
            "the backend returned wrong data: update the driver / NCCL, and check "
            "NCCL_P2P_DISABLE / NCCL_SHM_DISABLE settings",
        )
    return f"sum over {rt.world_size} ranks = {expected:g}"


def check_object_gather(rt: Runtime) -> str:
    # ddpgraph's collective, not torch's: a rank that fails here fails on every rank with a
    # message (torch's would hang the others), and the safe codec runs no peer's code.
    gathered = all_gather_object({"rank": rt.rank, "host": socket.gethostname()})
    ranks = [item["rank"] if isinstance(item, dict) else item for item in gathered]
    if ranks != list(range(rt.world_size)):
        raise SelfTestFailure(
            f"all_gather_object returned ranks {ranks} on rank {rt.rank}, expected "
            f"{list(range(rt.world_size))}",
            "bind every rank to its own device before object collectives (ddpgraph.init())",
        )
    return f"{len(gathered)} objects, in rank order"


def check_captured_all_reduce(rt: Runtime) -> str:
    """An all-reduce captured in a CUDA graph, replayed twice with new inputs."""
    if rt.device.type != "cuda":
        raise _Skipped("no GPU: CUDA graphs need CUDA")
    static = torch.zeros(1024, device=rt.device)
    stream = cuda_stream(rt.device)
    stream.wait_stream(torch.cuda.current_stream())
    # Warm up on the capture stream: NCCL creates its communicator on first use, which a
    # capture cannot contain.
    with torch.cuda.stream(stream):
        for _ in range(3):
            out = static.clone()
            dist.all_reduce(out)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads (NCCL's watchdog) must not invalidate the capture.
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        out = static.clone()
        dist.all_reduce(out)
    for round_ in (1, 2):
        static.fill_(float((rt.rank + 1) * round_))
        graph.replay()
        torch.cuda.synchronize()
        expected = round_ * rt.world_size * (rt.world_size + 1) / 2
        if not torch.all(out == expected):
            raise SelfTestFailure(
                f"replay {round_} of the captured all_reduce gave {out[0].item():g} on rank "
                f"{rt.rank}, expected {expected:g}",
                "collectives inside CUDA graphs need NCCL >= 2.9.6 and the same capture on "
                "every rank; update NCCL / torch",
            )
    return "captured once, replayed twice with new inputs: correct"


@dataclass(frozen=True)
class _Check:
    name: str
    run: Callable[[Runtime], str]
    fix: str  # the generic fix when the error text is not a known one


CHECKS: tuple[_Check, ...] = (
    _Check(
        "unique device per rank",
        check_device,
        "call ddpgraph.init() (or torch.cuda.set_device(LOCAL_RANK)) before any CUDA work, and "
        "give each rank of a host its own GPU",
    ),
    _Check(
        "all-reduce",
        check_all_reduce,
        "check that every rank can reach MASTER_ADDR:MASTER_PORT and, on GPU, run with "
        "NCCL_DEBUG=INFO to see why NCCL fails",
    ),
    _Check(
        "object gather",
        check_object_gather,
        "bind the device before object collectives and pass [None] * world_size",
    ),
    _Check(
        "captured all-reduce (CUDA graph)",
        check_captured_all_reduce,
        "capture on a side stream after warming NCCL up on it; update torch/NCCL",
    ),
)
_INIT_CHECK = "process group (ddpgraph.init)"


@dataclass(frozen=True)
class CheckOutcome:
    """One check on one rank."""

    name: str
    status: str  # "ok", "fail" or "skip"
    detail: str
    fix: str | None = None


def selftest_worker(timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run on every rank: init, then every check; outcomes as plain dicts (they cross processes)."""
    import ddpgraph

    outcomes: list[CheckOutcome] = []
    try:
        rt = ddpgraph.init(timeout=timeout_s)
    except Exception as exc:
        outcomes.append(_failure(_INIT_CHECK, exc, CHECKS[0].fix))
        outcomes += [CheckOutcome(c.name, "skip", "not run: init failed") for c in CHECKS]
        return [asdict(o) for o in outcomes]
    with rt:  # shuts down on the way out, also after an exception
        outcomes.append(
            CheckOutcome(_INIT_CHECK, "ok", f"{rt.world_size} rank(s), backend {rt.backend}")
        )
        outcomes += run_checks(rt)
    return [asdict(o) for o in outcomes]


def run_checks(rt: Runtime, checks: Sequence[_Check] | None = None) -> list[CheckOutcome]:
    """Every check in order on this rank. After a failure the rest are skipped: a rank that
    stops early would leave its peers waiting in the next collective."""
    outcomes: list[CheckOutcome] = []
    failed = False
    for check in CHECKS if checks is None else checks:
        if failed:
            outcomes.append(CheckOutcome(check.name, "skip", "not run: an earlier check failed"))
            continue
        try:
            outcomes.append(CheckOutcome(check.name, "ok", check.run(rt)))
        except _Skipped as why:
            outcomes.append(CheckOutcome(check.name, "skip", str(why)))
        except Exception as exc:
            outcomes.append(_failure(check.name, exc, check.fix))
            failed = True
    return outcomes


def _failure(name: str, exc: BaseException, generic_fix: str) -> CheckOutcome:
    text = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, SelfTestFailure):
        return CheckOutcome(name, "fail", text, exc.fix)
    found = explain_exception(exc)  # its frames order the causes
    fix = f"{found.title}: {found.fix}" if found else generic_fix
    return CheckOutcome(name, "fail", text, fix)


# --- the launcher and the summary -------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """One check over all ranks: ``status`` is "fail" if any rank failed, "skip" if all skipped."""

    name: str
    status: str
    detail: str
    fix: str | None = None
    failed_ranks: tuple[int, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.status != "fail"


def run_selftest(
    nproc: int | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[CheckResult]:
    """Start ``nproc`` ranks, run the checks on each, and merge the outcomes per check."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    nproc = default_nproc() if nproc is None else nproc
    try:
        per_rank = _launch(nproc, timeout_s)
    except SignalException:
        raise  # the self-test was stopped (SIGTERM, SIGHUP): not a fault of the environment
    except Exception as exc:
        return [_launch_failure(exc)]
    return merge(per_rank)


def _launch(nproc: int, timeout_s: float) -> dict[int, list[dict[str, Any]]]:
    return run_local(selftest_worker, timeout_s, nproc=nproc, name="doctor")


def _launch_failure(exc: BaseException) -> CheckResult:
    text = _describe_launch_failure(exc)
    found = explain(text)
    return CheckResult(
        "self-test processes",
        "fail",
        text,
        f"{found.title}: {found.fix}"
        if found
        else "a rank died before reporting; rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL",
    )


def _describe_launch_failure(exc: BaseException) -> str:
    """One line per dead rank for torch's ChildFailedError (its own text is a page of banner)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, Mapping) or not failures:
        return f"{type(exc).__name__}: {exc}".strip()
    parts = []
    for rank, failure in sorted(failures.items()):
        code = getattr(failure, "exitcode", None)
        how = (
            f"was killed by signal {-code}"
            if isinstance(code, int) and code < 0
            else f"exited with code {code}"
        )
        message = str(getattr(failure, "message", "") or "")
        detail = "" if "To enable traceback" in message or not message else f": {message}"
        parts.append(f"rank {rank} {how} before reporting{detail}")
    return "; ".join(parts)


def merge(per_rank: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[CheckResult]:
    """One :class:`CheckResult` per check name, in order; the first failing rank speaks."""
    names: list[str] = []
    by_name: dict[str, dict[int, Mapping[str, Any]]] = {}
    for rank in sorted(per_rank):
        for outcome in per_rank[rank]:
            if outcome["name"] not in by_name:
                names.append(outcome["name"])
                by_name[outcome["name"]] = {}
            by_name[outcome["name"]][rank] = outcome
    return [_merge_one(name, by_name[name]) for name in names]


def _merge_one(name: str, ranks: Mapping[int, Mapping[str, Any]]) -> CheckResult:
    failed = tuple(r for r, o in sorted(ranks.items()) if o["status"] == "fail")
    if failed:
        first = ranks[failed[0]]
        where = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        return CheckResult(name, "fail", f"{where}: {first['detail']}", first["fix"], failed)
    lowest = ranks[min(ranks)]
    if all(o["status"] == "skip" for o in ranks.values()):
        return CheckResult(name, "skip", lowest["detail"])
    return CheckResult(name, "ok", lowest["detail"])


# --- output -----------------------------------------------------------------------------------

_MARKS = {"ok": "[green]✓[/green]", "fail": "[red]✗[/red]", "skip": "[dim]–[/dim]"}


def to_json(report: EnvReport, results: Sequence[CheckResult]) -> dict[str, Any]:
    return {
        "ok": all(r.ok for r in results),
        "environment": report.to_dict(),
        "checks": [{**asdict(r), "ok": r.ok} for r in results],
    }


def render(report: EnvReport, results: Sequence[CheckResult], console: Any = None) -> None:
    """Print the report (plain lines, to paste into an issue) and the ✓/✗ table with fixes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    for line in report.lines():
        console.print(escape(line), highlight=False)
    table = Table(title="ddpgraph self-test", show_lines=True)
    table.add_column("", width=1)
    table.add_column("check")
    table.add_column("result")
    table.add_column("fix")
    for result in results:
        table.add_row(
            _MARKS[result.status],
            escape(result.name),
            escape(result.detail),
            escape(result.fix or ""),
        )
    console.print(table)
    failed = [r.name for r in results if not r.ok]
    if failed:
        console.print(f"[red]✗ {len(failed)} check(s) failed:[/red] {escape(', '.join(failed))}")
    else:
        console.print("[green]✓ all checks passed[/green]")
