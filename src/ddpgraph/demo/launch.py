"""Start ``ddpgraph train``'s workers through torch.distributed's own elastic launcher."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .._debug import DEBUG_ENV, debug_requested
from ..checkpoint.layout import (
    CheckpointError,
    checkpoint_problem,
    latest_checkpoint,
    read_manifest,
    step_dirs,
)
from ..distributed.launch import default_nproc, run_local
from .lock import OutLock, OutLockError
from .train import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    INTERRUPTED_EXITS,
    REPORTED_EXIT,
    SAME_ON_RESUME,
    TRAIN_SAMPLES,
    TrainConfig,
    launched_worker,
)


def launch_training(config: TrainConfig, *, nproc: int | None = None) -> int:
    """Run :func:`run_worker` on ``nproc`` local processes (torchrun --standalone); return an exit code.

    0: trained (stopped at --stop-after or finished: said where, and how to continue); 2: a usage
    error, before any worker starts or a ddpgraph error of the caller's input in the workers; 1:
    another failure; 130: Ctrl-C (the step reached and the newest checkpoint are said).
    """
    workers = nproc or default_nproc()
    if torch.cuda.is_available() and workers > torch.cuda.device_count():
        _say(
            f"--nproc {workers} is more than the {torch.cuda.device_count()} "
            f"visible GPU(s); each rank needs its own GPU. Use --nproc {torch.cuda.device_count()}."
        )
        return 2
    problem = _check_options(config, workers)
    if problem:
        _say(problem)
        return 2
    try:
        lock = OutLock.take(Path(config.out))
    except OutLockError as exc:
        _say(str(exc))
        return 2
    with lock:
        problem = _check_checkpoints(config, workers)
        if problem:
            lock.release(remove_folder_if_new=True)  # a refused run leaves nothing behind
            _say(problem)
            return 2
        if lock.stale_pid is not None:
            _say(f"note: took over --out {config.out} from pid {lock.stale_pid}, which ended "
                 "without releasing it")  # fmt: skip
        return _launch(config, workers, nproc)


def _launch(config: TrainConfig, workers: int, nproc: int | None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for note in _notes(config, workers):
        _say(f"note: {note}")
    # the workers import torch and build the data before their first line: seconds on a busy
    # machine, which would otherwise be silence
    _say(f"starting {workers} worker(s) ({_where(workers)}); --out {config.out}")
    # what an earlier run's workers left behind is not this run's news
    _take(config, INTERRUPTED)
    _take(config, FINISHED)
    _take_failures(config)
    try:
        run_local(
            launched_worker,
            config,
            nproc=workers,
            name="train",
            max_restarts=config.max_restarts,
            reported_exits=() if debug_requested() else (REPORTED_EXIT, *INTERRUPTED_EXITS),
        )
    except (SignalException, KeyboardInterrupt) as exc:
        if debug_requested():
            raise
        if _take(config, FINISHED) is not None:
            # the signal came once rank 0 had written run.json, while the workers exited
            _say(_ended(config, nproc))
            return 0
        signum = getattr(exc, "sigval", signal.SIGINT)
        _say(_interrupted(config, nproc, signal.Signals(signum).name))
        return 128 + int(signum)
    except ChildFailedError as exc:
        if _take(config, FINISHED) is not None and _all_stopped_by_signal(exc):
            _say(_ended(config, nproc))
            return 0
        return _failed(config, exc)
    _take(config, INTERRUPTED)  # left by a rank 0 stopped for a restart (--max-restarts)
    _take(config, FINISHED)
    _say(_ended(config, nproc))
    return 0


def _all_stopped_by_signal(exc: Any) -> bool:
    return all(failure.exitcode in INTERRUPTED_EXITS for failure in exc.failures.values())


def _say(text: str) -> None:
    print(f"ddpgraph train: {text}", file=sys.stderr, flush=True)


def _take(config: TrainConfig, name: str) -> str | None:
    """The text a worker left in --out under ``name`` (removed), or None."""
    path = Path(config.out) / name
    try:
        text = path.read_text()
    except OSError:
        return None
    path.unlink(missing_ok=True)
    return text


def _take_failures(config: TrainConfig) -> dict[int, dict[str, Any]]:
    found = {}
    for path in Path(config.out).glob(FAILED.format(rank="*")):
        rank = path.name.rsplit("rank", 1)[-1]
        text = _take(config, path.name)
        if text is not None and rank.isdigit():
            with contextlib.suppress(ValueError):
                found[int(rank)] = json.loads(text)
    return found


def _failed(config: TrainConfig, exc: Any) -> int:
    """A worker failed: a ddpgraph error as its message (grouped by rank), else torch's report."""
    reported = _take_failures(config)
    _take(config, INTERRUPTED)  # left by a rank 0 the launcher stopped (SIGTERM): not the news
    codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
    if not reported and REPORTED_EXIT in codes.values():
        # the workers could not leave their reports in --out (a full disk): they said it above
        said = ", ".join(str(r) for r, c in sorted(codes.items()) if c == REPORTED_EXIT)
        _say(
            f"failed on rank(s) {said}: the reason is above (no room for it in --out {config.out})"
        )
        return 1
    if not reported or REPORTED_EXIT not in codes.values():
        _say(f"failed:\n{exc.format_msg()}")
        return 1
    by_text: dict[str, list[int]] = {}
    for rank, failure in sorted(reported.items()):
        by_text.setdefault(f"{failure['type']}: {failure['message']}", []).append(rank)
    if len(by_text) == 1:
        # ddpgraph raises its errors alike on every rank; which ones reported before the
        # launcher stopped the others says nothing (the message names a rank where one matters)
        _say(f"failed: {next(iter(by_text))}")
    for text, ranks in by_text.items() if len(by_text) > 1 else ():
        _say(f"failed on rank(s) {', '.join(map(str, ranks))}: {text}")
    # a peer stopped by the launcher once the first rank failed, or one that died otherwise
    others = {r: c for r, c in codes.items() if c != REPORTED_EXIT and r not in reported}
    if others:
        _say("also ended: " + ", ".join(f"rank {r} ({_ending(c)})" for r, c in others.items()))
    print(f"(rerun with --debug or {DEBUG_ENV}=1 for the tracebacks)", file=sys.stderr)
    return 2 if all(failure["usage"] for failure in reported.values()) else 1


