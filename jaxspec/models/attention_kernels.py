"""JAX's own Pallas attention kernels as the cache part of `jaxspec.models.attention.attend`.

Each function reads a cache's valid prefix (slots < lengths[b]) for grouped queries
qg `[B, K, GT, H]` (the G query heads of each kv head times the T window positions, which all
see the same prefix) and returns what attend merges with the window part by log-sum-exp:
(unnormalised out f32[B, K, GT, H], running max f32[B, K, GT], weight sum f32[B, K, GT]).

  cache_part_pallas_tpu  jax.experimental.pallas.ops.tpu.paged_attention's kernel on a zero-copy
                         paged view of our contiguous cache (per-layer `[B, K, S, H]` or a
                         stack `[L, B, K, S, H]` indexed by a traced layer; see below).
  cache_part_pallas_gpu  jax.experimental.pallas.ops.gpu.decode_attention's per-(row, kv head)
                         kernel, vmapped on a per-layer `[B, K, S, H]` cache.

Both run on CPU in Pallas interpret mode (`interpret=True`), which is how tests check them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

TPU_BLOCK_SLOTS = 512  # cache slots per step of the TPU kernel's flash loop (pages x page size)
_EMPTY = -0.7 * float(jnp.finfo(jnp.float32).max)  # a prefix with no valid slot: weight 0


def tpu_pages(slots: int) -> tuple[int, int]:
    """(page size, pages per compute block) for a cache of `slots` slots: the largest page of
    128/64/32/16 slots dividing it, and about TPU_BLOCK_SLOTS slots per kernel step."""
    page = next((p for p in (128, 64, 32, 16) if slots % p == 0), None)
    if page is None:
        raise ValueError(f"pallas_tpu attention needs a cache capacity divisible by 16, got {slots}")
    per_seq = slots // page
    per_block = max(1, min(per_seq, TPU_BLOCK_SLOTS // page))
    while per_seq % per_block:
        per_block -= 1
    return page, per_block


def cache_part_pallas_tpu(qg, k_cache, v_cache, lengths, layer, scale, interpret=False):
    """The cache part by the TPU paged-attention kernel, without copying the cache.

    A contiguous cache is already paged: `[B, K, S, H]` (or the whole stack `[L, B, K, S, H]`)
    reshaped to `[1, B*K*S/P, P, H]` (a bitcast) is a table of pages of P slots, and each
    (row, kv head) is one sequence with ONE kv head whose pages are consecutive:
    page_indices[(b, k)] = layer * B*K*S/P + (b*K + k) * S/P + arange(S/P). The query heads of that
    sequence are qg[b, k] (G heads x T window positions: all see lengths[b] slots). The kernel
    DMAs only the pages below lengths[b] into VMEM; the rest of the stack is never read.

    The public `paged_attention` returns the normalised output only, so this launches the same
    kernel (`paged_flash_attention_kernel_inline_seq_dim`) with its running max and weight sum
    kept, which the merge with the window part needs (exact, no second pass over the cache).
    The kernel computes q.k and p.v with K/V rounded to bfloat16 (it dequantises to bf16), so it
    is exact for bf16 caches and bf16-accurate for float32 ones."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak

    b, kv, gt, h = qg.shape
    slots = k_cache.shape[-2]
    page, per_block = tpu_pages(slots)
    per_seq = slots // page
    pages = k_cache.size // (h * page)
    k_pages, v_pages = (c.reshape(1, pages, page, h) for c in (k_cache, v_cache))  # bitcasts
    first = 0 if layer is None else layer.astype(jnp.int32) * (b * kv * per_seq)
    page_indices = first + jnp.arange(b * kv * per_seq, dtype=jnp.int32)  # [(B*K) * S/P]
    lens = jnp.repeat(lengths.astype(jnp.int32), kv)  # [B*K]
    q = (qg.astype(jnp.float32) * scale).reshape(b * kv, gt, 1, h)  # one sequence per (row, head)
    q_spec = pl.BlockSpec((None, gt, None, h), lambda core, s, head, *_: (s, head, 0, 0))
    buffer = lambda c: pltpu.VMEM((2, per_block, page, h), c.dtype)  # noqa: E731  double-buffered
    kernel = functools.partial(
        pak.paged_flash_attention_kernel_inline_seq_dim, pages_per_sequence=per_seq,
        batch_size=b * kv, pages_per_compute_block=per_block, mask_value=pak.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None, megacore_mode=None,
    )
    o, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # lengths, page indices, buffer index, init flag
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), None,
                      pl.BlockSpec(memory_space=pl.ANY), None],
            out_specs=[q_spec, q_spec, q_spec],
            grid=(1, b * kv, 1),
            scratch_shapes=(buffer(k_pages), None, buffer(v_pages), None,
                            pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32),
                   jax.ShapeDtypeStruct((*q.shape[:-1], 1), jnp.float32),
                   jax.ShapeDtypeStruct((*q.shape[:-1], 1), jnp.float32)],
        interpret=pltpu.InterpretParams() if interpret else False,
    )(lens, page_indices, jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), q,
      k_pages, None, v_pages, None)
    m = jnp.maximum(m.reshape(b, kv, gt), _EMPTY)  # an empty prefix leaves -inf, l = 0
    l = l.reshape(b, kv, gt)
    return o.reshape(b, kv, gt, h) * l[..., None], m, l  # the kernel's o is normalised by l


def cache_part_pallas_gpu(qg, k_cache, v_cache, lengths, scale, interpret=False):
    """The cache part by Pallas GPU's decode kernel, vmapped over (row, kv head) on our
    [B, K, S, H] layout (no transpose); it reads slots < lengths[b] only."""
    from jax.experimental.pallas.ops.gpu import decode_attention as da

    b, kv, gt, _ = qg.shape
    slots = k_cache.shape[2]
    block_k = min(128, slots)
    k_splits = max(1, slots // block_k) if slots % block_k == 0 else 1
    if slots % (block_k * k_splits):
        block_k, k_splits = slots, 1
    inner = functools.partial(
        da.decode_attn_unbatched, sm_scale=scale, block_h=max(16, 1 << (gt - 1).bit_length()),
        block_k=block_k,
        k_splits=k_splits, num_warps=None, num_stages=2, grid=None, interpret=interpret,
        debug=False, return_residuals=True, normalize_output=False,
    )
    start = jnp.zeros((b, kv), jnp.int32)
    lens = jnp.broadcast_to(lengths[:, None], (b, kv)).astype(jnp.int32)
    o, (l, m) = jax.vmap(jax.vmap(inner))(qg, k_cache.astype(qg.dtype), v_cache.astype(qg.dtype),
                                          start, lens)
    # the kernel's m is the max of scaled scores; an empty prefix has l == 0
    return o.astype(jnp.float32), m.astype(jnp.float32), l.astype(jnp.float32)
