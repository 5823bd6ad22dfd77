"""A newcomer's edges, round five (issue 50): the command line never deletes or overwrites what
the user has, never misreports a finished run, and ends any option `--help` offers in one line.
Each test failed on the code before the fix (5713d53)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ddpgraph.cli import cli

from .procs import child_env, run_python, sigint_default


def _fake_run(names, *, modes, steps, repeats, quick, out):
    from ddpgraph.bench import write_outputs

    run = {m: {"median_ms": 1.0, "first_fast_step_s": 0.1} for m in ("eager_ddp", "train_step")}
    write_outputs({"environment": {}, "world_size": 1, "configs": {"c": {"runs": [run]}}}, out)


def _fake_varlen(*, repeats, quick, out):
    out.write_text(json.dumps({"config": {}, "runs": []}))


@pytest.fixture
def fake_bench(monkeypatch):
    import ddpgraph.bench
    import ddpgraph.bench.varlen

    monkeypatch.setattr(ddpgraph.bench, "run_bench", _fake_run)
    monkeypatch.setattr(ddpgraph.bench.varlen, "run_varlen", _fake_varlen)


def _user_png(path: Path) -> bytes:
    """A PNG the user made with matplotlib (as a logo or a plot of their own would be)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [1, 0])
    fig.savefig(path, format="png")
    plt.close(fig)
    return path.read_bytes()


# --- 1. bench removes only files it wrote ------------------------------------------------------


def test_bench_never_removes_a_users_file_that_shares_the_jsons_name(tmp_path, fake_bench):
    readme = tmp_path / "README.md"
    readme.write_text("# my project\n\nMy own words.\n")
    logo = tmp_path / "logo.png"
    logo_bytes = _user_png(logo)
    for out, kept in ((tmp_path / "README.json", readme), (tmp_path / "logo.json", logo)):
        result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert "removed" not in result.output
        assert f"{kept}: this run writes its {'table' if kept is readme else 'chart'} there, " in (
            " ".join(result.output.split())
        )
        assert not out.exists()
    assert readme.read_text() == "# my project\n\nMy own words.\n"
    assert logo.read_bytes() == logo_bytes
    # a --varlen run writes no table or chart: it leaves whatever is beside its JSON alone
    result = CliRunner().invoke(cli, ["bench", "--varlen", "--out", str(tmp_path / "README.json")])
    assert result.exit_code == 0, result.output
    assert "removed" not in result.output
    assert readme.read_text() == "# my project\n\nMy own words.\n"
    assert logo.read_bytes() == logo_bytes


def test_bench_replaces_the_table_and_chart_it_wrote(tmp_path, fake_bench):
    out = tmp_path / "b.json"
    assert CliRunner().invoke(cli, ["bench", "--quick", "--out", str(out)]).exit_code == 0
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"ddpgraph bench: removed {out.with_suffix('.md')}" in result.output
    assert f"ddpgraph bench: removed {out.with_suffix('.png')}" in result.output


# --- 2. an --out that is one of its own companions ----------------------------------------------


@pytest.mark.parametrize("name", ["res.md", "res.png"])
def test_bench_refuses_an_out_its_table_or_chart_would_overwrite(tmp_path, fake_bench, name):
    out = tmp_path / name
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "the JSON would be overwritten. Pass a .json name, e.g. " in " ".join(
        result.output.split()
    )
    assert not out.exists() and "wrote" not in result.output


# --- 5. a trailing / means a folder -------------------------------------------------------------


