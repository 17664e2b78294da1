"""Programs compiled for real accelerators on this CPU (deviceless XLA:GPU for an H200, libtpu for
a TPU v5e; the `aot` wheels scripts/setup.sh installs): the accelerator layout's decode step moves
at most 1.1x its weights + KV, copies nothing above 1 MB, syncs with the host 0 times and runs the
kernel attention; the fused layout runs fewer kernels, RoPE once a step; bf16 projections sum
in f32 in one-token and window programs (a bf16 dot, flagged); the speculative loop's step has no
host sync; a 2x4 TPU mesh reads each chip's shard once with two collectives a layer; the stacked
layout on GPU (the broken control) fails the bytes check; the CLI's bad input is one line naming
the fix. Launch and sync counting is checked on hand-written HLO."""

from __future__ import annotations

import functools
import json
import os

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
                                  batch, window, capacity=1024, valid=512, kernel_list=True)


@functools.cache
def _xla_projections_row() -> dict:
    """The h200 fused decode row with XLA's one-token projections (JAXSPEC_GPU_GEMV=0: the
    control for models/gemv_gpu.py, and what a verify window's projections run)."""
    before = os.environ.get("JAXSPEC_GPU_GEMV")
    os.environ["JAXSPEC_GPU_GEMV"] = "0"
    try:
        return _row.__wrapped__("h200", "fused")
    finally:
        if before is None:
            del os.environ["JAXSPEC_GPU_GEMV"]
        else:
            os.environ["JAXSPEC_GPU_GEMV"] = before


@pytest.mark.parametrize("target", ["h200", "v5e"])
def test_accelerator_layout_decode_reads_weights_and_kv_once(target):
    r = _row(target, "fused")
    # 1.11x on v5e: the TPU program's fixed costs over a 4-layer model's 85 MB
    bound = 1.1 if target == "h200" else 1.15
    assert r["bytes_moved"] <= bound * r["min_bytes"], r
    assert r["large_copies"] == 0 and r["host_syncs"] == 0 and r["collectives"] == 0, r
    assert r["attention"] == ("pallas_gpu" if target == "h200" else "pallas_tpu"), r
    assert r["floor_ms"] < r["predicted_ms"], r


def test_fused_layout_runs_fewer_kernels_and_rope_once_a_step():
    """q/k/v and gate/up fused: fewer launches than the separate weights, the same bytes; the RoPE
    tables are computed by 2 kernels a step (sine, cosine), not per layer."""
    fused, plain = _row("h200", "fused"), _row("h200", "unrolled")
    assert fused["kernels"] < plain["kernels"], (fused, plain)
    assert fused["bytes_moved"] <= 1.01 * plain["bytes_moved"], (fused, plain)
    assert fused["rope_kernels"] <= 2, fused
    # --kernels names each launch: one attention kernel a layer, the whole count listed
    listed = fused["kernel_list"]
    assert len(listed) == fused["kernels"], listed
    assert sum("(jaxspec_decode))/pallas_call" in k for k in listed) == 4, listed


def test_bf16_projections_accumulate_in_f32_in_decode_and_verify():
    """Greedy identity in bf16 on GPU: the one-token step's projections (which XLA:GPU rewrites
    into multiply + reduce) and the window's GEMMs both take f32 products and sums. A bf16 dot,
    the broken variant, is flagged in both forms."""
    import jax
    import jax.numpy as jnp

    for window in (1, 5):
        assert _row("h200", "fused", window=window)["low_precision_dots"] == 0
    t = aot.target("h200")
    on_gpu = jax.sharding.SingleDeviceSharding(aot.devices(t)[0])
    bf16_dot = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=on_gpu)
    for rows in (1, 5):
        x = jax.ShapeDtypeStruct((rows, 128), jnp.bfloat16, sharding=on_gpu)
        assert step_model.low_precision_dots(aot.compile_for(t, bf16_dot, x, w).as_text())


def test_verify_window_on_gpu_has_no_host_sync_and_few_kernels_more():
    decode, verify = _row("h200", "fused"), _row("h200", "fused", window=5)
    assert verify["host_syncs"] == 0 and verify["attention"] == "pallas_gpu"
    # the 5 rows' logits (49152 x f32 each) weigh on this small model: 1.13x at 30 layers
    assert verify["bytes_moved"] <= 1.2 * verify["min_bytes"], verify
    # the written window is read from the cache too (row t up to its own slot): no window part;
    # its projections are XLA's (the GEMV kernels take one token): the decode step run so
    assert verify["kernels"] <= _xla_projections_row()["kernels"] + 4, (decode, verify)


