"""Option types of the ``ddpgraph`` command line that click lacks."""

from __future__ import annotations

import math
from typing import Any

import click

__all__ = ["FiniteFloatRange"]


class FiniteFloatRange(click.FloatRange):
    """A float range that also refuses ``nan`` and ``inf`` (click's range lets nan through:
    every comparison with it is false)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; pass a number of the range.", param, ctx)
        return number
