"""The CPU kernels (panel matmul, prefix attention) and the "packed" layout: exact against float64
numpy and against the XLA layout, bit-identical across window sizes, and generation unchanged by
the layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import kernels
from jaxspec.decode import tree
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.loading import load_model
from jaxspec.loading.params import check_options, unpack_params
from jaxspec.models import attention, decoder, llama

# Justified skip: without a CPU backend and a C++ compiler the kernel cannot exist, and "auto"
# falls back to the unrolled layout, which test_parity and the mesh tests cover. CI has g++.
pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs a CPU backend and g++")


# Run eagerly, every op (a slice, a cache write, the kernel's wrapper) compiles a program of its
# own; these are compiled once per shape and shared by the tests.
panel_matmul = jax.jit(kernels.panel_matmul)
prefix_attention = jax.jit(kernels.prefix_attention, static_argnums=6)
write_kv = jax.jit(decoder.write_kv)


@pytest.mark.parametrize("out_features,in_features", [(1001, 577), (192, 576), (64, 3), (5, 16)])
def test_panel_matmul_matches_float64(out_features, in_features):
    rng = np.random.default_rng(out_features)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    packed = kernels.pack(w)
    np.testing.assert_array_equal(np.asarray(kernels.unpack(packed)), w)
    for rows in (1, 2, 3, 4, 5, 8, 13):
        x = rng.standard_normal((rows, in_features)).astype(np.float32)
        got = np.asarray(panel_matmul(x, packed))
        want = x.astype(np.float64) @ w.astype(np.float64).T
        assert got.shape == (rows, out_features)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_prompts_weights_run_as_a_gemm_with_the_same_product():
    """`kernels.for_prompts` marks a prefill's weights: over PROMPT_GEMM_ROWS rows or more they
    run as XLA's GEMM on the panels (same product, float64 reference), fewer keep the kernel
    bit for bit, and decode's weights stay unmarked."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((130, 96)).astype(np.float32)  # a padded last panel
    params = {"layers": ({"w": kernels.pack(w)},), "norm": jnp.ones((3,))}
    marked = kernels.for_prompts(params)
    assert marked["layers"][0]["w"].prompt and not params["layers"][0]["w"].prompt
    x = rng.standard_normal((2, kernels.PROMPT_GEMM_ROWS, 96)).astype(np.float32)
    got = np.asarray(jax.jit(kernels.panel_matmul)(x, marked["layers"][0]["w"]))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (2, kernels.PROMPT_GEMM_ROWS, 130)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    few = x[:1, :3]
    np.testing.assert_array_equal(np.asarray(panel_matmul(few, marked["layers"][0]["w"])),
                                  np.asarray(panel_matmul(few, params["layers"][0]["w"])))


def test_rows_are_bit_identical_whatever_the_window():
    """A verify window and a one-token step must see the same projection of the same row."""
    rng = np.random.default_rng(0)
    packed = kernels.pack(rng.standard_normal((300, 200)).astype(np.float32))
    x = rng.standard_normal((2, 7, 200)).astype(np.float32)  # [B, T, I]
    full = np.asarray(panel_matmul(x, packed))
    for b in range(2):
        for t in range(7):
            one = np.asarray(panel_matmul(x[b : b + 1, t : t + 1], packed))
            np.testing.assert_array_equal(one[0, 0], full[b, t])


def attention_reference(q, k, v, k_win, v_win, lengths, scale):
    """float64 numpy: query t of row b attends cache slots s < lengths[b], then window 0..t."""
    q, k, v, k_win, v_win = (np.asarray(a, np.float64) for a in (q, k, v, k_win, v_win))
    b, t, n, h = q.shape
    kv = k.shape[1]
    out = np.zeros(q.shape)
    for bi in range(b):
        for ti in range(t):
            for ni in range(n):
                kh = ni // (n // kv)
                keys = np.concatenate([k[bi, kh, : lengths[bi]], k_win[bi, : ti + 1, kh]])
                values = np.concatenate([v[bi, kh, : lengths[bi]], v_win[bi, : ti + 1, kh]])
                scores = keys @ q[bi, ti, ni] * scale
                w = np.exp(scores - scores.max())
                out[bi, ti, ni] = (w / w.sum()) @ values
    return out


def attention_inputs(rng, b, t, n, kv, slots, h):
    shapes = [(b, t, n, h), (b, kv, slots, h), (b, kv, slots, h), (b, t, kv, h), (b, t, kv, h)]
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


@pytest.mark.parametrize(
    "b,t,n,kv,slots,h",
    [(1, 1, 9, 3, 64, 64), (2, 5, 9, 3, 100, 64), (1, 9, 9, 3, 300, 64), (2, 3, 8, 2, 77, 128),
     (3, 4, 4, 2, 33, 16), (1, 2, 2, 1, 40, 24)],  # SmolLM2 heads, H=128 and the portable path
)
def test_prefix_attention_matches_float64(b, t, n, kv, slots, h):
    rng = np.random.default_rng(slots)
    q, k, v, k_win, v_win = attention_inputs(rng, b, t, n, kv, slots, h)
    lengths = rng.integers(0, slots - t + 1, b)
    lengths[0] = 0  # an empty cache
    lengths[-1] = slots - t if b > 1 else lengths[-1]  # and a full one
    lengths = jnp.asarray(lengths, jnp.int32)
    got = np.asarray(prefix_attention(q, k, v, k_win, v_win, lengths, h**-0.5))
    want = attention_reference(q, k, v, k_win, v_win, np.asarray(lengths), h**-0.5)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    # the same with the window already written into the cache (what a plain step does)
    pos = np.asarray(lengths)[:, None] + np.arange(t)
    written = [write_kv(c, w, pos) for c, w in ((k, k_win), (v, v_win))]
    np.testing.assert_array_equal(
        np.asarray(prefix_attention(q, *written, k_win, v_win, lengths, h**-0.5)), got)


