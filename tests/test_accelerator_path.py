"""The accelerator path, measured device-independently on CPU: the compiled decode loop copies and
zero-fills no cache-sized buffer (every layout x drafter), the stacked layout gives the unrolled
layout's tokens, accelerator defaults. The attention op's backends: tests/test_attention_impls.py."""

from __future__ import annotations

import dataclasses
import functools
import re

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import eagle_like, tiny_model

from jaxspec import hlo
from jaxspec.decode import speculate
from jaxspec.decode.sampling import SamplingParams
from jaxspec.drafters import dflash_forward
from jaxspec.drafters.dflash import DFlashDrafter
from jaxspec.drafters.draft_model import ModelDrafter, layer_skip_drafter
from jaxspec.drafters.prompt_lookup import NgramDrafter
from jaxspec.engine.runner import Engine
from jaxspec.models import decoder, fused_layout, llama
from jaxspec.tools import roofline

# XLA:CPU's YNNPACK library fusion (CPU only, absent on TPU/GPU) takes reductions out of XLA's own
# fusions and materialises their operands; compile as the accelerator compilers fuse, and as a
# compile that is read, not run (the default compile's optimised HLO in half the time:
# roofline.READ_ONLY_CPU, checked by test_roofline.py).
ACCEL_LIKE = roofline.compile_options()
CAPACITY = 200  # distinct from every other dim of the tiny model, so cache buffers are unambiguous


@functools.cache  # one model per layout for the module (immutable pytrees)
def _model(layout):
    m = tiny_model(seed=0, layers=4, packed=layout == "packed")
    if layout == "stacked":
        m = dataclasses.replace(m, params=decoder.stack_layers(m.params))
    if layout == "fused":  # the accelerator layout: q/k/v and gate/up fused
        m = dataclasses.replace(m, params=fused_layout.fuse(m.params))
    return m


def _dflash(m):
    """A random one-layer DFlash head over the target's first and last layers' features."""
    spec = dflash_forward.make_spec(m.cfg, m.cfg.num_layers, num_layers=1, block_size=5,
                                mask_token_id=m.cfg.vocab_size - 1,
                                target_layer_ids=(0, m.cfg.num_layers - 1), intermediate_size=32)
    return DFlashDrafter(spec, m.cfg.vocab_size), dflash_forward.init_params(spec, jax.random.key(1))


@functools.cache  # one drafter per (layout, method) for the module
def _drafter(layout, method):
    m = _model(layout)
    if method == "eagle":  # initialised from the same target (its unrolled form)
        return eagle_like(_model("unrolled"))
    if method == "dflash":
        return _dflash(m)
    if method == "dflash_tree":  # a dynamic tree: 5 nodes over 3 block positions, per step
        drafter, dparams = _dflash(m)
        return dataclasses.replace(drafter, tree_top_k=2, tree_levels=3, tree_budget=5), dparams
    return {
        "none": (None, None),
        "ngram": (NgramDrafter(64, 1, 3), None),
        "layer_skip": (layer_skip_drafter(m.target, 2), None),
        "draft_model": (ModelDrafter(model=llama.LlamaTarget(m.cfg), target_vocab=64), m.params),
    }[method]


def decode_hlo(m, drafter, dparams, batch=2, prompt=32, capacity=CAPACITY) -> str:
    """The optimised HLO of the whole jitted decode loop (abstract state: nothing is run)."""
    e = Engine(m, drafter, dparams, num_speculative_tokens=4 if drafter else 0)
    sp = SamplingParams.make()
    args = (m.params, dparams, jnp.zeros((batch, prompt), jnp.int32), jnp.full((batch,), 5, jnp.int32),
            jnp.full((batch,), 8, jnp.int32), sp, jax.random.key(0), jnp.arange(batch, dtype=jnp.int32))
    state = jax.eval_shape(lambda *a: speculate.prefill(e.spec, *a, capacity=capacity), *args)
    lowered = speculate.decode_jit.lower(e.spec, m.params, dparams, state, sp, jnp.int32(1))
    return lowered.compile(compiler_options=ACCEL_LIKE).as_text()


