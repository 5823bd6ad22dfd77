"""The graphed training step: :class:`TrainStep`, a thin front over named parts.

Where each concept lives (one home each):

=================  ==============================================================================
``train_step``     :class:`TrainStep`: construction, ``__call__``, ``evaluate``, state, ``report``
``options``        :class:`~.options.StepOptions` and every check run at construction
``body``           the step: zero_grad, k x (forward, loss, backward), clip, update, buffer sync
``precision``      fp32/bf16 autocast, fp16 loss scaling on the device: one object
``parallel/``      the data-parallel wrapper behind one interface (``ddp``; ``local`` without
                   a process group)
``policy``         phases, warm-up, rank agreement, fallbacks, new shapes and modes
``batch``          a call's batch, its :class:`~.batch.Signature` and the typed
                   :class:`~.batch.GraphKey`
``engine``         the engine protocol (``GraphSet``, ``GraphEngine``) and what a capture returns
``graph_table``    the key bookkeeping both engines share (no CUDA)
``graphs``         the CUDA engine: pool, static buffers, replay hooks
``streams``        the capture stream of each device, and ``on_stream``
``cpu_graphs``     the CPU stand-in engine (tests, dry runs)
``feed``           ``step(data)`` over a DeviceData, each step's LR, rolled back on failure
``optim``          optimizer graph-safety (capturable/fused, LR on the device, in-place loads)
``syncs``          host syncs found in warm-up, named when a capture fails
``report``         :class:`Phase` and :class:`StepReport`
=================  ==============================================================================
"""

from __future__ import annotations

from .body import model_loss
from .report import Phase, StepReport
from .train_step import TrainStep

__all__ = ["Phase", "StepReport", "TrainStep", "model_loss"]
