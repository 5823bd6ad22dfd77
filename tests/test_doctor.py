"""ddpgraph doctor: the environment report, the live self-test, failures with their fixes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from ddpgraph.cli import cli
from ddpgraph.doctor import env

CHECK_NAMES = [
    "process group (ddpgraph.init)",
    "unique device per rank",
    "all-reduce",
    "object gather",
    "captured all-reduce (CUDA graph)",
]


def in_process(nproc: int, timeout_s: float) -> dict[int, list[dict[str, Any]]]:
    """A stand-in for the launcher: this process as the only rank, so monkeypatches apply."""
    return {0: env.selftest_worker(timeout_s)}


def replace_check(monkeypatch: pytest.MonkeyPatch, name: str, run) -> None:
    checks = tuple(env._Check(c.name, run, c.fix) if c.name == name else c for c in env.CHECKS)
    assert checks != env.CHECKS
    monkeypatch.setattr(env, "CHECKS", checks)


@pytest.mark.timeout(180)
def test_cpu_selftest_passes_with_two_ranks():
    results = env.run_selftest(2, timeout_s=60)
    assert [r.name for r in results] == CHECK_NAMES
    assert [r.status for r in results] == ["ok", "ok", "ok", "ok", "skip"]
    by_name = {r.name: r for r in results}
    assert by_name["process group (ddpgraph.init)"].detail == "2 rank(s), backend gloo"
    assert by_name["all-reduce"].detail == "sum over 2 ranks = 3"
    assert by_name["object gather"].detail == "2 objects, in rank order"
    assert "no GPU" in by_name["captured all-reduce (CUDA graph)"].detail


@pytest.mark.timeout(180)
def test_cli_json_is_valid_and_complete():
    result = CliRunner().invoke(cli, ["doctor", "--json", "--nproc", "2"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["ok"] is True
    assert payload["environment"]["torch"] and "variables" in payload["environment"]
    assert [c["name"] for c in payload["checks"]] == CHECK_NAMES
    assert all(
        set(c) == {"name", "status", "detail", "fix", "failed_ranks", "ok"}
        for c in payload["checks"]
    )


def test_failing_check_gives_a_cross_its_fix_and_exit_one(monkeypatch: pytest.MonkeyPatch):
    def broken(rt):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    replace_check(monkeypatch, "all-reduce", broken)
    monkeypatch.setattr(env, "_launch", in_process)
    result = CliRunner().invoke(cli, ["doctor"], terminal_width=200)
    assert result.exit_code == 1
    row = next(line for line in result.output.splitlines() if "all-reduce" in line and "│" in line)
    assert "✗" in row and "illegal memory access" in row
    assert "CUDA_LAUNCH_BLOCKING=1" in result.output  # the fix explain() knows for this text
    assert "✗ 1 check(s) failed: all-reduce" in result.output


def test_failure_skips_the_checks_after_it(monkeypatch: pytest.MonkeyPatch):
    def wrong(rt):
        raise env.SelfTestFailure("all_reduce gave 7, expected 3", "update NCCL")

    replace_check(monkeypatch, "all-reduce", wrong)
    monkeypatch.setattr(env, "_launch", in_process)
    results = env.run_selftest(1)
    assert [r.status for r in results] == ["ok", "ok", "fail", "skip", "skip"]
    failed = results[2]
    assert failed.detail == "rank 0: SelfTestFailure: all_reduce gave 7, expected 3"
    assert failed.fix == "update NCCL" and failed.failed_ranks == (0,)
    assert results[3].detail == "not run: an earlier check failed"


def test_unknown_error_gets_the_checks_own_fix(monkeypatch: pytest.MonkeyPatch):
    def odd(rt):
        raise ValueError("something nobody has seen")

    replace_check(monkeypatch, "object gather", odd)
    monkeypatch.setattr(env, "_launch", in_process)
    result = CliRunner().invoke(cli, ["doctor", "--json"])
    assert result.exit_code == 1
    gather = next(c for c in json.loads(result.output)["checks"] if c["name"] == "object gather")
    assert gather["ok"] is False and gather["detail"].endswith("something nobody has seen")
    assert gather["fix"] == "bind the device before object collectives and pass [None] * world_size"


def test_launch_failure_is_reported_with_explanation(monkeypatch: pytest.MonkeyPatch):
    def dead(nproc, timeout_s):
        raise RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(...)")

    monkeypatch.setattr(env, "_launch", dead)
    result = CliRunner().invoke(cli, ["doctor", "--json"])
    assert result.exit_code == 1
    (check,) = json.loads(result.output)["checks"]
    assert check["name"] == "self-test processes" and check["status"] == "fail"
    assert check["fix"].startswith("a collective timed out: ")


def test_merge_names_the_failing_ranks():
    ok = {"name": "all-reduce", "status": "ok", "detail": "sum = 6", "fix": None}
    bad = {"name": "all-reduce", "status": "fail", "detail": "wrong sum 5", "fix": "fix it"}
    skip = {"name": "graph", "status": "skip", "detail": "no GPU", "fix": None}
    merged = env.merge({0: [ok, skip], 1: [bad, skip], 2: [bad, skip]})
    assert merged == [
        env.CheckResult("all-reduce", "fail", "ranks 1, 2: wrong sum 5", "fix it", (1, 2)),
        env.CheckResult("graph", "skip", "no GPU"),
    ]
    assert [r.ok for r in merged] == [False, True]


def test_environment_report_lists_the_relevant_variables():
    report = env.collect_env(
        {
            "CUDA_VISIBLE_DEVICES": "1,0",
            "NCCL_DEBUG": "INFO",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "4",
            "PATH": "/usr/bin",
        }
    )
    assert report.variables == {
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "4",
    }
    lines = report.lines()
    assert "CUDA_VISIBLE_DEVICES: '1,0'" in lines and "NCCL_DEBUG=INFO" in lines
    assert any(line.startswith("torch: ") for line in lines)
    if not report.cuda_available:
        assert report.gpus == () and report.nccl is None and "gpus: 0" in lines


def test_help():
    result = CliRunner().invoke(cli, ["doctor", "--help"])
    assert result.exit_code == 0
    assert "--json" in result.output and "--nproc" in result.output
    for command in ("lint", "explain"):
        assert CliRunner().invoke(cli, [command, "--help"]).exit_code == 0


def test_dead_rank_is_reported_in_one_line(monkeypatch: pytest.MonkeyPatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file="/nonexistent")

    def killed(nproc, timeout_s):
        raise ChildFailedError("selftest_worker", {1: failure})

    monkeypatch.setattr(env, "_launch", killed)
    (result,) = env.run_selftest(2)
    assert result.name == "self-test processes" and not result.ok
    assert result.detail.startswith("rank 1 was killed by signal 9 before reporting")
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in (result.fix or "")


def test_object_gather_check_uses_ddpgraphs_collective(monkeypatch: pytest.MonkeyPatch):
    import torch.distributed as dist

    def torchs(*args, **kwargs):
        raise AssertionError("the self-test called torch.distributed.all_gather_object")

    monkeypatch.setattr(dist, "all_gather_object", torchs)
    monkeypatch.setattr(env, "_launch", in_process)
    results = env.run_selftest(1)
    gather = next(r for r in results if r.name == "object gather")
    assert gather.status == "ok" and gather.detail == "1 objects, in rank order"
