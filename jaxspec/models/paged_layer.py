"""The paged serving forward's attention: a layer reads its page pool through the page table.

    k_l = PagedLayer(pages [K, NP, P, H], table int32[B, MP])      (one per layer, k and v)
    out = attend(q, k_l, v_l, k_win, v_win, positions, scale=...)   -> [B, T, N*H]

`PagedTarget` (serving/paged_cache.py) hands the inner target a `KVCache` whose per-layer k/v
are `PagedLayer`s instead of contiguous `[B, K, S, H]` arrays, so the target's own layer code
(Llama, Gemma: their `_layer`) runs unchanged up to its attention, which comes here. Nothing
gathers a row's pages into a contiguous view: every backend reads the pool through the table.

As in `models.attention.attend`, the window's own k/v (a decode token, a chain or tree verify
window of γ+1, a prompt chunk) are not in the pool yet: the attention is the committed part
(slots < lengths[b] = positions[b, 0], read through the table) plus a dense window part under
any mask (causal, a tree's ancestor mask), merged by log-sum-exp. That split is why the TPU path
is JAX's paged flash kernel and not `ragged_paged_attention`: the ragged kernel reads every key
from the pool (the window's k/v would have to be written first, and a tree's nodes share
positions) and knows only causal masks, so it cannot verify a tree; the paged kernel reads the
committed pages, which are exactly the pool's, and keeps its running max and weight sum for the
merge.

The committed part per backend (`impl`):
  "xla"         a bounded loop (`lax.fori_loop`) over blocks of pages, from the first block a
                sliding window reaches to the last block the longest live row uses, each block's
                pages gathered by the table ([B, K, block, H], never the pool), online softmax.
                The CPU path, and every sliding-window or soft-capped layer elsewhere (the
                kernels take neither a lower bound per query nor, on GPU, a cap here).
  "pallas_tpu"  JAX's TPU paged flash kernel (`pallas.ops.tpu.paged_attention`'s
                `paged_flash_attention_kernel_inline_seq_dim`) on the pool as is: [K, NP, P, H]
                is [1, K*NP, P, H] (a bitcast) and (row b, kv head k) is one sequence whose pages
                are k*NP + table[b]. It DMAs only pages below lengths[b].
  "pallas_gpu"  JAX's Triton paged kernel body (`pallas.ops.gpu.paged_attention.
                paged_attention_kernel`) on the pool as is, one program per (row, kv head),
                the G*T query rows of a kv head as its heads, residuals kept for the merge.
  "auto"        by the platform the program is lowered for (`lax.platform_dependent`), bfloat16
                pools only (the kernels round K/V to bf16 or use tf32; a float32 pool keeps
                the exact XLA path, as `attention.resolve_impl` decides for contiguous caches).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

from jaxspec.models import attention, blocks
from jaxspec.models import paged_attention as pa
from jaxspec.models.attention_kernels import cache_part_in_row_chunks, on_head_shards

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked part adds exp(..) = 0
BLOCK_SLOTS = 128  # committed slots per step of the XLA loop (whole pages)
TPU_BLOCK_SLOTS = 512  # slots per step of the TPU kernel's flash loop
TPU_MAX_ROWS = 256  # query rows per kv head per TPU kernel call (more: chunks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayer:
    """One layer's k (or v) page pool and the rows' page table, in place of a [B, K, S, H] cache.
    Entries == NP in the table are unallocated (read as page NP-1: past the row's length)."""
    pages: jax.Array  # [K, NP, P, H]
    table: jax.Array  # int32[B, MP]

    @property
    def dtype(self):
        return self.pages.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:  # the contiguous view it stands for
        kv, _, p, h = self.pages.shape
        b, mp = self.table.shape
        return (b, kv, mp * p, h)

    def write(self, new: jax.Array, positions: jax.Array) -> PagedLayer:
        """new [B, T, K, H] written at positions [B, T] through the table (in place: one
        scatter; a slot without a page is dropped). A layer writes before its attention reads
        (as the contiguous cache does): a scatter after the read would make XLA copy the pool
        that the read's loop holds, every layer and step."""
        _, np_, p, _ = self.pages.shape
        page, offset = pa.slot_pages(self.table, positions, np_, p)
        return dataclasses.replace(self, pages=pa.write_pages(self.pages, new, page, offset))


def pages_per_block(pages_per_row: int, page_size: int, slots: int) -> int:
    """The largest divisor of pages_per_row holding at most `slots` slots (at least one page)."""
    most = max(1, min(pages_per_row, slots // page_size))
    return next(d for d in range(most, 0, -1) if pages_per_row % d == 0)


def resolve(impl: str, dtype, backend: str) -> str:
    """The committed part's implementation for `impl` on `backend` (see the module doc)."""
    return attention.resolve_impl(impl, cache_dtype=dtype, backend=backend)


def attend(q, k_layer: PagedLayer, v_layer: PagedLayer, k_win, v_win, positions, *,
           scale: float, window=None, window_mask=None, softcap: float | None = None,
           impl: str = "auto", interpret: bool = False):
    """q [B, T, N, H]; k_win, v_win [B, T, K, H] (the window's own, not in the pool); positions
    int32[B, T] (entry 0 at the row's length: committed slots < positions[:, 0]); window: this
    layer's sliding window (None: none); window_mask bool[B, T, T] (None: causal) -> [B, T, N*H]."""
    run = functools.partial(_attend, q, k_layer, v_layer, k_win, v_win, positions, scale=scale,
                            window=window, window_mask=window_mask, softcap=softcap,
                            interpret=interpret)
    if impl == "auto" and not os.environ.get(attention.ENV_OVERRIDE):
        on = lambda backend: functools.partial(  # noqa: E731
            run, impl=resolve("auto", k_layer.dtype, backend))
        return jax.lax.platform_dependent(tpu=on("tpu"), cuda=on("gpu"), rocm=on("gpu"),
                                          default=functools.partial(run, impl="xla"))
    return run(impl=resolve(impl, k_layer.dtype, jax.default_backend()))


def _attend(q, k_layer, v_layer, k_win, v_win, positions, *, scale, window, window_mask,
            softcap, interpret, impl):
    b, t, n, h = q.shape
    kv = k_win.shape[2]
    g = n // kv
    lengths = positions[:, 0]
    qg = q.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)  # rows (g, t)
    qpos = jnp.broadcast_to(positions[:, None, :], (b, g, t)).reshape(b, 1, g * t)  # [B, 1, GT]
    if window is not None or impl not in ("pallas_tpu", "pallas_gpu") or (
            softcap is not None and impl == "pallas_gpu"):
        o_c, m_c, l_c = committed_xla_on_head_shards(qg, k_layer, v_layer, lengths, qpos, scale,
                                                     window, softcap)
    else:
        o_c, m_c, l_c = committed_on_head_shards(qg, k_layer, v_layer, lengths, scale, softcap,
                                                 impl, interpret)
    # the window part: T keys, any mask (causal, a tree's ancestors), the sliding window
    wmask = blocks.window_part_mask(positions, window_mask, window)  # [B, T, T]
    wmask = jnp.broadcast_to(wmask[:, None], (b, g, t, t)).reshape(b, 1, g * t, t)
    kw, vw = (w.transpose(0, 2, 1, 3) for w in (k_win, v_win))  # [B, K, T, H]
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    s_win = jax.lax.dot_general(qg, kw.astype(qg.dtype), dims, preferred_element_type=jnp.float32)
    s_win = jnp.where(wmask, blocks.soft_cap(s_win * scale, softcap), _NEG)  # [B, K, GT, T]
    return attention.merge_cache_and_window(o_c, m_c, l_c, s_win, vw, q.shape, q.dtype)


def committed_on_head_shards(qg, k_layer, v_layer, lengths, scale, softcap, impl, interpret):
    """The committed part on impl's kernel, under `jax.shard_map` per (rows, kv heads) shard when
    the program is traced under a kernel mesh (`attention_kernels.kernel_mesh`; no mesh: one
    call): a pool sharded over kv heads is read by each device on its own heads (the pool has no
    row dim: it is not split over "data"; each row's table and length go with its row)."""
    def part(q, k_pages, v_pages, table, n):
        kl, vl = PagedLayer(k_pages, table), PagedLayer(v_pages, table)
        if impl == "pallas_tpu":
            return committed_pallas_tpu(q, kl, vl, n, scale, softcap, interpret)
        return committed_pallas_gpu(q, kl, vl, n, scale, interpret)

    args = [qg, k_layer.pages, v_layer.pages, k_layer.table, lengths]
    dims = [(0, 1), (None, 0), (None, 0), (0, None), (0, None)]
    return on_head_shards(part, args, dims, [(4, 0, 1), (3, 0, 1), (3, 0, 1)])


def committed_xla_on_head_shards(qg, k_layer, v_layer, lengths, qpos, scale, window, softcap):
    """`committed_xla` per (rows, kv heads) shard under a kernel mesh, as the kernels run: each
    device reads its own heads' pages for its own rows (left to GSPMD, the block gathers of a
    pool sharded over kv heads may be laid out otherwise); no mesh: one call, the same program."""
    def part(q, k_pages, v_pages, table, n, qp):
        return committed_xla(q, PagedLayer(k_pages, table), PagedLayer(v_pages, table), n, qp,
                             scale, window, softcap)

    args = [qg, k_layer.pages, v_layer.pages, k_layer.table, lengths, qpos]
    dims = [(0, 1), (None, 0), (None, 0), (0, None), (0, None), (0, None)]
    return on_head_shards(part, args, dims, [(4, 0, 1), (3, 0, 1), (3, 0, 1)])


def committed_xla(qg, k_layer: PagedLayer, v_layer: PagedLayer, lengths, qpos, scale,
                  window=None, softcap=None):
    """The committed part in XLA: qg [B, K, GT, H], query positions qpos [B, 1, GT] ->
    (unnormalised out f32[B, K, GT, H], max f32[B, K, GT], weight sum f32[B, K, GT]).

    A loop over blocks of `pages_per_block` pages, from the first block any query's sliding
    window reaches to the last holding a committed slot of the longest row: each step gathers
    its block's pages by the table ([B, K, block, H]) and folds them in by online softmax, so
    the pool is read, never copied, and only the blocks in use are."""
    kv, np_, p, h = k_layer.pages.shape
    b, mp = k_layer.table.shape
    ppb = pages_per_block(mp, p, BLOCK_SLOTS)
    size = ppb * p
    table = jnp.minimum(k_layer.table, np_ - 1)  # unallocated: past the row's length, masked

    def block(j, carry):
        o, m, l = carry
        ids = jax.lax.dynamic_slice_in_dim(table, j * ppb, ppb, axis=1)  # [B, ppb]
        k_b, v_b = (jnp.take(x.pages, ids, axis=1).transpose(1, 0, 2, 3, 4).reshape(b, kv, size, h)
                    for x in (k_layer, v_layer))  # [B, K, size, H]
        dims = (((3,), (3,)), ((0, 1), (0, 1)))
        s = jax.lax.dot_general(qg, k_b.astype(qg.dtype), dims, preferred_element_type=jnp.float32)
        s = blocks.soft_cap(s * scale, softcap)  # [B, K, GT, size]
        slot = j * size + jnp.arange(size)
        keep = slot[None, None, None, :] < lengths[:, None, None, None]
        if window is not None:
            keep &= slot[None, None, None, :] > qpos[..., None] - window
        s = jnp.where(keep, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        a = jnp.exp(m - m_new)
        p_b = jnp.exp(s - m_new[..., None])
        pv = (((3,), (2,)), ((0, 1), (0, 1)))
        o_b = jax.lax.dot_general(p_b.astype(v_b.dtype), v_b, pv, preferred_element_type=jnp.float32)
        return a[..., None] * o + o_b, m_new, a * l + p_b.sum(-1)

    gt = qg.shape[2]
    init = (jnp.zeros((b, kv, gt, h), jnp.float32), jnp.full((b, kv, gt), _NEG, jnp.float32),
            jnp.zeros((b, kv, gt), jnp.float32))
    stop = (jnp.max(lengths) + size - 1) // size  # blocks holding a committed slot
    start = 0
    if window is not None:  # the first block any query's window reaches
        start = jnp.clip((jnp.min(qpos) - window + 1) // size, 0, stop)
    return jax.lax.fori_loop(start, stop, block, init)


def committed_pallas_tpu(qg, k_layer: PagedLayer, v_layer: PagedLayer, lengths, scale,
                         softcap=None, interpret=False):
    """The committed part by JAX's TPU paged flash kernel on the pool, with its running max and
    weight sum kept (the public `paged_attention` returns only the normalised output, which
    the merge with the window cannot use). K/V are read in bfloat16 by the kernel."""
    b, kv, gt, h = qg.shape
    if gt > TPU_MAX_ROWS:  # a prompt chunk: the same call per chunk of rows
        part = lambda x: committed_pallas_tpu(x, k_layer, v_layer, lengths, scale, softcap,  # noqa: E731
                                              interpret)
        return cache_part_in_row_chunks(part, qg, rows=TPU_MAX_ROWS)
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak

    _, np_, page, _ = k_layer.pages.shape
    mp = k_layer.table.shape[1]
    per_block = pages_per_block(mp, page, TPU_BLOCK_SLOTS)
    seqs = b * kv
    k_pages, v_pages = (x.pages.reshape(1, kv * np_, page, h) for x in (k_layer, v_layer))
    table = jnp.minimum(k_layer.table, np_ - 1)  # unallocated: past the length, never DMA'd
    indices = (jnp.arange(kv, dtype=jnp.int32)[None, :, None] * np_ + table[:, None, :])
    indices = indices.reshape(seqs * mp)  # sequence (b, k): pages k*NP + table[b]
    lens = jnp.repeat(lengths.astype(jnp.int32), kv)  # [B*K]
    rows = -(-gt // 8) * 8  # a multiple of 8 sublanes
    q = (qg.astype(jnp.float32) * scale).reshape(seqs, gt, h)
    q = jnp.pad(q, ((0, 0), (0, rows - gt), (0, 0)))
    q_spec = pl.BlockSpec((None, rows, h), lambda core, s, head, *_: (s, 0, 0))
    buffer = lambda c: pltpu.VMEM((2, per_block, page, h), c.dtype)  # noqa: E731
    kernel = functools.partial(
        pak.paged_flash_attention_kernel_inline_seq_dim, pages_per_sequence=mp,
        batch_size=seqs, pages_per_compute_block=per_block, mask_value=pak.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=softcap, megacore_mode=None)
    o, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # lengths, page indices, buffer index, init flag
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), None,
                      pl.BlockSpec(memory_space=pl.ANY), None],
            out_specs=[q_spec, q_spec, q_spec],
            grid=(1, seqs, 1),
            scratch_shapes=(buffer(k_pages), None, buffer(v_pages), None,
                            pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32)] * 3,
        interpret=pltpu.InterpretParams() if interpret else False,
    )(lens, indices, jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), q,
      k_pages, None, v_pages, None)
    o, m, l = (x.reshape(b, kv, rows, h)[:, :, :gt] for x in (o, m, l))
    m = jnp.maximum(m[..., 0], _NEG)  # an empty prefix leaves -inf (and l = 0)
    l = l[..., 0]
    return o * l[..., None], m, l  # the kernel's o is normalised by l


