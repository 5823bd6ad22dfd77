"""torchvision's ``train.py --amp`` as written and as ported, on one GPU: the first update where
the two part, and whose arithmetic each side's update is.

On an H100 at b726f90 (src 2ee68c1a67) the SGD set on data seed 0 parted at the 12th update, the
first one not skipped for an overflow and the port's last warm-up step (the one whose host syncs
are recorded): 65 of 170 parameters 1-2 ulps apart, the momentum buffers and gradients equal. The
script's new parameters were ``p - lr * buf`` computed in double and rounded once (the fused
kernel's arithmetic); the port's were not (at 3833ada, src d5341dc634: of the 65 differing
tensors 12 were ``p - fl(lr * buf)`` throughout, the product rounded to float first, and 53
matched neither; torch's SGD by every path gave the script's from the saved state). This probe
repeats that in one command and says which kernel and LR form gives each side, so the cause can
be named:

1. the original and the port (hashes of every update): the first update that differs;
2. the original, the port and the port without the warm-up's host-sync recording
   (``set_sync_debug_mode("warn")``), each saving its states after that update and the one before;
3. per side, the new parameters against the two arithmetics above, counted per tensor;
4. torch's SGD on the first differing tensor: its fused kernel with the LR as a float, a CPU
   tensor and a device tensor, inside and outside ``set_sync_debug_mode("warn")``, and its
   foreach and for-loop paths: which matches which side (torch's CUDA fused kernel computes
   ``p - lr * g`` in double, rounding once);
5. per side, every op that wrote into a parameter's memory during that training batch
   (``parameter_writes``: the op, its scalar arguments, whether a capture was under way).

    DDPGRAPH_UPSTREAM=.upstream python benchmarks/probes/torchvision_amp_updates.py \\
        --out tv-amp-updates.json          # SGD, data seed 0, 3 epochs, on cuda
    ... --opt adamw --seed 2 --out ...      # the AdamW set's seed-2 difference (no step 3/4)

Needs ../shared/upstream (or ``$DDPGRAPH_UPSTREAM``) and torchvision; ``--device cpu`` runs every
part on the CPU (gloo, the CPU engine), where the two sides are expected equal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

# imported before a script runs: tests/upstream_torchvision.py swaps torch's DDP class for a
# function during the original's run, whose signature ddp.py's import-time check cannot read
from ddpgraph.step.parallel.ddp import _off_grid

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FLAG_SETS = {
    "sgd": ["--opt", "sgd", "--lr", "0.02"],
    "adamw": ["--opt", "adamw", "--lr", "1e-3", "--clip-grad-norm", "0.5"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt", choices=sorted(FLAG_SETS), default="sgd")
    parser.add_argument("--seed", type=int, default=0, help="the data's ($DDPGRAPH_SCRIPT_SEED)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = probe(args.opt, args.seed, args.epochs, args.device)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "sides"}, indent=2))


def probe(opt: str, seed: int, epochs: int, device: str) -> dict[str, Any]:
    from tests import upstream, upstream_torchvision

    for name in upstream_torchvision.MODULES:
        upstream.script(upstream_torchvision.FOLDER, name)
    script = upstream.script(upstream_torchvision.FOLDER, upstream_torchvision.NAME)
    folder = Path(tempfile.mkdtemp(prefix="tv-amp-"))
    upstream_torchvision.make_images(folder / "images")
    flags = ["--epochs", str(epochs), "--amp", "--use-deterministic-algorithms", *FLAG_SETS[opt]]
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "DDPGRAPH_SCRIPT_SEED": str(seed)}
    result: dict[str, Any] = {
        "what": "torchvision train.py --amp as written (original) and ported: the first update "
        "that differs, and whose arithmetic each side's new parameters are",
        "opt": opt, "seed": seed, "epochs": epochs, "device": _device_name(device),
        "torch": torch.__version__, "src_tree": _src_tree(),
    }  # fmt: skip
    runs = {v: _run(folder, script, v, flags, device, env) for v in ("original", "port")}
    first = _first_difference(runs["original"]["updates"], runs["port"]["updates"])
    result["updates"] = len(runs["original"]["updates"])
    result["first_differing_update"] = first  # counted from 1; None: every update equal
    result["port_report"] = runs["port"]["report"]
    # per update from the 2nd, the state-dict tensors it changed: a skipped (overflowed) update
    # changes only BatchNorm's buffers, a real one the parameters too
    result["tensors_changed"] = {v: _changed(runs[v]["updates"]) for v in ("original", "port")}
    if first is None:
        return result
    at = f"{first - 1},{first}" if first > 1 else f"{first}"
    states = Path(tempfile.mkdtemp(prefix="tv-amp-states-"))
    sides = ("original", "port", "port-no-sync-recording")
    for name in sides:
        side_env = {**env, "DDPGRAPH_PROBE_STATES": str(states), "DDPGRAPH_PROBE_NAME": name,
                    "DDPGRAPH_PROBE_STATES_AT": at}  # fmt: skip
        if name == "port-no-sync-recording":
            side_env["DDPGRAPH_PROBE_NO_SYNC_RECORD"] = "1"
        variant = "original" if name == "original" else "port"
        runs[name] = _run(folder, script, variant, flags, device, side_env, out=name)
    result["states"] = str(states)  # each side's states after updates `at` (torch.load them)
    result["no_sync_recording_first_differing_update"] = _first_difference(
        runs["original"]["updates"], runs["port-no-sync-recording"]["updates"]
    )
    before = torch.load(states / f"original-{first - 1}.pt") if first > 1 else None
    after = {name: torch.load(states / f"{name}-{first}.pt") for name in sides}
    result["sides"] = {name: arithmetic_of(before, after[name]) for name in sides}
    result["kernel"] = fused_sgd_kernel_probe(before, after, device)
    result["parameter_writes"] = {
        variant: param_writes(folder, script, variant, flags, device, env, first)
        for variant in ("original", "port")
    }
    result["clip_comparison"] = compare_clips(result["parameter_writes"])
    return result


def compare_clips(writes: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | str:
    """Where the two sides' clippings of the parting batch part: the gradients they read (by
    digest), or only the norms torch computed from equal gradients."""
    clips = {side: [w["clip"] for w in ws if "clip" in w] for side, ws in writes.items()}
    if not all(clips.values()) or not all(c[-1].get("grads") for c in clips.values()):
        return "no clipping recorded on both sides"
    ours, theirs = (clips[side][-1]["grads"] for side in ("port", "original"))
    if ours["count"] != theirs["count"]:
        return f"{ours['count']} gradients clipped by the port, {theirs['count']} by the script"
    pairs = range(ours["count"])
    aligned = ours.get("aligned_foreach_norms", ours["foreach_norms"])
    return {
        key: [i for i in pairs if ours[key][i] != theirs[key][i]]
        for key in ("digests", "digests_zero_sign_free", "foreach_norms", "vector_norms")
        if key in ours and key in theirs
    } | {
        # the port's gradients copied to aligned allocations against the script's own
        "aligned_foreach_norms_vs_script": [
            i for i in pairs if aligned[i] != theirs["foreach_norms"][i]
        ],
    } | {side: {k: clips[side][-1]["grads"][k] for k in ("views", "misaligned", "dtypes")}
         for side in ("port", "original")}  # fmt: skip


def param_writes(
    folder: Path, script: Path, variant: str, flags: list[str], device: str,
    env: dict[str, str], update: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every op that writes into a parameter's memory during training batch ``update`` (from
    the script's ``metric_logger.update(..., lr=...)`` after batch ``update - 1`` to the one
    after it), with its scalar arguments and whether a CUDA capture was under way; first the
    optimizer's param-group values: the op that made one side's update. With clipping, each
    ``clip_grad_norm_`` of that batch too (its ``max_norm`` and the total norm it found)."""
    from ddpgraph.testing import run_distributed

    args = (str(folder), str(script), variant, flags, f"writes-{variant}", device, update)
    (writes,) = run_distributed(_param_writes_worker, 1, args=args, timeout=900, init=False,
                                env=env)  # fmt: skip
    return writes


