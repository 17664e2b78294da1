"""A paged KV cache: per layer one page pool shared by every row, and a page table per row.

    k[l], v[l]:  [K, NP, P, H]   kv heads, pages, slots per page, head dim
    page_table:  int32[B, MP]    row b's i-th page (slots i*P .. i*P+P-1); NP = no page
    lengths:     int32[B]        committed tokens per row

The pool is the layout JAX's TPU kernel `jax.experimental.pallas.ops.tpu.paged_attention`
reads (`k_pages [num_kv_heads, total_num_pages, page_size, head_dim]`, `page_indices
int32[batch, pages_per_sequence]`), so `tpu_decode_attention` hands it over with no copy.

Writes go through the table: slot s of row b is page table[b, s // P], offset s % P; a slot
whose table entry is NO_PAGE (a free row, a page not yet allocated, past the last page) is
dropped, so a row can never write into another row's pages. Reads are the XLA reference: a
row's pages gathered into a contiguous [B, K, MP*P, H] view, one layer at a time, attended by
the target's own attention (slots past a row's length are never read, as in `jaxspec.models.cache`).
Rejected draft slots are simply past the length: nothing is cleared or copied.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k: tuple[jax.Array, ...]  # per layer [K, NP, P, H]
    v: tuple[jax.Array, ...]
    page_table: jax.Array  # int32[B, MP]; entries == num_pages are unallocated
    lengths: jax.Array  # int32[B]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def capacity(self) -> int:  # slots a row can address
        return self.page_table.shape[1] * self.page_size

    def positions(self, num_queries: int) -> jax.Array:  # int32[B, T]
        return self.lengths[:, None] + jnp.arange(num_queries, dtype=jnp.int32)

    def with_lengths(self, lengths: jax.Array) -> PagedKVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def with_table(self, page_table: jax.Array) -> PagedKVCache:
        return dataclasses.replace(self, page_table=page_table.astype(jnp.int32))


def init_paged_cache(num_layers: int, batch: int, num_pages: int, page_size: int,
                     pages_per_row: int, kv_heads: int, head_dim: int, dtype,
                     identity: bool = False) -> PagedKVCache:
    """An empty pool of `num_pages` pages. identity: row b owns pages b*MP .. b*MP+MP-1 (a
    standalone cache, num_pages = batch * MP); else every table entry is unallocated."""
    shape = (kv_heads, num_pages, page_size, head_dim)
    k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    if identity:
        table = jnp.arange(batch * pages_per_row, dtype=jnp.int32).reshape(batch, pages_per_row)
    else:
        table = jnp.full((batch, pages_per_row), num_pages, jnp.int32)
    return PagedKVCache(k, v, table, jnp.zeros((batch,), jnp.int32))


def gather_pages(pages: jax.Array, table: jax.Array) -> jax.Array:
    """pages [K, NP, P, H], table int32[B, MP] -> the rows' contiguous view [B, K, MP*P, H].
    Unallocated entries read page NP-1 (clipped): those slots are past the row's length."""
    kv, _, p, h = pages.shape
    b, mp = table.shape
    rows = jnp.take(pages, table, axis=1, mode="clip")  # [K, B, MP, P, H]
    return jnp.swapaxes(rows, 0, 1).reshape(b, kv, mp * p, h)


def view(cache: PagedKVCache) -> KVCache:
    """The cache as a contiguous per-layer `KVCache` (what a target's forward reads)."""
    k = tuple(gather_pages(x, cache.page_table) for x in cache.k)
    v = tuple(gather_pages(x, cache.page_table) for x in cache.v)
    return KVCache(k=k, v=v, lengths=cache.lengths)


def slot_pages(table: jax.Array, positions: jax.Array, num_pages: int, page_size: int):
    """(page int32[B, T], offset int32[B, T]) of each position; NO page (num_pages) where the
    table has none or the position is past the table."""
    index = positions // page_size
    inside = (index >= 0) & (index < table.shape[1])
    page = jnp.take_along_axis(table, jnp.clip(index, 0, table.shape[1] - 1), axis=1)
    return jnp.where(inside, page, num_pages), positions % page_size


