from __future__ import annotations

import functools
import time

import pytest

from ddpgraph.testing import WorkerError, WorkerTimeout, run_distributed

from . import workers
from .procs import run_python

pytestmark = pytest.mark.timeout(120)


def test_results_come_back_in_rank_order():
    assert run_distributed(workers.return_rank, 3, init=False, timeout=60) == [0, 1, 2]


def test_workers_run_the_thread_count_their_environment_names():
    # torch is preloaded before a worker's environment is set (forkserver), so OMP_NUM_THREADS
    # must be applied, not only exported, as torchrun's children start with it
    assert run_distributed(workers.thread_counts, 2, init=False, timeout=60) == [(1, 1)] * 2
    asked = run_distributed(
        workers.thread_counts, 2, init=False, timeout=60, env={"OMP_NUM_THREADS": "2"}
    )
    assert asked == [(2, 2)] * 2


def test_failing_rank_is_reported_even_while_peers_block():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 0 raised") as info:
        run_distributed(workers.fail_then_peers_block, 2, args=(0,), timeout=600)
    assert "rank failed before the collective" in info.value.tracebacks[0]
    # the property: the report does not wait for the 600 s timeout (bound sized for a loaded CI)
    assert time.monotonic() - start < 240, "a blocked peer must not stall the report until timeout"


def test_hanging_rank_is_killed_at_timeout_and_named():
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"ranks \[1\] did not finish within 3s") as info:
        run_distributed(workers.hang_on_rank, 2, args=(1,), init=False, timeout=3)
    assert info.value.pending == [1]
    assert time.monotonic() - start < 120  # killed at the timeout, not left running


def test_return_exceptions_keeps_every_rank():
    results = run_distributed(
        workers.fail_on_rank, 2, args=(0,), init=False, timeout=60, return_exceptions=True
    )
    assert isinstance(results[0], KeyError) and results[1] == 1


def test_a_worker_that_dies_without_a_result_is_reported():
    with pytest.raises(WorkerError, match="exited with code 3"):
        run_distributed(workers.exit_abruptly, 2, init=False, timeout=60)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size=0"):
        run_distributed(workers.return_rank, 0)
    with pytest.raises(ValueError, match="timeout=0"):
        run_distributed(workers.return_rank, 1, timeout=0)
    with pytest.raises(ValueError, match=r"fn=.*<lambda> cannot be imported by the workers"):
        run_distributed(lambda: 1, 2)

    def nested() -> int:
        return 1

    with pytest.raises(ValueError, match=r"fn=.*<locals>.nested cannot be imported"):
        run_distributed(nested, 2)


def test_a_partial_of_a_module_level_function_is_accepted():
    assert run_distributed(functools.partial(workers.fail_on_rank, 5), 2, timeout=60) == [0, 1]


SCRIPT = """\
import os
from ddpgraph.testing import run_distributed

def pid():
    return os.getpid()

{call}
"""


@pytest.mark.timeout(60)
def test_a_script_without_a_main_guard_is_told_once_before_any_worker_starts(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.format(call="print(run_distributed(pid, 2))"))
    proc = run_python([str(script)], timeout=50)
    assert proc.returncode == 1
    assert (
        f"run_distributed is called at the top level of {script} (line 7) without "
        '`if __name__ == "__main__":`' in proc.stderr
    )
    assert proc.stderr.count("ddpgraph.errors.ConfigError:") == 1  # once, from the parent
    assert "bootstrapping phase" not in proc.stderr


@pytest.mark.timeout(60)
def test_a_guarded_script_runs_its_workers(tmp_path):
    script = tmp_path / "guarded.py"
    guarded = 'def main():\n    print(len(run_distributed(pid, 2)))\n\nif __name__ == "__main__":\n    main()'
    script.write_text(SCRIPT.format(call=guarded))
    proc = run_python([str(script)], timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "2"


@pytest.mark.timeout(200)
def test_run_distributed_works_inside_a_torchrun_job(tmp_path):
    # torchrun's agent variables (TORCHELASTIC_USE_AGENT_STORE above all) must not reach the
    # workers: their rendezvous would wait for the agent's store on their own port
    script = tmp_path / "inside.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from ddpgraph.testing import run_distributed\n"
        "if __name__ == '__main__':\n"
        "    print('ranks', run_distributed(dist.get_rank, 2, timeout=90))\n"
    )
    job = run_python(["-m", "torch.distributed.run", "--nproc-per-node", "1", str(script)],
                     timeout=180)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    assert "ranks [0, 1]" in job.stdout
