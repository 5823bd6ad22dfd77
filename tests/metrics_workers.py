"""Module-level workers for the gather_for_metrics tests (run_distributed needs importable ones).

The evaluation is exact in float64 (small integer inputs and weights), so a sample's result does
not depend on which batch it was in: one process over the whole set is the reference, bit for
bit, and any sample counted twice or lost changes the metric.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpgraph as dg

SAMPLES = 37  # a multiple of neither 2 nor 3: the sampler pads
FEATURES, CLASSES = 4, 3


def dataset(n: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 5, (n, FEATURES), generator=g).double()
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(torch.arange(n), x, y)


def logits_of(x: torch.Tensor) -> torch.Tensor:
    weight = torch.arange(FEATURES * CLASSES, dtype=torch.float64, device=x.device) - 5
    return x @ weight.reshape(
        FEATURES, CLASSES
    )  # small integers: exact in float64 whatever the batch


def evaluate(loader: DataLoader) -> dict[str, Any]:
    """Per-sample results in the loader's order, in each form gather_for_metrics takes."""
    ids, preds, scores, labels, logits = [], [], [], [], []
    for idx, x, y in loader:
        out = logits_of(x)
        ids += idx.tolist()
        preds += out.argmax(1).tolist()
        scores += out.amax(1).tolist()
        labels += y.tolist()
        logits.append(out)
    records = [{"id": i, "pred": p, "score": s} for i, p, s in zip(ids, preds, scores, strict=True)]
    return {
        "records": records,
        "columns": {"id": ids, "pred": preds, "label": labels},
        "logits": torch.cat(logits) if logits else torch.empty(0, CLASSES, dtype=torch.float64),
        "mixed": {"label": labels, "correct": torch.tensor(preds) == torch.tensor(labels)},
    }


def metrics(results: dict[str, Any]) -> dict[str, Any]:
    """Accuracy and the sum of scores, as a metrics script computes them."""
    columns = results["columns"]
    correct = sum(p == y for p, y in zip(columns["pred"], columns["label"], strict=True))
    return {
        "samples": len(columns["id"]),
        "accuracy": correct / len(columns["id"]),
        "score_sum": sum(r["score"] for r in results["records"]),
        "logit_sum": float(results["logits"].sum()),
        "correct_count": int(results["mixed"]["correct"].sum()),
    }


def reference(batch_size: int, shuffle: bool, n: int = SAMPLES) -> dict[str, Any]:
    """One process over the whole set, in the sampler's order (its permutation when shuffled)."""
    sampler = DistributedSampler(dataset(n), num_replicas=1, rank=0, shuffle=shuffle, seed=3)
    sampler.set_epoch(1)
    return evaluate(DataLoader(dataset(n), batch_size=batch_size, sampler=sampler))


def distributed_evaluations(batch_sizes: list[int]) -> list[dict[str, Any]]:
    """Every (batch size, shuffle) evaluation on this rank, gathered with the sampler; also a
    split without padding (dataset[rank::world]) gathered with total=."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for batch_size in batch_sizes:
        for shuffle in (False, True):
            sampler = DistributedSampler(dataset(), shuffle=shuffle, seed=3, drop_last=False)
            sampler.set_epoch(1)
            local = evaluate(DataLoader(dataset(), batch_size=batch_size, sampler=sampler))
            gathered = {
                name: dg.gather_for_metrics(value, sampler=sampler) for name, value in local.items()
            }
            naive = sum(dg.all_gather_object(len(local["records"])))
            out.append({"config": (batch_size, shuffle), "gathered": gathered, "naive": naive})
    shard = torch.utils.data.Subset(dataset(), range(rank, SAMPLES, world))
    local = evaluate(DataLoader(shard, batch_size=batch_sizes[0]))
    gathered = {name: dg.gather_for_metrics(v, total=SAMPLES) for name, v in local.items()}
    out.append({"config": (batch_sizes[0], False), "gathered": gathered, "naive": SAMPLES})
    return out


def _capture(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return exc


def disagreements() -> dict[str, Any]:
    """One rank (the last) differs from the others in each case; every rank reports."""
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    sampler = DistributedSampler(dataset(), shuffle=False)
    share = len(range(rank, SAMPLES, world))
    full = len(sampler)  # with the padding
    ids = list(range(full))
    cases: dict[str, Any] = {}
    fields = {"id": ids, "extra": ids} if odd else {"id": ids, "pred": ids}
    cases["fields"] = _capture(dg.gather_for_metrics, fields, sampler=sampler)
    cases["total"] = _capture(dg.gather_for_metrics, ids, total=SAMPLES + (1 if odd else 0))
    short = ids[: share - 1] if odd else ids
    cases["too_few"] = _capture(dg.gather_for_metrics, short, sampler=sampler)
    cases["too_many"] = _capture(dg.gather_for_metrics, ids + [0] * odd, sampler=sampler)
    tensor = torch.zeros(full, 2, dtype=torch.float32 if odd else torch.float64)
    cases["dtype"] = _capture(dg.gather_for_metrics, tensor, sampler=sampler)
    rows = torch.zeros(full, 3 if odd else 2)
    cases["row_shape"] = _capture(dg.gather_for_metrics, rows, sampler=sampler)
    kind = torch.zeros(full) if odd else ids
    cases["kind"] = _capture(dg.gather_for_metrics, kind, sampler=sampler)
    cases["both"] = _capture(
        dg.gather_for_metrics, ids, sampler=sampler, total=SAMPLES if odd else None
    )
    cases["neither"] = _capture(dg.gather_for_metrics, ids, total=None if odd else SAMPLES)
    other = DistributedSampler(dataset(), num_replicas=world + 1, rank=0) if odd else sampler
    cases["sampler_world"] = _capture(dg.gather_for_metrics, ids, sampler=other)
    loader = DataLoader(dataset(), sampler=sampler)
    cases["loader"] = _capture(dg.gather_for_metrics, ids, sampler=loader if odd else sampler)
    cases["tuple"] = _capture(dg.gather_for_metrics, tuple(ids) if odd else ids, total=SAMPLES)
    uneven = {"id": ids, "pred": ids[:-1] if odd else ids}
    cases["uneven_fields"] = _capture(dg.gather_for_metrics, uneven, sampler=sampler)
    # still in step after all of these: a good call returns the whole set
    cases["after"] = dg.gather_for_metrics(ids[:share], total=SAMPLES)
    return cases
