"""The GPU receipt: which tree `tests/gpu` ran on, where, and what came of it.

A change to `src/` is GPU-verified only when `benchmarks/results/gpu-tests-h200.json` names its
tree (`git rev-parse HEAD:src`). `benchmarks/gpu_suite.sh` runs the suite on the GPU machine in
parts (each under the device's 10-minute call limit) and calls `env` there; `merge` then joins
the parts' JUnit files into the receipt, here or there:

    python benchmarks/gpu_receipt.py env --out OUT/gpu-env-1.json          # on the GPU machine
    python benchmarks/gpu_receipt.py merge PART_DIR [PART_DIR ...] \\
        --out benchmarks/results/gpu-tests-h200.json [--expect-head]

The GPU machine gets a copy of the working tree without `.git`, so the tree hashes are computed
from the files themselves, the way git computes them (`git_tree_hash`); a test checks that they
equal git's own on this checkout. `--expect-head` refuses a receipt whose `src/` tree is not
HEAD's, so a receipt is never committed for another tree than the one it describes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("src", "tests/gpu")
PACKAGES = ("transformers", "accelerate", "lightning", "trl", "peft", "datasets", "msgspec")
# What .gitignore keeps out of git and a run creates inside the trees (bytecode, the editable
# install's metadata); anything else in the tree is part of what ran.
_IGNORED_DIRS = ("__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache")


def _ignored(name: str, is_dir: bool) -> bool:
    if is_dir:
        return name in _IGNORED_DIRS or name.endswith(".egg-info")
    return name.endswith((".pyc", ".pyo"))


def _git_object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def _tree_entries(folder: Path) -> list[tuple[bytes, bytes, bytes]]:
    """(sort key, mode + name, object id) per entry, as `git write-tree` writes them."""
    entries = []
    for entry in os.scandir(folder):
        is_dir = entry.is_dir(follow_symlinks=False)
        if _ignored(entry.name, is_dir):
            continue
        name = entry.name.encode()
        if is_dir:
            digest = _tree_digest(Path(entry.path))
            if digest is None:  # git keeps no empty folders
                continue
            entries.append((name + b"/", b"40000 " + name, digest))
        elif entry.is_symlink():
            target = os.readlink(entry.path).encode()
            entries.append((name, b"120000 " + name, _git_object("blob", target)))
        else:
            mode = b"100755 " if os.access(entry.path, os.X_OK) else b"100644 "
            blob = _git_object("blob", Path(entry.path).read_bytes())
            entries.append((name, mode + name, blob))
    return sorted(entries)


def _tree_digest(folder: Path) -> bytes | None:
    entries = _tree_entries(folder)
    if not entries:
        return None
    body = b"".join(head + b"\0" + digest for _, head, digest in entries)
    return _git_object("tree", body)


def git_tree_hash(folder: Path) -> str:
    """The id git gives `folder`'s tree (`git rev-parse HEAD:<folder>` when it is committed)."""
    digest = _tree_digest(folder)
    if digest is None:
        raise ValueError(f"{folder} holds no files; a receipt needs the tree that ran")
    return digest.hex()


def _package_versions() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def environment() -> dict[str, object]:
    """Where the tests ran: tree hashes, torch/CUDA/driver, the GPU and the framework versions."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "trees": {name: git_tree_hash(ROOT / name) for name in TREES},
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "driver": _driver_version(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "python": platform.python_version(),
        "packages": _package_versions(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _node_id(case: ET.Element) -> str:
    """pytest's node id back from JUnit's classname (dotted module path + class) and name."""
    parts = case.get("classname", "").split(".")
    module_end = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    path = "/".join(parts[: module_end + 1]) + ".py"
    return "::".join([path, *parts[module_end + 1 :], case.get("name", "")])


def _first_line(element: ET.Element) -> str:
    message = element.get("message") or (element.text or "")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0][:300] if lines else element.tag


def _outcome(case: ET.Element) -> tuple[str, ET.Element | None]:
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            return ("failed" if tag == "failure" else "error"), found
    skipped = case.find("skipped")
    if skipped is not None:
        kind = skipped.get("type", "")
        return ("xfailed" if kind == "pytest.xfail" else "skipped"), skipped
    return "passed", None


def read_junit(path: Path) -> list[dict[str, object]]:
    """One row per test case: node id, outcome, seconds and, unless it passed, its first line."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, detail = _outcome(case)
        row: dict[str, object] = {
            "nodeid": _node_id(case),
            "outcome": outcome,
            "seconds": round(float(case.get("time", "0")), 2),
        }
        if detail is not None:
            row["first_line"] = _first_line(detail)
        rows.append(row)
    return rows