def _param_writes_worker(
    base: str, script: str, variant: str, flags: list[str], out: str, device: str, update: int
) -> list[dict[str, Any]]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests import upstream_torchvision

    writes: list[dict[str, Any]] = []
    storages: set[int] = set()

    class ParamWrites(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            if func._schema.is_mutable and any(
                isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages
                for t in leaves
            ):
                capturing = device == "cuda" and torch.cuda.is_current_stream_capturing()
                plain = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float))}
                writes.append({"op": str(func), "scalars": plain, "capturing": capturing,
                               "tensors": _tensor_words(kwargs, capturing)})  # fmt: skip
            return func(*args, **kwargs)

    made = upstream_torchvision._optimizers_made()  # the script's optimizer is the first
    sys.path.insert(0, str(Path(script).parent))
    import utils  # the script's own, which it imports from its folder

    inner = utils.MetricLogger.update
    mode = ParamWrites()
    batches = [0]

    def logged(self: Any, **kwargs: Any) -> None:
        if "lr" in kwargs:  # a training batch, after its update
            batches[0] += 1
            if batches[0] == update - 1:
                groups = made[0].param_groups
                storages.update(p.untyped_storage().data_ptr() for g in groups for p in g["params"])
                writes.append({"param_group": _group_words(groups[0])})
                mode.__enter__()
            elif batches[0] == update:
                mode.__exit__(None, None, None)
        inner(self, **kwargs)

    clip, clip_with = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grads_with_norm_

    def recorded(params: list[Any], max_norm: float, kwargs: dict[str, Any], norm: Any) -> Any:
        capturing = device == "cuda" and torch.cuda.is_current_stream_capturing()
        if batches[0] != update - 1:
            return norm()
        grads = None if capturing else _grad_words(params)
        total = norm()
        writes.append({"clip": {"max_norm": max_norm, "tensors": len(params),
                                "kwargs": {k: repr(v) for k, v in kwargs.items()},
                                "total_norm": None if capturing else float(total),
                                "grads": grads}})  # fmt: skip
        return total

    def clipped(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the script's clipping of the batch: its total norm says whether it scaled the
        # gradients (norm > max_norm)
        params = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        return recorded(params, max_norm, kwargs, lambda: clip(params, max_norm, *args, **kwargs))

    def clipped_with(parameters: Any, max_norm: float, total: Any, **kwargs: Any) -> Any:
        # the step's under DDP (its total norm taken first: parallel.ddp.norm_as_unbucketed);
        # torch's clip_grad_norm_ calls this function by its module's own name, not this one
        params = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        recorded(params, max_norm, kwargs, lambda: total)
        return clip_with(params, max_norm, total, **kwargs)

    utils.MetricLogger.update = logged  # type: ignore[method-assign]
    torch.nn.utils.clip_grad_norm_ = clipped
    torch.nn.utils.clip_grads_with_norm_ = clipped_with
    try:
        upstream_torchvision.run(base, script, variant, flags, out, device)
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
        torch.nn.utils.clip_grads_with_norm_ = clip_with
    return writes


def _digest(tensor: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha1(tensor.detach().cpu().numpy().tobytes()).hexdigest()[:12]


def _grad_words(params: list[torch.Tensor]) -> dict[str, Any]:
    """The gradients a clipping is about to read, as the two sides can be compared from their
    records: a digest of each one's bytes, each one's norm as torch's foreach kernel and as
    ``vector_norm`` give it (hex) and as the foreach kernel gives a copy of it where it is not
    aligned, and how many are views (DDP's bucket views) or off the foreach kernels' vector
    grid (16 bytes for float32; they take a slower, differently summing path for those)."""
    grads = [p.grad for p in params if p.grad is not None]
    foreach = torch._foreach_norm(grads, 2.0) if grads else []
    # the same gradients each in an allocation of its own (a copy where one is not aligned to
    # the foreach kernels' 4-element vector): the layout of a script's own gradients
    copied = [g.clone() if _off_grid(g) else g for g in grads]  # as norm_as_unbucketed copies
    aligned = torch._foreach_norm(copied, 2.0) if grads else []
    return {
        "count": len(grads),
        "digests": [_digest(g) for g in grads],
        # -0.0 + 0.0 is 0.0: a gradient accumulated into a zeroed bucket (0 + -0.0) against
        # one stolen from autograd (-0.0) differs only in zeros' signs, which no update sees
        "digests_zero_sign_free": [_digest(g + 0.0) for g in grads],
        "foreach_norms": [float(n).hex() for n in foreach],
        "aligned_foreach_norms": [float(n).hex() for n in aligned],
        "vector_norms": [float(torch.linalg.vector_norm(g, 2.0)).hex() for g in grads],
        "views": sum(g._base is not None for g in grads),
        "misaligned": sum(map(_off_grid, grads)),
        "dtypes": sorted({str(g.dtype) for g in grads}),
    }


def _tensor_words(kwargs: dict[str, Any], capturing: bool) -> dict[str, Any]:
    """An op's tensor keyword arguments (the fused kernels' ``lr``, ``grad_scale``,
    ``found_inf``): dtype, and the value of a one-element tensor (not read under a capture)."""
    words: dict[str, Any] = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            one = value.numel() == 1 and not capturing
            words[key] = f"{value.dtype}" + (f" = {value.item()!r}" if one else "")
    return words


def _group_words(group: dict[str, Any]) -> dict[str, Any]:
    return {
        key: (
            f"{value.dtype} tensor on {value.device}" if isinstance(value, torch.Tensor) else value
        )
        for key, value in group.items()
        if key != "params" and isinstance(value, (bool, int, float, torch.Tensor, type(None)))
    }


def _run(
    folder: Path, script: Path, variant: str, flags: list[str], device: str,
    env: dict[str, str], out: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    from ddpgraph.testing import run_distributed
    from tests import upstream_torchvision

    args = (str(folder), str(script), variant, flags, out or variant, device)
    (record,) = run_distributed(
        upstream_torchvision.run, 1, args=args, timeout=900, init=False, env=env
    )
    return record


def _first_difference(ours: list[list[torch.Tensor]], theirs: list[list[torch.Tensor]]) -> Any:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
            return i + 1
    return None


def _changed(updates: list[list[torch.Tensor]]) -> list[int]:
    return [
        sum(not torch.equal(x, y) for x, y in zip(a, b, strict=True))
        for a, b in zip(updates[1:], updates[:-1], strict=True)
    ]


def arithmetic_of(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """For an SGD-with-momentum update: per parameter, whether the new value is ``p - lr * buf``
    computed in double and rounded once (``"rounded_once"``, the fused CUDA kernel's), or with
    the product rounded to float first (``"product_rounded"``), or ``p`` itself (the update was
    skipped for an overflow); ``buf`` the state after."""
    if before is None or not all("momentum_buffer" in s for s in after["state"].values()):
        return {"formula": "n/a (not an SGD-with-momentum update after a saved one)"}
    lr = torch.as_tensor(after["groups"][0]["lr"]).to(torch.float32)
    counts = {"unchanged": 0, "rounded_once": 0, "product_rounded": 0, "neither": 0}
    for name, state in after["state"].items():
        p, buf, new = before["model"][name], state["momentum_buffer"], after["model"][name]
        once = (p.double() - lr.double() * buf.double()).float()
        product = p - lr * buf
        counts["unchanged" if torch.equal(new, p) else  # a skipped (overflowed) update
               "rounded_once" if torch.equal(new, once) else
               "product_rounded" if torch.equal(new, product) else "neither"] += 1  # fmt: skip
    return {"parameters": len(after["state"]), "matches": counts}


def fused_sgd_kernel_probe(
    before: dict[str, Any] | None, after: dict[str, dict[str, Any]], device: str
) -> dict[str, Any]:
    """torch's SGD on the first parameter where the sides differ, from the saved state before:
    its fused kernel with the LR in three forms and (CUDA) the sync-debug mode on and off, and
    its foreach and for-loop paths (LR a float): which gives which side's new value."""
    if before is None or "momentum_buffer" not in next(iter(after["original"]["state"].values())):
        return {"skipped": "not an SGD-with-momentum update after a saved one"}
    ours, theirs = after["port"]["model"], after["original"]["model"]
    name = next(
        (n for n in after["original"]["state"] if not torch.equal(ours[n], theirs[n])), None
    )
    if name is None:
        return {"skipped": "no parameter differs"}
    lr32 = float(torch.as_tensor(after["original"]["groups"][0]["lr"]).float())
    forms = {"float": lr32, "cpu tensor": torch.tensor(lr32)}
    if device == "cuda":
        forms["device tensor"] = torch.tensor(lr32, device=device)
    modes = ["default", "warn"] if device == "cuda" else ["default"]
    found: dict[str, str] = {}
    for form, lr in forms.items():
        for mode in modes:
            new = _one_sgd_step(before, after, name, device, lr, mode, fused=True)
            found[f"fused, lr as {form}, sync debug {mode}"] = _whose(new, name, ours, theirs)
    for path, foreach in (("foreach", True), ("for-loop", False)):
        new = _one_sgd_step(before, after, name, device, lr32, "default", foreach=foreach)
        found[f"{path}, lr as float"] = _whose(new, name, ours, theirs)
    return {"parameter": name, "gives": found}


def _one_sgd_step(
    before: dict[str, Any], after: dict[str, dict[str, Any]], name: str, device: str,
    lr: Any, mode: str, **path: bool,
) -> torch.Tensor:  # fmt: skip
    group = after["original"]["groups"][0]
    p = before["model"][name].to(device).clone().requires_grad_(True)
    opt = torch.optim.SGD(
        [p], lr=lr, momentum=group["momentum"], weight_decay=group["weight_decay"],
        dampening=group["dampening"], nesterov=group["nesterov"], **path,
    )  # fmt: skip
    # a copy: the step updates the buffer in place (.to() of a CPU tensor is itself)
    opt.state[p]["momentum_buffer"] = before["state"][name]["momentum_buffer"].to(device, copy=True)
    # unscaled: the two sides' gradients are equal after the step
    p.grad = after["original"]["grads"][name].to(device, copy=True)
    _step_in_mode(opt, mode, device)
    return p.detach().cpu()


def _whose(new: torch.Tensor, name: str, ours: dict, theirs: dict) -> str:
    return (
        "original"
        if torch.equal(new, theirs[name])
        else ("port" if torch.equal(new, ours[name]) else "neither")
    )


def _step_in_mode(opt: torch.optim.Optimizer, mode: str, device: str) -> None:
    if device != "cuda":
        opt.step()
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode(mode)  # type: ignore[arg-type]
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def _src_tree() -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_receipt import git_tree_hash  # type: ignore[import-not-found]

    return str(git_tree_hash(ROOT / "src"))[:10]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
