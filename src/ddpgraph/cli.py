"""The ``ddpgraph`` console script. Each subcommand is a thin wrapper over a library function."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import tokenize
from pathlib import Path

import click

from . import __version__, _cli_start, _stdout
from ._debug import DEBUG_ENV, REPORTED, debug_requested, request_debug
from .cli_bench import (
    bench_out,
    hf_names,
    modes_left_out,
    prepare_result_set,
    refuse_colliding_out,
    refuse_ignored_options,
    result_set,
    without_torchvision,
)
from .cli_types import Bounded, FiniteFloatRange, InFolder, OutPath, ProcessCount
from .demo.train import TRAIN_SAMPLES
from .distributed.launch import RANKS_PER_CORE
from .errors import ConfigError
from .errors import explain as explain_error


class _Commands(click.Group):
    """The command group: a signal that stops a command (Ctrl-C, or SIGTERM to one that launched
    workers) ends it with one line and 128 + the signal, as a shell reports it, instead of
    click's "Aborted!" with exit status 1 or a traceback (--debug keeps the traceback)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except BaseException as exc:
            signum = _stopped_by(exc)
            if signum is None or debug_requested():
                raise
            command = " ".join(filter(None, ["ddpgraph", ctx.invoked_subcommand]))
            # a command that stops on Ctrl-C says what it kept (bench: its finished repeats)
            kept = f"; {exc}" if isinstance(exc, KeyboardInterrupt) and str(exc) else ""
            click.echo(f"{command}: interrupted ({signal.Signals(signum).name}){kept}", err=True)
            raise SystemExit(128 + signum) from None


def _stopped_by(exc: BaseException) -> int | None:
    """The signal behind ``exc``: SIGINT for KeyboardInterrupt, torch's agent's SignalException
    (SIGTERM, SIGHUP, SIGQUIT while it runs workers); None for any other exception."""
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    agent = sys.modules.get("torch.distributed.elastic.multiprocessing.api")
    if agent is not None and isinstance(exc, agent.SignalException):
        return int(exc.sigval)
    return None


# The real range of each number (checked at parse time, before any worker starts).
MAX_STEPS = 10_000_000
STEPS = Bounded(min=1, max=MAX_STEPS, why="run.json keeps a loss every 20 steps")
MAX_SEED = 2**63 - 1
MAX_RESTARTS = 1000
MAX_BENCH_STEPS = 100_000
MAX_REPEATS = 1000
TIMEOUT = FiniteFloatRange(
    min=1,
    max=1e9,
    max_open=True,
    why="ddpgraph.init's range: a longer wait is a hang, and timedelta overflows",
)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddpgraph")
@click.option(
    "--debug",
    is_flag=True,
    help=f"Show the traceback of an error, not only its message (also {DEBUG_ENV}=1).",
)
def cli(debug: bool) -> None:
    """Fast PyTorch data-parallel training that never fails silently."""
    if debug:
        request_debug()


