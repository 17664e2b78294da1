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
