"""Preallocated KV cache with per-row lengths. Rollback is masking: never copy, never clear.

Invariant: row b's committed tokens occupy slots 0..lengths[b]-1. A forward over T tokens writes
slots lengths..lengths+T-1 and reads slots <= each query's position, so whatever sits past a
row's length (rejected drafts, padding, garbage) is never read and is overwritten later.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    # Per-layer tuple of [B, K, S, H] (unrolled layout; in-place writes on XLA:CPU), or one
    # [L, B, K, S, H] array (stacked layout, scanned with the stacked params). Heads before
    # slots: attention reads each head's [S, H] block in place (see models/attention.py).
    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    lengths: jax.Array  # int32[B], committed tokens per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if isinstance(self.k, tuple) else self.k.shape[3]

    def positions(self, num_queries: int) -> jax.Array:  # int32[B, T]
        return self.lengths[:, None] + jnp.arange(num_queries, dtype=jnp.int32)

    def mask(self, num_queries: int) -> jax.Array:  # bool[B, T, S]
        q_pos = self.positions(num_queries)
        return jnp.arange(self.capacity)[None, None, :] <= q_pos[..., None]

    def commit(self, num_new: jax.Array) -> KVCache:  # rejected entries stay, masked
        return dataclasses.replace(self, lengths=self.lengths + num_new.astype(jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def init_cache(
    num_layers: int,
    batch: int,
    capacity: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
    stacked: bool = False,
) -> KVCache:
    lengths = jnp.zeros((batch,), jnp.int32)
    if stacked:
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=lengths)
    shape = (batch, num_kv_heads, capacity, head_dim)
    k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return KVCache(k=k, v=v, lengths=lengths)


def cache_axes(num_layers: int, stacked: bool = False) -> KVCache:
    """Logical axis names of every cache leaf (same pytree structure as a KVCache)."""
    if stacked:
        return KVCache(k=CACHE_AXES, v=CACHE_AXES, lengths=("batch",))
    per_layer = tuple(CACHE_AXES[1:] for _ in range(num_layers))
    return KVCache(k=per_layer, v=per_layer, lengths=("batch",))