@cli.command()
@click.option(
    "--model",
    type=click.Choice(["mlp", "resnet", "transformer"]),
    default="mlp",
    show_default=True,
    help="Built-in model to train.",
)
@click.option("--steps", type=STEPS, default=300, show_default=True)
@click.option(
    "--batch-size",
    type=Bounded(min=1, max=TRAIN_SAMPLES, why=f"the data set has {TRAIN_SAMPLES} samples"),
    default=64,
    show_default=True,
    help="Per rank.",
)
@click.option(
    "--lr",
    type=FiniteFloatRange(min=0, max=10, min_open=True),
    default=0.05,
    show_default=True,
    help="SGD's learning rate (AdamW's is --lr/50 with --parallel fsdp2).",
)
@click.option(
    "--nproc",
    type=ProcessCount(),
    default=None,
    help=f"Worker processes: at most one per local GPU, or {RANKS_PER_CORE} per CPU core "
    "without GPU [default: one per local GPU, or 2 CPU workers on gloo].",
)
@click.option(
    "--seed",
    type=Bounded(min=0, max=MAX_SEED, why="the range every generator the run seeds takes"),
    default=0,
    show_default=True,
)
@click.option(
    "--out",
    type=OutPath(
        file_okay=False, path_type=Path, example="runs/latest", writes="run.json and checkpoints/"
    ),
    default=Path("runs/latest"),
    show_default=True,
    help="Directory for run.json (and checkpoints/).",
)
@click.option(
    "--timeout",
    type=TIMEOUT,
    default=600.0,
    show_default=True,
    help="Seconds a collective may wait for a peer (ddpgraph.init's timeout).",
)
@click.option(
    "--checkpoint-every",
    type=STEPS,
    default=None,
    help="Save a checkpoint every N steps in OUT/checkpoints (the newest 2 are kept).",
)
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in OUT.")
@click.option(
    "--stop-after",
    type=STEPS,
    default=None,
    help="Stop after N steps with a checkpoint, as if interrupted; continue with --resume.",
)
@click.option(
    "--max-restarts",
    type=Bounded(min=0, max=MAX_RESTARTS, why="more restarts than that is a crash loop"),
    default=0,
    show_default=True,
    help="Restart all workers up to K times when one fails (torchrun's option); they resume "
    "from the newest checkpoint.",
)
@click.option(
    "--data",
    type=click.Choice(["auto", "device", "loader"]),
    default="auto",
    show_default=True,
    help="Where batches come from: the data set on the device, gathered inside the graph "
    "(device), a DataLoader through prefetch (loader), or device when it fits (auto).",
)
@click.option(
    "--steps-per-replay",
    type=Bounded(
        min=1, max=TRAIN_SAMPLES, why="one replay takes at most one epoch of the data set"
    ),
    default=2,
    show_default=True,
    help="With the data on the device: training steps per graph replay (more helps models "
    "whose step is shorter than its host work, and slows GPU-bound ones: see the docs).",
)
@click.option(
    "--parallel",
    type=click.Choice(["ddp", "fsdp2"]),
    default="ddp",
    show_default=True,
    help="fsdp2: shard the model with FSDP2 (fully_shard per block, then the root) and train "
    "with AdamW at --lr/50 (SGD on DTensor shards cannot be captured).",
)
def train(
    model: str,
    steps: int,
    batch_size: int,
    lr: float,
    nproc: int | None,
    seed: int,
    out: Path,
    timeout: float,
    checkpoint_every: int | None,
    resume: bool,
    stop_after: int | None,
    max_restarts: int,
    data: str,
    steps_per_replay: int,
    parallel: str,
) -> None:
    """Train a built-in model on a synthetic data set, on every local GPU (or 2 CPU ranks).

    Exit status: 0 trained (or stopped at --stop-after); 1 the run failed, its reason said (a
    diverged run: NaN or inf at step N; a checkpoint that could not be written); 2 a usage error;
    130 Ctrl-C.
    """
    from .demo.launch import launch_training
    from .demo.train import RESULTS_ELSEWHERE, TrainConfig

    _stdout.guard("ddpgraph train", RESULTS_ELSEWHERE)

    _check_train_options(data, steps_per_replay)

    config = TrainConfig(
        model=model,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        out=str(out),
        timeout=timeout,
        checkpoint_every=checkpoint_every,
        resume=resume,
        stop_after=stop_after,
        max_restarts=max_restarts,
        data=data,
        steps_per_replay=steps_per_replay,
        parallel=parallel,
    )
    raise SystemExit(launch_training(config, nproc=nproc))


def _check_train_options(data: str, steps_per_replay: int) -> None:
    """What click's types cannot see: an option the run would ignore."""
    given = click.get_current_context().get_parameter_source("steps_per_replay")
    if data == "loader" and given is not click.core.ParameterSource.DEFAULT:
        raise click.BadParameter(
            f"{steps_per_replay}: steps per replay take their batches from the data on the "
            "device; --data loader feeds one step per call. Drop one of the two.",
            param_hint="'--steps-per-replay'",
        )