def _ending(code: int) -> str:
    """How a worker ended: a signal it handled (the launcher's SIGTERM once a peer failed) by
    name, else its exit code."""
    if code in INTERRUPTED_EXITS:
        return f"stopped by {signal.Signals(code - 128).name}"
    return f"exit code {code}"


def _interrupted(config: TrainConfig, nproc: int | None, signal_name: str) -> str:
    left = _take(config, INTERRUPTED)
    step = None
    with contextlib.suppress(TypeError, ValueError, KeyError):
        step = int(json.loads(left)["step"]) if left else None
    where = (
        f"interrupted ({signal_name}) at step {step} of {config.steps}"
        if step is not None
        else f"interrupted ({signal_name}) before the first step"
    )
    found = latest_checkpoint(config.checkpoints) if _checkpoints_are_this_runs(config) else None
    if found is None and config.checkpoint_every is not None:
        return (
            f"{where}; no checkpoint saved yet (the first comes at step "
            f"{config.checkpoint_every}), so a new run starts from step 0."
        )
    if found is None:
        return (
            f"{where}; no checkpoint saved, so a new run starts from step 0 (pass "
            "--checkpoint-every N to be able to continue an interrupted run)."
        )
    saved = read_manifest(found)["step"] if checkpoint_problem(found) is None else found.name
    return (
        f"{where}; newest checkpoint: step {saved} ({found}); continue with --resume: "
        f"{resume_command(config, nproc)}"
    )


def _checkpoints_are_this_runs(config: TrainConfig) -> bool:
    return config.resume or config.checkpoint_every is not None or config.stop_after is not None


def _ended(config: TrainConfig, nproc: int | None) -> str:
    found = latest_checkpoint(config.checkpoints)
    if config.last_step < config.steps:
        return (
            f"stopped at step {config.last_step} of {config.steps} (--stop-after "
            f"{config.stop_after}); checkpoint {found}; continue with --resume: "
            f"{resume_command(config, nproc)}"
        )
    if config.checkpoint_every is not None:
        return f"finished all {config.steps} steps; final checkpoint {found}"
    return f"finished all {config.steps} steps"


def resume_command(config: TrainConfig, nproc: int | None) -> str:
    """The command line that continues ``config``'s run: --resume and the options it must share,
    quoted for a POSIX shell (it is meant to be pasted)."""
    defaults = TrainConfig()
    parts = ["ddpgraph train --resume", f"--out {shlex.quote(config.out)}"]
    for name in SAME_ON_RESUME:
        if getattr(config, name) != getattr(defaults, name):
            parts.append(f"--{name.replace('_', '-')} {shlex.quote(str(getattr(config, name)))}")
    if config.checkpoint_every is not None:
        parts.append(f"--checkpoint-every {config.checkpoint_every}")
    if nproc is not None:
        parts.append(f"--nproc {nproc}")
    return " ".join(parts)


def _where(workers: int) -> str:
    if torch.cuda.is_available():
        return f"one GPU each, of {torch.cuda.device_count()}"
    return "CPU, gloo"


def _notes(config: TrainConfig, workers: int) -> list[str]:
    """What the run will do that its options alone do not show."""
    notes = []
    per_epoch = TRAIN_SAMPLES // workers // config.batch_size
    if config.data != "loader" and config.steps_per_replay > per_epoch:
        # a replay gathers its batches from one epoch of the data (DeviceData's order)
        notes.append(
            f"--steps-per-replay {config.steps_per_replay} is more than the {per_epoch} batches "
            f"of one epoch on each rank ({TRAIN_SAMPLES} samples / {workers} rank(s) / "
            f"--batch-size {config.batch_size}): a replay takes {per_epoch} steps at most."
        )
    every = config.checkpoint_every
    if every is not None and every >= config.last_step:
        notes.append(
            f"--checkpoint-every {every} is not below the {config.last_step} steps this run "
            f"trains: the only checkpoint will be the one at the end (step {config.last_step}); "
            "pass a smaller --checkpoint-every for checkpoints along the way."
        )
    if config.max_restarts and every is None:
        notes.append(
            f"--max-restarts {config.max_restarts} without --checkpoint-every: a restart trains "
            "again from step 0; pass --checkpoint-every N to restart from the newest checkpoint."
        )
    found = latest_checkpoint(config.checkpoints)
    if found is not None and not _checkpoints_are_this_runs(config):
        notes.append(
            f"--out {config.out} holds checkpoints of an earlier run (newest: {found.name}); this "
            f"run neither uses nor replaces them. Pass --resume to continue that run, or delete "
            f"{config.checkpoints} to start clean."
        )
    return notes


