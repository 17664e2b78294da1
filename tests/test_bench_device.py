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


@pytest.mark.skipif(os.environ.get("JAXSPEC_DEVICE_SMOKE") != "1", reason="set JAXSPEC_DEVICE_SMOKE=1")
def test_bench_device_smoke_end_to_end(tmp_path):
    subprocess.run(["bash", str(REPO / "scripts/bench_device.sh"), "--smoke", str(tmp_path)],
                   env=ENV, check=True, timeout=1200)
    for name in ("roofline.md", "attention.md", "summary.md", "results.json"):
        assert (tmp_path / name).stat().st_size > 0