@cli.command()
@click.option(
    "--config",
    "configs",
    type=click.Choice(["mlp", "transformer", "resnet50", "resnet50-b256", "transformer-large"]),
    multiple=True,
    help="Configs to run (repeatable) [default: all]; transformer-large with --parallel fsdp2.",
)
@click.option(
    "--mode",
    "modes",
    type=click.Choice(
        [
            "eager_ddp",
            "compile_reduce_overhead",
            "train_step",
            "train_step_channels_last",
            "train_step_compiled",
            "train_step_fp16",
            "train_step_device_data",
        ]
    ),
    multiple=True,
    help="Modes to run (repeatable; eager_ddp always runs, as the baseline) [default: all].",
)
@click.option(
    "--steps",
    type=Bounded(min=5, max=MAX_BENCH_STEPS, why="each step's time is kept in memory"),
    default=60,
    show_default=True,
)
@click.option(
    "--repeats",
    type=Bounded(min=1, max=MAX_REPEATS, why="each repeat is kept in the JSON"),
    default=3,
    show_default=True,
)
@click.option(
    "--quick",
    is_flag=True,
    help="A CPU-friendly smoke run: by default a tiny MLP, eager and TrainStep; --config and "
    "--mode still choose.",
)
@click.option(
    "--varlen",
    is_flag=True,
    help="The variable-length LM instead (lengths 32..256: eager, eager padded, reduce-overhead, "
    "TrainStep + pad_batch buckets); JSON only.",
)
@click.option(
    "--hf",
    "hf",
    multiple=True,
    is_flag=False,
    flag_value="all",
    help="With --varlen: real transformers models (GPT-2, Llama, BERT, ... or the names given) "
    "fed padded, attention-masked batches; needs a GPU and transformers.",
)
@click.option(
    "--out",
    type=OutPath(
        dir_okay=False,
        path_type=Path,
        example="benchmarks/results/bench.json",
        writes="the result set's JSON",
        folders=True,
    ),
    default=None,
    help="The result set's JSON file; a plain run also writes the .md table and .png chart "
    "beside it. A run replaces the whole set, and refuses a file of another kind of run or a "
    "table or chart it did not write. A folder (results/) gets the default name in it "
    "[default: benchmarks/results/bench.json, varlen.json with --varlen, hf.json with --hf, "
    "fsdp2.json with --parallel fsdp2].",
)
@click.option(
    "--parallel",
    type=click.Choice(["ddp", "fsdp2"]),
    default="ddp",
    show_default=True,
    help="fsdp2: the FSDP2 (fully_shard) modes instead: eager FSDP2, forward+backward graphed "
    "(torchtitan's way), TrainStep's whole-step graph; configs transformer, transformer-large.",
)
@click.pass_context
def bench(
    ctx: click.Context,
    configs: tuple[str, ...],
    modes: tuple[str, ...],
    steps: int,
    repeats: int,
    quick: bool,
    varlen: bool,
    hf: tuple[str, ...],
    out: Path | InFolder | None,
    parallel: str,
) -> None:
    """Eager DDP vs torch.compile vs TrainStep, in one run per config; JSON + table + chart."""
    kind = "fsdp2" if parallel == "fsdp2" else "hf" if hf else "varlen" if varlen else "bench"
    _stdout.guard("ddpgraph bench", "the run goes on, and its results go to the files it writes")
    refuse_ignored_options(ctx, kind)
    if kind == "bench" and "transformer-large" in configs:
        raise click.BadParameter(
            "transformer-large is an FSDP2 config; add --parallel fsdp2", param_hint="'--config'"
        )
    notes = modes_left_out(list(configs), list(modes), quick) if kind == "bench" else []
    if kind == "fsdp2":
        _check_fsdp2_configs(configs)
    names = hf_names(hf) if kind == "hf" else None
    if kind == "bench":
        configs, vision_note = without_torchvision(configs, quick)
        notes += vision_note
    path = bench_out(out, kind)
    refuse_colliding_out(path, kind)
    # after every check (a refused run creates no folder), before the run is measured
    prepare_result_set(path, kind)
    for note in notes:
        click.echo(f"ddpgraph bench: {note}", err=True)
    _run_bench(kind, list(configs), list(modes), steps, repeats, quick, names, path)
    for written in result_set(path, kind):
        if written.exists():
            click.echo(f"ddpgraph bench: wrote {written}")


def _run_bench(
    kind: str,
    configs: list[str],
    modes: list[str],
    steps: int,
    repeats: int,
    quick: bool,
    names: list[str] | None,
    out: Path,
) -> None:
    if kind == "fsdp2":
        from .bench.fsdp2 import run_fsdp2

        run_fsdp2(configs, steps=steps, repeats=repeats, quick=quick, out=out)
    elif kind == "hf":
        from .bench.hf import run_hf

        run_hf(repeats=repeats, out=out, only=names, steps=steps)
    elif kind == "varlen":
        from .bench.varlen import run_varlen

        run_varlen(repeats=repeats, quick=quick, out=out)
    else:
        from .bench import run_bench

        run_bench(configs, modes=modes or None, steps=steps, repeats=repeats, quick=quick, out=out)


