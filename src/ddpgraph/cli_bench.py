"""``ddpgraph bench``'s result sets and option checks: which options a kind of run uses, and the
files one run writes (replaced whole, never mixed with another run's)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_types import InFolder

__all__ = [
    "bench_out",
    "hf_names",
    "modes_left_out",
    "prepare_result_set",
    "refuse_colliding_out",
    "refuse_ignored_options",
    "result_set",
    "without_torchvision",
]


_BENCH_OPTIONS = {
    "bench": {"configs", "modes", "steps", "quick"},
    "varlen": {"varlen", "quick"},
    "hf": {"varlen", "hf", "steps"},
    "fsdp2": {"configs", "steps", "quick"},
}
_BENCH_RUNS = {
    "bench": "ddpgraph bench",
    "varlen": "--varlen",
    "hf": "--varlen --hf",
    "fsdp2": "--parallel fsdp2",
}


def refuse_ignored_options(ctx: click.Context, kind: str) -> None:
    if kind == "hf" and not ctx.params["varlen"]:
        raise click.UsageError(
            "--hf runs real transformers models on variable-length batches, a --varlen run: "
            "add --varlen (e.g. `ddpgraph bench --varlen --hf gpt2`)."
        )
    given = [
        name
        for name in ("configs", "modes", "steps", "quick", "varlen", "hf")
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        and name not in _BENCH_OPTIONS[kind]
    ]
    if given:
        flags = ", ".join(_flag(ctx, name) for name in given)
        raise click.UsageError(
            f"{flags}: not used by a {_BENCH_RUNS[kind]} run, which takes "
            f"{', '.join(sorted(_flag(ctx, n) for n in _BENCH_OPTIONS[kind]))}, --repeats and "
            "--out; leave them out."
        )


def modes_left_out(configs: list[str], modes: list[str], quick: bool) -> list[str]:
    """Refuse a --mode that applies to none of the configs run; for one that applies to some,
    what to say (it is measured only there)."""
    from .bench import CONFIGS, choose, not_applied

    chosen, _ = choose(configs, modes or None, quick=quick)
    names = {id(cfg): name for name, cfg in CONFIGS.items()}
    notes = []
    for mode in modes:
        skipped = {
            names.get(id(cfg), "--quick's tiny MLP"): why
            for cfg in chosen
            if (why := not_applied(mode, cfg))
        }
        if not skipped:
            continue
        why = "; ".join(sorted(set(skipped.values())))
        if len(skipped) == len(chosen):
            raise click.BadParameter(
                f"{mode} does not apply to {', '.join(skipped)} ({why}); pick a config it "
                "applies to with --config, or leave the mode out.",
                param_hint="'--mode'",
            )
        notes.append(f"note: {mode} is not measured on {', '.join(skipped)} ({why})")
    return notes


def _flag(ctx: click.Context, name: str) -> str:
    return next(p.opts[0] for p in ctx.command.params if p.name == name)


def result_set(out: Path, kind: str) -> list[Path]:
    """The files of one run: the JSON, and for a plain run its table and chart beside it."""
    if kind == "bench":
        return [out, out.with_suffix(".md"), out.with_suffix(".png")]
    return [out, out.with_suffix(".md")] if kind == "fsdp2" else [out]


def prepare_result_set(out: Path, kind: str) -> None:
    """Make ``out`` ready for a ``kind`` run, or refuse it: its folder writable (created and
    said if new), an existing JSON of the same kind, and the old set's table and chart removed
    (said), so that an interrupted run never leaves one run's JSON beside another's table."""
    folder = out.parent
    created = not folder.exists()
    problem = _unwritable_file(out)
    if problem:
        raise click.BadParameter(problem, param_hint="'--out'")
    if created:
        click.echo(f"ddpgraph bench: created {folder}", err=True)
    found = _result_kind(out)
    if found is not None and found != kind:
        raise click.BadParameter(
            f"{out} holds {found}; this is a {_BENCH_RUNS[kind]} run. Pick another --out, "
            "or delete that file to replace it.",
            param_hint="'--out'",
        )
    from .bench.report import written_by_bench

    # only this kind's table and chart, and only files that prove to be ones (their content):
    # a README.md or logo.png that happens to share the JSON's name is the user's
    stale = [path for path in result_set(out, kind)[1:] if path.exists()]
    foreign = [path for path in stale if not written_by_bench(path)]
    if foreign:
        raise click.BadParameter(
            f"{' and '.join(map(str, foreign))}: this run writes its "
            f"{' and '.join(_COMPANIONS[p.suffix] for p in foreign)} there, and "
            f"{'they are' if len(foreign) > 1 else 'it is'} not one that ddpgraph bench wrote; "
            f"pick another --out (e.g. {out.with_name(out.stem + '-bench.json')}), or move "
            f"{'them' if len(foreign) > 1 else 'it'} away.",
            param_hint="'--out'",
        )
    for companion in stale:
        companion.unlink()
        click.echo(f"ddpgraph bench: removed {companion} (of the set this run replaces)", err=True)


_COMPANIONS = {".md": "table", ".png": "chart"}


def refuse_colliding_out(out: Path, kind: str) -> None:
    """An --out that is itself one of the files the run writes beside it (``res.md``: the JSON
    would be overwritten by the table) is refused before anything runs."""
    if out in result_set(out, kind)[1:]:
        also = " and ".join(
            f"its {_COMPANIONS[p.suffix]} ({p.suffix})" for p in result_set(out, kind)[1:]
        )
        raise click.BadParameter(
            f"{out}: a {_BENCH_RUNS[kind]} run writes {also} beside the JSON, under the same "
            f"name: the JSON would be overwritten. Pass a .json name, e.g. "
            f"{out.with_suffix('.json')}.",
            param_hint="'--out'",
        )


def _result_kind(path: Path) -> str | None:
    """Which kind of bench run wrote ``path`` (None: no file); a text for any other file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError):
        return "a file that is not a ddpgraph bench result"
    if not isinstance(data, dict):
        return "a file that is not a ddpgraph bench result"
    if data.get("parallel") == "fsdp2":
        return "fsdp2"
    if "configs" in data:
        return "bench"
    if "batches" in data:
        return "hf"
    if "config" in data and "runs" in data:
        return "varlen"
    return "a file that is not a ddpgraph bench result"