def test_bench_out_naming_a_folder_writes_the_default_name_in_it(tmp_path, fake_bench):
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", f"{tmp_path}/results/"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "results" / "bench.json").is_file()
    assert (tmp_path / "results" / "bench.md").is_file()
    assert not (tmp_path / "results.md").exists()
    assert f"wrote {tmp_path}/results/bench.json" in result.output
    # an existing folder, without the slash, is a folder too
    result = CliRunner().invoke(cli, ["bench", "--varlen", "--out", str(tmp_path / "results")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "results" / "varlen.json").is_file()


# --- 3. Ctrl-C once run.json is written ---------------------------------------------------------


@pytest.mark.timeout(300)
def test_ctrl_c_after_run_json_is_written_reports_the_finished_run(tmp_path):
    out = tmp_path / "run"
    job = subprocess.Popen(
        [sys.executable, "-m", "ddpgraph", "train", "--steps", "40", "--out", str(out)],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=sigint_default,
    )  # fmt: skip
    try:
        assert job.stdout is not None
        for line in job.stdout:
            if line.startswith("wrote "):  # rank 0 wrote run.json; the workers are exiting
                os.killpg(job.pid, signal.SIGINT)
                break
        _, stderr = job.communicate(timeout=200)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert "interrupted" not in stderr and "--resume" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "ddpgraph train: finished all 40 steps", stderr
    assert job.returncode == 0
    assert json.loads((out / "run.json").read_text())["steps_done"] == 40


# --- 4. one run per --out folder ----------------------------------------------------------------


def test_a_second_train_in_the_same_out_is_refused_naming_the_first_runs_pid(tmp_path):
    from ddpgraph.demo.lock import OutLock

    out = tmp_path / "run"
    with OutLock.take(out):  # this process is "the other run", alive
        for extra in ([], ["--resume"]):
            result = CliRunner().invoke(cli, ["train", "--steps", "5", "--out", str(out), *extra])
            assert result.exit_code == 2, result.output
            assert (
                f"ddpgraph train: --out {out} is in use by another ddpgraph train (pid "
                f"{os.getpid()}): two runs in one folder would overwrite"
            ) in " ".join(result.output.split())
    assert not (out / ".ddpgraph-train.lock").exists()  # released


def test_a_lock_left_by_a_run_that_died_is_taken_over(tmp_path):
    from ddpgraph.demo.lock import LOCK_NAME, OutLock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(f"{dead.pid}\n")  # what a SIGKILLed run leaves
    with OutLock.take(out) as lock:
        assert lock.stale_pid == dead.pid
        assert (out / LOCK_NAME).read_text() == f"{os.getpid()}\n"


# --- 14. a refused run leaves no folder ---------------------------------------------------------


@pytest.mark.parametrize(
    "args", [["--resume"], ["--stop-after", "10", "--steps", "5"], ["--batch-size", "8192"]]
)
def test_a_refused_train_run_leaves_no_folder_behind(tmp_path, args):
    out = tmp_path / "new" / "run"
    result = CliRunner().invoke(cli, ["train", "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "new").exists()


# --- 11. the --resume command can be pasted -----------------------------------------------------


def test_the_resume_command_is_quoted_for_the_shell():
    import shlex

    from ddpgraph.demo.launch import resume_command
    from ddpgraph.demo.train import TrainConfig

    config = TrainConfig(out="my runs/two words", checkpoint_every=10, lr=0.1)
    command = resume_command(config, 2)
    assert shlex.split(command)[:5] == [
        "ddpgraph",
        "train",
        "--resume",
        "--out",
        "my runs/two words",
    ]
    assert "--lr 0.1" in command and command.endswith("--checkpoint-every 10 --nproc 2")


# --- 16. a file where a folder is expected, and the reverse ------------------------------------


def test_out_naming_a_file_for_a_folder_says_what_the_option_writes(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("")
    result = CliRunner().invoke(cli, ["train", "--out", str(a_file)])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert (
        f"{a_file} is a file; this option names a folder (run.json and checkpoints/ go in it)"
        in text
    )
    assert "Directory" not in text


# --- 9, 10. standard output closed or full ------------------------------------------------------


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    "args",
    [
        ["lint", "--format", "json", "{bad}"],
        ["explain", "operation not permitted when stream is capturing"],
    ],
)
def test_a_full_standard_output_is_one_line_and_exit_1(tmp_path, args):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\ntorch.cuda.set_device(0)\ntorch.distributed.init_process_group()\n"
    )
    args = [a.format(bad=bad) for a in args]
    with open("/dev/full", "w") as full:
        job = subprocess.run([sys.executable, "-m", "ddpgraph", *args], stdout=full,
                             stderr=subprocess.PIPE, text=True, env=child_env(), timeout=120)  # fmt: skip
    assert "Traceback" not in job.stderr and "Exception ignored" not in job.stderr, job.stderr
    assert (
        "ddpgraph: cannot write to standard output (No space left on device); its output is lost."
        in job.stderr
    )
    assert job.returncode == 1


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_train_on_a_full_standard_output_trains_on_and_writes_run_json(tmp_path):
    out = tmp_path / "run"
    with open("/dev/full", "w") as full:
        job = subprocess.run([sys.executable, "-m", "ddpgraph", "train", "--steps", "20", "--out",
                              str(out)], stdout=full, stderr=subprocess.PIPE, text=True,
                             env=child_env(), timeout=280)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    assert "Traceback" not in job.stderr and "failed" not in job.stderr
    assert job.stderr.count("cannot write to standard output (No space left on device)") == 1
    assert job.stderr.strip().splitlines()[-1] == "ddpgraph train: finished all 20 steps"
    assert json.loads((out / "run.json").read_text())["steps_done"] == 20


@pytest.mark.timeout(300)
def test_a_closed_standard_output_does_not_stop_train_or_bench(tmp_path):
    out = tmp_path / "run"
    # the reader takes one line and goes away, as `| head -1` does
    script = (
        f"{sys.executable} -m ddpgraph train --steps 40 --out {out} | head -c 1 >/dev/null; "
        "echo train=${PIPESTATUS[0]} >&2; "
        f"{sys.executable} -m ddpgraph bench --quick --steps 5 --repeats 1 "
        f"--out {tmp_path}/b.json | head -c 1 >/dev/null; echo bench=${{PIPESTATUS[0]}} >&2"
    )
    job = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=child_env(),
                         timeout=280)  # fmt: skip
    assert "train=0" in job.stderr and "bench=0" in job.stderr, job.stderr[-3000:]
    assert "Traceback" not in job.stderr and "BrokenPipe" not in job.stderr
    assert "cannot write" not in job.stderr  # a reader that went away is no error
    assert json.loads((out / "run.json").read_text())["steps_done"] == 40
    assert (tmp_path / "b.json").is_file() and (tmp_path / "b.md").is_file()


# --- 7. --hf: checked before anything is created ------------------------------------------------


def test_an_unknown_hf_name_is_a_usage_error_and_creates_nothing(tmp_path):
    out = tmp_path / "new" / "hf.json"
    result = CliRunner().invoke(cli, ["bench", "--varlen", "--hf", "foo", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--hf': unknown foo; choose from gpt2, llama" in result.output
    assert not (tmp_path / "new").exists()


def _hf_run(out: Path, *, hide_transformers: bool) -> subprocess.CompletedProcess[str]:
    hide = "sys.modules['transformers'] = None; " if hide_transformers else ""
    return run_python(["-c", f"import sys; {hide}from ddpgraph.cli import main; main()",
                       "bench", "--varlen", "--hf", "gpt2", "--out", str(out)],
                      timeout=120)  # fmt: skip


def test_hf_without_transformers_is_one_line_naming_the_install_and_creates_nothing(tmp_path):
    out = tmp_path / "new" / "hf.json"
    job = _hf_run(out, hide_transformers=True)  # as in a venv without transformers
    assert job.returncode == 1, job.stderr[-3000:]
    assert job.stderr.strip() == (
        "ddpgraph bench: --hf builds transformers models, and transformers is not installed: "
        "pip install 'transformers>=4.40' (or the clone's extra: pip install -e '.[hf]')."
    )
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_hf_without_a_gpu_is_refused_before_the_folder_is_created(tmp_path):
    out = tmp_path / "new" / "hf.json"
    job = _hf_run(out, hide_transformers=False)
    assert job.returncode == 1, job.stderr[-3000:]
    assert (
        job.stderr.strip()
        == "ddpgraph bench: bench --varlen --hf measures CUDA graphs: it needs a GPU."
    )
    assert not (tmp_path / "new").exists()


# --- 13. bench: what a failed write or a Ctrl-C at the end keeps --------------------------------


@pytest.mark.timeout(240)
def test_a_disk_that_fills_before_the_last_repeat_says_how_many_the_json_holds(
    tmp_path, monkeypatch
):
    import ddpgraph._files
    from ddpgraph._files import OutputWriteError
    from ddpgraph.bench import run_bench

    out = tmp_path / "b.json"
    real_replace, writes = os.replace, []

    def full_on_the_second_json(src, dst):
        writes.append(Path(dst))
        if writes.count(out) == 2:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(ddpgraph._files.os, "replace", full_on_the_second_json)
    with pytest.raises(OutputWriteError) as failed:
        run_bench([], modes=None, steps=5, repeats=2, quick=True, out=out)
    assert (
        f"pass another --out ({out} holds 1 of the 2 repeat(s); each finished repeat's times "
        "are printed above)"
    ) in str(failed.value)
    assert "results are printed above" not in str(failed.value)
    assert len(json.loads(out.read_text())["configs"]["MLP 2x64 b8 (quick)"]["runs"]) == 1


def test_ctrl_c_while_the_chart_is_drawn_says_the_json_and_table_are_kept(
    tmp_path, fake_bench, monkeypatch
):
    import ddpgraph.bench.report

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ddpgraph.bench.report, "chart", interrupted)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(out)])
    assert result.exit_code == 130, result.output
    assert (
        f"ddpgraph bench: interrupted (SIGINT); kept {out} and {out.with_suffix('.md')}; the "
        "results are printed above\n"
    ) in result.output