# What each kind of bench run takes besides --repeats and --out; any other option given is
# refused rather than silently ignored.
@cli.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Output format.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Also show what a rule suspects but cannot prove, as notes (they do not change the "
    "exit status).",
)
def lint(files: tuple[Path, ...], fmt: str, strict: bool) -> None:
    """Check scripts for the classic DDP / CUDA-graph / object-collective bugs (never runs them).

    Exit status: 0 clean (notes alone too), 1 findings, 2 a file could not be read or parsed.
    """
    from .doctor.lint import RULES, lint_paths

    findings, errors = lint_paths(files, strict=strict)
    proven = sum(f.severity == "error" for f in findings)
    if fmt == "json":
        payload = {
            "findings": [f.to_dict() for f in findings],
            "errors": [{"file": e.path, "message": str(e)} for e in errors],
            "rules": {code: rule.summary for code, rule in RULES.items()},
        }
        click.echo(json.dumps(payload, indent=2))
    else:
        for finding in findings:
            click.echo(finding.format_text())
        for error in errors:
            click.echo(f"error: {error}", err=True)
        if findings:
            notes = f", {len(findings) - proven} note(s)" if strict else ""
            click.echo(f"{proven} finding(s){notes}", err=True)
        elif not errors:  # a clean file gets a word too: silence reads as "did it run?"
            click.echo(f"no findings in {_count_files(files)}", err=True)
    raise SystemExit(2 if errors else 1 if proven else 0)


def _count_files(paths: tuple[Path, ...]) -> str:
    count = sum(len(list(p.rglob("*.py"))) if p.is_dir() else 1 for p in paths)
    return f"{count} file{'s' * (count != 1)}"


@cli.command()
@click.argument("source")
def explain(source: str) -> None:
    """Explain an error message: its causes, most likely first, and their fixes.

    SOURCE is the message itself, a file that holds it (a log or a traceback), or "-" to read
    it from stdin. Exit status: 0 when the error is known, 1 otherwise, 2 for a usage error
    (an empty SOURCE, a missing file, a script).
    """
    found = explain_error(_read_message(source))
    if found is None:
        click.echo(
            "No known explanation for this error. Run `ddpgraph doctor` to check the environment "
            "and `ddpgraph lint SCRIPT.py` to check the script.",
            err=True,
        )
        raise SystemExit(1)
    click.echo(found.render())


def _check_fsdp2_configs(configs: tuple[str, ...]) -> None:
    from .bench.fsdp2 import FSDP2_CONFIGS

    other = sorted(set(configs) - set(FSDP2_CONFIGS))
    if other:
        raise click.BadParameter(
            f"{', '.join(other)}: DDP config(s); --parallel fsdp2 runs "
            f"{' and '.join(sorted(FSDP2_CONFIGS))}",
            param_hint="'--config'",
        )


def _read_message(source: str) -> str:
    """The text of ``explain``'s SOURCE: stdin for "-", a file's contents, or SOURCE itself."""
    if source == "-":
        text = _decode(sys.stdin.buffer.read())
        if not text.strip():
            raise click.BadParameter(
                "no text on stdin; pipe the error into it, e.g. "
                "`python train.py 2>&1 | ddpgraph explain -`, or pass the message itself.",
                param_hint="'SOURCE'",
            )
        return text
    if not source.strip():  # Path("") is the working directory
        raise click.BadParameter(
            "empty; pass the error message (quoted), a log file that holds it, or - to read it "
            "from stdin.",
            param_hint="'SOURCE'",
        )
    try:
        is_file = "\n" not in source and Path(source).is_file()
        is_dir = "\n" not in source and Path(source).is_dir()
    except OSError:  # e.g. a long message is not a valid file name
        is_file = is_dir = False
    if is_dir:
        raise click.BadParameter(
            f"{source} is a directory; pass a log file in it, or the error message itself.",
            param_hint="'SOURCE'",
        )
    if not is_file and _names_a_file(source):
        raise click.BadParameter(
            f"no file {source} (looked in {Path.cwd()}); pass an existing log file, or the error "
            "message itself (text with spaces, or on stdin: `... | ddpgraph explain -`).",
            param_hint="'SOURCE'",
        )
    if not is_file:
        return source
    try:
        text = _decode(Path(source).read_bytes())
    except OSError as exc:
        raise click.FileError(source, hint=exc.strerror) from exc
    if _is_a_script(source, text):
        raise click.BadParameter(
            f"{source} is a Python script, not an error message. Check it with `ddpgraph lint "
            f"{source}`, or explain the error it ends with: `python {source} 2>&1 | ddpgraph "
            "explain -`.",
            param_hint="'SOURCE'",
        )
    return text


