"""Run a ported script and its baseline the same way, and read back their per-iteration losses.

Each port lives in ``examples/ports/<name>/``: ``original/`` (the public files, verbatim, with their
licence and source), ``baseline.py`` (the original's training script plus the few lines that let
it run on 2 CPU ranks and record its losses) and ``ported.py`` (``baseline.py`` moved to
ddpgraph). Both run under torchrun with ``original/`` on ``PYTHONPATH``, so the unchanged helper
modules (nanoGPT's ``model.py``, the tutorial's ``datautils.py``) are imported from there.

Used by ``tests/test_ports.py`` (CPU, 2 gloo ranks) and ``run_gpu.py`` (one CUDA device).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PORTS = Path(__file__).resolve().parent
VARIANTS = ("baseline", "ported")


@dataclass(frozen=True)
class Port:
    """One ported script: where it lives, its tiny CPU arguments and its GPU arguments."""

    name: str
    original: str  # the training script in original/ that baseline.py starts from
    cpu_args: tuple[str, ...]
    gpu_args: tuple[str, ...]
    prepare: Callable[[Path], None] = lambda workdir: None
    launcher: str = "torchrun"  # on the GPU; "spawn": the script starts its own processes

    def script(self, variant: str) -> Path:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}; use one of {VARIANTS}")
        return PORTS / self.name / f"{variant}.py"


def _nanogpt_data(workdir: Path) -> None:
    """nanoGPT's own data layout (``data/<dataset>/{train,val}.bin`` + ``meta.pkl``) and its
    ``configurator.py``, which ``train.py`` execs from the working directory."""
    shutil.copy(PORTS / "nanogpt" / "original" / "configurator.py", workdir)
    data = workdir / "data" / "tiny"
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    # a learnable token stream: a random walk over a 64-token vocabulary
    tokens = np.cumsum(rng.integers(-2, 3, size=200_000)) % 64
    tokens[:180_000].astype(np.uint16).tofile(data / "train.bin")
    tokens[180_000:].astype(np.uint16).tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 64}, f)


def _llmc_data(workdir: Path) -> None:
    """One shard in llm.c's layout (``dev/data/*``: a header of 256 int32, magic 20240520,
    version 1, the token count; then the tokens as uint16): a random walk over 64 tokens."""
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tokens = (np.cumsum(rng.integers(-2, 3, size=100_000)) % 64).astype(np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, len(tokens))
    with open(data / "tiny_train.bin", "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())


LLMC_COMMON = (
    "--input_bin=data/tiny_train.bin", "--overfit_single_batch=0", "--write_tensors=0",
    "--learning_rate=0.001", "--warmup_iters=3", "--learning_rate_decay_frac=0.1",
    "--weight_decay=0.1", "--grad_clip=1.0", "--val_loss_every=0", "--sample_every=0",
)  # fmt: skip

# 2 ranks x batch 2 x 16 tokens = 64 tokens per micro-step: 2 micro-steps per step, each with
# require_backward_grad_sync, the LR set after them, the norm printed
LLMC_CPU = (
    *LLMC_COMMON, "--device=cpu", "--dtype=float32", "--model=d2", "--batch_size=2",
    "--sequence_length=16", "--total_batch_size=128", "--num_iterations=12",
)  # fmt: skip
# GPT-2 124M's shape (d12) from scratch, bf16, 2 micro-steps per step on one GPU
LLMC_GPU = (
    *LLMC_COMMON, "--dtype=bfloat16", "--model=d12", "--batch_size=8", "--sequence_length=256",
    "--total_batch_size=4096", "--num_iterations=80",
)  # fmt: skip

NANOGPT_COMMON = (
    "--dataset=tiny", "--eval_interval=100000", "--eval_iters=2", "--log_interval=1",
    "--always_save_checkpoint=False", "--out_dir=out",
)  # fmt: skip

PORTS_BY_NAME: dict[str, Port] = {
    port.name: port
    for port in (
        Port(
            "nanogpt",
            "train.py",
            # nanoGPT's own configurator; 2 ranks split gradient_accumulation_steps=4 into 2 each
            cpu_args=(
                *NANOGPT_COMMON,
                "--device=cpu",
                "--backend=gloo",
                "--dtype=float32",
                "--compile=False",
                "--n_layer=2",
                "--n_head=2",
                "--n_embd=32",
                "--block_size=32",
                "--batch_size=4",
                "--gradient_accumulation_steps=4",
                "--dropout=0.1",
                "--max_iters=15",
                "--warmup_iters=5",
                "--lr_decay_iters=15",
                "--learning_rate=0.001",
                "--min_lr=0.0001",
            ),
            # the baby-GPT of nanoGPT's config/train_shakespeare_char.py on one GPU, dropout 0 so that
            # the two curves differ only by graphed-vs-eager numerics (the first 12 steps are eager)
            gpu_args=(
                *NANOGPT_COMMON,
                "--dtype=bfloat16",
                "--compile=False",
                "--n_layer=6",
                "--n_head=6",
                "--n_embd=384",
                "--block_size=256",
                "--batch_size=64",
                "--gradient_accumulation_steps=4",
                "--dropout=0.0",
                "--max_iters=300",
                "--warmup_iters=100",
                "--lr_decay_iters=300",
                "--learning_rate=0.001",
                "--min_lr=0.0001",
            ),
            prepare=_nanogpt_data,
        ),
        Port(
            "llmc",
            "train_gpt2.py",
            cpu_args=LLMC_CPU,
            gpu_args=LLMC_GPU,
            prepare=_llmc_data,
        ),
        Port(
            "ddp_tutorial",
            "multigpu_torchrun.py",
            # its own argparse: total_epochs save_every --batch_size; 2048 samples / 2 ranks / 64
            cpu_args=("1", "1", "--batch_size=64"),
            gpu_args=("20", "100", "--batch_size=32"),
        ),
        Port(
            "imagenet",
            "main.py",
            # its own flags, plus --dummy-samples/--image-size (baseline.py adds them); squeezenet1_1
            # because it is small (torchvision's, or the stand-in's where torchvision is missing)
            cpu_args=(
                "--dist-url=env://",
                "--dist-backend=gloo",
                "--dummy",
                "--dummy-samples=160",
                "--lr=0.01",
                "--image-size=32",
                "-a",
                "squeezenet1_1",
                "-b",
                "8",
                "-j",
                "0",
                "--epochs=1",
                "--seed=0",
                "--print-freq=1000",
            ),
            # one GPU in the script's recommended mode (torch.multiprocessing.spawn, one process
            # per visible GPU: run_gpu.py shows it one); under torchrun with one process the
            # script would take its DataParallel branch instead of DDP
            gpu_args=(
                "--multiprocessing-distributed",
                "--world-size=1",
                "--rank=0",
                "--dist-url=tcp://127.0.0.1:{port}",
                "--dist-backend=nccl",
                "--dummy",
                "--dummy-samples=25600",
                "--image-size=224",
                "-a",
                "{arch}",
                "-b",
                "256",
                "-j",
                "12",
                "--epochs=1",
                "--seed=0",
                "--print-freq=20",
            ),
            launcher="spawn",
        ),
    )
}


@dataclass
class Result:
    """One run: the losses rank 0 recorded, ms per iteration after ``skip`` iterations, and how
    the process ended."""

    port: str
    variant: str
    returncode: int | None
    seconds: float
    losses: list[float] = field(default_factory=list)
    ms_per_iter: float | None = None
    error: str | None = None
    stderr_tail: str | None = None
    retried: str | None = None  # why the run was started again (torch's exit abort)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@functools.cache
def has_torchvision() -> bool:
    """Whether a working torchvision imports here (a CUDA build next to a CPU-only torch fails)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    probe = "import torchvision.models, torchvision.datasets"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def command(
    port: Port, variant: str, nproc: int, mode: str, extra: Sequence[str] = ()
) -> list[str]:
    """The command line; ``extra`` arguments come last, so they override (argparse and nanoGPT's
    configurator both keep the last value)."""
    args = (*(port.cpu_args if mode == "cpu" else port.gpu_args), *extra)
    if mode == "gpu" and port.launcher == "spawn":
        arch = "resnet50" if has_torchvision() else "squeezenet1_1"
        args = tuple(a.format(port=free_port(), arch=arch) for a in args)
        return [sys.executable, str(port.script(variant)), *args]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(port.script(variant)), *args,
    ]  # fmt: skip