# --- 6. ResNet-50 without a torchvision that imports ---------------------------------------------

# What `import torchvision` raises with PyPI's x86 torchvision 0.28.0 beside CPU torch 2.13.0
# (its _C.so links libtorch_cuda.so; found on this machine, issue 50): a package that fails alike.
BROKEN_TORCHVISION = 'raise RuntimeError("operator torchvision::nms does not exist")\n'


@pytest.mark.parametrize("broken", [False, True], ids=["missing", "built-for-another-torch"])
def test_resnet50_without_a_working_torchvision_is_one_line_naming_the_install(tmp_path, broken):
    hide = "import sys; sys.modules['torchvision'] = None; " if not broken else "import sys; "
    if broken:
        (tmp_path / "shadow" / "torchvision").mkdir(parents=True)
        (tmp_path / "shadow" / "torchvision" / "__init__.py").write_text(BROKEN_TORCHVISION)
        hide += f"sys.path.insert(0, {str(tmp_path / 'shadow')!r}); "
    out = tmp_path / "new" / "b.json"
    job = run_python(["-c", f"{hide}from ddpgraph.cli import main; main()", "bench", "--config",
                      "resnet50", "--out", str(out)], timeout=120)  # fmt: skip
    assert job.returncode == 1, job.stderr[-3000:]
    (line,) = job.stderr.strip().splitlines()
    assert line.startswith(
        "ddpgraph bench: resnet50: the ResNet-50 configs need torchvision, which does not import "
        "here ("
    ), line
    # torchvision's minor is torch's + 15 (torch 2.13 with 0.28, 2.14 with 0.29)
    wanted = f"pip install 'torchvision==0.{int(torch.__version__.split('.')[1]) + 15}.*'"
    cpu = f"install the CPU build: {wanted} --index-url "
    assert (cpu if torch.version.cuda is None else wanted) in line
    if broken:
        assert "RuntimeError: operator torchvision::nms does not exist" in line
    assert not (tmp_path / "new").exists()