def _is_a_script(source: str, text: str) -> bool:
    """A Python file (by its suffix, or source that compiles) that holds no traceback: what it
    says is code, whose error names and messages would match known errors by accident."""
    if "Traceback (most recent call last)" in text:
        return False
    if Path(source).suffix.lower() in (".py", ".pyw", ".ipynb"):
        return True
    try:
        compile(text, source, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return any(word in text for word in ("import ", "def ", "class "))


def _names_a_file(source: str) -> bool:
    """Whether ``source`` reads as a file name rather than a message: one word with a path
    separator or a log-like suffix (``run.log``, ``logs/err.txt``); error messages have spaces."""
    if any(c.isspace() for c in source):
        return False
    return os.sep in source or "/" in source or Path(source).suffix.lower() in _LOG_SUFFIXES


_LOG_SUFFIXES = frozenset({".log", ".txt", ".out", ".err", ".stderr", ".stdout", ".json"})


def _decode(data: bytes) -> str:
    """``data`` decoded as ``tokenize.open`` decodes source: a UTF-8 BOM or a PEP 263 coding line
    picks the codec, UTF-8 otherwise; bytes that do not decode are replaced (a log may hold some)."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:  # an unknown or conflicting coding line, or a first line not in UTF-8
        encoding = "utf-8"
    return data.decode(encoding, errors="replace")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option(
    "--nproc",
    type=ProcessCount(),
    default=None,
    help=f"Ranks for the self-test: at most one per local GPU, or {RANKS_PER_CORE} per CPU "
    "core without GPU [default: one per local GPU, or 2 CPU ranks on gloo].",
)
@click.option(
    "--timeout",
    type=TIMEOUT,
    default=60.0,
    show_default=True,
    help="Seconds a self-test collective may take before it counts as hung.",
)
def doctor(as_json: bool, nproc: int | None, timeout: float) -> None:
    """Report the environment and run a live multi-rank self-test, with a fix for each failure.

    Exit status: 0 when every check passes, 1 otherwise.
    """
    from .doctor import env

    report = env.collect_env()
    results = env.run_selftest(nproc, timeout_s=timeout)
    if as_json:
        click.echo(json.dumps(env.to_json(report, results), indent=2))
    else:
        env.render(report, results)
    raise SystemExit(0 if all(r.ok for r in results) else 1)


@cli.command(
    context_settings={
        # every torchrun option passes through to torch's parser, and everything from SCRIPT on
        # (its own --help included) goes to the script
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
    },
    options_metavar="",
)
@click.argument("torchrun_args", metavar="[TORCHRUN OPTIONS] SCRIPT [ARGS]...", nargs=-1,
                type=click.UNPROCESSED)  # fmt: skip
def launch(torchrun_args: tuple[str, ...]) -> None:
    """torchrun with guard rails, for unmodified scripts.

    Takes exactly torchrun's options (see `torchrun --help`), e.g.
    `ddpgraph launch --nproc-per-node 2 train.py --lr 0.1`, and runs torch's own launcher. Each
    worker first binds its device from LOCAL_RANK, routes torch.distributed's object collectives
    (all_gather_object, gather_object, broadcast_object_list) through ddpgraph's checked ones, and
    prints a one-line summary on rank 0; then it runs SCRIPT as __main__ with ARGS. The script
    creates its process group itself, as under torchrun.

    Exit status: 0 when every worker succeeded, 1 when one failed, 2 for a usage error.
    """
    from .distributed.launch import launch as run_launch

    try:
        status = run_launch(torchrun_args)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    raise SystemExit(status)


def main() -> None:
    """The console script: a ddpgraph error is its message (exit 2 for a usage error, else 1);
    its traceback only with --debug or DDPGRAPH_DEBUG=1."""
    _cli_start.done()  # the imports are done: Ctrl-C is a KeyboardInterrupt again
    _stdout.guard("ddpgraph")  # a closed or full standard output: one line, never a traceback
    try:
        cli()
    except SystemExit as exc:
        if _stdout.lost() is not None and exc.code in (0, None):
            raise SystemExit(1) from None  # the output was the product, and it is lost
        raise
    except REPORTED as exc:
        if debug_requested():
            raise
        click.echo(f"ddpgraph: error: {exc}", err=True)
        click.echo(f"(rerun with --debug or {DEBUG_ENV}=1 for the traceback)", err=True)
        raise SystemExit(2 if isinstance(exc, ConfigError) else 1) from None
