"""pytorch/examples' FSDP2 example (tests/fixtures/upstream/pytorch_examples_fsdp2, pinned there,
BSD-3-Clause) as a feature matrix: each row runs the example's loop as written (the plain run)
and ported to TrainStep (eagerly, and graphed on the CPU stand-in engine), on gloo CPU ranks.

The example's ``model.py`` (Transformer) and ``checkpoint.py`` (Checkpointer, both APIs) are
imported unchanged; its loop is :func:`plain_run`, line for line, with each row's feature added
the way a script adds it. The port (:func:`port_run`) changes only what the FSDP2 guide says: the
step's lines become ``loss = step(x, x)`` (the example's loss is ``model(x).sum()``: a loss_fn
that ignores its target), ``clip_grad_norm=`` and, for the script's own accumulation,
``accumulate_calls=``. Tiny config: 2 layers, vocabulary 64, 4 sequences of 8 tokens, 5 steps
(warm-up 2: FSDP2's least). One change to the set-up of both runs: the example's
``Transformer.reset_parameters()`` initializes the embeddings, norm and head but not the layers,
which keep ``to_empty``'s uninitialized memory (NaN on a CPU host); each layer is reset too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.testing import CpuGraphs

UPSTREAM = Path(__file__).parent / "fixtures" / "upstream" / "pytorch_examples_fsdp2"
VOCAB, BATCH, SEQ, LAYERS, STEPS = 64, 4, 8, 2, 5


def _upstream(name: str) -> ModuleType:
    key = f"pytorch_examples_fsdp2_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, UPSTREAM / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


# --------------------------------------------------------------------------- the example's set-up
def set_modules_to_forward_prefetch(model: Any, num_to_forward_prefetch: int) -> None:
    """example.py's, verbatim."""
    for i, layer in enumerate(model.layers):
        if i >= len(model.layers) - num_to_forward_prefetch:
            break
        layers_to_prefetch = [model.layers[i + j] for j in range(1, num_to_forward_prefetch + 1)]
        layer.set_modules_to_forward_prefetch(layers_to_prefetch)


def set_modules_to_backward_prefetch(model: Any, num_to_backward_prefetch: int) -> None:
    """example.py's, verbatim."""
    for i, layer in enumerate(model.layers):
        if i < num_to_backward_prefetch:
            continue
        layers_to_prefetch = [model.layers[i - j] for j in range(1, num_to_backward_prefetch + 1)]
        layer.set_modules_to_backward_prefetch(layers_to_prefetch)


def build(row: dict, load_from: str | None) -> tuple[Any, torch.optim.Optimizer, Any]:
    """example.py's model, sharding, prefetch, init or checkpoint load, and optimizer; the
    row's scheduler. The same for the plain run and the port."""
    model_mod, checkpoint_mod = _upstream("model"), _upstream("checkpoint")
    torch.manual_seed(0)
    args = model_mod.ModelArgs(
        n_layers=LAYERS,
        n_heads=4,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        dropout_p=row.get("dropout", 0.0),
    )
    with torch.device("meta"):
        model = model_mod.Transformer(args)
    if row.get("frozen"):
        model.pos_embeddings.weight.requires_grad_(False)
    fsdp_kwargs: dict[str, Any] = {}
    if row.get("mp"):
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if "reshard" in row:
        fsdp_kwargs["reshard_after_forward"] = row["reshard"]
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    if row.get("prefetch"):
        set_modules_to_forward_prefetch(model, num_to_forward_prefetch=2)
        set_modules_to_backward_prefetch(model, num_to_backward_prefetch=2)
    checkpointer = None
    if load_from is not None:
        checkpointer = checkpoint_mod.Checkpointer(load_from, dcp_api=row["api"] == "dcp")
        assert checkpointer.last_training_time is not None, load_from
        checkpointer.load_model(model)
    else:
        model.to_empty(device="cpu")
        model.reset_parameters()
        for layer in model.layers:  # not in the example: its layers stay uninitialized
            layer.reset_parameters()
    if row.get("optimizer") == "adamw":
        optim: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-2, weight_decay=0.1
        )
    else:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    # issue 47: every run steps the optimizer the graphed step steps (capturable, the LR in a
    # tensor), the CPU engine's as CUDA's: what else differs is the graph's doing
    make_graph_safe(optim, torch.device("cpu"))
    if checkpointer is not None:
        checkpointer.load_optim(model, optim)
    scheduler = None
    if row.get("scheduler"):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    return model, optim, scheduler


