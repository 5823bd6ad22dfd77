"""An evaluation's per-sample results from every rank, each sample exactly once, in order.

``DistributedSampler`` pads the data set so that every rank gets ``ceil(N / world_size)``
samples (it repeats the first ones), then hands rank ``r`` the positions ``r, r + world_size,
r + 2 * world_size, …`` of its index sequence. Gathered naively, the repeated samples are
counted twice and the results come in rank order. :func:`gather_for_metrics` undoes both: rank
``r``'s ``i``-th result is position ``i * world_size + r`` of the sampler's sequence, and the
positions from ``N`` on are the padding.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from ..errors import ObjectArgumentError
from ._object_call import DEFAULT_MAX_BYTES
from ._object_exchange import _all_gather_single, _bound_device, _group_state
from .objects import all_gather_object

__all__ = ["gather_for_metrics"]

_KINDS = (list, torch.Tensor, dict)


def gather_for_metrics(
    obj: list[Any] | torch.Tensor | dict[str, Any],
    *,
    sampler: DistributedSampler[Any] | None = None,
    total: int | None = None,
    group: dist.ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Any:
    """Every rank's per-sample results as one sequence: each sample once, in the sampler's order.

    Call on every rank, once, after the evaluation loop, with this rank's results for every
    sample its loader gave it, in the order given (one entry, or tensor row, per sample):

    * a ``list`` (labels, scores, records such as ``{"id", "pred", "score"}``): a list back;
    * a ``torch.Tensor`` (first dimension: samples): one tensor back, gathered as raw bytes by
      one all-gather of tensors (never pickled), on this rank's GPU under NCCL, on the CPU
      under gloo;
    * a ``dict`` of those (``{"pred": tensor, "label": list}``): a dict of them back.

    Pass ``sampler=`` (the evaluation's ``torch.utils.data.DistributedSampler``; its padding
    is removed), or ``total=`` (the number of samples, for a split without padding such as
    ``dataset[rank::world_size]``). Rank ``r`` must hold at least its share of the ``total``
    samples and at most ``ceil(total / world_size)``; the padding past ``total`` is dropped.

    Order: the sampler's index sequence before it was split across the ranks, so result
    ``k`` belongs to data-set index ``k`` with ``shuffle=False``; with ``shuffle=True`` to
    the ``k``-th index of the sampler's permutation for its epoch (what a
    ``DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)`` with the
    same epoch yields). With ``drop_last=True`` only the ``sampler.total_size`` samples the
    sampler kept are there.

    Raises :class:`ObjectArgumentError` on every rank, naming the ranks, when a rank passed a
    bad argument or the ranks disagree (kind, fields, tensor dtype or row shape, total), or a
    rank holds fewer results than its share or more than ``ceil(total / world_size)``.
    ``timeout`` and ``max_bytes`` as in :func:`ddpgraph.all_gather_object`.
    """
    about = _describe(obj, sampler, total, group)
    lists = None if about["problem"] else _list_part(obj)
    everyone = all_gather_object(
        {"about": about, "lists": lists}, group=group, timeout=timeout, max_bytes=max_bytes
    )
    abouts = [entry["about"] for entry in everyone]
    n = _agreed_total(abouts)
    world = len(everyone)
    if isinstance(obj, torch.Tensor):
        return _interleave_rows(obj, n, world, group)
    if isinstance(obj, list):
        return _interleave([entry["lists"] for entry in everyone], n)
    gathered: dict[str, Any] = {}
    for name in abouts[0]["fields"]:  # rank 0's order, the same on every rank
        value = obj[name]
        if isinstance(value, torch.Tensor):
            gathered[name] = _interleave_rows(value, n, world, group)
        else:
            gathered[name] = _interleave([entry["lists"][name] for entry in everyone], n)
    return gathered


# ---- what each rank holds ----


def _describe(
    obj: Any, sampler: Any, total: Any, group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """This rank's kind, count, fields, tensor layouts, total and any local problem: plain data,
    gathered so that every rank decides from the same facts."""
    about: dict[str, Any] = {"kind": type(obj).__name__, "count": 0, "fields": None}
    about["layout"] = {}
    problems = []
    n, problem = _total_from(sampler, total, group)
    about["total"] = n
    problems += [problem] if problem else []
    if isinstance(obj, dict):
        about["fields"] = [name if type(name) is str else repr(name) for name in obj]
        if any(type(name) is not str for name in obj):
            problems.append(f"obj has keys that are not str ({about['fields']})")
        counts = set()
        for name, value in obj.items():
            count, layout, problem = _column(value, f"obj[{name!r}]")
            problems += [problem] if problem else []
            counts.add(count)
            about["layout"][str(name)] = layout
        if not obj:
            problems.append("obj is an empty dict; pass at least one field of results")
        if len(counts) > 1:
            problems.append(
                f"the fields of obj hold different numbers of results ({sorted(counts)}); "
                "every field needs one entry per sample"
            )
        about["count"] = max(counts, default=0)
    else:
        about["count"], about["layout"][""], problem = _column(obj, "obj")
        problems += [problem] if problem else []
    about["problem"] = "; ".join(problems) or None
    return about


def _column(value: Any, where: str) -> tuple[int, Any, str | None]:
    """(results held, the tensor layout or None, a problem) of one sequence of results."""
    if type(value) is list:
        return len(value), None, None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return 0, None, f"{where} is a 0-d tensor; pass one row per sample (e.g. t.reshape(1))"
        return value.shape[0], [str(value.dtype), list(value.shape[1:])], None
    kind = type(value).__name__
    return 0, None, f"{where} is a {kind}; pass a list, a torch.Tensor or a dict of those"


def _total_from(
    sampler: Any, total: Any, group: dist.ProcessGroup | None
) -> tuple[int | None, str | None]:
    """The number of samples the evaluation covers, or None and what is wrong."""
    if (sampler is None) == (total is None):
        return None, (
            "pass exactly one of sampler= (the evaluation's DistributedSampler) and total= "
            f"(the number of samples); got sampler={type(sampler).__name__}, total={total!r}"
        )
    if total is not None:
        if type(total) is not int or total < 0:
            return None, f"total={total!r} is not a non-negative int"
        return total, None
    if not isinstance(sampler, DistributedSampler):
        hint = " (pass loader.sampler)" if hasattr(sampler, "sampler") else ""
        return None, f"sampler= is a {type(sampler).__name__}, not a DistributedSampler{hint}"
    rank, world = _rank_and_world(group)
    if (sampler.num_replicas, sampler.rank) != (world, rank):
        return None, (
            f"the sampler splits for rank {sampler.rank} of {sampler.num_replicas}, but this is "
            f"rank {rank} of {world}; build it with this group's rank and world size"
        )
    n = sampler.total_size if sampler.drop_last else len(sampler.dataset)  # type: ignore[arg-type]
    return n, None


def _rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _list_part(obj: Any) -> Any:
    """What travels through the object collective: the lists (tensors go as tensors)."""
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        return {name: value for name, value in obj.items() if isinstance(value, list)}
    return None


# ---- every rank decides from the same descriptions ----


def _agreed_total(abouts: list[dict[str, Any]]) -> int:
    """The total, if every rank's description fits with every other's; else raise the same
    error everywhere."""
    problems = [(r, a["problem"]) for r, a in enumerate(abouts) if a["problem"]]
    if problems:
        _refuse(problems, "passed bad arguments")
    for key, what in (("kind", "kind of obj"), ("fields", "fields"), ("layout", "tensor layout")):
        values = [a[key] for a in abouts]
        if any(v != values[0] for v in values):
            seen = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            differ = [r for r, v in enumerate(values) if v != values[0]] or [0]
            _refuse([(r, f"{what} differs ({seen})") for r in differ[:1]], f"differ in {what}")
    totals = [a["total"] for a in abouts]
    if len(set(totals)) > 1:
        seen = ", ".join(f"rank {r}: {t}" for r, t in enumerate(totals))
        _refuse([(0, f"the totals differ ({seen}); pass the same sampler or total=")], "disagree")
    n = totals[0]
    world = len(abouts)
    most = math.ceil(n / world)
    wrong = []
    for r, a in enumerate(abouts):
        share = len(range(r, n, world))
        if not share <= a["count"] <= most:
            wrong.append((r, f"holds {a['count']} results, its share of {n} samples is {share}"))
    if wrong:
        _refuse(
            wrong,
            f"hold a wrong number of results (rank r needs its share, len(range(r, {n}, "
            f"{world})), up to {most} with the sampler's padding; a DataLoader with "
            "drop_last=True drops a rank's last batch: use drop_last=False, or pass the right "
            "total=)",
        )
    return int(n)


def _refuse(problems: list[tuple[int, str]], summary: str) -> None:
    ranks = sorted({r for r, _ in problems})
    detail = " | ".join(f"rank {r}: {text}" for r, text in problems)
    raise ObjectArgumentError(
        f"gather_for_metrics: ranks {ranks} {summary}: {detail}. Every rank raised this error.",
        ranks,
    )


# ---- putting the results in order ----


def _interleave(per_rank: list[list[Any]], n: int) -> list[Any]:
    """Rank r's i-th result at position i * world + r; positions from n on are padding."""
    world = len(per_rank)
    out: list[Any] = [None] * n
    for r, results in enumerate(per_rank):
        share = len(range(r, n, world))
        out[r::world] = results[:share]
    return out


