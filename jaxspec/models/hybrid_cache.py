"""The cache of a hybrid model (full-attention layers and linear-attention layers): a KV cache for
the attention layers and, for every linear layer, a ring of its recurrent and convolution states
indexed by length -- so that "rollback is masking" holds for recurrent state too.

Slot r of a linear layer's ring holds the state after the first l tokens for the newest l
written with l = r (mod R). A forward reads the state at `lengths` (slot lengths mod R); a verify
commit writes the accepted path's states at lengths + 1 .. lengths + P, every path entry, kept
or not, exactly as its k/v are written; advancing `lengths` by the accepted count then selects
the accepted state, and a rejected draft's state sits at a length past the row's, never read
and overwritten later. Rolling back up to R - 1 tokens below the newest write is exact (a draft
model's catch-up rewrites its two newest slots), so R must exceed the longest window.

Leaves per attention layer k, v [B, K, S, H]; per linear layer ssm [B, R, Hv, Dk, Dv] (float32)
and conv [B, R, Kc-1, C]; lengths int32[B]. Slot 0 starts as the zero state (length 0).

`snapshots` (None but in a paged serving prompt forward, `serving/paged_hybrid.py`): state
pools shared by the rows, where a forward that writes the cache also keeps chosen entries'
states (the state at each page's end, so a prompt sharing those pages starts from it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.cache import CACHE_AXES

SSM_AXES = ("batch", None, "linear_heads", None, None)  # value heads, as the layer's weights
CONV_AXES = ("batch", None, None, "linear_channels")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateSnapshots:
    """Entry (b, t)'s states after it kept at slot index[b, t] of every linear layer's pools
    (index >= NS: not kept). Slots written by one forward are distinct."""

    ssm: tuple[jax.Array, ...]  # per linear layer [NS, Hv, Dk, Dv] f32
    conv: tuple[jax.Array, ...]  # per linear layer [NS, Kc-1, C]
    index: jax.Array  # int32[B, T]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    k: tuple[jax.Array, ...]  # per attention layer [B, K, S, H]
    v: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]  # per linear layer [B, R, Hv, Dk, Dv] f32
    conv: tuple[jax.Array, ...]  # per linear layer [B, R, Kc-1, C]
    lengths: jax.Array  # int32[B] committed tokens per row
    snapshots: StateSnapshots | None = None  # pools a prompt forward keeps states in

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def ring(self) -> int:
        return self.ssm[0].shape[1]

    def positions(self, num_queries: int) -> jax.Array:  # int32[B, T]
        return self.lengths[:, None] + jnp.arange(num_queries, dtype=jnp.int32)

    def commit(self, num_new: jax.Array) -> HybridCache:
        return dataclasses.replace(self, lengths=self.lengths + num_new.astype(jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> HybridCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def read_state(ring: jax.Array, lengths: jax.Array) -> jax.Array:
    """The state at each row's length: ring [B, R, ...] -> [B, ...]."""
    return ring[jnp.arange(ring.shape[0]), lengths % ring.shape[1]]


def write_states(ring: jax.Array, states: jax.Array, lengths_after: jax.Array) -> jax.Array:
    """ring [B, R, ...] <- states [B, P, ...] at lengths_after int32[B, P] (P < R: distinct
    slots)."""
    rows = jnp.arange(ring.shape[0])[:, None]
    return ring.at[rows, lengths_after % ring.shape[1]].set(states.astype(ring.dtype))


def init_cache(*, batch: int, capacity: int, num_attention: int, num_kv_heads: int,
               head_dim: int, num_linear: int, ring: int, ssm_shape: tuple[int, int, int],
               conv_shape: tuple[int, int], dtype) -> HybridCache:
    kv = (batch, num_kv_heads, capacity, head_dim)
    return HybridCache(
        k=tuple(jnp.zeros(kv, dtype) for _ in range(num_attention)),
        v=tuple(jnp.zeros(kv, dtype) for _ in range(num_attention)),
        ssm=tuple(jnp.zeros((batch, ring, *ssm_shape), jnp.float32) for _ in range(num_linear)),
        conv=tuple(jnp.zeros((batch, ring, *conv_shape), dtype) for _ in range(num_linear)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def cache_axes(num_attention: int, num_linear: int) -> HybridCache:
    """Logical axis names of every leaf (same structure as a HybridCache)."""
    kv = tuple(CACHE_AXES[1:] for _ in range(num_attention))
    return HybridCache(k=kv, v=kv, ssm=tuple(SSM_AXES for _ in range(num_linear)),
                       conv=tuple(CONV_AXES for _ in range(num_linear)), lengths=("batch",))