# --------------------------------------------------------------------------- the two loops
def plain_run(row: dict, load_from: str | None = None, save_to: str | None = None) -> dict:
    """example.py's training loop, with the row's feature as a script adds it."""
    model, optim, scheduler = build(row, load_from)
    clip = row.get("clip", 1.0)
    calls, split = row.get("calls", 1), row.get("split", 1)
    out: dict[str, list] = {"losses": [], "norms": [], "evals": []}
    probe = _probe()
    for i in range(row.get("steps", STEPS)):
        _set_lr(row, optim, i)
        total = torch.zeros(())
        for j in range(calls):
            if row.get("prefetch"):
                model.unshard()
            x = torch.randint(0, VOCAB, (BATCH, SEQ))
            for k, xs in enumerate(x.chunk(split)):
                if calls > 1 or split > 1:
                    model.set_requires_gradient_sync(j == calls - 1 and k == split - 1)
                loss = model(xs).sum()
                (loss / (calls * split) if calls * split > 1 else loss).backward()
                total = loss.detach() / split if k == 0 else total + loss.detach() / split
            out["losses"].append(float(total))
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip)
        else:
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None]
            )
        out["norms"].append(norm.full_tensor().clone())  # type: ignore[attr-defined]
        optim.step()
        optim.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if row.get("eval_every") and i % row["eval_every"] == 0:
            model.eval()
            with torch.no_grad():
                out["evals"].append(model(probe).clone())
            model.train()
    return _finish(row, model, optim, out, save_to)


def port_run(
    row: dict, graphed: bool, load_from: str | None = None, save_to: str | None = None
) -> dict:
    """The same loop ported to TrainStep as the FSDP2 guide says."""
    model, optim, scheduler = build(row, load_from)
    calls, split = row.get("calls", 1), row.get("split", 1)
    step = TrainStep(
        model,
        optim,
        lambda output, _: output.sum(),
        clip_grad_norm=row.get("clip", 1.0),
        grad_norm=True,
        accumulate_calls=calls,
        accumulate=split,
        warmup=2,
        engine=CpuGraphs() if graphed else None,
    )
    out: dict[str, list] = {"losses": [], "norms": [], "evals": []}
    probe = _probe()
    for i in range(row.get("steps", STEPS)):
        _set_lr(row, optim, i)
        for j in range(calls):
            if row.get("prefetch"):
                model.unshard()
            x = torch.randint(0, VOCAB, (BATCH, SEQ))
            if calls > 1:
                model.set_requires_gradient_sync(j == calls - 1)  # the script's own, kept
            out["losses"].append(float(step(x, x)))
        out["norms"].append(step.grad_norm.clone())  # type: ignore[union-attr]
        if scheduler is not None:
            scheduler.step()
        if row.get("eval_every") and i % row["eval_every"] == 0:
            out["evals"].append(step.evaluate(probe).clone())
    report = step.report()
    out["report"] = [report.mode, report.replays, list(report.fallbacks)]  # type: ignore[list-item]
    return _finish(row, model, optim, out, save_to)


def _probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))


def _set_lr(row: dict, optim: torch.optim.Optimizer, i: int) -> None:
    if row.get("lr_by_hand"):
        for group in optim.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # the plain run: the graph's LR tensor
                group["lr"].fill_(1e-2 * 0.8**i)
            else:
                group["lr"] = 1e-2 * 0.8**i


def _finish(row: dict, model: Any, optim: Any, out: dict, save_to: str | None) -> dict:
    if save_to is not None:
        checkpoint_mod = _upstream("checkpoint")
        checkpoint_mod.Checkpointer(save_to, dcp_api=row["api"] == "dcp").save(model, optim)
    out["params"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    out["state"] = [
        value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()
        for param in model.parameters()
        for value in optim.state.get(param, {}).values()
    ]
    return out


# --------------------------------------------------------------------------- the matrix
def run_rows(rows: list[dict], directory: str) -> dict[str, dict]:
    """Every row: the plain run, the port eagerly, the port graphed (CPU stand-in). A row with
    ``save`` saves each run's checkpoint (the example's Checkpointer) under ``directory``; one
    with ``load`` starts every run from the plain run's checkpoint of the row it names."""
    results: dict[str, dict] = {}
    for row in rows:
        name = row["name"]
        load_from = os.path.join(directory, row["load"], "plain") if row.get("load") else None
        runs: dict[str, Any] = {}
        for kind in ("plain", "eager", "graphed"):
            save_to = os.path.join(directory, name, kind) if row.get("save") else None
            torch.manual_seed(1234)  # the data and dropout draws start alike in every run
            if kind == "plain":
                runs[kind] = plain_run(row, load_from, save_to)
            else:
                runs[kind] = port_run(row, kind == "graphed", load_from, save_to)
            dist.barrier()  # rank 0 wrote the checkpoint before any rank loads it
        results[name] = runs
    return results


def refuse_sync_off_without_accumulate_calls() -> None:
    """The script keeps ``set_requires_gradient_sync(False)`` around ``step()`` but leaves
    ``accumulate_calls=1``: refused on every rank (the optimizer would step on every call)."""
    row = {"name": "refused"}
    model, optim, _ = build(row, None)
    step = TrainStep(model, optim, lambda output, _: output.sum(), warmup=3, engine=CpuGraphs())
    for i in range(4):
        x = torch.randint(0, VOCAB, (BATCH, SEQ))
        model.set_requires_gradient_sync(i % 2 == 1)
        step(x, x)