@pytest.mark.parametrize("layout", ["stacked", "unrolled", "packed"])
@pytest.mark.parametrize("method", ["none", *cases.names("hlo")])  # tests/cases.py
def test_decode_loop_copies_no_cache(layout, method):
    """Batch 2, and batch 1 on the accelerators' layouts: there XLA drops the unit batch dim,
    and a layout or fusion choice around it copied whole caches (before session 10: EAGLE 16
    drafter-cache copies a step unrolled, 26 + 10 stacked; n-gram 14 stacked)."""
    m = _model(layout)
    drafter, dparams = _drafter(layout, method)
    c = m.cfg
    for b in (2, 1) if layout != "packed" else (2,):
        text = decode_hlo(m, drafter, dparams, batch=b)
        per_layer = (b, c.num_kv_heads, CAPACITY, c.head_dim)
        for shape in (per_layer, (c.num_layers, *per_layer)):  # a layer's cache, the stack
            traffic = hlo.cache_traffic(text, shape)
            assert (b, traffic.copies, traffic.zero_fills) == (b, (), ())


def test_dflash_runs_the_packed_lm_head_as_stored():
    """DFlash drafts through the target's whole LM head every step: in the packed CPU layout it
    must run the panels as stored (head_weight), not unpack them. Reading it through head_table
    copied the whole [V, D] head each step (SmolLM2: 36 of a step's 127 ms); that variant fails
    here with one [V, D] copy. V = 320 (five panels) is distinct from every other dim."""
    from jaxspec import kernels
    if not kernels.available():
        pytest.skip(f"CPU kernels unavailable: {kernels.unavailable_reason()}")
    m = tiny_model(seed=0, layers=2, vocab=320, packed=True)
    drafter, dparams = _dflash(m)
    text = decode_hlo(m, drafter, dparams, batch=1)
    traffic = hlo.cache_traffic(text, (1, 1, m.cfg.vocab_size, m.cfg.hidden_size))
    assert traffic.copies == ()


def test_copy_counter_sees_a_cache_through_scan_xs():
    """The pre-fix stacked forward (cache as lax.scan xs/ys) in miniature: the counter must see the
    zero-filled ys buffer and the copies."""
    shape = (4, 2, 2, CAPACITY, 16)

    def step(cache, x):
        def body(h, kv):
            return h + 1.0, kv.at[:, :, 0].set(h)
        return jax.lax.scan(body, x, cache)

    def loop(cache, x):
        return jax.lax.fori_loop(0, 3, lambda i, c: step(*c)[::-1], (cache, x))

    text = jax.jit(loop, donate_argnums=0).lower(jnp.zeros(shape), jnp.zeros((2, 16))).compile(
        compiler_options=ACCEL_LIKE).as_text()
    traffic = hlo.cache_traffic(text, shape[1:])
    assert traffic.copies or traffic.zero_fills


def stack_prefix_slices(text: str, stacked_shapes, n: int) -> list[str]:
    """Buffers in the optimised HLO shaped like the first n layers of a stacked weight
    ([n, ...] of an [L, ...] leaf): what slicing the target's stack for a drafter costs per step."""
    per_layer = {tuple(s[1:]) for s in stacked_shapes}
    out = []
    for name, instrs in hlo.parse(text).items():
        if name.startswith("fused") or "wrapped" in name or "computation" in name:
            continue  # inside a fusion: no buffer of its own
        for ins in instrs:
            if ins.opcode in ("parameter", "get-tuple-element", "tuple", "bitcast"):
                continue
            for dims in re.findall(r"\w+\[([\d,]*)\]", hlo.shape_of(ins.line)):
                shape = tuple(int(d) for d in dims.split(",") if d)
                if len(shape) >= 2 and shape[0] == n and shape[1:] in per_layer:
                    out.append(ins.line.strip()[:120])
    return out


def test_layer_skip_on_a_stack_slices_no_layers_per_step():
    """layer_skip shares the target's [L, ...] weights: on the stacked layout its forward runs the
    first n layers of the stack in place, so the decode loop holds no [n, ...] slice of any weight
    (slicing the stack would copy n layers of weights every step). Distinct dims (L=5, n=3, D=40,
    F=80) keep weight shapes apart from every other buffer."""
    m = tiny_model(seed=0, layers=5, hidden=40)
    m = dataclasses.replace(m, params=decoder.stack_layers(m.params))
    shapes = [x.shape for x in jax.tree.leaves(m.params["layers"])]
    text = decode_hlo(m, layer_skip_drafter(m.target, 3), None)
    assert stack_prefix_slices(text, shapes, 3) == []