def test_a_default_bench_without_torchvision_leaves_resnet50_out_and_says_so(tmp_path, monkeypatch):
    import ddpgraph.bench

    ran = {}

    def record(names, **kwargs):
        ran["configs"] = names
        _fake_run(names, **kwargs)

    monkeypatch.setattr(ddpgraph.bench, "run_bench", record)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as in a venv without it
    result = CliRunner().invoke(cli, ["bench", "--out", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    assert ran["configs"] == ["mlp", "transformer"]
    assert (
        "ddpgraph bench: note: not measuring ResNet-50: the ResNet-50 configs need torchvision"
        in (result.output)
    )


# --- 12. TrainStep refuses a loss class and a model with nothing to train ----------------------


@pytest.mark.parametrize("loss", [torch.nn.MSELoss, torch.nn.CrossEntropyLoss])
def test_train_step_refuses_a_loss_class_at_construction(loss):
    import ddpgraph as dg
    from ddpgraph.errors import ConfigError

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError) as refused:
        dg.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss)
    name = loss.__name__
    assert str(refused.value) == (
        f"loss_fn={name} is the class, not a loss; pass an instance: loss_fn={name}()."
    )


def test_train_step_refuses_a_model_whose_parameters_are_all_frozen():
    import ddpgraph as dg
    from ddpgraph.errors import ConfigError

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model.requires_grad_(False)
    with pytest.raises(ConfigError) as refused:
        dg.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss())
    assert str(refused.value).startswith(
        "every parameter of the model (Sequential, 4 tensors) has requires_grad=False: there is "
        "nothing to train. Unfreeze"
    )
    model[1].requires_grad_(True)  # a head left trainable (fine-tuning) is accepted
    dg.TrainStep(model, torch.optim.SGD(model[1].parameters(), lr=0.1), torch.nn.MSELoss())


# --- 8. FSDP2 on the built-in ResNet -------------------------------------------------------------


