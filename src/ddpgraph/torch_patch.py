"""Moved to :mod:`ddpgraph.distributed.torch_patch` in 0.2; this path imports it, with a warning, until 0.3."""

from ._moved import moved

moved(__name__, "ddpgraph.distributed.torch_patch")