@pytest.mark.parametrize("method", ["none", "ngram", "layer_skip"])
def test_stacked_layout_gives_unrolled_tokens(method):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 64, n)] for n in (7, 19, 12)]
    out = {}
    for layout in ("unrolled", "stacked", "fused"):
        m = _model(layout)
        drafter, dparams = _drafter(layout, method)
        e = Engine(m, drafter, dparams, num_speculative_tokens=3 if drafter else 0)
        out[layout] = [r.token_ids for r in e.generate(prompts, max_new_tokens=24, batch_size=3)]
    assert out["stacked"] == out["unrolled"] == out["fused"]


# ---------------------------------------------------------------------------- accelerator defaults


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_auto_dtype_and_layout_follow_the_backend(monkeypatch, backend):
    from jaxspec.kernels import available
    from jaxspec.loading import params as lp

    monkeypatch.setattr(lp.jax, "default_backend", lambda: backend)
    dtype = lp.resolve_dtype("auto")
    layout, why = lp.resolve_layout("auto", dtype)
    assert why.startswith("auto")
    if backend == "cpu":
        assert dtype == "float32" and layout == ("packed" if available() else "unrolled")
    else:
        want = "stacked" if backend == "tpu" else "fused"  # GPU: per-layer weights, q/k/v fused
        assert (dtype, layout) == ("bfloat16", want)
    assert lp.resolve_dtype("float32") == "float32"  # explicit choices stay


def test_load_model_auto_dtype_on_this_cpu(tiny_llama_dir):
    from jaxspec.loading import load_model

    m = load_model(tiny_llama_dir, dtype="auto", layout="stacked")
    assert m.cfg.dtype == "float32" and m.stacked
    # the attention impl shows in the metrics (CPU: the XLA reference)
    assert Engine(m).generate([[5, 9]], max_new_tokens=2)[0].metrics["attention"] == "xla"


def test_fused_layout_loads_splits_back_and_refuses_a_mesh(tiny_llama_dir):
    """layout "fused" (the GPU default): the checkpoint's q/k/v and gate/up concatenated at load,
    split back exactly for readers of a layer's plain weights, same greedy tokens; one device."""
    from jaxspec.errors import JaxspecError
    from jaxspec.loading import load_model

    fused, plain = (load_model(tiny_llama_dir, layout=x) for x in ("fused", "unrolled"))
    assert fused.target.layout(fused.params) == "fused" and "wqkv" in fused.params["layers"][0]
    for key, w in plain.target.layer_weights(plain.params, 1).items():
        assert np.array_equal(fused.target.layer_weights(fused.params, 1)[key], w), key
    prompts = [[5, 9, 3, 7], [2, 4]]
    tokens = lambda m: [r.token_ids for r in Engine(m).generate(prompts, max_new_tokens=8)]  # noqa: E731
    assert tokens(fused) == tokens(plain)
    with pytest.raises(JaxspecError, match="cannot be sharded"):
        load_model(tiny_llama_dir, layout="fused", mesh=object())


def test_fixed_capacity_engine_gives_the_same_tokens_and_one_capacity():
    m = _model("unrolled")
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(1, 64, n)] for n in (5, 40)]
    plain = [r.token_ids for r in Engine(m).generate(prompts, max_new_tokens=12)]
    fixed = Engine(m, max_context=96)
    assert {fixed.capacity(16, 12), fixed.capacity(64, 12)} == {96}
    assert [r.token_ids for r in fixed.generate(prompts, max_new_tokens=12)] == plain
    from jaxspec.errors import JaxspecError

    with pytest.raises(JaxspecError, match="max_context=96"):
        fixed.generate([list(range(1, 60))], max_new_tokens=40)


