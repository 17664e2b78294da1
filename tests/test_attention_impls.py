"""The attention op's backends against references, on CPU: the XLA path (chunked prompts,
blocked cache loop, tree masks) against a float64 dense softmax, JAX's Pallas kernels (TPU paged /
splash attention, GPU decode / Triton flash attention, ours on a stack) in Pallas's interpreter
against the XLA path, and their lowering for a TPU / GPU with `jax.export`. Numerics only: the
compiled programs' HLO (copies, bytes) is tests/test_accelerator_path.py's."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

from jaxspec.models.cache import init_cache
from jaxspec.models import attention, decoder, llama


def _attention_inputs(seed=0, b=2, t=3, n=4, kv=2, s=64, h=16, layers=None, dtype="float32"):
    """Random q, caches, window K/V (in `dtype`) and lengths, drawn in one compiled program."""
    q, kc, vc, kw, vw = _random_arrays(seed, b=b, t=t, n=n, kv=kv, s=s, h=h, layers=layers,
                                       dtype=dtype)
    return q, kc, vc, kw, vw, jnp.asarray([5, 40][:b], jnp.int32)


@functools.partial(jax.jit, static_argnames=("b", "t", "n", "kv", "s", "h", "layers", "dtype"))
def _random_arrays(seed, *, b, t, n, kv, s, h, layers, dtype):
    ks = jax.random.split(jax.random.key(seed), 5)
    cache_shape = (b, kv, s, h) if layers is None else (layers, b, kv, s, h)
    q = jax.random.normal(ks[0], (b, t, n, h))
    kc, vc = jax.random.normal(ks[1], cache_shape), jax.random.normal(ks[2], cache_shape)
    kw, vw = jax.random.normal(ks[3], (b, t, kv, h)), jax.random.normal(ks[4], (b, t, kv, h))
    return tuple(a.astype(dtype) for a in (q, kc, vc, kw, vw))


# attention.attend run eagerly compiles each of its ops as a program of its own (hundreds per
# module); jitted, a call is one program. The XLA path's is shared by every test at the same shapes
# and options (it reads no monkeypatched setting); a kernel's is traced afresh per call, since
# tests monkeypatch what the kernels read at trace time (TPU page sizes, core counts).
xla = jax.jit(functools.partial(attention.attend, impl="xla"), static_argnames=("chunk", "block"))


def compiled(**options):
    """attention.attend(*arrays, **options) as one freshly traced program."""
    return jax.jit(lambda *a, **kw: attention.attend(*a, **kw, **options))


def _dense_reference(q, kc, vc, kw, vw, lengths, window_mask):
    """Plain softmax over [valid cache slots ; masked window], in float64 numpy."""
    q, kc, vc, kw, vw = (np.asarray(a, np.float64) for a in (q, kc, vc, kw, vw))
    b, t, n, h = q.shape
    kv = kc.shape[1]
    out = np.zeros((b, t, n, h))
    for i in range(b):
        for j in range(n):
            g = j // (n // kv)
            keys = np.concatenate([kc[i, g, : lengths[i]], kw[i, :, g]])
            vals = np.concatenate([vc[i, g, : lengths[i]], vw[i, :, g]])
            for u in range(t):
                sc = keys @ q[i, u, j] / np.sqrt(h)
                ok = np.concatenate([np.ones(int(lengths[i]), bool), np.asarray(window_mask[i, u])])
                sc = np.where(ok, sc, -np.inf)
                w = np.exp(sc - sc.max())
                out[i, u, j] = (w / w.sum()) @ vals
    return out.reshape(b, t, n * h)


@pytest.mark.parametrize("tree", [False, True])
def test_attend_xla_matches_dense_reference(tree):
    q, kc, vc, kw, vw, lengths = _attention_inputs()
    mask = attention.causal_mask(2, 3)
    if tree:  # node 2 is a sibling of node 1: it sees the root and itself only
        mask = mask.at[:, 2, 1].set(False)
    want = _dense_reference(q, kc, vc, kw, vw, lengths, mask)
    got = xla(q, kc, vc, kw, vw, lengths, window_mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    stacked = [jnp.stack([jnp.zeros_like(kc), kc, jnp.ones_like(kc)]) for kc in (kc, vc)]
    got_l = xla(q, *stacked, kw, vw, lengths, layer=jnp.int32(1), window_mask=mask)
    np.testing.assert_allclose(got_l, want, rtol=1e-5, atol=1e-5)


def test_attend_prefill_chunks_match_one_block():
    q, kc, vc, kw, vw, lengths = _attention_inputs(t=32, s=64)
    whole = xla(q, kc, vc, kw, vw, lengths, chunk=64)
    chunked = xla(q, kc, vc, kw, vw, lengths, chunk=8)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
    ragged = xla(q, kc, vc, kw, vw, lengths, chunk=12)  # 12, 12, 8
    np.testing.assert_allclose(ragged, whole, rtol=1e-5, atol=1e-5)
    # any T is chunked: no score block has more than `chunk` queries (a 32-query one would),
    # and a causal chunk reads the window keys up to its last query only: 12, 24, then 32
    jaxpr = str(jax.make_jaxpr(lambda *a: attention.attend(*a, impl="xla", chunk=12))(
        q, kc, vc, kw, vw, lengths))
    assert "f32[2,2,64,32]" not in jaxpr  # [B, K, G*C, Tw]
    assert "f32[2,2,24,12]" in jaxpr and "f32[2,2,24,24]" in jaxpr


def _runs_a_kernel(*args, **kw) -> bool:
    """Whether attend(*args, **kw) calls a Pallas kernel (not the XLA fallback)."""
    return "pallas_call" in str(jax.make_jaxpr(lambda *a: attention.attend(*a, **kw))(*args))


def test_attend_pallas_gpu_kernel_matches_reference_in_interpret_mode():
    """Pallas GPU decode kernel (reads slots < lengths only), run by the Pallas interpreter on
    CPU; on a GPU scripts/bench_device.sh runs it compiled."""
    pytest.importorskip("jax.experimental.pallas.ops.gpu.decode_attention")
    q, kc, vc, kw, vw, lengths = _attention_inputs(t=2, s=128)
    want = xla(q, kc, vc, kw, vw, lengths)
    got = compiled(impl="pallas_gpu", interpret=True)(q, kc, vc, kw, vw, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert _runs_a_kernel(q, kc, vc, kw, vw, lengths, impl="pallas_gpu", interpret=True)
    # a capacity the kernel's blocks do not divide runs the XLA path
    assert not _runs_a_kernel(q, kc[:, :, :96], vc[:, :, :96], kw, vw, lengths, impl="pallas_gpu")


def test_pallas_gpu_kernel_merges_its_slot_splits_exactly(monkeypatch):
    """512 slots: 4 slot splits of 128 merged by log-sum-exp, or, where the batch alone fills the
    GPU (`GPU_PROGRAMS` reached), halved down to 1: both match the reference."""
    pytest.importorskip("jax.experimental.pallas.ops.gpu.decode_attention")
    from jaxspec.models import attention_kernels

    args = _attention_inputs(t=2, s=512)
    want = xla(*args)
    jaxprs = []
    for programs in (512, 1):
        monkeypatch.setattr(attention_kernels, "GPU_PROGRAMS", programs)
        run = lambda *a: attention.attend(*a, impl="pallas_gpu", interpret=True)  # noqa: E731
        np.testing.assert_allclose(jax.jit(run)(*args), want, rtol=1e-4, atol=1e-4)
        jaxprs.append(str(jax.make_jaxpr(run)(*args)))
    assert jaxprs[0] != jaxprs[1]  # the split count changed the kernel's grid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attend_pallas_gpu_stacked_kernel_matches_reference_in_interpret_mode(dtype):
    """Our Pallas GPU kernel on a stack at a traced layer (the stacked layout's GPU path): chain
    and tree windows, an empty prefix, a prefix ending mid-block, several splits."""
    q, kc, vc, kw, vw, _ = _attention_inputs(b=3, t=3, s=256, layers=3, dtype=dtype)
    lengths = jnp.asarray([0, 17, 250], jnp.int32)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    for mask in (None, attention.causal_mask(3, 3).at[:, 2, 1].set(False)):
        args = (q, kc, vc, kw, vw, lengths)
        want = xla(*args, layer=jnp.int32(1), window_mask=mask)
        got = compiled(impl="pallas_gpu", interpret=True)(*args, layer=jnp.int32(1),
                                                          window_mask=mask)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)
    assert _runs_a_kernel(*args, layer=jnp.int32(1), impl="pallas_gpu", interpret=True)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attend_pallas_tpu_kernel_matches_reference_in_interpret_mode(monkeypatch, stacked, dtype):
    """JAX's TPU paged-attention kernel on the zero-copy paged view of our cache (a stack indexed
    at a traced layer included), run by Pallas's TPU interpreter on CPU; chain and tree windows, a
    row with an empty prefix (prefill), lengths across page and block edges. On a TPU
    scripts/bench_device.sh runs it compiled. The kernel rounds K/V to bf16: bf16 tolerance."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    from jaxspec.models import attention_kernels

    monkeypatch.setattr(attention_kernels, "tpu_pages", lambda slots: (16, 2))  # 4 pages, 2 blocks
    q, kc, vc, kw, vw, _ = _attention_inputs(b=3, t=3, s=64, layers=3 if stacked else None,
                                             dtype=dtype)
    lengths = jnp.asarray([0, 17, 64 - 3], jnp.int32)
    layer = jnp.int32(1) if stacked else None
    tree = attention.causal_mask(3, 3).at[:, 2, 1].set(False)
    tol = 2e-2 if dtype == "bfloat16" else 1e-2
    for mask in (None, tree):
        args = (q, kc, vc, kw, vw, lengths)
        want = xla(*args, layer=layer, window_mask=mask)
        got = jax.jit(lambda *a, mask=mask: attention.attend(
            *a, layer=layer, window_mask=mask, impl="pallas_tpu", interpret=True))(*args)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)
    assert _runs_a_kernel(*args, layer=layer, impl="pallas_tpu", interpret=True)
    if not stacked:  # the same kernel under jax's own switch for TPU interpret mode
        with pltpu.force_tpu_interpret_mode():
            forced = compiled(window_mask=tree, impl="pallas_tpu")(*args)
        np.testing.assert_allclose(np.asarray(forced, np.float32), np.asarray(got, np.float32),
                                   rtol=1e-6, atol=1e-6)