def write_pages(pages: jax.Array, new: jax.Array, page: jax.Array, offset: jax.Array):
    """pages [K, NP, P, H] <- new [B, T, K, H] at (page, offset) [B, T]; NO page: dropped."""
    update = jnp.moveaxis(new.astype(pages.dtype), 2, 0)  # [K, B, T, H]
    return pages.at[:, page, offset].set(update, mode="drop")


def write_window(cache: PagedKVCache, window_kv, positions: jax.Array) -> PagedKVCache:
    """Per-layer window k/v (tuples of [B, T, K, H]) written at positions [B, T]."""
    k_win, v_win = window_kv
    page, offset = slot_pages(cache.page_table, positions, cache.num_pages, cache.page_size)
    k = tuple(write_pages(c, w, page, offset) for c, w in zip(cache.k, k_win))
    v = tuple(write_pages(c, w, page, offset) for c, w in zip(cache.v, v_win))
    return dataclasses.replace(cache, k=k, v=v)


def page_bytes(cache: PagedKVCache) -> int:
    """Bytes one page holds across every layer's k and v."""
    return sum(x.nbytes for x in (*cache.k, *cache.v)) // cache.num_pages


def tpu_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         lengths: jax.Array, page_table: jax.Array,
                         pages_per_compute_block: int = 4) -> jax.Array:
    """One query per row over its pages with JAX's TPU kernel, on this module's layout as is:
    q [B, N, H]; k/v_pages [K, NP, P, H]; lengths int32[B] (slots below it attended);
    page_table int32[B, MP] -> [B, N, H]. TPU only (Mosaic); `jax.export` lowers it anywhere."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return paged_attention(q, k_pages, v_pages, lengths, page_table,
                           pages_per_compute_block=pages_per_compute_block)


# --- The combined pool layout JAX's ragged TPU kernel reads -------------------------------
#
#     kv_pages: [NP, P, 2K, H]   pages, slots, kv heads interleaved (2i = k head i, 2i+1 = v)
#
# `jax.experimental.pallas.ops.tpu.ragged_paged_attention` takes every row's queries in one
# flat [sum T_b, N, H] array with ragged lengths (cu_q_lens), so decode (T=1), verify windows
# (T=γ+1) and prefill chunks go through one call. `ragged_attend` runs it on TPU and an XLA
# reference elsewhere (the same masks: causal from each row's kv length, optional sliding window).


def combine_kv(k_pages: jax.Array, v_pages: jax.Array) -> jax.Array:
    """k/v pages [K, NP, P, H] -> the kernel's combined pool [NP, P, 2K, H] (heads interleaved)."""
    kv, np_, p, h = k_pages.shape
    both = jnp.stack([k_pages, v_pages], axis=1)  # [K, 2, NP, P, H]
    return jnp.transpose(both, (2, 3, 0, 1, 4)).reshape(np_, p, 2 * kv, h)


