"""The notebooks run top to bottom headlessly (nbclient) on CPU with small settings
(JAXSPEC_NB_SMALL=1: 16 new tokens); their install cell finds this checkout's jaxspec and skips
pip (tests/test_wheel.py runs that cell's install path in a fresh venv).

A cell may take CELL_TIMEOUT_S and a notebook NOTEBOOK_TIMEOUT_S. Quiet, the quickstart's
slowest cell compiles for ~30 s; in one CI run on a loaded machine it took over 300 s, while a mesh
test beside it ran at 10x its quiet time. The test proves the notebooks run, not how fast they
run (BENCHMARKS.md measures that)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 900
NOTEBOOK_TIMEOUT_S = 1800  # over pyproject's 900 s per test: a notebook is many compiles


def run_notebook(name: str, tmp_path: Path, **env: str):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    old = {k: os.environ.get(k) for k in [*env, "JAXSPEC_NB_SMALL", "MPLBACKEND"]}
    os.environ.update({"JAXSPEC_NB_SMALL": "1", "MPLBACKEND": "Agg", **env})
    try:  # the kernel inherits this environment (JAXSPEC_CACHE_DIR from conftest included)
        nbclient.NotebookClient(
            nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
def test_quickstart_runs(tmp_path):
    text = run_notebook("quickstart.ipynb", tmp_path)
    # the install cell found this checkout's jaxspec (not PyPI's X-ray "jaxspec") and said so
    assert f"from {NOTEBOOKS.parent / 'jaxspec'}" in text
    assert "greedy outputs identical: lossless" in text
    assert "speedup (decode)" in text


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
def test_gamma_tuning_runs_with_measured_points(tmp_path):
    sweep = {
        "config": "smollm2-135m-ngram",
        "points": [{"gamma": g, "speedup": s} for g, s in [(1, 1.1), (3, 1.2), (8, 0.8)]],
        "formula": {"alpha": 0.5, "step_cost_fit": {"r0": 1.0, "r1": 0.1}, "optimal_gamma": 2},
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"gamma_sweep": sweep}))
    text = run_notebook("gamma_tuning.ipynb", tmp_path, JAXSPEC_RESULTS=str(path))
    assert "3 measured points" in text
    assert "optimal γ on this machine: 2" in text
