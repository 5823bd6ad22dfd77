"""Moved to :mod:`ddpgraph.distributed.objects` in 0.2; this path imports it, with a warning, until 0.3."""

from ._moved import moved

moved(__name__, "ddpgraph.distributed.objects")
