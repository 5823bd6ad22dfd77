from __future__ import annotations

import os
import sys

import pytest

_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch):
    """Tests run as a plain single process unless they set launcher variables themselves."""
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    import ddpgraph

    ddpgraph.shutdown()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each test starts with no Accelerator set up. Accelerate keeps its state (mixed precision,
    device, the process group it saw, the gradient sync flags) in process-wide singletons, so one
    test's ``Accelerator(mixed_precision="bf16")`` would refuse the next test's ``"fp16"``
    ("AcceleratorState has already been initialized and cannot be changed"). Reset as
    Accelerate's own ``AccelerateTestCase.tearDown`` does, and put back the ``ACCELERATE_*``
    variables a test's TrainingArguments set (torch_compile sets ACCELERATE_DYNAMO_*)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    yield
    state = sys.modules.get("accelerate.state")  # only where a test imported accelerate
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()
    for name in [k for k in os.environ if k.startswith("ACCELERATE_") and k not in saved]:
        del os.environ[name]
    os.environ.update(saved)
