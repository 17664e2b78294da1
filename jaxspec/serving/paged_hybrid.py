"""The paged serving cache of a hybrid target (full-attention and linear-attention layers,
`models/hybrid_cache.py`): the attention layers' k/v in the page pool, each row's
linear-attention rings in its own slot beside the pages, and one state snapshot per page.

    k   (attention k pools [K, NP, P, H] ..., ssm snapshots [NP, Hv, Dk, Dv] f32 ...)
    v   (attention v pools [K, NP, P, H] ..., conv snapshots [NP, Kc-1, C] ...)
    page_table int32[B, MP], lengths int32[B]                    (as `PagedKVCache`)
    ssm  per linear layer the rows' rings [B, R, Hv, Dk, Dv] f32  (`hybrid_cache`: by length)
    conv per linear layer the rows' rings [B, R, Kc-1, C]

Every pool shared by the rows travels in `k` / `v` (the attention pools first, then the linear
layers' snapshots), so the scheduler moves, donates and splices them exactly as it moves a KV
pool; the rings have a batch axis and move with their rows.

Rollback under speculation is the rings' (`hybrid_cache`): a verify window's states are written
at lengths + 1 .. + P along the accepted path, and advancing `lengths` selects the accepted one,
per row, whatever the other rows accepted.

Snapshots (prefix caching, `serving.prefix`): a prompt forward over pages (admission's cache has
no rings yet: a `PagedKVCache` whose tables hold the rows' pages) keeps the linear layers' state
after the last token of each page it fills at that page's snapshot slot, so the snapshot of page
q is the state at the end of q, named and shared with q's k/v, and evicted with it. A prompt
whose first n pages come from the cache (or from its own earlier chunks: chunks are whole pages
here) starts its rings from the snapshot of its page n - 1, never recomputing the prefix. The
state lives only at page ends: a prompt piece must start at a page boundary
(`check_chunk`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError
from jaxspec.models import paged_layer
from jaxspec.models import paged_attention as pa
from jaxspec.models.hybrid_cache import HybridCache, StateSnapshots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedHybridCache(pa.PagedKVCache):
    ssm: tuple[jax.Array, ...] = ()  # per linear layer [B, R, Hv, Dk, Dv] f32
    conv: tuple[jax.Array, ...] = ()  # per linear layer [B, R, Kc-1, C]


def is_hybrid(shape) -> bool:
    """Whether a target's own cache (or its shape) is a per-layer `HybridCache`."""
    return isinstance(shape, HybridCache) and isinstance(shape.k, tuple)


def init_cache(one: HybridCache, batch: int, num_pages: int, page_size: int, per_row: int,
               identity: bool) -> PagedHybridCache:
    """An empty pool of `num_pages` pages for a target whose one-row cache is `one`, its rows'
    rings zero (the state at length 0)."""
    _, kv, _, h = one.k[0].shape
    base = pa.init_paged_cache(len(one.k), batch, num_pages, page_size, per_row, kv, h,
                               one.k[0].dtype, identity=identity)
    ssm_snap = tuple(jnp.zeros((num_pages, *r.shape[2:]), r.dtype) for r in one.ssm)
    conv_snap = tuple(jnp.zeros((num_pages, *r.shape[2:]), r.dtype) for r in one.conv)
    return PagedHybridCache(base.k + ssm_snap, base.v + conv_snap, base.page_table,
                            base.lengths, ssm=zero_rings(one.ssm, batch),
                            conv=zero_rings(one.conv, batch))


def zero_rings(rings, batch: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.zeros((batch, *r.shape[1:]), r.dtype) for r in rings)


def snapshot_page(lengths: jax.Array, page_size: int) -> jax.Array:
    """int32[B]: the table index of the page whose end state a row of `lengths` starts from
    (the page holding its last token; -1 at length 0)."""
    return lengths // page_size - 1


def start_rings(cache: pa.PagedKVCache, one: HybridCache) -> PagedHybridCache:
    """Admission's prompt cache (the pools, the rows' tables, lengths at a page boundary: what
    their pages already hold) with rings: each row's state at its length taken from the
    snapshot of the page before it (zero at length 0)."""
    num_linear = len(one.ssm)
    split = len(cache.k) - num_linear
    b = cache.page_table.shape[0]
    at = snapshot_page(cache.lengths, cache.page_size)  # [B]
    page = jnp.take_along_axis(cache.page_table, jnp.maximum(at, 0)[:, None], axis=1)[:, 0]
    slot = cache.lengths % one.ssm[0].shape[1]

    def restored(pool, ring):  # pool [NP, ...], ring [1, R, ...] (shape) -> [B, R, ...]
        state = jnp.take(pool, page, axis=0, mode="clip")  # [B, ...]
        keep = (at >= 0).reshape((b,) + (1,) * (state.ndim - 1))
        zeros = jnp.zeros((b, *ring.shape[1:]), ring.dtype)
        return zeros.at[jnp.arange(b), slot].set(jnp.where(keep, state, 0).astype(ring.dtype))

    return PagedHybridCache(
        cache.k, cache.v, cache.page_table, cache.lengths,
        ssm=tuple(restored(p, r) for p, r in zip(cache.k[split:], one.ssm)),
        conv=tuple(restored(p, r) for p, r in zip(cache.v[split:], one.conv)))


