"""The GPU receipt names the tree that ran and counts what pytest itself reported."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def _receipt_module():
    spec = importlib.util.spec_from_file_location("gpu_receipt", ROOT / "benchmarks/gpu_receipt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_receipt"] = module
    spec.loader.exec_module(module)
    return module


def _git_tree_of_working_files(tmp_path: Path, folder: str) -> str:
    """git's own id for `folder` as it is on disk now (a scratch index: the real one is untouched)."""
    env = {**os.environ, "GIT_INDEX_FILE": str(tmp_path / "index")}
    subprocess.run(["git", "add", "-A", "--", folder], cwd=ROOT, env=env, check=True)
    return subprocess.run(
        ["git", "write-tree", f"--prefix={folder}/"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git")
@pytest.mark.parametrize("folder", ["src", "tests/gpu"])
def test_tree_hash_is_gits_own_for_the_files_on_disk(tmp_path, folder):
    # src/ holds the editable install's egg-info and bytecode here: the hash must skip both, as git does
    receipt = _receipt_module()
    assert receipt.git_tree_hash(ROOT / folder) == _git_tree_of_working_files(tmp_path, folder)


def test_tree_hash_sees_a_one_byte_change_and_the_executable_bit(tmp_path):
    receipt = _receipt_module()
    (tmp_path / "pkg").mkdir()
    module = tmp_path / "pkg" / "a.py"
    module.write_text("x = 1\n")
    first = receipt.git_tree_hash(tmp_path)
    module.write_text("x = 2\n")
    second = receipt.git_tree_hash(tmp_path)
    module.chmod(0o755)
    assert len({first, second, receipt.git_tree_hash(tmp_path)}) == 3


_SAMPLE = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="needs 2 GPUs")
def test_skipped():
    pass

@pytest.mark.xfail(strict=True, reason="upstream bug")
def test_known_failure():
    raise RuntimeError("known")

class TestGroup:
    @pytest.mark.parametrize("n", [1, 2])
    def test_param(self, n):
        assert n == 1
"""


def test_merge_counts_what_pytest_reported_in_each_part(tmp_path):
    receipt = _receipt_module()
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_sample.py").write_text(_SAMPLE)
    part = tmp_path / "part1"
    part.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={part}/gpu-tests-1.xml",
        ],
        cwd=suite,
        capture_output=True,
        check=False,
    )
    env = {"trees": {"src": "abc"}, "gpus": ["NVIDIA H200"], "date": "d1"}
    (part / "gpu-env-1.json").write_text(json.dumps(env))
    result = receipt.merge([part], expect_head=False)
    assert result["counts"] == {"failed": 2, "passed": 2, "skipped": 1, "xfailed": 1}
    failed = {
        row["nodeid"]: row["first_line"]
        for row in result["not_passed"]
        if row["outcome"] == "failed"
    }
    assert set(failed) == {"test_sample.py::test_fails", "test_sample.py::TestGroup::test_param[2]"}
    assert "one is not two" in failed["test_sample.py::test_fails"]


def test_merge_refuses_parts_that_ran_on_different_trees(tmp_path):
    receipt = _receipt_module()
    for i, tree in ((1, "aaa"), (2, "bbb")):
        part = tmp_path / f"part{i}"
        part.mkdir()
        env = {"trees": {"src": tree}, "gpus": ["NVIDIA H200"], "date": "d"}
        (part / f"gpu-env-{i}.json").write_text(json.dumps(env))
        (part / f"gpu-tests-{i}.xml").write_text(
            '<testsuites><testsuite name="pytest"/></testsuites>'
        )
    with pytest.raises(SystemExit, match="different trees"):
        receipt.merge([tmp_path / "part1", tmp_path / "part2"], expect_head=False)


def test_merge_refuses_a_run_without_a_gpu(tmp_path):
    receipt = _receipt_module()
    (tmp_path / "gpu-env-1.json").write_text(
        json.dumps({"trees": {"src": "a"}, "gpus": [], "date": "d"})
    )
    (tmp_path / "gpu-tests-1.xml").write_text('<testsuites><testsuite name="pytest"/></testsuites>')
    with pytest.raises(SystemExit, match="without a GPU"):
        receipt.merge([tmp_path], expect_head=False)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    ("part", "files", "said"),
    [
        ("only", None, "set FILES to the test files"),
        ("only", "   ", "set FILES to the test files"),
        ("3", None, "PART must be 1, 2, all or only (with FILES), not '3'"),
    ],
)
def test_gpu_suite_refuses_a_part_it_cannot_run_before_installing_anything(
    tmp_path, part, files, said
):
    env = {k: v for k, v in os.environ.items() if k != "FILES"}
    env["OUT"] = str(tmp_path / "out")
    if files is not None:
        env["FILES"] = files
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_suite.sh"), part],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert said in done.stderr
    assert not list((tmp_path / "out").iterdir())  # no env file, no JUnit, no log
