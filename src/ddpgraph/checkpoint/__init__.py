"""Checkpoints that lose nothing, on ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds the model, optimizer and LR scheduler (through torch's
``get_state_dict``/``set_state_dict``, keyed by parameter name), the :class:`TrainStep`'s counters,
every rank's RNG states (CPU and its CUDA device), the data position (a :class:`ResumableLoader`
or any object with ``state_dict``/``load_state_dict``), the step and the caller's ``extra`` values.

Layout of ``directory``::

    step-00000100/      one committed checkpoint: DCP's files, its ``.metadata``, ddpgraph.json
    step-00000200/
    latest              the newest committed directory's name (for people and tools)
    .step-00000300.partial-<token>/   a save in progress, or one a crash interrupted

A save writes into a ``.partial`` directory; once every rank's data and DCP's metadata are on
disk, rank 0 writes ``ddpgraph.json`` and renames the directory to ``step-N``: a writer killed at
any point before that rename leaves the earlier checkpoints as they were and loadable. Loading
takes the newest ``step-N`` that loads, and copies the values into the tensors the model and
optimizer already hold, so CUDA graphs captured over them stay valid. A newest checkpoint damaged
later (a truncated shard, a lost ``.metadata``, a garbled ``ddpgraph.json``) is skipped, by name
and reason, for the next older one; every rank agrees on which one it loads. A save that fails
(no space left on the device) raises :class:`CheckpointWriteError` on every rank and removes its
partial directory; the earlier checkpoints stay.
"""

from __future__ import annotations

from .layout import JSON, CheckpointError, Stateful, latest_checkpoint
from .load import load_checkpoint
from .save import (
    CheckpointWriteError,
    save_checkpoint,
    save_checkpoint_async,
    wait_for_pending_save,
)
from .state import ResumableLoader

__all__ = [
    "JSON",
    "CheckpointError",
    "CheckpointWriteError",
    "ResumableLoader",
    "Stateful",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_checkpoint_async",
    "wait_for_pending_save",
]
