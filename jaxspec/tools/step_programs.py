"""The target forwards a decode step runs, from abstract shapes (no weights): params and cache as
ShapeDtypeStructs, the jitted step (forward + logits, cache donated), and the minimum bytes a step
must move. Shared by the CPU roofline (jaxspec.tools.roofline) and the accelerator one
(jaxspec.tools.accel_roofline)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models import base


def abstract_params(target: base.Target, layout: str):
    """The target's params as ShapeDtypeStructs (its `init_params` trait, never run)."""
    init = base.require(target, "init_params", "the roofline")
    return jax.eval_shape(lambda: init(jax.random.key(0), layout))


def abstract_cache(target: base.Target, params, batch, capacity):
    """The cache the target allocates for these (abstract) params, as ShapeDtypeStructs."""
    return jax.eval_shape(lambda: target.init_cache(params, batch, capacity))


def _cache_block(cache) -> tuple[int, ...]:
    """One layer's cache buffer shape (the size hlo.cache_traffic looks for): [B, K, S, H]."""
    return max((x.shape[-4:] for x in jax.tree.leaves(cache) if x.ndim >= 4), key=len)


def _step(target: base.Target, last_only):
    def step(params, tokens, cache):  # one target forward + logits; the cache is donated
        out = target.forward(params, tokens, cache)
        hidden = out.hidden[:, -1:] if last_only else out.hidden
        return target.logits(params, hidden), out.cache

    return jax.jit(step, donate_argnums=2)


def min_bytes(target: base.Target, params, cache, batch, window, valid, logits_rows) -> float:
    """Weights once + valid KV read + new KV written + f32 logits out. The embedding table
    (`embedding_table`) counts whole only where it is the LM head (`head_table`), else its
    gathered rows; a cache slot costs the cache's bytes over its B x S slots."""
    item = jnp.dtype(target.dtype).itemsize
    nbytes = lambda x: x.size * jnp.dtype(x.dtype).itemsize  # noqa: E731
    weights = sum(nbytes(x) for x in jax.tree.leaves(params))
    t = base.target_traits(target)
    table = t.embedding_table(params) if t.embedding_table is not None else None
    if table is not None and not (t.head_table is not None and t.head_table(params) is table):
        weights += batch * window * target.hidden_size * item - nbytes(table)  # rows only
    capacity = _cache_block(cache)[2]
    per_slot = sum(nbytes(x) for x in jax.tree.leaves(cache) if x.ndim >= 4) / (batch * capacity)
    kv = batch * (valid + window) * per_slot
    return float(weights + kv + batch * logits_rows * target.vocab_size * 4)
