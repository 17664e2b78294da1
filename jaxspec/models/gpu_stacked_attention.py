"""Our own Pallas (Triton) flash-decoding kernel on a stacked cache `[L, B, K, S, H]` at a
traced layer, as the cache part of `jaxspec.models.attention.attend` (the same (out, max, weight
sum) contract as `attention_kernels`): JAX's GPU decode kernel takes a per-layer operand, which
would copy the layer out of the stack each step; this one indexes the stack by address.
Runs on CPU in Pallas interpret mode (`interpret=True`), which is how tests check it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.models.attention_kernels import (
    _EMPTY, GPU_PROGRAMS, GPU_WARPS, _merge_splits, cache_part_in_row_chunks, gpu_block_rows,
    gpu_rows,
)

GPU_BLOCK_SLOTS = 64  # cache slots per step of the stacked GPU kernel's loop
GPU_SPLITS = 8  # programs per (row, kv head) in the stacked GPU kernel, each over a slot range


def _stacked_decode_kernel(layer_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                           block_k: int, split_len: int, causal: int = 0):
    """One (row b, kv head h, split j) program: cache slots [j*split_len, (j+1)*split_len) below
    lengths[b] of layer `layer` of the stack, in blocks of block_k (online softmax). causal = T > 0:
    the query rows are (g, t) pairs of a window already written at lengths[b].., and row t also
    sees slots lengths[b] .. lengths[b] + t (its own and the earlier window entries)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    start = j * split_len
    q = q_ref[...]  # [rows, H] f32, pre-scaled
    rows = q.shape[0]
    seen = lengths_ref[b] + (jnp.arange(rows) % causal + 1 if causal else 0)  # [rows] or scalar
    row_stop = jnp.minimum(seen, start + split_len)
    stop = jnp.max(row_stop) if causal else row_stop
    row_stop = row_stop[:, None] if causal else stop

    def body(i, carry):
        o, m, l = carry
        at = start + i * block_k
        k = k_ref[layer, b, h, pl.ds(at, block_k), :]  # [block_k, H] straight from the stack
        s = plgpu.dot(q.astype(k.dtype), k, trans_b=True, allow_tf32=False)  # [rows, block_k]
        s = jnp.where((at + jnp.arange(block_k))[None, :] < row_stop, s.astype(jnp.float32),
                      _EMPTY)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        a = jnp.exp(m - m_new)
        v = v_ref[layer, b, h, pl.ds(at, block_k), :]
        o = a[:, None] * o + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False).astype(jnp.float32)
        return o, m_new, a * l + p.sum(axis=-1)

    init = (jnp.zeros((rows, q.shape[1]), jnp.float32), jnp.full((rows,), _EMPTY, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    n = jnp.maximum(pl.cdiv(stop - start, block_k), 0)
    o, m, l = jax.lax.fori_loop(0, n, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def cache_part_pallas_gpu_stacked(qg, k_all, v_all, lengths, layer, scale, interpret=False,
                                  causal: int = 0):
    """The cache part on a stacked cache `[L, B, K, S, H]` at a traced layer, by a Pallas GPU
    (Triton) flash-decoding kernel of ours: the stack goes in whole (no copy of the layer), each
    program loads its blocks from (layer, b, h) by address, below lengths[b] only. The cache slots
    are split over GPU_SPLITS programs per (row, kv head) and merged here by log-sum-exp.
    causal = T: a causal window of T entries already written at lengths.. (rows (g, t)), each
    row also reading the window's slots up to its own (`_stacked_decode_kernel`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b, kv, gt, h = qg.shape
    if gt > gpu_rows(h):
        if causal:
            raise ValueError("a written causal window runs in one row chunk")
        def part(x):
            return cache_part_pallas_gpu_stacked(x, k_all, v_all, lengths, layer, scale, interpret)
        return cache_part_in_row_chunks(part, qg, rows=gpu_rows(h))
    slots = k_all.shape[-2]
    block_k = GPU_BLOCK_SLOTS if slots % GPU_BLOCK_SLOTS == 0 else slots
    splits = min(GPU_SPLITS, slots // block_k)
    while (slots // block_k) % splits or (splits > 1 and b * kv * splits > GPU_PROGRAMS):
        splits -= 1  # as far as the GPU needs programs: each split's f32 partials are re-read
    rows = gpu_block_rows(gt)
    q = jnp.pad(qg.astype(jnp.float32) * scale, ((0, 0), (0, 0), (0, rows - gt), (0, 0)))
    whole = pl.no_block_spec  # the whole array: the kernel indexes it by address
    q_spec = pl.BlockSpec((None, None, rows, h), lambda i, k, j: (i, k, 0, 0))
    out_spec = lambda *shape: pl.BlockSpec(
        (None, None, None, *shape), lambda i, k, j: (j, i, k) + (0,) * len(shape))
    o, m, l = pl.pallas_call(
        functools.partial(_stacked_decode_kernel, block_k=block_k, split_len=slots // splits,
                          causal=causal),
        grid=(b, kv, splits),
        in_specs=[whole, whole, q_spec, whole, whole],
        out_specs=[out_spec(rows, h), out_spec(rows), out_spec(rows)],
        out_shape=[jax.ShapeDtypeStruct((splits, b, kv, rows, h), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, kv, rows), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, kv, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=GPU_WARPS, num_stages=2),  # Triton
        interpret=interpret,
        name="jaxspec_stacked_decode",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths.astype(jnp.int32), q, k_all, v_all)
    o, m, l = _merge_splits(o, m, l, axis=0)  # [B, K, rows(, H)]
    return o[:, :, :gt], m[:, :, :gt], l[:, :, :gt]
