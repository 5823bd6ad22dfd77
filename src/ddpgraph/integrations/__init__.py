"""Front-ends for the frameworks users train with; each imported on its own, never by
``import ddpgraph`` (the core stays light), each an optional extra:

=================  ==================================================================  ======================
``transformers``   :class:`~ddpgraph.integrations.transformers.GraphTrainer`, a        ``ddpgraph[transformers]``
                   drop-in for ``transformers.Trainer``
``lightning``      :class:`~ddpgraph.integrations.lightning.GraphStrategy` for         ``ddpgraph[lightning]``
                   ``L.Trainer(strategy=...)``
``accelerate``     :meth:`ddpgraph.TrainStep.from_accelerator`                          ``ddpgraph[accelerate]``
                   (``TrainStep.from_accelerator``)
``fabric``         :meth:`ddpgraph.TrainStep.from_fabric`                               ``ddpgraph[lightning]``
                   (``TrainStep.from_fabric``)
=================  ==================================================================  ======================

Each owns DDP through a :class:`~ddpgraph.TrainStep` (every framework builds DDP on the default
stream, where its backward cannot be captured) and leaves the framework its data loading,
scheduling, logging and checkpoints.
"""

from __future__ import annotations

__all__: list[str] = []