def test_fused_decode_runs_10_kernels_a_layer():
    """The fused layout's one-token layer on an H200 (`roofline --kernels`): the norm inside the
    q/k/v projection's Pallas GEMV (models/gemv_gpu.py), RoPE in the k and v writes (one in-place
    dynamic_update_slice each) and q's slice, the attention kernel reading its own row from the
    written cache, the output projection with its residual add, gate/up with the norm and
    SiLU * up, down with its residual: 10 kernels a layer (13 with XLA's projections, 21 before
    the fused layout). The controls: the XLA projections (JAXSPEC_GPU_GEMV=0) and the separate
    weights (the unrolled layout) run more."""
    fused, plain = _row("h200", "fused"), _row("h200", "unrolled")
    listed = fused["kernel_list"]
    assert fused["kernels"] <= 10 * 4 + 7 < plain["kernels"], (fused["kernels"], plain["kernels"])
    assert sum("jaxspec_gemv/pallas_call" in k for k in listed) == 4 * 4, listed
    assert sum(" dynamic-update-slice " in k for k in listed) == 2 * 4, listed
    assert not any(" concatenate " in k for k in listed), listed
    assert sum(" select " in k for k in listed) <= 2, listed  # the RoPE tables, once a step
    xla = _xla_projections_row()
    assert not any("jaxspec_gemv" in k for k in xla["kernel_list"]), xla["kernel_list"]
    assert fused["kernels"] + 2 * 4 <= xla["kernels"], (fused["kernels"], xla["kernels"])
    assert fused["bytes_moved"] <= 1.01 * xla["bytes_moved"], (fused, xla)


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


@functools.cache
def _loop_step(method: str, temperature: float = 0.0, write_chains: bool = True) -> dict:
    """The decode loop's step compiled for an H200 (jaxspec.tools.spec_steps: the program
    speculate.decode_jit runs) on a tiny 4-layer bf16 model whose 5000-token vocabulary is no
    other dim of the program."""
    import dataclasses

    from tiny import tiny_config

    from jaxspec.models import llama
    from jaxspec.tools import spec_steps

    cfg = dataclasses.replace(tiny_config(layers=4, vocab=5000), dtype="bfloat16")
    model = llama.LlamaTarget(cfg)
    place = accel_roofline.placement("h200", None, model)
    gamma = spec_steps.DEFAULT_GAMMA.get(method, 0)
    return spec_steps.measure_step(place, model, "fused", method, gamma, 1, 256, 128, temperature,
                                   write_chains)


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_speculative_step_on_gpu_has_no_host_sync(method):
    """n-gram's variable-length proposals run the widest window rather than a switch over widths
    (a host sync a step on XLA:GPU), EAGLE-3 drafts γ tokens in a scan, and both accept on the
    device: 0 host round trips, the kernel attention. Greedy: the drafts, the acceptance and the
    next token are argmaxes, no prefix sum or one-hot over a vocabulary (`vocab_scans`)."""
    from jaxspec.tools import spec_steps

    r = _loop_step(method)
    assert r["host_syncs"] == 0 and r["kernels"] > 0 and r["attention"] == "pallas_gpu", r
    assert r["window"] == spec_steps.DEFAULT_GAMMA[method] + 1, r
    assert r["vocab_scans"] == 0, r


def test_a_chain_window_is_written_by_the_verify_on_gpu():
    """n-gram's chain window on an H200: the verify writes its k/v into the cache in place
    (`LoopSpec.write_chains`), as decode writes its token. The read-only window compacted after
    (the broken control, the program before) runs at least 4 kernels a layer more: each layer's
    window k/v out, the compaction's scatters into both caches."""
    written, read_only = _loop_step("ngram"), _loop_step("ngram", write_chains=False)
    assert written["host_syncs"] == 0 and written["attention"] == "pallas_gpu", written
    assert written["kernels"] + 4 * 4 <= read_only["kernels"], (written, read_only)


def test_the_loop_step_compiles_on_a_v5e_mesh():
    """`--method` on `--mesh`: n-gram's loop step placed as the engine places it on a v5e 1x2
    (params by the rules, the state by rows and kv heads): two chips, the paged TPU kernel per
    shard, collectives for the model axis, no host sync."""
    import dataclasses

    from tiny import tiny_config

    from jaxspec.models import llama
    from jaxspec.tools import spec_steps

    model = llama.LlamaTarget(dataclasses.replace(tiny_config(layers=2, vocab=5000),
                                                  dtype="bfloat16"))
    place = accel_roofline.placement("v5e", (1, 2), model)
    r = spec_steps.measure_step(place, model, "unrolled", "ngram", 4, 2, 256, 128)
    assert r["chips"] == 2 and r["attention"] == "pallas_tpu" and r["host_syncs"] == 0, r
    assert r["collectives"] >= 2 * 2, r  # two all-reduces a layer at least