def _part(folder: Path) -> tuple[dict[str, object], list[dict[str, object]]]:
    envs = sorted(folder.glob("gpu-env-*.json"))
    xmls = sorted(folder.glob("gpu-tests-*.xml"))
    if len(envs) != 1 or len(xmls) != 1:
        raise SystemExit(
            f"{folder}: expected one gpu-env-*.json and one gpu-tests-*.xml (found "
            f"{len(envs)} and {len(xmls)}); pass each part's folder as gpu_suite.sh left it"
        )
    return json.loads(envs[0].read_text()), read_junit(xmls[0])


def _head_trees() -> dict[str, str]:
    return {
        name: subprocess.run(
            ["git", "rev-parse", f"HEAD:{name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for name in TREES
    }


def merge(folders: list[Path], *, expect_head: bool, allow_cpu: bool = False) -> dict[str, object]:
    """The receipt: the parts must have run on one tree, on a GPU; counts, failures, slow files."""
    parts = [_part(folder) for folder in folders]
    trees = {json.dumps(env["trees"], sort_keys=True) for env, _ in parts}
    if len(trees) != 1:
        raise SystemExit(f"the parts ran on different trees: {sorted(trees)}; run them again")
    env = parts[0][0]
    if not allow_cpu and not all(part_env.get("gpus") for part_env, _ in parts):
        raise SystemExit(
            "a part ran without a GPU (every tests/gpu test skips there): not a receipt"
        )
    if expect_head and env["trees"] != _head_trees():
        raise SystemExit(
            f"the parts ran on trees {env['trees']}, HEAD has {_head_trees()}: commit what ran "
            "(or run the suite again on HEAD) before recording the receipt"
        )
    rows = [row for _, part_rows in parts for row in part_rows]
    counts: dict[str, int] = {}
    for row in rows:
        counts[str(row["outcome"])] = counts.get(str(row["outcome"]), 0) + 1
    by_file: dict[str, float] = {}
    for row in rows:
        file = str(row["nodeid"]).split("::")[0]
        by_file[file] = round(by_file.get(file, 0.0) + float(str(row["seconds"])), 1)
    return {
        **{k: v for k, v in env.items() if k != "date"},
        "dates": [part_env["date"] for part_env, _ in parts],
        "total": len(rows),
        "counts": dict(sorted(counts.items())),
        "not_passed": [row for row in rows if row["outcome"] != "passed"],
        "seconds_by_file": dict(sorted(by_file.items(), key=lambda kv: -kv[1])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env_cmd = sub.add_parser("env", help="write this machine's facts and the trees' hashes")
    env_cmd.add_argument("--out", type=Path, required=True)
    merge_cmd = sub.add_parser("merge", help="join the parts into the receipt")
    merge_cmd.add_argument("folders", type=Path, nargs="+")
    merge_cmd.add_argument("--out", type=Path, required=True)
    merge_cmd.add_argument("--expect-head", action="store_true")
    merge_cmd.add_argument("--allow-cpu", action="store_true", help="for trying the tool itself")
    args = parser.parse_args(argv)
    if args.command == "env":
        result = environment()
    else:
        result = merge(args.folders, expect_head=args.expect_head, allow_cpu=args.allow_cpu)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.command == "merge":
        print(f"{args.out}: src {result['trees']['src'][:10]}, {result['counts']}")  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
