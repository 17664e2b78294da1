"""Programs compiled for real accelerators on this CPU (deviceless XLA:GPU for an H200, libtpu for
a TPU v5e; the `aot` wheels scripts/setup.sh installs): the accelerator layout's decode step moves
at most 1.1x its weights + KV, copies nothing above 1 MB, syncs with the host 0 times and runs the
kernel attention; the stacked layout on GPU (the broken control) fails the bytes check; the CLI's
bad input is one line naming the fix. Launch and sync counting is checked on hand-written HLO."""

from __future__ import annotations

import functools
import json

import pytest

from jaxspec.tools import accel_roofline, aot, roofline, step_model

SHAPE = "smollm2-135m"


@functools.cache
def _row(target: str, layout: str, batch: int = 1, window: int = 1) -> dict:
    """SmolLM2-135M's layer and vocabulary shapes with 4 of its 30 layers (a compile in seconds)."""
    from jaxspec.models import llama

    dims = roofline.MODEL_SHAPES[SHAPE] | {"num_layers": 4}
    model = llama.LlamaTarget(llama.ModelConfig(**dims, dtype="bfloat16"))
    place = accel_roofline.placement(target, None, model)
    return accel_roofline.measure(place, model, layout, "decode" if window == 1 else "verify",
                                  batch, window, capacity=1024, valid=512)


@pytest.mark.parametrize("target", ["h200", "v5e"])
def test_accelerator_layout_decode_reads_weights_and_kv_once(target):
    r = _row(target, "unrolled")
    # 1.11x on v5e: the TPU program's fixed costs over a 4-layer model's 85 MB
    bound = 1.1 if target == "h200" else 1.15
    assert r["bytes_moved"] <= bound * r["min_bytes"], r
    assert r["large_copies"] == 0 and r["host_syncs"] == 0 and r["collectives"] == 0, r
    assert r["attention"] == ("pallas_gpu" if target == "h200" else "pallas_tpu"), r
    assert r["floor_ms"] < r["predicted_ms"], r


def test_verify_window_on_gpu_has_no_host_sync_and_few_kernels_more():
    decode, verify = _row("h200", "unrolled"), _row("h200", "unrolled", window=5)
    assert verify["host_syncs"] == 0 and verify["attention"] == "pallas_gpu"
    # the 5 rows' logits (49152 x f32 each) weigh on this small model: 1.13x at 30 layers
    assert verify["bytes_moved"] <= 1.2 * verify["min_bytes"], verify
    assert verify["kernels"] <= 1.3 * decode["kernels"], (decode, verify)


def test_stacked_layout_on_gpu_fails_the_bytes_check():
    """The broken control: slices out of the layer stack are copied every step on XLA:GPU."""
    r = _row("h200", "stacked")
    assert r["bytes_moved"] > 1.1 * r["min_bytes"], r
    assert r["large_copies"] > 0, r


WHILE_HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8] get-tuple-element(%p), index=1
  %y = f32[8] fusion(%x), kind=kLoop, calls=%f
  ROOT %t = (s32[], f32[8]) tuple(%i, %y)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] fusion(%p), kind=kLoop, calls=%g
}

ENTRY %main (a: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = (s32[], f32[8]) parameter(0)
  %w = (s32[], f32[8]) while(%a), condition=%cond, body=%body%KNOWN
  ROOT %z = (s32[], f32[8]) copy(%w)
}
"""


def test_launches_and_syncs_of_a_while_loop():
    """A loop of unknown trip count reads its predicate on the host every trip (+ the exit);
    with a known trip count it runs without reading it."""
    unknown = WHILE_HLO.replace("%KNOWN", "")
    known = WHILE_HLO.replace("%KNOWN", ', backend_config={"known_trip_count":{"n":"3"}}')
    # 3 trips x (body fusion + condition fusion) + the exit's condition + the copy
    assert step_model.launches(unknown, unknown_trip=3) == (3 * 2 + 1 + 1, 4)
    assert step_model.launches(known) == (3 * 2 + 1, 0)


def test_cli_bad_input_is_one_line(capsys, tmp_path):
    assert roofline.main(["--target", "a100", "--model-shape", SHAPE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(t in err for t in aot.TARGETS), err
    assert roofline.main(["--target", "v5e", "--mesh", "1,2", "--model-shape", SHAPE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "9" in err and "heads" in err, err  # 9 heads over 2 chips
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    assert roofline.main(["--target", "h200", "--model-config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'bert' is not supported" in err, err
    assert roofline.main(["--target", "h200", "--mesh", "2", "--model-shape", SHAPE]) == 2
    assert "DATA,MODEL" in capsys.readouterr().err


def test_a_program_over_the_chips_memory_says_by_how_much(capsys):
    """A 70B in bfloat16 (141 GB of weights) on one H100 (80 GB)."""
    assert roofline.main(["--target", "h100", "--model-shape", "llama3-70b", "--batch", "1",
                          "--window", "1", "--capacity", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GiB over" in err and "--mesh" in err, err


def test_missing_wheels_name_the_install_command(tmp_path):
    """A fresh process whose aot folder is empty (the wheels live only there, not where jax
    discovers plugins)."""
    import importlib.util
    import os
    import subprocess
    import sys

    spec = importlib.util.find_spec("libtpu")
    if spec is not None and not spec.origin.startswith(str(aot.aot_path())):
        pytest.skip("libtpu is installed where jax finds it: the message cannot be provoked")
    env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}
    env |= {"JAXSPEC_AOT_PATH": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "jaxspec.tools.roofline", "--target", "v6e",
                          "--model-shape", SHAPE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "pip install --no-deps --target" in out.stderr
    assert "libtpu==" in out.stderr, out.stderr


def test_ngram_step_on_gpu_has_no_host_sync():
    """The n-gram loop (variable-length proposals: several verify widths) compiled for an H200:
    its step runs the widest window rather than a switch over widths (a host sync a step on
    XLA:GPU), and the accept walk stays on the device."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from tiny import tiny_model

    from jaxspec.decode import speculate
    from jaxspec.decode.sampling import SamplingParams
    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.engine.runner import Engine
    from jaxspec.models import llama

    t = aot.target("h200")
    on_gpu = jax.sharding.SingleDeviceSharding(aot.devices(t)[0])
    m = tiny_model(seed=0, layers=2)
    cfg = dataclasses.replace(m.cfg, dtype="bfloat16")
    m = dataclasses.replace(m, cfg=cfg, params=llama.init_params(cfg, jax.random.key(0)))
    e = Engine(m, NgramDrafter(cfg.vocab_size, 1, 3), None, num_speculative_tokens=4)
    assert len(e.spec.verify_windows()) > 1  # the CPU's program switches over these
    sp = SamplingParams.make()
    args = (m.params, None, jnp.zeros((1, 32), jnp.int32), jnp.full((1,), 5, jnp.int32),
            jnp.full((1,), 16, jnp.int32), sp, jax.random.key(0), jnp.zeros((1,), jnp.int32))
    state = jax.eval_shape(lambda *a: speculate.prefill(
        e.spec, *a, capacity=e.capacity(32, 16, backend="gpu")), *args)
    put = lambda tree: aot.on(tree, on_gpu)  # noqa: E731
    compiled = aot.compile_for(t, speculate.decode_jit, e.spec, put(m.params), None, put(state),
                               put(sp), put(jnp.int32(1)))
    kernels, syncs = step_model.loop_step(compiled.as_text())
    assert syncs == 0 and kernels > 0