def test_an_eagle3_head_on_a_model_mesh_is_read_by_shards():
    """EAGLE-3's loop step on a v5e 1x2 (Llama-3.2-1B's shapes, 4 layers: taps 2, 2, 1), the
    head placed as `MeshPlan(shard_drafter=True)` places it (its layer and LM head by the
    target's rules): a chip moves <= 1.2x its share of target + head + KV (0.742 GB, 1.11x).
    The head replicated (the control, the tool's program before: `_plan` -> MeshPlan(mesh))
    moves 1.017 GB, 1.27x its share even with the whole head counted once in it: each chip
    reads the whole layer and LM head 3 times a step."""
    from jaxspec.tools import spec_steps

    model = roofline.shape_target("llama3-1b", "bfloat16").prefix(4)
    place = accel_roofline.placement("v5e", (1, 2), model)
    r = spec_steps.measure_step(place, model, "unrolled", "eagle3", 3, 2, 256, 128)
    assert r["chips"] == 2 and r["host_syncs"] == 0 and r["attention"] == "pallas_tpu", r
    assert r["bytes_moved"] <= 1.2 * r["min_bytes"], r


def test_a_batch_window_on_tpu_is_written_without_relaying_the_cache(monkeypatch):
    """v5e, Llama-3.2-1B's layer shapes (2 layers), batch 8: the loop's k/v writes go row by row
    in place (`decoder._write_rows`). The vmapped scatter (the control, the program before) made
    XLA:TPU lay the written caches out for the scatter and copy each layer's k and v caches to
    the kernel's layout every step: at least one more read of every cache."""
    import jax

    from jaxspec.models import decoder, llama
    from jaxspec.tools import spec_steps

    dims = roofline.MODEL_SHAPES["llama3-1b"] | {"num_layers": 2}
    model = llama.LlamaTarget(llama.ModelConfig(**dims, dtype="bfloat16"))
    place = accel_roofline.placement("v5e", None, model)
    good = spec_steps.measure_step(place, model, "unrolled", "plain", 0, 8, 1024, 512)
    one = lambda c, n, p: c.at[p].set(n, mode="drop")  # noqa: E731
    monkeypatch.setattr(decoder, "_write_rows", lambda c, n, p: jax.vmap(
        jax.vmap(one, in_axes=(0, 1, None)))(c, n.astype(c.dtype), p))
    jax.clear_caches()  # the loop's trace is cached by its static arguments: trace the control
    bad = spec_steps.measure_step(place, model, "unrolled", "plain", 0, 8, 1024, 512)
    cfg = model.cfg
    caches = 2 * cfg.num_layers * 8 * cfg.num_kv_heads * 1024 * cfg.head_dim * 2  # k, v (bf16)
    assert good["attention"] == "pallas_tpu" and good["bytes_ratio"] <= 1.1, good
    assert good["bytes_moved"] + 0.9 * caches <= bad["bytes_moved"], (good, bad)


def test_greedy_decoding_picks_the_argmax_and_sampling_still_draws():
    """Plain decoding's compiled step: greedy takes the argmax (no vocabulary scan, fewer kernels);
    the sampled step (the control: the detector sees its inverse-CDF draw) scans."""
    greedy, sampled = _loop_step("plain"), _loop_step("plain", temperature=0.7)
    assert greedy["vocab_scans"] == 0 and sampled["vocab_scans"] > 0, (greedy, sampled)
    assert greedy["kernels"] < sampled["kernels"], (greedy, sampled)


def test_a_model_sharded_mesh_reads_its_shard_once_with_two_all_reduces_a_layer():
    """Llama-3.2-1B's shapes (2 layers) on a v5e 2x4, data 2 x model 4: each chip moves <= 1.1x
    its share of weights + KV (weights replicated over "data"), two collectives a layer (+1: the
    logits), the paged TPU kernel per shard (a Mosaic call GSPMD cannot split)."""
    model = roofline.shape_target("llama3-1b", "bfloat16").prefix(2)
    place = accel_roofline.placement("v5e", (2, 4), model)
    r = accel_roofline.measure(place, model, "unrolled", "decode", 8, 1, 1024, 512)
    assert r["shard_ratio"] <= 1.1 and r["collectives"] == 2 * 2 + 1, r
    assert r["attention"] == "pallas_tpu" and r["large_copies"] == 0, r
