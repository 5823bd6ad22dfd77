"""Front-ends for the frameworks users train with; each imported on its own, never by
``import ddpgraph`` (the core stays light), each an optional extra:

=================  ==================================================================  ======================
``transformers``   :class:`~ddpgraph.integrations.transformers.GraphTrainer`, a        ``ddpgraph[transformers]``
                   drop-in for ``transformers.Trainer``
``lightning``      :class:`~ddpgraph.integrations.lightning.GraphStrategy` for         ``ddpgraph[lightning]``
                   ``L.Trainer(strategy=...)``
``accelerate``     :func:`~ddpgraph.integrations.accelerate.from_accelerator`, a        ``ddpgraph[accelerate]``
                   TrainStep as an ``Accelerator`` is set up
``fabric``         :func:`~ddpgraph.integrations.fabric.from_fabric`, a TrainStep as    ``ddpgraph[lightning]``
                   a ``Fabric`` is set up
=================  ==================================================================  ======================

Each owns DDP through a :class:`~ddpgraph.TrainStep` (every framework builds DDP on the default
stream, where its backward cannot be captured) and leaves the framework its data loading,
scheduling, logging and checkpoints.
"""

from __future__ import annotations

__all__: list[str] = []
