"""A drafter's target features kept in pages, so a prefix hit serves drafters that read the
target's hidden states (EAGLE, EAGLE-3, DFlash, MTP, P-EAGLE, DSpark: `hidden_layers`).

Such a drafter's prefill reads the tapped hidden states of every prompt position. A prompt whose
first pages come from the prefix cache runs only its tail through the target, so the features of
the shared positions must come from where their k/v come from: a feature pool beside the KV
pages, one entry per cache slot,

    features [NP, P, nT, D]    the nT tapped hidden states of the token in each slot

written through the page table by every forward that writes the cache (prompts, chunks, plain
decode steps), named, shared and evicted with its page. A tail's prefill then reads the whole
prompt's features back through the table (the shared pages' and its own just written) and the
drafter sets itself up over the whole prompt as on a miss: the target computes the prefix once;
the drafter's own KV over it (one or two small layers) is recomputed from the cached features.

The pool travels as the last entry of the cache's `k` (its `v` entry a zero-size placeholder),
so the scheduler moves, donates and splices it with the KV pool.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models import paged_attention as pa


def init_pool(num_pages: int, page_size: int, taps: int, hidden: int, dtype) -> jax.Array:
    return jnp.zeros((num_pages, page_size, taps, hidden), dtype)


def attach(cache, pool: jax.Array):
    """`cache` with the feature pool appended to its shared pools."""
    return dataclasses.replace(cache, k=(*cache.k, pool),
                               v=(*cache.v, jnp.zeros((0,), pool.dtype)))


def detach(cache):
    """(cache without the feature pool, the pool)."""
    return dataclasses.replace(cache, k=cache.k[:-1], v=cache.v[:-1]), cache.k[-1]


def write(pool: jax.Array, taps: jax.Array, table: jax.Array, positions: jax.Array) -> jax.Array:
    """taps [nT, B, T, D] written at positions [B, T] through the table (no page: dropped)."""
    page, offset = pa.slot_pages(table, positions, pool.shape[0], pool.shape[1])
    return pool.at[page, offset].set(jnp.moveaxis(taps, 0, 2).astype(pool.dtype), mode="drop")


def read(pool: jax.Array, table: jax.Array, width: int) -> jax.Array:
    """The features of positions 0 .. width-1 of every row -> [nT, B, width, D] (slots without
    a page read page NP-1: past the row's prompt, never used)."""
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (table.shape[0], width))
    page, offset = pa.slot_pages(table, positions, pool.shape[0], pool.shape[1])
    return jnp.moveaxis(pool.at[page, offset].get(mode="clip"), 2, 0)
