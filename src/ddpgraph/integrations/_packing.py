"""Packed (padding-free) batches at a fixed capacity, so one graph serves every packed batch.

TRL's ``packing=True`` / ``padding_free=True`` (and transformers' ``DataCollatorWithFlattening``)
flatten a batch into one row of ``T`` tokens with the document boundaries in ``position_ids``
(restarting at 0), ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``docs + 1`` offsets) and the longest
document in ``max_length_q`` / ``max_length_k`` (Python ints): ``T``, the number of documents and
the longest one change at every batch. As torchtitan (PR #4156: boundaries kept at ``max_docs +
1`` entries, max lengths at ``seq_len``) and Megatron's packed THD format (a static token
capacity) do, :func:`fixed_capacity` pads the row to ``capacity`` tokens with padding documents
of at most ``max_length`` tokens each (pad token, labels -100, positions restarting at 0, so
each attends to itself only), the offsets to ``capacity + 1`` entries (the last offset repeated:
empty documents) and the max lengths to ``max_length``. The real documents see the same
attention (their own tokens only) and the padding counts in no loss (its labels are ignored).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["PACKED_KEYS", "fixed_capacity", "is_packed"]

OFFSETS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTHS = ("max_length_q", "max_length_k")
PACKED_KEYS = OFFSETS + MAX_LENGTHS
# per-token entries padded with a constant (input_ids: the pad token; position_ids and seq_idx:
# the padding documents' own)
_FILL = {"labels": -100, "attention_mask": 1}


def is_packed(batch: Mapping[str, Any]) -> bool:
    """Whether ``batch`` is a flattened (packed / padding-free) batch."""
    return any(key in batch for key in PACKED_KEYS)


def fixed_capacity(
    batch: Mapping[str, Any], capacity: int, max_length: int, pad_token_id: int
) -> dict[str, Any]:
    """``batch`` (one flattened row) padded to ``capacity`` tokens as the module says; raises
    :class:`ConfigError` with the numbers where it does not fit or is not one row."""
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.shape[0] != 1 or "position_ids" not in batch:
        raise ConfigError(
            f"a packed batch is one row with position_ids, but input_ids has shape "
            f"{tuple(ids.shape)} and the entries are {sorted(batch)}; GraphTrainer pads "
            "TRL's packed and padding-free batches (one flattened row) to a fixed capacity."
        )
    tokens = ids.shape[1]
    if tokens > capacity:
        raise ConfigError(
            f"a packed batch of {tokens} tokens exceeds GraphTrainer's capacity of {capacity} "
            f"(per_device_train_batch_size x max_length); set max_length so that every "
            "batch fits (packing=True keeps each pack within max_length)."
        )
    extra = capacity - tokens
    lengths = [max_length] * (extra // max_length) + (
        [extra % max_length] if extra % max_length else []
    )
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0)
    out: dict[str, Any] = dict(batch)
    out["position_ids"] = _append(batch["position_ids"], positions)
    out["input_ids"] = _append(ids, torch.full((extra,), pad_token_id))
    for key, fill in _FILL.items():
        if key in batch:
            out[key] = _append(batch[key], torch.full((extra,), fill))
    if "seq_idx" in batch:  # each padding document its own index, after the real ones
        seq_idx = batch["seq_idx"]
        first = int(seq_idx.max()) + 1 if seq_idx.numel() else 0
        pad = [torch.full((n,), first + i) for i, n in enumerate(lengths)]
        out["seq_idx"] = _append(seq_idx, torch.cat(pad) if pad else torch.zeros(0))
    for key in OFFSETS:
        if key in batch:
            out[key] = _offsets(batch[key], lengths, capacity)
    for key in MAX_LENGTHS:
        if key in batch:
            if int(batch[key]) > max_length:
                raise ConfigError(
                    f"a packed batch has a document of {int(batch[key])} tokens ({key}), longer "
                    f"than max_length={max_length}; truncate the documents to max_length."
                )
            out[key] = max_length
    return out


def _append(row: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    return torch.cat([row, tail.to(device=row.device, dtype=row.dtype)[None]], dim=1)


def _offsets(offsets: torch.Tensor, lengths: list[int], capacity: int) -> torch.Tensor:
    """The documents' offsets, the padding documents' after them, the last one repeated to
    ``capacity + 1`` entries (at most one document a token)."""
    last = int(offsets[-1])
    ends = torch.tensor(lengths, dtype=torch.long).cumsum(0) + last
    full = torch.cat([offsets.cpu().long(), ends])
    full = torch.cat([full, full[-1:].expand(capacity + 1 - full.numel())])
    return full.to(device=offsets.device, dtype=offsets.dtype)