def test_compare_greedy_tells_a_near_tie_from_a_real_difference(tiny_llama_dir):
    from jaxspec.loading import load_model
    from jaxspec.tools.greedy_check import compare_greedy

    m = load_model(tiny_llama_dir)
    prompt = [5, 9, 17, 33, 2]
    plain = Engine(m, chat_template=False).generate([prompt], max_new_tokens=8)[0].token_ids
    assert compare_greedy(m, prompt, plain, plain)[0]
    other = plain[:3] + [(plain[3] + 1) % m.cfg.vocab_size] + plain[4:]
    same, tie, gap = compare_greedy(m, prompt, plain, other, margin=1e9)
    assert not same and tie and gap > 0
    assert compare_greedy(m, prompt, plain, other, margin=0.0)[1] is False


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_batch_one_step_copies_no_cache(layout):
    """At batch 1 the size-1 batch dim leaves XLA free to re-lay the cache out: a loop over cache
    blocks inside the stacked layer loop made it copy the whole stack (found by the roofline)."""
    target = _model("unrolled").target
    for window in (1, 5):
        r = roofline.measure(target, layout, "verify", 1, window, capacity=512, valid=256)
        assert (r.cache_copies, r.zero_fills) == (0, 0)


# ----------------------------------------------------------------------------- loading peak

_PEAK_SCRIPT = """
import sys, numpy as np, jax
from jaxspec.loading.params import assemble, place, expected_shapes
from jaxspec.models.llama import ModelConfig

def status(key):
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key))

cfg = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_layers=8,
                  num_heads=8, num_kv_heads=4, head_dim=128, max_position_embeddings=512)
params = assemble(cfg, {k: np.ones(s, np.float32) for k, s in expected_shapes(cfg).items()},
                  source="test")
# compile every program first (XLA's own memory is not the load's): a first load, released
# (with glibc's threshold fixed its buffers go back to the OS)
jax.block_until_ready(place(params, "bfloat16", "stacked"))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the present
before = status("VmRSS")
jax.block_until_ready(place(params, "bfloat16", "stacked"))
print(status("VmHWM") - before)
"""


def test_loading_the_stacked_layout_peaks_at_weights_plus_one_layer():
    """A 168 MB (bf16) model loaded from float32 host tensors into the stacked layout: the
    process's peak memory grows by at most the final params + one layer + 5% (stacking after
    placing every per-layer tensor grew it by ~1.7x the params). glibc's large-allocation
    threshold is fixed so freed tensors leave the resident set."""
    import os
    import subprocess
    import sys

    from jaxspec.loading.params import expected_shapes, load_peak_bytes

    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072", "JAX_PLATFORMS": "cpu"}
    grew = int(subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], env=env, check=True,
                              capture_output=True, text=True).stdout.split()[-1])
    cfg = llama.ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048,
                            num_layers=8, num_heads=8, num_kv_heads=4, head_dim=128,
                            max_position_embeddings=512)
    final = load_peak_bytes(cfg, "bfloat16")["final"]
    layer = sum(2 * int(np.prod(s)) for k, s in expected_shapes(cfg).items()
                if k.startswith("layers.0."))
    assert grew <= 1.05 * final + layer, (grew, final, layer)


def test_llama3_8b_stacked_load_fits_weights_plus_one_tensor():
    """By shape arithmetic (nothing read): Llama-3-8B in bf16 peaks at its 16.06 GB of weights +
    one tensor (a 117 MB MLP matrix) while stacking, under the 16 GiB of a v5e only with headroom
    for nothing else, and not at ~2x as before."""
    from jaxspec.loading.params import load_peak_bytes

    cfg = llama.ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                            max_position_embeddings=8192, tie_word_embeddings=False)
    got = load_peak_bytes(cfg, "bfloat16")
    assert got["final"] == 16_060_522_496 and got["largest_tensor"] == 14336 * 4096 * 2
    assert got["peak"] <= 1.01 * got["final"]


def test_bf16_logits_are_not_rounded_to_bf16():
    """A bf16 model's LM head accumulates and returns f32: logits differ from their bf16 rounding
    (a head that rounded first would give only bf16-representable values)."""
    m = _model("unrolled")
    cfg = dataclasses.replace(m.cfg, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), m.params)
    hidden = jax.random.normal(jax.random.key(1), (2, 3, cfg.hidden_size), jnp.bfloat16)
    logits = llama.lm_head(params, hidden)
    assert logits.dtype == jnp.float32
    assert np.any(np.asarray(logits) != np.asarray(logits.astype(jnp.bfloat16).astype(jnp.float32)))


