"""Module paths moved in 0.2 keep importing, as the same module, with a DeprecationWarning that
names the new path (until 0.3)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MOVED = {
    "ddpgraph.runtime": "ddpgraph.distributed.runtime",
    "ddpgraph.watchdog": "ddpgraph.distributed.watchdog",
    "ddpgraph.launch": "ddpgraph.distributed.launch",
    "ddpgraph.torch_patch": "ddpgraph.distributed.torch_patch",
    "ddpgraph.device_data": "ddpgraph.data.device_data",
    "ddpgraph.optim": "ddpgraph.step.optim",
    "ddpgraph.objects": "ddpgraph.distributed.objects",
    "ddpgraph.codec": "ddpgraph.distributed.codec",
}

PROBE = """
import importlib, json, sys, warnings
old, new = sys.argv[1], sys.argv[2]
import ddpgraph  # the package itself imports no old path
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    module = importlib.import_module(old)
print(json.dumps({
    "same": module is importlib.import_module(new),
    "warnings": [(w.category.__name__, str(w.message)) for w in caught],
}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_imports_the_new_module_with_a_warning_naming_it(old, new):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, old, new], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"]
    assert [category for category, _ in result["warnings"]] == ["DeprecationWarning"]
    assert new in result["warnings"][0][1] and "0.3" in result["warnings"][0][1]


@pytest.mark.timeout(120)
def test_importing_ddpgraph_warns_about_nothing():
    subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", "import ddpgraph, ddpgraph.cli"],
        check=True,
    )
