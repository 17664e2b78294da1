"""The roofline tool: its minimum bytes and its device byte count match hand counts on tiny
programs, its CLI prints what the issue asks for, and the read-only compile it (and the suite's
HLO checks) use gives the optimised HLO of XLA's default compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from tiny import tiny_config

from jaxspec import hlo
from jaxspec.models import llama
from jaxspec.tools import roofline


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=roofline.compile_options())


def test_min_bytes_is_the_hand_count():
    cfg = tiny_config(vocab=64, layers=4, hidden=64)  # heads 4, kv heads 2, head dim 16, mlp 128
    target = llama.LlamaTarget(cfg)
    params = roofline.abstract_params(target, "unrolled")
    b, t, valid = 3, 5, 40
    cache = roofline.abstract_cache(target, params, b, 96)
    layer = 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 64 + 3 * (128 * 64)  # norms, q k v o, mlp
    weights = 4 * (4 * layer + 64 + 64 * 64)  # + final norm + untied LM head, float32
    rows = 4 * b * t * 64  # gathered embedding rows (the table itself is not read)
    kv = 4 * b * (valid + t) * 4 * 2 * 2 * 16  # read prefix + written rows, k and v, 4 layers
    logits = 4 * b * t * 64
    assert roofline.min_bytes(target, params, cache, b, t, valid, t) == weights + rows + kv + logits


def test_device_bytes_of_a_matmul_is_operands_plus_output():
    x, w = jnp.zeros((8, 256)), jnp.zeros((128, 256))
    text = _compile(lambda x, w: x @ w.T, x, w).as_text()
    assert hlo.device_bytes(text) == 4 * (8 * 256 + 128 * 256 + 8 * 128)


def test_device_bytes_counts_in_place_rows_times_the_trip_count():
    """A 6-step loop that updates one 1024-float row of a [6, 1024] buffer per step: 6 x (row read +
    row written); XLA's cost analysis counts the whole buffer and the body once."""
    buf = jnp.zeros((6, 1024))

    def f(buf):
        def body(c, i):
            return c.at[i].set(c[i] * 2.0 + 1.0), None
        return jax.lax.scan(body, buf, jnp.arange(6))[0]

    compiled = jax.jit(f, donate_argnums=0).lower(buf).compile(compiler_options=roofline.compile_options())
    row = 4 * 1024
    got = hlo.device_bytes(compiled.as_text())
    assert 6 * 2 * row <= got <= 6 * 2 * row + 512  # + the loop counter and index bytes


def test_roofline_table_on_a_tiny_model():
    cfg = tiny_config(vocab=64, layers=4, hidden=64)
    for layout in ("unrolled", "stacked"):
        rows = roofline.table(llama.LlamaTarget(cfg), layout, [2], [1, 3], capacity=96, fill=0.5)
        assert [r.program for r in rows] == ["prefill", "decode", "verify"]
        for r in rows[1:]:
            assert r.cache_copies == 0 and r.zero_fills == 0 and r.collectives == 0
            assert r.min_bytes <= r.bytes < 4 * r.min_bytes, (layout, r)
            assert r.flops > 0


def test_cli_json_and_errors(capsys):
    assert roofline.main(["--model-shape", "nope"]) == 2
    assert "llama3-8b" in capsys.readouterr().err
    assert roofline.main(["--batch", "0"]) == 2
    capsys.readouterr()


