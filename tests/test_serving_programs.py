"""`python -m jaxspec.tools.programs --serving [--mesh D,M]`: the programs a server with a config
compiles, exported for a device on this host, with the attention read from each.

On the real SmolLM2 config as a TPU loads it (bfloat16, the stacked layout, whose cache is not
paged: `kv_layout` says contiguous), the listing is the scheduler's own warm-up list: a decode
call at the slots' width and the prompt bucket's prefill, each holding the TPU kernel; with
batched admission on, the prefill is listed at every admission width too (the control: the
listing follows the config). Under `--mesh 1,3` (three simulated CPU devices, set by the tool
before jax starts, in a subprocess) the same programs are exported under that mesh. Bad input:
one line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
SMALL = ["serving.slots=2", "serving.max_context=64", "serving.prefix_cache=false"]
BASE = ["--config", "configs/smollm2-135m.yaml", "--platform", "tpu", "--serving", "--json",
        "--prompt", "20"]


def listing(rows):
    return [(r["name"], r["rows"], r["prompt_bucket"]) for r in rows]


def test_serving_programs_are_the_warm_up_list_with_their_kernels(capsys):
    from jaxspec.tools.programs import main

    assert main([*BASE, *SMALL]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert listing(rows) == [("decode", 2, None), ("prefill", 1, 32)]
    for r in rows:
        assert r["attention"] == "pallas_tpu" and r["kernel_calls"] > 0, r
        assert r["dtype"] == "bfloat16" and r["kv_layout"] == "contiguous" and r["mesh"] is None
    assert main([*BASE, *SMALL, "serving.batch_prefill=true"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert listing(rows) == [("decode", 2, None), ("prefill", 1, 32), ("prefill", 2, 32)]
    assert main([*BASE, "--mesh", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--mesh" in err and "\n" not in err


def test_serving_programs_under_a_mesh():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the tool simulates the mesh's devices itself
    out = subprocess.run([sys.executable, "-m", "jaxspec.tools.programs", *BASE, "--mesh", "1,3",
                          *SMALL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert listing(rows) == [("decode", 2, None), ("prefill", 1, 32)]
    for r in rows:
        assert r["mesh"] == {"data": 1, "model": 3}, r
        assert r["attention"] == "pallas_tpu" and r["kernel_calls"] > 0, r