# Each kernel's code path (impl x stacked) once, in float32 or bfloat16 by turns: each dtype
# meets each impl and each layout (every pair of the three), in half the interpreted runs.
PREFILL_KERNEL_CASES = [("pallas_tpu", False, "float32"), ("pallas_tpu", True, "bfloat16"),
                        ("pallas_gpu", False, "bfloat16"), ("pallas_gpu", True, "float32")]


@pytest.mark.parametrize("impl,stacked,dtype", PREFILL_KERNEL_CASES,
                         ids=["-".join(map(str, c)) for c in PREFILL_KERNEL_CASES])
def test_attend_prefill_on_kernels_matches_reference_in_interpret_mode(monkeypatch, impl, stacked,
                                                                        dtype):
    """A prompt (G*T > PALLAS_MAX_QUERIES) on the kernels: JAX's flash kernel for the causal window
    (TPU splash attention; GPU Pallas's Triton flash attention), the decode kernels in query-row
    chunks for an earlier cache, merged by log-sum-exp, against the XLA reference, in Pallas's
    interpreter (TPU's for pallas_tpu). T = 300 is padded to 384 (3 x 3 flash blocks of 128, the
    diagonal ones partly masked); 600 query rows per kv head make 3 chunks of 256; earlier-cache
    lengths 0 (an engine prefill), 17 and 141 cross TPU pages (16 slots, 2-page blocks) and the GPU
    kernels' 64/128-slot blocks. Row 0 has no earlier cache, so its output is the flash kernel's
    alone: exact in float32 (the TPU paged kernel rounds K/V to bfloat16, hence the looser
    tolerance of the other rows there). On a device scripts/bench_device.sh runs them compiled."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    from jaxspec.models import attention_kernels

    monkeypatch.setattr(attention_kernels, "tpu_pages", lambda slots: (16, 2))
    q, kc, vc, kw, vw, _ = _attention_inputs(b=3, t=300, n=4, kv=2, s=256, h=32,
                                             layers=3 if stacked else None, dtype=dtype)
    lengths = jnp.asarray([0, 17, 141], jnp.int32)
    layer = jnp.int32(1) if stacked else None
    args = (q, kc, vc, kw, vw, lengths)
    want = xla(*args, layer=layer, chunk=100)  # 3 query chunks
    run = lambda *a: attention.attend(*a, layer=layer, impl=impl, interpret=True)
    got = np.asarray(jax.jit(run)(*args), np.float32)
    want = np.asarray(want, np.float32)
    bf16 = dtype == "bfloat16"
    tol = 3e-2 if bf16 else (1e-2 if impl == "pallas_tpu" else 1e-5)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    if not bf16:
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(run)(*args))
    flash = {"pallas_tpu": "splash_mha_fwd", "pallas_gpu": "mha_forward"}[impl]
    assert flash in jaxpr and jaxpr.count("pallas_call") == 2
    # a tree mask keeps the XLA path (the flash kernels' masks are causal)
    tree = attention.causal_mask(3, 300).at[:, 2, 1].set(False)
    assert not _runs_a_kernel(*args, layer=layer, window_mask=tree, impl=impl)


@pytest.mark.parametrize("layout", ["unrolled", "stacked"])
def test_prefill_forward_on_tpu_kernels_matches_xla(monkeypatch, layout):
    """The model's prefill forward with JAXSPEC_ATTENTION=pallas_tpu, under jax's switch for TPU
    interpret mode: right-padded prompts of 300, 129 and 7 tokens in one [3, 300] batch (129 ends
    one past a 128-block edge) give the XLA path's hidden states at every valid position. Pad
    keys come after each row's tokens, so the causal mask alone keeps them out of valid rows."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    m = tiny_model(seed=0, layers=4)
    if layout == "stacked":
        m = dataclasses.replace(m, params=decoder.stack_layers(m.params))
    lens = np.asarray([300, 129, 7])
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(np.where(np.arange(300)[None] < lens[:, None],
                                  rng.integers(1, 64, (3, 300)), 0), jnp.int32)
    cache = init_cache(m.cfg.num_layers, 3, 320, m.cfg.num_kv_heads, m.cfg.head_dim,
                       m.cfg.compute_dtype, layout == "stacked")
    hidden = {}
    for impl in ("xla", "pallas_tpu"):  # the impl is read at trace time: a fresh function each
        monkeypatch.setenv(attention.ENV_OVERRIDE, impl)
        fwd = lambda p, tok, c: llama.forward(p, tok, c, m.cfg).hidden
        assert ("splash_mha_fwd" in str(jax.make_jaxpr(fwd)(m.params, tokens, cache))) == (
            impl == "pallas_tpu")
        with pltpu.force_tpu_interpret_mode():
            hidden[impl] = np.asarray(jax.jit(fwd)(m.params, tokens, cache))
    for row, n in enumerate(lens):
        np.testing.assert_allclose(hidden["pallas_tpu"][row, :n], hidden["xla"][row, :n],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("platform, impl, stacked, t", [
    ("tpu", "pallas_tpu", False, 5), ("tpu", "pallas_tpu", True, 5), ("cuda", "pallas_gpu", False, 5),
    ("cuda", "pallas_gpu", True, 5), ("tpu", "pallas_tpu", False, 200), ("tpu", "pallas_tpu", True, 200),
    ("cuda", "pallas_gpu", False, 200), ("cuda", "pallas_gpu", True, 200),
])
def test_attention_kernels_lower_for_their_device(platform, impl, stacked, t):
    """jax.export lowers the Pallas kernels for a TPU (Mosaic) / GPU (Triton) without one, which
    checks what interpret mode does not: block shapes the device compiler takes. SmolLM2 heads
    (H = 64, G*T = 15 query rows: neither a multiple of 128 nor of 8), bfloat16. T = 200 is a
    prefill: the flash kernel (TPU splash attention, GPU Pallas's Triton flash attention; T padded
    to 256) and the decode kernel over 600 query rows per kv head (3 chunks of 256 rows, the last
    part padding)."""
    from jax import export

    b, n, kv, h, s = 2, 9, 3, 64, 256
    bf = jnp.bfloat16
    cache = jax.ShapeDtypeStruct((3, b, kv, s, h) if stacked else (b, kv, s, h), bf)
    args = (jax.ShapeDtypeStruct((b, t, n, h), bf), cache, cache,
            jax.ShapeDtypeStruct((b, t, kv, h), bf), jax.ShapeDtypeStruct((b, t, kv, h), bf),
            jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    fn = jax.jit(lambda q, kc, vc, kw, vw, lengths, i: attention.attend(
        q, kc, vc, kw, vw, lengths, layer=i if stacked else None, impl=impl))
    target = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}[platform]
    exp = export.export(fn, platforms=(platform,),
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*args)
    module = exp.mlir_module()
    assert target in module
    if t > 5:  # the prefill runs the flash kernel for the window and a decode kernel for the cache
        flash = {"tpu": "splash_mha_fwd", "cuda": "mha_forward"}[platform]
        assert flash in module and module.count(f"@{target}(") == 2


@pytest.mark.parametrize("backend, dtype, want", [
    ("tpu", "bfloat16", "pallas_tpu"), ("tpu", "float32", "xla"), ("gpu", "bfloat16", "pallas_gpu"),
    ("gpu", "float32", "xla"), ("cpu", "bfloat16", "xla"), ("cpu", "float32", "xla"),
])
def test_attention_impl_follows_the_backend(monkeypatch, backend, dtype, want):
    monkeypatch.delenv(attention.ENV_OVERRIDE, raising=False)
    assert attention.resolve_impl("auto", cache_dtype=dtype, backend=backend) == want
    monkeypatch.setenv(attention.ENV_OVERRIDE, "xla")  # the override forces the reference path
    assert attention.resolve_impl("auto", cache_dtype=dtype, backend=backend) == "xla"
    assert attention.resolve_impl("pallas_tpu", backend=backend) == "pallas_tpu"  # explicit wins
    monkeypatch.setenv(attention.ENV_OVERRIDE, "flash")
    with pytest.raises(ValueError, match="JAXSPEC_ATTENTION"):
        attention.resolve_impl("auto", backend=backend)


@pytest.mark.parametrize("stacked", [False, True])
def test_attend_blocked_cache_loop_matches_one_pass(stacked):
    q, kc, vc, kw, vw, lengths = _attention_inputs(t=3, s=64, layers=2 if stacked else None)
    layer = jnp.int32(1) if stacked else None
    one = xla(q, kc, vc, kw, vw, lengths, layer=layer, block=None)
    for block in (16, 32):
        got = xla(q, kc, vc, kw, vw, lengths, layer=layer, block=block)
        np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-5)
    empty = jnp.zeros_like(lengths)  # prefill: the loop reads no block
    np.testing.assert_allclose(
        xla(q, kc, vc, kw, vw, empty, layer=layer, block=16),
        xla(q, kc, vc, kw, vw, empty, layer=layer, block=None),
        rtol=1e-5, atol=1e-5)