GPU_BLOCK_H = 16  # query rows per Triton program (tl.dot's least)


def committed_pallas_gpu(qg, k_layer: PagedLayer, v_layer: PagedLayer, lengths, scale,
                         interpret=False):
    """The committed part by JAX's Triton paged kernel body on the pool as is ([K, NP, P, H]):
    one program per (row, kv head, block of GPU_BLOCK_H query rows), the kernel's residuals
    (weight sum, max) kept for the merge."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu import paged_attention as gpa

    b, kv, gt, h = qg.shape
    _, np_, page, _ = k_layer.pages.shape
    mp = k_layer.table.shape[1]
    per_block = pages_per_block(mp, page, 128)
    rows = -(-gt // GPU_BLOCK_H) * GPU_BLOCK_H
    q = jnp.pad((qg.astype(jnp.float32) * scale).astype(k_layer.dtype),
                ((0, 0), (0, 0), (0, rows - gt), (0, 0)))  # [B, K, R, H]
    table = jnp.minimum(k_layer.table, np_ - 1)
    kernel = functools.partial(gpa.paged_attention_kernel, num_heads=rows,
                               pages_per_compute_block=per_block,
                               mask_value=gpa.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None)

    def one_row(q_b, table_b, length_b):  # q_b [K, R, H], table_b [MP], length_b [1]
        pages = pl.BlockSpec((None, np_, page, h), lambda k, i, s: (k, 0, 0, 0))
        return pl.pallas_call(
            kernel, grid=(kv, rows // GPU_BLOCK_H, 1),
            in_specs=[pl.BlockSpec((None, GPU_BLOCK_H, h), lambda k, i, s: (k, i, 0)), pages,
                      None, pages, None, pl.BlockSpec((None, mp), lambda k, i, s: (s, 0)),
                      pl.BlockSpec((1,), lambda k, i, s: (0,))],
            out_specs=[pl.BlockSpec((None, GPU_BLOCK_H, h), lambda k, i, s: (k, i, 0)),
                       pl.BlockSpec((None, GPU_BLOCK_H), lambda k, i, s: (k, i)),
                       pl.BlockSpec((None, GPU_BLOCK_H), lambda k, i, s: (k, i))],
            out_shape=[jax.ShapeDtypeStruct((kv, rows, h), jnp.float32),
                       jax.ShapeDtypeStruct((kv, rows), jnp.float32),
                       jax.ShapeDtypeStruct((kv, rows), jnp.float32)],
            interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            name="paged_attention_committed",
        )(q_b, k_layer.pages, None, v_layer.pages, None, table_b[None], length_b)

    o, l, m = jax.vmap(one_row)(q, table, lengths.astype(jnp.int32)[:, None])
    o, l, m = o[:, :, :gt], l[:, :, :gt], m[:, :, :gt]
    return o, jnp.maximum(m, _NEG), l
