"""Serving on a (2, 4) mesh of 8 simulated CPU devices (a subprocess: tests/serving_mesh_check.py,
the device count is fixed before jax starts): the scheduler runs unchanged with its page pool
sharded over kv heads (one of the tiny model's 4 kv heads per device, rows over "data"), greedy
output equals one-device solo runs for plain decoding and n-gram speculation, and no decode
program the scheduler compiles copies, zero-fills or gathers a buffer as large as a device's
pool shard (read in the optimised HLO with the codegen the one-device HLO checks use). The
control (`serving_mesh_check.py replicated`: the pool whole on every device) fails the shard
checks and copies the pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, "tests/serving_mesh_check.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_mesh_serving_greedy_equals_solo_runs_on_a_paged_pool(served, method):
    out = served[method]
    assert out["kv_layout"] == "paged", out
    assert out["same"], out


def test_the_pool_stays_sharded_over_kv_heads(served):
    for out in served.values():
        assert out["pool_spec"] == "('model',)", out
        assert out["pool_shard"][0] == 1, out  # [K/4, NP, P, H]: one kv head per device


def test_no_decode_program_copies_the_pool_on_a_mesh(served):
    copies = served["ngram"]["copies"]
    assert len(copies) == 9, copies  # widths 1, 2, 4 x tables of 4, 8, 12 pages
    assert {k: v for k, v in copies.items() if v} == {}, copies