def _interleave_rows(
    tensor: torch.Tensor, n: int, world: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The rows of every rank's tensor in sampler order, through one all-gather of raw bytes
    (any dtype, bool and bfloat16 included, on gloo and NCCL alike)."""
    rows = tensor.detach()
    device = _collective_device(group, rows.device)
    row_shape, dtype = list(rows.shape[1:]), rows.dtype
    most = math.ceil(n / world)
    row_bytes = math.prod(row_shape) * rows.element_size()
    if world == 1 or n == 0 or row_bytes == 0:
        return rows[:n].to(device).clone()
    own = rows[:most].to(device).contiguous().reshape(-1, math.prod(row_shape))
    send = torch.zeros(most, row_bytes, dtype=torch.uint8, device=device)
    send[: own.shape[0]] = own.view(torch.uint8)
    out = torch.empty(world, most, row_bytes, dtype=torch.uint8, device=device)
    _all_gather_single(out.view(-1), send.view(-1), group=group)
    ordered = out.transpose(0, 1).reshape(world * most, row_bytes)[:n].contiguous()
    return ordered.view(dtype).reshape(n, *row_shape)


def _collective_device(group: dist.ProcessGroup | None, fallback: torch.device) -> torch.device:
    """Where the group's collectives run: the CPU on gloo, the rank's checked GPU on NCCL (found
    by the object collective that came first), or where the tensor is without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return fallback
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    backend = str(dist.get_backend(pg)).lower()
    if "nccl" not in backend:
        return torch.device("cpu")
    return _group_state(pg).device or _bound_device(pg)