def test_fused_layer_pieces_match_the_plain_ones():
    """The fused layout's layer pieces against the plain ones they replace: RoPE over the whole
    q/k/v projection is `apply_rope` bit for bit on q and k and leaves v alone (rotating one head
    too few, the broken variant, leaves k unrotated); the norm scaled after the projection
    (`normed_linear`) is rms_norm then the projection; the one-token cache write (one
    dynamic_update_slice on TPU/GPU) writes what the scatter writes."""
    from jaxspec.models import blocks

    b, t, n, kv, h = 2, 3, 4, 2, 16
    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (b, t, n + 2 * kv, h))
    positions = jnp.array([[3, 4, 5], [90, 91, 92]], jnp.int32)
    inv_freq = blocks.rope_inv_freq(h, 10000.0)
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = x.astype(dtype)
        got = blocks.apply_rope_heads(xd, positions, inv_freq, n + kv)
        want = blocks.apply_rope(xd[:, :, : n + kv], positions, inv_freq)
        assert np.array_equal(np.asarray(got[:, :, : n + kv]), np.asarray(want))
        assert np.array_equal(np.asarray(got[:, :, n + kv :]), np.asarray(xd[:, :, n + kv :]))
        broken = blocks.apply_rope_heads(xd, positions, inv_freq, n + kv - 1)
        assert not np.array_equal(np.asarray(broken[:, :, : n + kv]), np.asarray(want))
    d, out = 32, 24
    xs = jax.random.normal(keys[1], (b, t, d))
    w, norm_w = jax.random.normal(keys[2], (out, d)), 1 + 0.1 * jax.random.normal(keys[3], (d,))
    want = decoder.linear(blocks.rms_norm(xs, norm_w, 1e-5), w)
    np.testing.assert_allclose(fused_layout.normed_linear(xs, norm_w, w, 1e-5), want,
                               rtol=1e-5, atol=1e-5)
    cache = jax.random.normal(keys[0], (1, kv, 8, h))
    new, pos = x[:1, :1, :kv], jnp.array([[5]], jnp.int32)
    scattered = jax.jit(decoder.write_kv)(cache, new, pos)  # CPU: the scatter
    assert np.array_equal(np.asarray(decoder._write_one(cache, new, pos)), np.asarray(scattered))
    # TPU at batch > 1: each row's window by its own dynamic_update_slice, as the scatter writes
    cache = jax.random.normal(keys[0], (3, kv, 8, h))
    new, pos = x[:1, :2, :kv].repeat(3, axis=0) * jnp.arange(1, 4)[:, None, None, None], \
        jnp.array([[0, 1], [5, 6], [3, 4]], jnp.int32)
    scattered = jax.jit(decoder.write_kv)(cache, new, pos)
    assert np.array_equal(np.asarray(decoder._write_rows(cache, new, pos)), np.asarray(scattered))


def test_a_window_write_traces_flat_in_the_batch():
    """A contiguous window write at batch 600 traces no more than at batch 8: the TPU branch's
    one write a row (which platform_dependent traces on every platform, CPU included) stops at
    decoder.ROW_WRITES_MAX rows. Unbounded, batch 600 traced 600 writes a layer."""
    def traced_lines(batch):
        cache, new = jnp.zeros((batch, 2, 16, 8)), jnp.ones((batch, 3, 2, 8))
        pos = jnp.tile(jnp.arange(3, dtype=jnp.int32)[None], (batch, 1))
        fn = lambda c, n, p: decoder.write_kv(c, n, p, contiguous=True)  # noqa: E731
        return len(str(jax.make_jaxpr(fn)(cache, new, pos)).splitlines())

    small, large = traced_lines(8), traced_lines(600)
    assert large <= small, (small, large)
    assert traced_lines(decoder.ROW_WRITES_MAX) > small  # the TPU branch is traced below it


