"""Chunked prefill (decode/prefill.py `forward_prompt`): a long prompt runs as a lax.scan over
fixed-width chunks, each attending the cache the chunks before it wrote. The decode state it
leaves (first token, every cache slot, the drafter's state built from the target's taps) equals
the one-pass prefill's, for rows of different lengths in one batch, on the plain and the packed
(CPU kernel) layouts; a change in the first chunk reaches the last chunk's cache (the chunks read
each other). Chunk widths divide the prompt buckets, which pad at most 1.25x.

A sliding-window layer's attention (`blocks.masked_attention`) reads only the window's span of
the cache and a query chunk's keys up to its causal edge: equal to a dense numpy softmax over
every visible key, for a static and a traced window (and a traced global one); a span starting
one slot late fails the same comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import dflash_like, tiny_model

from jaxspec.decode import speculate
from jaxspec.decode.prefill import prompt_chunk
from jaxspec.decode.sampling import SamplingParams
from jaxspec.engine.prepare import prompt_bucket
from jaxspec.models import blocks

CHUNK = 16
LENGTHS = (70, 45)  # padded to 80: five chunks; the shorter row ends inside the third


def prefilled(target, drafter, dparams, prompts, chunk):
    spec = speculate.LoopSpec(target=target.target, drafter=drafter, num_speculative_tokens=3,
                              eos_ids=())
    b, p = len(prompts), prompt_bucket(max(map(len, prompts)))
    tokens = jnp.asarray([row + [0] * (p - len(row)) for row in prompts], jnp.int32)
    lengths = jnp.asarray([len(row) for row in prompts], jnp.int32)
    return speculate.prefill_jit(spec, target.params, dparams, tokens, lengths,
                                 jnp.full((b,), 8, jnp.int32), SamplingParams.make(),
                                 jax.random.key(0), jnp.arange(b, dtype=jnp.int32),
                                 capacity=p + 16, chunk=chunk)


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_prefill_leaves_the_one_pass_state(packed):
    target = tiny_model(seed=3, packed=packed, eos=(-1,))
    drafter, dparams = dflash_like(target)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(1, 63, size=n)] for n in LENGTHS]
    one = prefilled(target, drafter, dparams, prompts, None)
    chunked = prefilled(target, drafter, dparams, prompts, CHUNK)
    np.testing.assert_array_equal(chunked.tokens, one.tokens)  # prompts + the first token
    np.testing.assert_array_equal(chunked.cache.lengths, one.cache.lengths)
    for got, want in zip(jax.tree.leaves((chunked.cache, chunked.drafter_state)),
                         jax.tree.leaves((one.cache, one.drafter_state))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # packed: GEMM vs kernel rows
    # control: the first token changed, the last chunk's keys change with it (each chunk reads
    # the cache the chunks before it wrote; chunks run alone would leave them equal)
    changed = [[prompts[0][0] % 60 + 1] + prompts[0][1:], prompts[1]]
    other = prefilled(target, drafter, dparams, changed, CHUNK)
    last = slice(4 * CHUNK, LENGTHS[0])
    assert not np.allclose(other.cache.k[-1][0, :, last], chunked.cache.k[-1][0, :, last],
                           atol=1e-4)


@pytest.mark.parametrize("tokens", [600, 1025, 2000, 7984, 32000])
def test_long_prompts_pad_little_and_split_into_even_chunks(tokens):
    width = prompt_bucket(tokens)
    assert tokens <= width <= 1.25 * tokens
    chunk = prompt_chunk(width)
    if width <= 1024:
        assert chunk is None  # one pass
    else:
        assert chunk is not None and width % chunk == 0 and 128 <= chunk <= 1024


def dense_attention(q, k_cache, v_cache, k_win, v_win, lengths, window):
    """numpy reference: every committed slot and window entry a query sees, one softmax.
    q [B, T, N, H]; caches [B, K, S, H]; window k/v [B, T, K, H] -> [B, T, N*H]."""
    b, t, n, h = q.shape
    kv = k_win.shape[2]
    out = np.zeros((b, t, n, h))
    for r in range(b):
        keys = np.concatenate([k_cache[r][:, :lengths[r]], k_win[r].transpose(1, 0, 2)], 1)
        vals = np.concatenate([v_cache[r][:, :lengths[r]], v_win[r].transpose(1, 0, 2)], 1)
        k_pos = np.concatenate([np.arange(lengths[r]), lengths[r] + np.arange(t)])
        for i in range(t):
            seen = (k_pos <= lengths[r] + i) & (k_pos > lengths[r] + i - window)
            for head in range(n):
                s = keys[head // (n // kv), seen] @ q[r, i, head] / np.sqrt(h)
                p = np.exp(s - s.max())
                out[r, i, head] = p @ vals[head // (n // kv), seen] / p.sum()
    return out.reshape(b, t, n * h)


@pytest.mark.parametrize("variant", ["correct", "span_one_slot_late"])
def test_sliding_attention_reads_the_window_only_and_equals_dense(variant, monkeypatch):
    if variant == "span_one_slot_late":
        start = blocks.window_span_start
        monkeypatch.setattr(blocks, "window_span_start", lambda n, s, w: start(n, s, w) + 1)
    rng = np.random.default_rng(0)
    b, t, n, kv, h, slots, window = 2, 12, 4, 2, 8, 48, 7
    lengths = np.array([30, 3], np.int32)  # the short row's span clamps to slot 0
    q, k_win, v_win = (rng.normal(size=(b, t, x, h)).astype(np.float32) for x in (n, kv, kv))
    k_cache, v_cache = (rng.normal(size=(b, kv, slots, h)).astype(np.float32) for _ in range(2))
    positions = jnp.asarray(lengths[:, None] + np.arange(t), jnp.int32)

    def ours(win, span=None):
        return np.asarray(jax.jit(lambda w: blocks.masked_attention(
            q, k_cache, v_cache, k_win, v_win, jnp.asarray(lengths), positions, scale=h**-0.5,
            window=w if span else window, chunk=5, window_span=span))(jnp.int32(win)))

    want = dense_attention(q, k_cache, v_cache, k_win, v_win, lengths, window)
    for got in (ours(window), ours(window, span=window)):  # static, traced within the span
        error = np.abs(got - want).max()
        if variant == "correct":
            assert error < 1e-5
        else:
            assert error > 1e-3, f"a span one slot late should miss a key (max error {error})"
    if variant == "correct":  # a traced window wider than the span: the whole cache
        wide = dense_attention(q, k_cache, v_cache, k_win, v_win, lengths, 10**6)
        np.testing.assert_allclose(ours(blocks.NO_WINDOW, span=window), wide, atol=1e-5)
