"""What a fresh clone and a fresh venv get: declared extras, licence, changelog, README rendering."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_optional_features_have_extras_and_dev_pulls_what_the_tests_import():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert "matplotlib" in _names(extras["plot"])
    assert "transformers" in _names(extras["hf"])
    # dev repeats the other extras, so CI runs the transformers tests and draws the chart
    assert set(extras["plot"]) | set(extras["hf"]) <= set(extras["dev"])
    # transformers must not pull its own torch over the CPU wheel CI installs first
    assert "torch" not in _names(extras["hf"])
    # the framework front-ends: an extra each, tested in CI through dev, no torch of their own
    fronts = ("transformers", "accelerate", "lightning")
    assert set().union(*(extras[name] for name in fronts)) <= set(extras["dev"])
    assert "torch" not in set().union(*(_names(extras[name]) for name in fronts))


def test_license_changelog_and_urls_ship_with_the_project():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    assert "## [Unreleased]" in (ROOT / "CHANGELOG.md").read_text()
    urls = project["urls"]
    assert urls["Source"].startswith("https://github.com/")
    assert {"Homepage", "Issues", "Changelog"} <= set(urls)


@pytest.fixture
def render(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    readme.write_text((ROOT / "README.md").read_text())
    page.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    monkeypatch.setattr(module, "README", readme)
    monkeypatch.setattr(module, "PAGE", page)
    return module


def test_render_without_matplotlib_keeps_the_chart_line(render, capsys, monkeypatch):
    before = render.PAGE.read_text()
    assert "![step time relative to eager DDP]" in before
    monkeypatch.setattr(render, "CHART", render.PAGE.parent / "img" / "step-time.png")
    render.CHART.parent.mkdir()
    render.CHART.write_bytes((ROOT / "docs" / "img" / "step-time.png").read_bytes())
    render.chart = lambda rows, path: False  # as without matplotlib: nothing drawn
    render.main()
    after = render.PAGE.read_text()
    assert "![step time relative to eager DDP](img/step-time.png)" in after
    assert "kept the existing" in capsys.readouterr().err


def test_render_without_results_keeps_the_sections_as_they_were(render, tmp_path, capsys):
    before = render.README.read_text(), render.PAGE.read_text()
    render.RESULTS = tmp_path / "no-results"
    render.RESULTS.mkdir()
    render.main()
    assert (render.README.read_text(), render.PAGE.read_text()) == before
    assert "kept that section as it was" in capsys.readouterr().err


def _bench_file(path, date, eager_ms, step_ms):
    run = {
        "eager_ddp": {"median_ms": eager_ms, "first_fast_step_s": 1.0},
        "train_step": {"median_ms": step_ms, "first_fast_step_s": 0.5},
    }
    env = {
        "gpu": "GPU X",
        "torch": "2.x",
        "cuda": "13",
        "nccl": "2",
        "commit": "c0ffee",
        "date": date,
    }
    data = {"environment": env, "world_size": 1, "timing": "t", "configs": {"MLP": {"runs": [run]}}}
    path.write_text(json.dumps(data))


def test_render_shows_each_config_once_with_its_newest_result_in_tables_that_fit(render, tmp_path):
    render.RESULTS = tmp_path / "results"
    render.RESULTS.mkdir()
    render.chart = lambda rows, path: False
    render.CHART = tmp_path / "no-chart.png"
    _bench_file(render.RESULTS / "b-old.json", "2026-01-01T00:00:00Z", 4.0, 2.0)
    _bench_file(render.RESULTS / "a-new.json", "2026-02-01T00:00:00Z", 4.0, 1.0)
    render.main()
    page = render.PAGE.read_text()
    perf = page.split("<!-- perf:start -->")[1].split("<!-- perf:end -->")[0]
    tables = [line for line in perf.splitlines() if line.startswith("|")]
    assert "| mode | MLP |" in tables
    assert "| TrainStep | 1.000 (0.25×) a |" in tables  # the newer file, not the older
    assert "b-old.json" not in perf  # a file whose every cell is newer elsewhere is no source
    assert max(map(len, tables)) <= 100
    readme = render.README.read_text().split("<!-- perf:start -->")[1]
    assert readme.count("| MLP |") == 1


def test_render_tables_the_upstream_ports_gpu_figures_and_skips_a_cpu_smoke_run(render, tmp_path):
    """benchmarks/upstream_ports.py's JSON (its shape as the script writes it) becomes a row
    per script and precision in docs/benchmarks.md; a failed run a row naming its error; a
    CPU smoke run no table."""
    render.RESULTS = tmp_path / "results"
    render.RESULTS.mkdir()

    def side(ms):
        return {"median_ms": ms, "steps_per_s": 1e3 / ms, "printed": [], "report": ""}

    timm = {
        "sizes": {"model": "resnet50", "batch": 128},
        "fp32": {"script": side(80.0), "port": side(40.0), "port_vs_script": 2.0,
                 "report": {"replayed_uncaptured": 0.75, "captures": 1}},
        "amp": {"error": "RuntimeError: boom"},
    }  # fmt: skip
    data = {"device": "GPU X", "torch": "2.x", "src_tree": "c0ffee", "world_size": 1}
    for name, device in (("upstream-ports-gpu.json", "GPU X"), ("upstream-ports-cpu.json", "cpu")):
        payload = {**data, "device": device, "scripts": {"timm": timm}}
        (render.RESULTS / name).write_text(json.dumps(payload))
    render.main()
    page = render.PAGE.read_text()
    assert "| timm | fp32 | resnet50, 128 | 80.00 | 40.00 (2.00×) | 0.75 | 1 |" in page
    assert "| timm | amp | resnet50, 128 | failed: RuntimeError: boom | | | |" in page
    assert "upstream-ports-gpu.json" in page and "upstream-ports-cpu.json" not in page