@pytest.mark.parametrize("t", [1, 3])
def test_a_written_window_reads_its_own_rows_from_the_cache(t):
    """window_in_cache (a writing forward's causal window) on the GPU kernels (Pallas
    interpreter): one token reads lengths + 1 slots (JAX's kernel), a window of 3 rows up to its
    own slot (ours, causal=T); both equal the cache + window merge. The same call on a cache
    whose rows were not written differs: the path reads the cache, not the window."""
    from jaxspec.models import attention

    b, kv, g, h, s = 2, 2, 2, 32, 128
    keys = jax.random.split(jax.random.key(4), 5)
    q = jax.random.normal(keys[0], (b, t, kv * g, h), jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (b, kv, s, h), jnp.bfloat16) for k in keys[1:3])
    kw, vw = (jax.random.normal(k, (b, t, kv, h), jnp.bfloat16) for k in keys[3:5])
    lengths = jnp.array([7, 100], jnp.int32)
    pos = lengths[:, None] + jnp.arange(t)[None]
    kc_w, vc_w = decoder.write_kv(kc, kw, pos), decoder.write_kv(vc, vw, pos)
    run = lambda k, v, written: attention.attend(  # noqa: E731
        q, k, v, kw, vw, lengths, impl="pallas_gpu", interpret=True, window_in_cache=written)
    want = run(kc_w, vc_w, False)
    got = run(kc_w, vc_w, True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)
    stale = run(kc, vc, True)
    assert np.abs(np.asarray(stale, np.float32) - np.asarray(want, np.float32)).max() > 0.05


def _chain_run(model, write_chains: bool, temperature: float, gamma: int = 4, new: int = 24):
    """n-gram (a variable-length chain: rows with fewer drafts than γ pad their window) through
    the decode loop with its chain windows written in place or read-only -> (tokens, each row's
    valid k/v prefix of the final cache)."""
    from tiny import motif_prompts

    drafter = NgramDrafter(model.cfg.vocab_size, 1, 3) if gamma else None
    spec = speculate.LoopSpec(target=model.target, drafter=drafter, num_speculative_tokens=gamma,
                              eos_ids=(), write_chains=write_chains)
    prompts = motif_prompts((21, 13, 17))
    b, p = len(prompts), max(map(len, prompts))
    tokens = jnp.asarray([row + [0] * (p - len(row)) for row in prompts], jnp.int32)
    lengths = jnp.asarray([len(row) for row in prompts], jnp.int32)
    sp = SamplingParams.make(temperature)
    args = (jnp.full((b,), new, jnp.int32), sp, jax.random.key(3), jnp.arange(b, dtype=jnp.int32))
    state = speculate.prefill_jit(spec, model.params, None, tokens, lengths, *args,
                                  capacity=p + new + gamma + 8)
    state = speculate.decode_jit(spec, model.params, None, state, sp, jnp.int32(64))
    valid = [int(n) for n in state.cache.lengths]
    kv = [np.asarray(c)[:, r, :, :n] for c in (state.cache.k, state.cache.v)
          for r, n in enumerate(valid)]  # [L, K, n, H] per row
    return np.asarray(state.tokens), kv


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_chain_window_written_in_place_is_the_read_only_window(temperature):
    """`LoopSpec.write_chains` (TPU/GPU's default; forced here on XLA:CPU): the verify writes a
    chain's window into the cache and nothing is compacted after. Greedy and sampled, its tokens
    and every row's valid cache equal the read-only window's (the accepted prefix is already in
    its slots; the rest is past the row's length), and greedy equals plain decoding. The cache
    agrees to float rounding: on XLA:CPU the read-only window runs the narrowest width that
    holds the drafts (a switch), the written one the widest (as on GPU), so the dots differ in
    shape; a row written one slot off differs by O(1)."""
    model = _model("unrolled")
    got, got_kv = _chain_run(model, True, temperature)
    want, want_kv = _chain_run(model, False, temperature)
    np.testing.assert_array_equal(got, want)
    for g, w in zip(got_kv, want_kv):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    if temperature == 0.0:
        plain = _chain_run(model, False, 0.0, gamma=0)[0]  # its buffer has no γ columns
        np.testing.assert_array_equal(got[:, :plain.shape[1]], plain)