@pytest.mark.parametrize("layout", ["unrolled"])
def test_cli_json_fields(capsys, monkeypatch, layout):
    monkeypatch.setitem(roofline.MODEL_SHAPES, "tiny", {
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 16})
    assert roofline.main(["--model-shape", "tiny", "--layout", layout, "--batch", "1",
                          "--window", "1,5", "--capacity", "96", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["program"] for x in lines] == ["prefill", "decode", "verify"]
    for x in lines:
        assert {"program", "batch", "window", "bytes", "min_bytes", "ratio", "cache_copies",
                "collectives"} <= set(x)


@pytest.mark.parametrize("backend, want", [("tpu", "stacked"), ("gpu", "unrolled"), ("cpu", "unrolled")])
def test_cli_auto_layout_is_this_backends(capsys, monkeypatch, backend, want):
    """layout auto (the configs' default, as scripts/bench_device.sh runs it) measures the layout
    the backend would run (stacked on TPU, unrolled on GPU: the accelerator layout): resolve_layout returns
    (layout, why), and the tuple once fell through
    to the unrolled programs on every backend."""
    from jaxspec.loading import params as lp

    monkeypatch.setattr(lp.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(lp.kernels, "available", lambda: False)
    monkeypatch.setitem(roofline.MODEL_SHAPES, "tiny", {
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 16})
    assert roofline.main(["--model-shape", "tiny", "--dtype", "float32", "--batch", "1",
                          "--window", "1", "--capacity", "96", "--no-prefill", "--json"]) == 0
    assert [json.loads(x)["layout"] for x in capsys.readouterr().out.splitlines()] == [want]


def test_roofline_reports_the_compiled_attention_not_the_setting(monkeypatch):
    """A bf16 target with JAX's backend patched to "tpu": the setting ("auto" resolved for the
    backend) says the TPU kernel, while the program compiled here, lowered for the CPU, holds the
    XLA path, and that is what the roofline reports."""
    import dataclasses

    from jaxspec.models import attention

    cfg = dataclasses.replace(tiny_config(vocab=64, layers=2, hidden=64), dtype="bfloat16")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert attention.resolve_impl("auto", cache_dtype=jnp.bfloat16) == "pallas_tpu"  # the setting
    r = roofline.measure(llama.LlamaTarget(cfg), "unrolled", "decode", 1, 1, capacity=96, valid=40)
    assert r.attention == "xla" and r.to_json()["attention"] == "xla"
    assert "| xla |" in roofline.format_table([r])


_HLO_OF_BOTH = """
import hashlib, re, sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp
from tiny import tiny_model
from jaxspec.decode import speculate
from jaxspec.decode.sampling import SamplingParams
from jaxspec.drafters.draft_model import layer_skip_drafter
from jaxspec.engine.runner import Engine
from jaxspec.tools import roofline

m = tiny_model(seed=0, layers=4)
e = Engine(m, layer_skip_drafter(m.target, 2), None, num_speculative_tokens=4)
sp = SamplingParams.make()
args = (m.params, None, jnp.zeros((1, 32), jnp.int32), jnp.full((1,), 5, jnp.int32),
        jnp.full((1,), 8, jnp.int32), sp, jax.random.key(0), jnp.arange(1, dtype=jnp.int32))
state = jax.eval_shape(lambda *a: speculate.prefill(e.spec, *a, capacity=200), *args)
lowered = speculate.decode_jit.lower(e.spec, m.params, None, state, sp, jnp.int32(1))
for options in (roofline.ACCEL_LIKE, roofline.compile_options()):  # XLA's defaults; read-only
    text = re.sub(r"metadata=[{][^}]*[}]", "", lowered.compile(compiler_options=options).as_text())
    print(hashlib.sha256(text.encode()).hexdigest(), len(text))
"""


def test_the_read_only_compile_gives_the_default_optimised_hlo():
    """LLVM level 0 with the default fusion emitters (roofline.READ_ONLY_CPU, the suite's
    tests/codegen.py HLO_CODEGEN) leaves the optimised HLO of XLA's default compile unchanged:
    a speculative decode loop compiled both ways in a process with no XLA flags, the same text.
    (The classic emitters of the suite's fast code generation do change it.)"""
    root = Path(__file__).resolve().parents[1]
    # both compiled here: no XLA flags, no persistent cache (a program loaded from it may carry
    # another process's instruction ids)
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    proc = subprocess.run([sys.executable, "-c", _HLO_OF_BOTH], check=False, cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    default, read_only = proc.stdout.split("\n")[-3:-1]
    assert int(default.split()[1]) > 100_000  # a whole decode loop, not an empty module
    assert read_only == default