def environment(port: Port, losses: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(PORTS / port.name / "original"), str(PORTS), env.get("PYTHONPATH", "")]
    if port.name == "imagenet" and not has_torchvision():
        paths.insert(0, str(PORTS / "imagenet" / "standin"))
    if port.name == "llmc" and importlib.util.find_spec("tiktoken") is None:
        paths.insert(0, str(PORTS / "llmc" / "standin"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PORTS_LOSSES"] = str(losses)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


# A worker that trained to the end can still die as its interpreter exits: torch's C++ side
# aborts with this line (a c10d/gloo thread torn down while joinable). Seen with the unmodified
# nanoGPT baseline in 1 of 12 CPU runs (torch 2.13), and twice in a row in one CI run on a loaded
# 2-core machine (torch 2.14.1); it says nothing about the training compared.
TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_RETRIES = 2  # runs after the first that such an abort may start


def run(
    port: Port,
    variant: str,
    workdir: Path,
    *,
    nproc: int,
    mode: str,
    timeout: float,
    skip: int = 0,
    env: dict[str, str] | None = None,
    extra: Sequence[str] = (),
) -> Result:
    """Run one variant in ``workdir``; never raises for a failed run.

    ``workdir`` is emptied first: the scripts resume from what they find there (the tutorial's
    ``snapshot.pt``), and a comparison needs two fresh runs. A run killed by torch's abort at
    interpreter exit (``TEARDOWN_ABORT``) is run again, from scratch, up to
    ``TEARDOWN_RETRIES`` times, and says so in ``retried``; any other failure, or an abort on
    the last run, is the result.
    """
    argv = command(port, variant, nproc, mode, extra)
    variables = environment(port, workdir / "losses.json", env)
    result = _run_once(port, variant, workdir, argv, variables, timeout, skip)
    aborts: list[str] = []
    while (
        result.error is not None
        and TEARDOWN_ABORT in (result.stderr_tail or "")
        and len(aborts) < TEARDOWN_RETRIES
    ):
        aborts.append(result.error)
        result = _run_once(port, variant, workdir, argv, variables, timeout, skip)
        result.retried = f"{len(aborts)} run(s) died at exit ({TEARDOWN_ABORT}): {aborts[0]}"
    return result


def _run_once(
    port: Port,
    variant: str,
    workdir: Path,
    argv: list[str],
    variables: dict[str, str],
    timeout: float,
    skip: int,
) -> Result:
    """One run of ``argv`` in a fresh ``workdir`` (the port's files put in again)."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    port.prepare(workdir)
    losses = workdir / "losses.json"
    losses.unlink(missing_ok=True)
    started = time.perf_counter()
    result = Result(port.name, variant, None, 0.0)
    try:
        proc = subprocess.run(
            argv,
            cwd=workdir,
            env=variables,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        result.returncode = proc.returncode
        (workdir / "stdout.txt").write_text(proc.stdout)
        (workdir / "stderr.txt").write_text(proc.stderr)
        if proc.returncode != 0:
            result.error = f"exit {proc.returncode}: {root_cause(proc.stderr)}"
            result.stderr_tail = proc.stderr[-4000:]
    except subprocess.TimeoutExpired:
        result.error = f"timed out after {timeout:g} s"
    result.seconds = time.perf_counter() - started
    if losses.exists():
        recorded = json.loads(losses.read_text())
        result.losses = recorded["losses"]
        result.ms_per_iter = ms_per_iter(recorded["times"], skip)
    elif result.error is None:
        result.error = "no losses were recorded"
    return result


def root_cause(stderr: str) -> str:
    """The last exception line a worker printed (torchrun's own summary comes after it)."""
    pattern = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Interrupt)\b.*")
    lines = [
        m.group(0)
        for m in map(pattern.match, stderr.splitlines())
        if m and "ChildFailed" not in m.group(0)
    ]
    fallback = [line for line in stderr.splitlines() if line.strip() and not line.startswith("=")]
    return (lines or fallback or ["(no stderr)"])[-1][:500]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ms_per_iter(times: Sequence[float], skip: int) -> float | None:
    """Median milliseconds between consecutive iterations, leaving out the first ``skip``."""
    gaps = np.diff(np.asarray(times[skip:], dtype=np.float64))
    return float(np.median(gaps) * 1000) if gaps.size else None