def test_gpu_gemv_kernels_match_the_xla_projections():
    """The small-batch Pallas GEMVs of the fused layout on a GPU (models/gemv_gpu.py, run here by
    Pallas's interpreter) against the XLA path they replace, at one token and a window of 5: the
    normed q/k/v projection, gate/up with SiLU * up, and a projection with its residual add.
    float32 to rounding; bfloat16 equal but for a bf16 step or two (the activation rounds once,
    not per op). A model dim of 576 (SmolLM2) takes 64-column loop trips. Gate and up swapped
    (the broken variant) is far off."""
    from jaxspec.models import gemv_gpu

    d, o, f = 576, 96, 128
    keys = jax.random.split(jax.random.key(5), 5)
    for dtype, tol, t in ((jnp.float32, 1e-5, 1), (jnp.bfloat16, 2 ** -6, 1),
                          (jnp.float32, 1e-5, 5), (jnp.bfloat16, 2 ** -5, 5)):
        x = jax.random.normal(keys[0], (1, t, d), dtype)
        nw = (1 + 0.1 * jax.random.normal(keys[1], (d,))).astype(dtype)
        w = (0.05 * jax.random.normal(keys[2], (o, d))).astype(dtype)
        w_gu = (0.05 * jax.random.normal(keys[3], (2 * f, d))).astype(dtype)
        res = jax.random.normal(keys[4], (1, t, o), dtype)
        gate, up = jnp.split(fused_layout.normed_linear(x, nw, w_gu, 1e-5), 2, axis=-1)
        pairs = [(gemv_gpu.normed_gemv(x, nw, w, 1e-5, interpret=True),
                  fused_layout.normed_linear(x, nw, w, 1e-5)),
                 (gemv_gpu.gated_normed_gemv(x, nw, w_gu, 1e-5, interpret=True),
                  jax.nn.silu(gate) * up),
                 (gemv_gpu.residual_gemv(x, w, res, interpret=True), res + decoder.linear(x, w))]
        for got, want in pairs:
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                       rtol=tol, atol=tol)
    # one token and a window's first token round alike (the same dot in the same block): bf16
    one = gemv_gpu.normed_gemv(x[:, :1], nw, w, 1e-5, interpret=True)
    window = gemv_gpu.normed_gemv(x, nw, w, 1e-5, interpret=True)
    assert np.array_equal(np.asarray(one, np.float32), np.asarray(window[:, :1], np.float32))
    swapped = jnp.concatenate([w_gu[f:], w_gu[:f]])
    broken = gemv_gpu.gated_normed_gemv(x, nw, swapped, 1e-5, interpret=True)
    assert np.abs(np.asarray(broken, np.float32) - np.asarray(pairs[1][1], np.float32)).max() > 0.1


def test_the_gemv_switch_takes_0_or_1_and_refuses_the_rest(monkeypatch):
    """JAXSPEC_GPU_GEMV (the device A/B switch): 0 and 1 are honoured, anything else is a
    one-line error naming both, not read as on."""
    from jaxspec.models import gemv_gpu

    for value, on in (("0", False), ("1", True)):
        monkeypatch.setenv(gemv_gpu.ENV_SWITCH, value)
        assert gemv_gpu.enabled() is on
    monkeypatch.setenv(gemv_gpu.ENV_SWITCH, "false")
    with pytest.raises(ValueError, match=r"set it to 0 .* or 1"):
        gemv_gpu.enabled()


def test_gpu_decode_merge_kernel_is_the_xla_merge():
    """One query token's GPU attention with the slot splits merged by one Triton program per
    (row, kv head) (`decode_out_pallas_gpu`, interpreted) == the decode kernel's parts merged and
    normalised by XLA; rows of 5 and 300 valid slots (empty splits weigh nothing)."""
    from jaxspec.models import attention_kernels as ak

    b, kv, g, h, s = 2, 2, 4, 64, 512
    keys = jax.random.split(jax.random.key(6), 3)
    qg = jax.random.normal(keys[0], (b, kv, g, h), jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (b, kv, s, h), jnp.bfloat16) for k in keys[1:])
    lengths = jnp.array([5, 300], jnp.int32)
    assert ak.gpu_out_takes(qg, kc)
    got = ak.decode_out_pallas_gpu(qg, kc, vc, lengths, h**-0.5, jnp.float32, interpret=True)
    o, _, l = ak.cache_part_pallas_gpu(qg, kc, vc, lengths, h**-0.5, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(o / l[..., None]), rtol=1e-5, atol=1e-5)