def _check_options(config: TrainConfig, workers: int) -> str | None:
    """What would make the run fail or hang after it started, found from the options alone,
    before --out is touched."""
    per_rank = TRAIN_SAMPLES // workers
    if config.batch_size > per_rank:
        # drop_last would leave every rank with no batch at all: the loop would never step
        return (
            f"--batch-size {config.batch_size} is more than the {per_rank} training samples each "
            f"of the {workers} rank(s) gets ({TRAIN_SAMPLES} in all); use --batch-size "
            f"{per_rank} or less."
        )
    if config.stop_after is not None and config.stop_after >= config.steps:
        return (
            f"--stop-after {config.stop_after} is not before --steps {config.steps}; use a "
            f"smaller --stop-after, or leave it out to train all {config.steps} steps."
        )
    return None


def _check_checkpoints(config: TrainConfig, workers: int) -> str | None:
    """--resume needs a checkpoint that fits this run; a fresh run must not find old ones."""
    found = latest_checkpoint(config.checkpoints)
    if not config.resume:
        if found is None or not (_checkpoints_are_this_runs(config) or config.max_restarts):
            return None
        # a restart (--max-restarts) resumes from the newest checkpoint: it must be this run's
        return (
            f"--out {config.out} already holds checkpoints (newest: {found.name}); pass --resume "
            f"to continue that run, or pick another --out (or delete {config.checkpoints})."
        )
    if found is None:
        return _no_checkpoint(config)
    return _check_fits_run(config, workers)


def _no_checkpoint(config: TrainConfig) -> str:
    """--resume found no committed checkpoint: step directories that lost a file are named with
    what they lack (incomplete, not absent)."""
    incomplete = [
        f"{path.name}: {checkpoint_problem(path) or 'not committed'}"
        for path in step_dirs(config.checkpoints)
    ]
    if incomplete:
        return (
            f"--resume found no complete checkpoint in {config.checkpoints}: "
            f"{'; '.join(incomplete)}. Restore the missing files from a copy, or start without "
            "--resume (with another --out, or after deleting those directories)."
        )
    return (
        f"--resume found no checkpoint in {config.checkpoints}; start without --resume, or "
        "point --out at the directory of the run to continue."
    )


def _check_fits_run(config: TrainConfig, workers: int) -> str | None:
    """The newest checkpoint whose manifest reads must fit this run (the workers skip damaged
    checkpoints for older ones on their own, naming each)."""
    unreadable = []
    for found in step_dirs(config.checkpoints):
        try:
            manifest = read_manifest(found)
        except CheckpointError as exc:
            unreadable.append(f"{found.name}: {exc}")
            continue
        return _check_manifest_fits(config, workers, found, manifest)
    return (
        f"--resume found no loadable checkpoint in {config.checkpoints}: {'; '.join(unreadable)}; "
        "restore them from a copy, or start without --resume."
    )


def _check_manifest_fits(
    config: TrainConfig, workers: int, found: Path, manifest: dict[str, Any]
) -> str | None:
    saved = manifest["step"]
    if config.stop_after is not None and config.stop_after <= saved < config.steps:
        between = (
            f"pass a --stop-after between {saved + 1} and {config.steps - 1}, or "
            if saved + 1 < config.steps
            else ""
        )
        return (
            f"--stop-after {config.stop_after} is not after step {saved}, where {found} "
            f"resumes: there would be nothing to train. {between.capitalize()}"
            f"{'leave' if between else 'Leave'} it out to train to step {config.steps}."
        )
    if manifest["step"] >= config.steps:
        return (
            f"{found} is the end of a finished run (step {manifest['step']} of --steps "
            f"{config.steps}): there is nothing left to train. Start a new run with another --out."
        )
    if manifest.get("world_size") != workers:
        return (
            f"{found} was saved by {manifest.get('world_size')} rank(s), this run has {workers}; "
            f"resume with --nproc {manifest.get('world_size')}."
        )
    saved = manifest.get("extra", {}).get("config", {})
    ours = asdict(config)
    differ = [name for name in SAME_ON_RESUME if name in saved and saved[name] != ours[name]]
    if differ:
        flags = " ".join(f"--{n.replace('_', '-')} {saved[n]}" for n in differ)
        return (
            f"{found} was saved by a run with other options ({flags}); an exact resume needs "
            f"the same ones: add {flags}."
        )
    return None