def snapshot_index(table: jax.Array, positions: jax.Array, num_pages: int,
                   page_size: int) -> jax.Array:
    """int32[B, T]: the snapshot slot of each entry that ends a page (its page), else
    num_pages (kept nowhere)."""
    page, offset = pa.slot_pages(table, positions, num_pages, page_size)
    return jnp.where(offset == page_size - 1, page, num_pages)


def inner_cache(cache: PagedHybridCache, positions=None, snapshots: bool = False) -> HybridCache:
    """What the hybrid target's forward reads: its attention layers' pools through the table
    (`PagedLayer`), the rows' rings, and (`snapshots`: a prompt forward at `positions`) the
    snapshot pools it keeps page-end states in."""
    split = len(cache.k) - len(cache.ssm)
    k = tuple(paged_layer.PagedLayer(x, cache.page_table) for x in cache.k[:split])
    v = tuple(paged_layer.PagedLayer(x, cache.page_table) for x in cache.v[:split])
    snaps = None
    if snapshots:
        index = snapshot_index(cache.page_table, positions, cache.num_pages, cache.page_size)
        snaps = StateSnapshots(cache.k[split:], cache.v[split:], index)
    return HybridCache(k=k, v=v, ssm=cache.ssm, conv=cache.conv, lengths=cache.lengths,
                       snapshots=snaps)


def outer_cache(cache: PagedHybridCache, inner: HybridCache) -> PagedHybridCache:
    """`cache` with what a forward or commit wrote into `inner` (pools, snapshots, rings)."""
    split = len(cache.k) - len(cache.ssm)
    ssm_snap, conv_snap = cache.k[split:], cache.v[split:]
    if inner.snapshots is not None:
        ssm_snap, conv_snap = inner.snapshots.ssm, inner.snapshots.conv
    k = tuple(layer.pages for layer in inner.k) + tuple(ssm_snap)
    v = tuple(layer.pages for layer in inner.v) + tuple(conv_snap)
    return dataclasses.replace(cache, k=k, v=v, ssm=inner.ssm, conv=inner.conv)


def forward(inner_target, params, tokens, cache, one: HybridCache, *, positions, window_mask,
            write_cache, taps, count=None):
    """The hybrid target's forward over the paged cache -> (TargetOutput of the inner forward,
    the paged cache after it). A cache without rings is a prompt piece from admission: its rows
    start from their snapshots and it keeps the states at the page ends it fills. count int32[B]:
    real tokens of a right-padded prompt piece (None: all)."""
    piece = not isinstance(cache, PagedHybridCache)
    if piece:
        cache = start_rings(cache, one)
    if positions is None:
        positions = cache.positions(tokens.shape[1])
    inner = inner_cache(cache, positions, snapshots=piece and write_cache)
    if count is not None:
        out = inner_target.forward_prompt(params, tokens, inner, count, taps=taps)
    else:
        out = inner_target.forward(params, tokens, inner, positions=positions,
                                   window_mask=window_mask, write_cache=write_cache, taps=taps)
    return out, (outer_cache(cache, out.cache) if write_cache else cache)


def commit_window(inner_target, cache: PagedHybridCache, window_kv, path, positions):
    """The accepted path's k/v through the table and its states into the rows' rings."""
    inner = inner_target.commit_window(inner_cache(cache), window_kv, path, positions)
    return outer_cache(cache, inner)


def check_chunk(chunk: int | None, page_size: int) -> None:
    """A hybrid target resumes a prompt only where a page ends (its state is kept there)."""
    if chunk is not None and chunk % page_size:
        raise JaxspecError(
            f"serving.prefill_chunk (or max_batched_tokens) = {chunk}: a hybrid "
            f"(linear-attention) target resumes a prompt only at a page end; use a multiple of "
            f"serving.page_size={page_size}")


def num_snapshot_bytes(cache: PagedHybridCache) -> int:
    """Device bytes of the per-page state snapshots (a part of `kv_cache_bytes`)."""
    split = len(cache.k) - len(cache.ssm)
    return sum(x.nbytes for x in (*cache.k[split:], *cache.v[split:]))
