from __future__ import annotations

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
