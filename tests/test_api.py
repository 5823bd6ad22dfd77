from __future__ import annotations

import subprocess
import sys

import ddpgraph


def test_public_names_are_pinned():
    assert sorted(ddpgraph.__all__) == [
        "CaptureError",
        "CollectiveTimeout",
        "ConfigError",
        "DeviceConflictError",
        "DistributedStateError",
        "ObjectCollectiveError",
        "Runtime",
        "__version__",
        "all_gather_object",
        "broadcast_object",
        "gather_object",
        "get_runtime",
        "init",
        "shutdown",
    ]
    for name in ddpgraph.__all__:
        assert hasattr(ddpgraph, name), name


def test_core_import_stays_light():
    code = "import sys, ddpgraph; print(sorted(m for m in ('rich', 'click') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