def split_kv(kv_pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The combined pool [NP, P, 2K, H] -> (k, v) pages [K, NP, P, H] (inverse of combine_kv)."""
    k = jnp.transpose(kv_pages[:, :, 0::2], (2, 0, 1, 3))
    v = jnp.transpose(kv_pages[:, :, 1::2], (2, 0, 1, 3))
    return k, v


def ragged_inputs(q: jax.Array, kv_lens: jax.Array):
    """q [B, T, N, H] (every row T queries, the last T of its kv_lens[b] slots) -> the kernel's
    flat queries [B*T, N, H], cu_q_lens int32[B+1] and num_seqs int32[1]."""
    b, t, n, h = q.shape
    cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    return q.reshape(b * t, n, h), cu, jnp.array([b], jnp.int32)


def reference_attend(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                     page_table: jax.Array, *, sm_scale: float,
                     sliding_window: int | None = None) -> jax.Array:
    """The XLA reference of `ragged_attend`: each row's pages gathered into a contiguous view.
    q [B, T, N, H]; kv_lens int32[B] (slots written, the T queries included) -> [B, T, N, H]."""
    b, t, n, h = q.shape
    k_pages, v_pages = split_kv(kv_pages)
    k = gather_pages(k_pages, page_table)  # [B, K, S, H]
    v = gather_pages(v_pages, page_table)
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, n // kv, h)
    logits = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    logits = logits * sm_scale
    qpos = kv_lens[:, None] - t + jnp.arange(t)  # [B, T]
    kpos = jnp.arange(k.shape[2])
    keep = kpos[None, None, :] <= qpos[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        keep &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
    logits = jnp.where(keep[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, v)
    return out.reshape(b, t, n, h).astype(q.dtype)


def kernel_blocks(num_q_tokens: int, pages_per_row: int, page_size: int) -> dict:
    """The ragged kernel's block sizes from the shapes (given, not looked up: JAX's tuned table
    asks the local TPU's generation, which a host exporting for TPU has not): about 128 kv slots
    and up to 32 queries per block, never more than a row's pages or the call's queries."""
    pages = max(1, min(pages_per_row, 128 // page_size))
    return {"num_kv_pages_per_block": pages, "num_queries_per_block": min(32, num_q_tokens)}


def ragged_attend(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                  page_table: jax.Array, *, sm_scale: float, sliding_window: int | None = None,
                  backend: str = "xla") -> jax.Array:
    """Attention of q [B, T, N, H] over the combined pool [NP, P, 2K, H] through page_table
    int32[B, MP]; kv_lens int32[B] counts each row's written slots, its T queries included
    (query i sits at kv_lens - T + i). backend "tpu": JAX's ragged paged kernel (one call for
    every row; `jax.export(..., platforms=["tpu"])` lowers it on any host), else the XLA
    reference. -> [B, T, N, H]. Tree masks are not the kernel's: tree verification stays XLA."""
    if backend != "tpu":
        return reference_attend(q, kv_pages, kv_lens, page_table, sm_scale=sm_scale,
                                sliding_window=sliding_window)
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    b, t, n, h = q.shape
    flat, cu, num = ragged_inputs(q, kv_lens)
    table = jnp.minimum(page_table, kv_pages.shape[0] - 1)  # unallocated: past kv_lens, unread
    blocks = kernel_blocks(b * t, page_table.shape[1], kv_pages.shape[1])
    out = ragged_paged_attention(flat, kv_pages, kv_lens.astype(jnp.int32), table, cu, num,
                                 sm_scale=sm_scale, sliding_window=sliding_window, **blocks)
    return out.reshape(b, t, n, h)


def tpu_lowering(device_kind: str = "TPU v5 lite"):
    """A context in which Mosaic lowers for `device_kind` on a host without a TPU: the ragged
    kernel asks the chip's generation while lowering (`jax.export(..., platforms=["tpu"])` from
    a CPU host fails without it). An abstract mesh of one device of that kind, public API."""
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("tpu",), abstract_device=dev))


def gpu_decode_attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      kv_lens: jax.Array, page_table: jax.Array, *, sm_scale: float,
                      interpret: bool = False) -> jax.Array:
    """One query per row (q [B, 1, N, H], the last of its kv_lens slots) over k/v pages
    [K, NP, P, H] with JAX's Triton paged kernel (`pallas.ops.gpu.paged_attention`, this
    module's layout as is; it applies no softmax scale: q is scaled first). -> [B, 1, N, H].
    The kernel takes one query per row and no window: verify windows and prefill stay XLA."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    t = q.shape[1]
    if t != 1:
        raise ValueError(f"gpu_decode_attend takes one query per row, got {t}: use ragged_attend")
    table = jnp.minimum(page_table, k_pages.shape[1] - 1)  # unallocated: past kv_lens, unread
    p = k_pages.shape[2]
    out = paged_attention((q[:, 0] * sm_scale).astype(q.dtype), k_pages, v_pages, table,
                          kv_lens.astype(jnp.int32), block_h=16,
                          pages_per_compute_block=max(1, min(table.shape[1], 128 // p)),
                          k_splits=1, interpret=interpret)
    return out[:, None]