def test_fsdp2_shards_the_blocks_of_a_sequential_model_once_each():
    from ddpgraph.demo.models import build_model
    from ddpgraph.step.parallel.fsdp2 import _block_names

    names = _block_names(build_model("resnet"))
    # the root's children only: a block's own shortcut Sequential is inside a block
    assert names == ["0", "1", "3", "4", "7"]


@pytest.mark.timeout(300)
def test_train_fsdp2_resnet_trains(tmp_path):
    out = tmp_path / "run"
    job = run_python(["-m", "ddpgraph", "train", "--parallel", "fsdp2", "--model", "resnet",
                      "--steps", "4", "--out", str(out)], timeout=280)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    assert "Traceback" not in job.stderr and "FAILED" not in job.stderr
    assert job.stderr.strip().splitlines()[-1] == "ddpgraph train: finished all 4 steps"
    assert json.loads((out / "run.json").read_text())["config"]["parallel"] == "fsdp2"


# --- 20. the Ctrl-C tests do not depend on how the suite was started ---------------------------


def test_children_get_sigint_s_default_even_when_the_suite_ignores_it():
    """As under `nohup`, `cmd &` or a CI runner: SIGINT ignored in the test process."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        probe = (
            "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
        )
        assert run_python(["-c", probe], timeout=60).stdout.strip() == "True"
        job = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True,
                               preexec_fn=sigint_default)  # fmt: skip
        assert job.communicate(timeout=60)[0].strip() == "True"
    finally:
        signal.signal(signal.SIGINT, previous)


# --- 18, 19. --help says the real limits and exit statuses --------------------------------------


@pytest.mark.parametrize("command", ["train", "doctor"])
def test_nproc_help_gives_the_cpu_limit_the_option_checks(command):
    from ddpgraph.distributed.launch import RANKS_PER_CORE

    text = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())
    assert f"at most one per local GPU, or {RANKS_PER_CORE} per CPU core without GPU" in text
    assert "(or CPU core)" not in text


def test_explain_help_names_the_usage_error_status():
    text = " ".join(CliRunner().invoke(cli, ["explain", "--help"]).output.split())
    assert "Exit status: 0 when the error is known, 1 otherwise, 2 for a usage error" in text
    assert CliRunner().invoke(cli, ["explain", ""]).exit_code == 2  # as it says


# --- 21. the docs show what runs, and what prints ----------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _first_python_block(text: str, after: str) -> str:
    return text.split(after, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_example_and_the_docs_quickstart_are_one_script():
    readme = _first_python_block((ROOT / "README.md").read_text(), "## Example\n")
    index = _first_python_block((ROOT / "docs" / "index.md").read_text(), "## Quickstart\n")
    assert readme == index


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the sample is of a machine without a GPU")
def test_the_doctor_sample_in_the_docs_is_what_doctor_prints(tmp_path):
    doc = (ROOT / "docs" / "guides" / "diagnostics.md").read_text()
    sample = doc.split("On a machine without a GPU:\n\n```text\n", 1)[1].split("```", 1)[0]
    job = run_python(["-m", "ddpgraph", "doctor"], env={"COLUMNS": "80"}, timeout=280)
    assert job.returncode == 0, job.stderr[-3000:]
    printed = job.stdout[job.stdout.index(sample.splitlines()[0].strip()) :]
    assert [line.strip() for line in sample.strip().splitlines()] == [
        line.strip() for line in printed.strip().splitlines()
    ]


def test_a_failed_train_run_leaves_no_progress_bar_at_zero(capsys):
    from ddpgraph.demo.progress import Progress

    with pytest.raises(RuntimeError), Progress(True, 300) as progress:
        progress.note("data held on cpu")
        raise RuntimeError("diverged")
    out = capsys.readouterr().out
    assert "data held on cpu" in out
    assert "0/300" not in out and "train" not in out.replace("ddpgraph train:", "")


@pytest.mark.timeout(200)
def test_a_bench_repeat_line_is_one_line_in_a_narrow_terminal(tmp_path, monkeypatch, capsys):
    from ddpgraph.bench import run_bench

    monkeypatch.setenv("COLUMNS", "40")
    run_bench([], modes=None, steps=5, repeats=1, quick=True, out=tmp_path / "b.json")
    (line,) = [text for text in capsys.readouterr().out.splitlines() if text.startswith("[bench]")]
    assert re.fullmatch(r"\[bench\] .* 1/1: eager_ddp [\d.]+ ms \(1\.00x\), train_step [\d.]+ ms "
                        r"\([\d.]+x\)", line), line  # fmt: skip