def _unwritable_file(path: Path) -> str | None:
    """Why ``path`` (and the files written beside it) cannot be written, or None: found by
    opening it as the run will (a file of its own in its folder), so the error is the real one."""
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        return f"{path}: {folder} is not a writable directory (it is a file); pick another."
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return (
            f"{path}: {folder} is not a writable directory ({exc.strerror or exc}); pick another."
        )
    try:
        if path.exists():
            with open(path, "a"):  # appends nothing: the file is left as it is
                pass
        else:
            with open(path, "x"):
                pass
            path.unlink()
    except OSError as exc:
        return f"{path} cannot be written ({exc.strerror or exc}); pick another file."
    return None


def bench_out(out: Path | InFolder | None, kind: str) -> Path:
    """--out: a file, a folder (the kind's default name in it), or the kind's default."""
    name = f"{kind}.json"
    if out is None:
        return Path("benchmarks/results") / name
    return out.folder / name if isinstance(out, InFolder) else out


def refuse(text: str) -> None:
    """A run that cannot work here (a missing package, no GPU): one line, exit status 1, before
    anything is created."""
    click.echo(f"ddpgraph bench: {text}", err=True)
    raise SystemExit(1)


def hf_names(given: tuple[str, ...]) -> list[str] | None:
    """--hf's architectures (None: all), checked with what they need before anything runs."""
    import importlib.util

    import torch

    from .bench.hf import ARCHITECTURES

    names = [n for n in given if n != "all"] or None
    unknown = sorted(set(names or []) - set(ARCHITECTURES))
    if unknown:
        raise click.BadParameter(
            f"unknown {', '.join(unknown)}; choose from {', '.join(ARCHITECTURES)}",
            param_hint="'--hf'",
        )
    if importlib.util.find_spec("transformers") is None:
        refuse(
            "--hf builds transformers models, and transformers is not installed: pip install "
            "'transformers>=4.40' (or the clone's extra: pip install -e '.[hf]')."
        )
    if not torch.cuda.is_available():
        refuse("bench --varlen --hf measures CUDA graphs: it needs a GPU.")
    return names


def without_torchvision(configs: tuple[str, ...], quick: bool) -> tuple[tuple[str, ...], list[str]]:
    """The configs a plain run measures, and notes: ResNet-50 needs a torchvision that imports
    with this torch. Asked for by name without one, the run is refused (one line, the install
    named); among the defaults, it is left out with a note saying so."""
    from .bench import CONFIGS, choose, needs_torchvision, torchvision_problem

    chosen, _ = choose(list(configs), None, quick=quick)
    if not any(needs_torchvision(cfg) for cfg in chosen):
        return configs, []
    problem = torchvision_problem()
    if problem is None:
        return configs, []
    if configs:
        refuse(f"{', '.join(n for n in configs if needs_torchvision(CONFIGS[n]))}: {problem}")
    kept = tuple(name for name, cfg in CONFIGS.items() if not needs_torchvision(cfg))
    return kept, [f"note: not measuring ResNet-50: {problem}"]