def test_prefix_attention_rows_are_bit_identical_whatever_the_window():
    """Verify row t equals a one-token step at that position, bit for bit (greedy identity)."""
    rng = np.random.default_rng(0)
    q, k, v, k_win, v_win = (np.asarray(a) for a in attention_inputs(rng, 2, 6, 9, 3, 50, 64))
    lengths = np.asarray([7, 30], np.int32)
    full = np.asarray(prefix_attention(q, k, v, k_win, v_win, lengths, 0.125))
    for t in range(6):  # the step at position lengths + t sees the first t window rows as cache
        pos = lengths[:, None] + np.arange(t, dtype=np.int32)
        k_t, v_t = write_kv(k, k_win[:, :t], pos), write_kv(v, v_win[:, :t], pos)
        one = prefix_attention(q[:, t : t + 1], k_t, v_t, k_win[:, t : t + 1], v_win[:, t : t + 1], lengths + t, 0.125)
        np.testing.assert_array_equal(np.asarray(one)[:, 0], full[:, t])


@pytest.mark.parametrize("h", [64, 24])  # the AVX-512 path and the portable one
def test_prefix_attention_tree_mask(h):
    """A draft tree's window: each node attends the cache prefix and its ancestors-and-self, in
    depth order; its row equals the XLA reference and, bit for bit, a one-token step after its
    path was written into the cache (what plain decoding computes once the path is committed)."""
    rng = np.random.default_rng(h)
    parents = jnp.asarray([[-1, -1, 0, 0, 1, 3, 2], [-1, 0, 1, -1, 3, 0, 5]])
    mask = np.asarray(tree.ancestors(parents, jnp.asarray([7, 7])))  # [B, 8, 8]
    q, k, v, k_win, v_win = (np.asarray(a) for a in attention_inputs(rng, 2, 8, 9, 3, 50, h))
    lengths = np.asarray([7, 30], np.int32)
    got = np.asarray(prefix_attention(q, k, v, k_win, v_win, lengths, h**-0.5, mask))
    want = jax.jit(lambda *a, mask: attention.attend(*a, window_mask=mask, impl="xla"))(
        q, k, v, k_win, v_win, lengths, mask=mask)
    np.testing.assert_allclose(got.reshape(2, 8, -1), want, atol=2e-6, rtol=1e-5)
    for b in range(2):
        for t in range(8):
            path = np.nonzero(mask[b, t])[0]  # ancestors, then t itself
            pos = lengths[b] + np.arange(len(path) - 1, dtype=np.int32)
            kb = write_kv(k[b : b + 1], k_win[b : b + 1, path[:-1]], pos[None])
            vb = write_kv(v[b : b + 1], v_win[b : b + 1, path[:-1]], pos[None])
            one = prefix_attention(
                q[b : b + 1, t : t + 1], kb, vb, k_win[b : b + 1, t : t + 1],
                v_win[b : b + 1, t : t + 1], lengths[b : b + 1] + len(path) - 1, h**-0.5,
            )
            np.testing.assert_array_equal(np.asarray(one)[0, 0], got[b, t])


def test_packed_forward_matches_unrolled(tiny_llama_dir):
    unrolled = load_model(tiny_llama_dir, layout="unrolled")
    packed = load_model(tiny_llama_dir, layout="packed")
    assert (unrolled.layout, packed.layout) == ("unrolled", "packed")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 9)), jnp.int32)
    logits = [
        jax.jit(llama.forward_logits, static_argnums=3)(m.params, tokens, m.init_cache(2, 16), m.cfg)[0]
        for m in (unrolled, packed)
    ]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5 * float(jnp.abs(logits[0]).max()))


def test_generation_is_the_same_in_both_layouts(tiny_llama_dir):
    prompts = [[5, 17, 3, 99, 4], [8, 1, 2]]
    tokens = [
        [r.token_ids for r in Engine(load_model(tiny_llama_dir, layout=layout), chat_template=False)
         .generate(prompts, max_new_tokens=12)]
        for layout in ("unrolled", "packed")
    ]
    assert tokens[0] == tokens[1]


def test_packed_needs_float32():
    with pytest.raises(JaxspecError, match="needs dtype float32"):
        check_options("bfloat16", "packed")


def test_unpack_params_inverts_pack_params(tiny_llama_dir, tiny_qwen2_dir):
    for path in (tiny_llama_dir, tiny_qwen2_dir):  # untied and tied LM heads
        unrolled = load_model(path, layout="unrolled")
        packed = load_model(path, layout="packed")
        back = unpack_params(packed.params, packed.cfg)
        assert jax.tree.structure(back) == jax.tree.structure(unrolled.params)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(unrolled.params)):
            np.testing.assert_array_equal(a, b)