# ------------------------------------------------------- kernel details on the accelerators' terms


def _kernel_operands(fn, *args) -> list[list[tuple]]:
    """Per pallas_call in fn's jaxpr (sub-jaxprs included), its operands' shapes."""
    out = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                out.append([tuple(v.aval.shape) for v in eqn.invars])
            for sub in jax.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def test_gpu_decode_kernel_merges_its_splits_in_float32():
    """bf16 cache, 16 slot splits of 128 (2048 slots, lengths across them): JAX's wrapper merged
    the splits' unnormalised outputs in bfloat16, twice the XLA path's error against a float64
    reference; merged in float32 the kernel is as accurate as the XLA path."""
    q, kc, vc, kw, vw, _ = _attention_inputs(b=2, t=2, s=2048, h=64, dtype="bfloat16")
    lengths = jnp.asarray([2000, 1500], jnp.int32)
    want = _dense_reference(q, kc, vc, kw, vw, lengths, attention.causal_mask(2, 2))
    err = lambda impl, **opts: float(np.abs(np.asarray(  # noqa: E731
        compiled(impl=impl, **opts)(q, kc, vc, kw, vw, lengths), np.float64) - want).max())
    assert err("pallas_gpu", interpret=True) <= 1.25 * err("xla")


def test_tpu_page_table_is_per_call_not_per_query_chunk():
    """A prompt chunk over an earlier cache (600 query rows per kv head, 3 chunks of 256): each
    kernel call prefetches one table of B*K*S/P entries, not one per chunk; a table too large for
    SMEM is refused with the fix."""
    from jaxspec.errors import JaxspecError
    from jaxspec.models import attention_kernels as ak

    b, kv, gt, s, h = 2, 2, 600, 512, 32
    qg = jnp.zeros((b, kv, gt, h), jnp.float32)
    cache = jnp.zeros((b, kv, s, h), jnp.bfloat16)
    def run(q, c):
        return ak.cache_part_pallas_tpu(q, c, c, jnp.ones((b,), jnp.int32), None, 1.0)
    tables = [ops[1] for ops in _kernel_operands(run, qg, cache)]  # scalar prefetch: the table
    assert tables == [(ak.tpu_page_table_entries(b, kv, s),)] == [(b * kv * s // 128,)]
    big = jax.ShapeDtypeStruct((64, 8, 65536, h), jnp.bfloat16)  # 64 x 8 x 512 pages
    with pytest.raises(JaxspecError, match="SMEM"):
        jax.eval_shape(lambda c: ak.cache_part_pallas_tpu(
            jnp.zeros((64, 8, 8, h)), c, c, jnp.ones((64,), jnp.int32), None, 1.0), big)


def test_tpu_kernel_on_two_tensorcores_splits_the_grid(monkeypatch):
    """Megacore: on a chip with two TensorCores the paged kernel's grid leads with 2 and the
    sequences are split between the cores. Structure only: this jax's TPU interpret mode hangs
    running a two-core grid on CPU, so the two-core numerics wait for a device run."""
    from jaxspec.models import attention_kernels as ak

    monkeypatch.setattr(ak, "tpu_pages", lambda slots: (16, 2))
    q, kc, vc, kw, vw, _ = _attention_inputs(b=3, t=3, s=64, dtype="bfloat16")
    lengths = jnp.asarray([0, 17, 61], jnp.int32)
    for cores in (1, 2):
        monkeypatch.setattr(ak, "tpu_cores", lambda: cores)  # noqa: B023
        run = lambda *a: attention.attend(*a, impl="pallas_tpu", interpret=True)  # noqa: E731
        eqn = jax.make_jaxpr(run)(q, kc, vc, kw, vw, lengths).jaxpr
        grids = [e.params["grid_mapping"].grid for e in eqn.eqns
                 if e.primitive.name == "pallas_call"]
        assert grids == [(cores, 3 * 2 // cores, 1)]


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_prefill_on_an_empty_cache_runs_no_cache_kernel(impl):
    """An engine prefill (every length 0): the cache-part kernel sits in a branch taken only when
    some row has an earlier cache, so only the flash kernel runs; with an earlier cache the branch
    gives the merged result (interpret mode)."""
    q, kc, vc, kw, vw, _ = _attention_inputs(b=2, t=300, n=4, kv=2, s=256, h=32, dtype="bfloat16")
    run = lambda *a: attention.attend(*a, impl=impl, interpret=True)  # noqa: E731
    jaxpr = jax.make_jaxpr(run)(q, kc, vc, kw, vw, jnp.zeros((2,), jnp.int32)).jaxpr
    # flash outside any branch (possibly inside its custom_vjp wrapper); the cache's kernel only
    # inside the cond
    outside = sum(str(e).count("pallas_call") for e in jaxpr.eqns if e.primitive.name != "cond")
    branches = [str(e).count("pallas_call") for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert outside == 1 and branches and all(n >= 1 for n in branches), (outside, branches)
    for lengths in ([0, 0], [0, 37]):
        lengths = jnp.asarray(lengths, jnp.int32)
        got = np.asarray(jax.jit(run)(q, kc, vc, kw, vw, lengths), np.float32)
        want = np.asarray(xla(q, kc, vc, kw, vw, lengths), np.float32)
        np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("h, rows", [(64, 128), (128, 64), (256, 32)])
def test_gpu_tiles_are_sized_to_the_head_dim(h, rows):
    """The GPU decode kernels hold [rows, H] f32 accumulators: rows shrink as H grows (a 256-row
    tile at H = 128 spilled registers at 4 warps), longer windows run in row chunks."""
    from jaxspec.models import attention_kernels as ak
    from jaxspec.models.gpu_stacked_attention import cache_part_pallas_gpu_stacked

    assert ak.gpu_rows(h) == rows and rows * h <= ak.GPU_ACC_ELEMS
    qg = jnp.zeros((1, 1, 256, h), jnp.bfloat16)
    cache = jnp.zeros((1, 1, 256, h), jnp.bfloat16)
    lens = jnp.ones((1,), jnp.int32)
    per_layer = lambda q, c: ak.cache_part_pallas_gpu(q, c, c, lens, 1.0)  # noqa: E731
    stacked = lambda q, c: cache_part_pallas_gpu_stacked(q, c[None], c[None], lens,  # noqa: E731
                                                         jnp.int32(0), 1.0)
    for fn in (per_layer, stacked):
        qs = [ops[0] if fn is per_layer else ops[2] for ops in _kernel_operands(fn, qg, cache)]
        assert all(shape[-2] <= rows for shape in qs), qs


@pytest.mark.parametrize("stacked", [False, True])
def test_xla_path_with_dots_matches_the_cpu_form(monkeypatch, stacked):
    """On TPU/GPU the XLA path contracts a stack's layer with dots (the matrix units), on CPU with
    the multiply + reduce fusion: the same numbers (the dots form run here on CPU), and the dots
    form is what a TPU export of a float32 stack holds."""
    from jax import export

    q, kc, vc, kw, vw, lengths = _attention_inputs(t=3, s=64, layers=2 if stacked else None)
    layer = jnp.int32(1) if stacked else None
    cpu = compiled(layer=layer, impl="xla", block=16)(q, kc, vc, kw, vw, lengths)
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")  # read at trace time
    dots = compiled(layer=layer, impl="xla", block=16)(q, kc, vc, kw, vw, lengths)
    np.testing.assert_allclose(dots, cpu, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    fn = jax.jit(lambda *a: attention.attend(*a, layer=layer))
    dot_count = {p: export.export(fn, platforms=[p])(q, kc, vc, kw, vw, lengths).mlir_module()
                 .count("stablehlo.dot_general") for p in ("cpu", "tpu")}
    assert dot_count["tpu"] > dot_count["cpu"] if stacked else dot_count["tpu"] == dot_count["cpu"]


def test_kernel_entry_points_keep_the_signatures_we_call():
    """The JAX kernels jaxspec launches by keyword (their modules are experimental): a renamed or
    dropped parameter fails here, not on a device."""
    import inspect

    from jax.experimental.pallas.ops.gpu import attention as fa
    from jax.experimental.pallas.ops.gpu import decode_attention as da
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    def has(fn, *names):
        params = inspect.signature(fn).parameters
        missing = [n for n in names if n not in params]
        assert not missing, f"{fn.__module__}.{fn.__name__} lacks {missing}"

    has(da.attn_forward_kernel, "q_ref", "k_ref", "v_ref", "start_idx_ref", "kv_seq_len_ref",
        "o_ref", "sm_scale", "block_k", "block_h", "num_heads")
    has(pak.paged_flash_attention_kernel_inline_seq_dim, "pages_per_sequence", "batch_size",
        "pages_per_compute_block", "mask_value", "attn_logits_soft_cap", "megacore_mode")
    assert list(inspect.signature(fa.mha).parameters)[:14] == [  # mha is called positionally
        "q", "k", "v", "segment_ids", "sm_scale", "causal", "block_sizes", "backward_pass_impl",
        "num_warps", "num_stages", "grid", "interpret", "debug", "return_residuals"]
    has(sk.make_splash_mha, "mask", "block_sizes", "head_shards", "q_seq_shards",
        "save_residuals", "interpret")
