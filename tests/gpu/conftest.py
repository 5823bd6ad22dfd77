from __future__ import annotations

import pytest
import torch

import ddpgraph


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


# Accelerate's process-wide state (an earlier test's mixed_precision) is reset after every test
# by tests/conftest.py, for these tests and the CPU ones alike.


@pytest.fixture
def rt():
    """A single-process NCCL group (world size 1), so TrainStep wraps the model in DDP."""
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    runtime = ddpgraph.init()
    yield runtime
    ddpgraph.shutdown()
