"""A stand-in for the few torchvision names ``imagenet/main.py`` uses with ``--dummy`` data.

Put on ``PYTHONPATH`` by ``examples/ports/port_runner.py`` only where torchvision cannot be imported
(the CPU CI image has no torchvision build matching its CPU-only torch), so that the original
script runs unchanged: ``models.squeezenet1_1`` (torchvision's architecture and initialisation),
``datasets.FakeData`` (deterministic random images as tensors) and the transforms the dummy path
constructs. Anything else raises, naming this file.
"""

from . import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
__version__ = "0.0-standin"
