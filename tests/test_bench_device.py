"""scripts/bench_device.sh: syntax, its shipped data and attention table, and (JAXSPEC_DEVICE_SMOKE=1,
~4 min on the shared CPU) the whole script end to end in --smoke mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = os.environ | {"PYTHONPATH": str(REPO), "PYTHON": sys.executable}


def test_script_parses_and_its_data_is_in_the_repo():
    subprocess.run(["bash", "-n", str(REPO / "scripts/bench_device.sh")], check=True)
    rows = [json.loads(x) for x in (REPO / "data/spec_bench_device.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and all(r["turns"] for r in rows)
    text = (REPO / "scripts/bench_device.sh").read_text()
    assert "data/spec_bench_device.jsonl" in text and "-c \"$constraints\"" in text


def test_attention_table_smoke():
    out = subprocess.run([sys.executable, str(REPO / "scripts/bench_attention.py"), "--smoke"],
                         env=ENV, capture_output=True, text=True, check=True).stdout
    assert "| xla (auto) |" in out and "GB/s" in out  # xla is what attend picks on CPU
    for cache in ("per-layer", "stacked"):  # every kernel ran (interpret mode) on both caches
        assert f"| {cache} | pallas_tpu |" in out and f"| {cache} | pallas_gpu |" in out
    assert "failed" not in out
    prefill = out[out.index("prefill:"):]  # the prompt table: the flash kernels (interpret mode)
    for cache in ("per-layer", "stacked"):
        assert f"| {cache} | pallas_tpu |" in prefill and f"| {cache} | pallas_gpu |" in prefill
        assert f"| 37 | {cache} | pallas_tpu |" in prefill  # a prompt over an earlier cache


def test_device_run_refuses_a_cpu(tmp_path):
    """Without --smoke on a machine whose jax backend is the CPU (no GPU/TPU here, or a CPU-only
    jax on a GPU box), the script refuses before measuring anything: exit 3, no figures."""
    run = subprocess.run(["bash", str(REPO / "scripts/bench_device.sh"), str(tmp_path)],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 3, run.stderr
    assert "error:" in run.stderr and not list(tmp_path.glob("*.md"))


def test_script_pins_the_tested_jax():
    text = (REPO / "scripts/bench_device.sh").read_text()
    pin = next(x for x in (REPO / "pyproject.toml").read_text().splitlines() if '"jax>=' in x)
    version = text.split('JAX_VERSION="${JAX_VERSION:-')[1].split("}")[0]
    assert f">={version}" in pin and "<" in pin  # the script installs the low end of the range
    assert 'jax[$extra]==$JAX_VERSION' in text


@pytest.mark.skipif(os.environ.get("JAXSPEC_DEVICE_SMOKE") != "1",
                    reason="set JAXSPEC_DEVICE_SMOKE=1")
def test_bench_device_smoke_end_to_end(tmp_path):
    """--smoke runs every part on the CPU and marks each table as no device figure."""
    subprocess.run(["bash", str(REPO / "scripts/bench_device.sh"), "--smoke", str(tmp_path)],
                   env=ENV, check=True, timeout=1200)
    for name in ("roofline.md", "attention.md", "summary.md", "results.json"):
        assert (tmp_path / name).stat().st_size > 0
    for name in ("roofline.md", "attention.md", "summary.md"):
        assert (tmp_path / name).read_text().startswith("SMOKE (cpu): not a device figure")
    assert json.loads((tmp_path / "device.json").read_text())["smoke"] is True
