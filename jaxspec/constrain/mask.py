"""Pure functions over `Tables`: which tokens a state allows, where a token leads, and the states
along a drafted chain or tree, so the target's p and the drafter's q at every window position are
masked with the state reached along that position's own path (lossless under the constraint).

A state of -1 is an unconstrained row (all tokens allowed, stays -1), so one program serves
constrained and free rows of a batch alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.constrain.tables import Tables


def allowed(tables: Tables, state: jax.Array) -> jax.Array:
    """state int32[...] -> bool[..., V]."""
    row = tables.next[jnp.maximum(state, 0)]  # [..., V]
    return jnp.where(state[..., None] < 0, True, row >= 0)


def advance(tables: Tables, state: jax.Array, token: jax.Array) -> jax.Array:
    """state int32[...], token int32[...] -> int32[...]; a disallowed token gives -2 (dead)."""
    nxt = tables.next[jnp.maximum(state, 0), token]
    nxt = jnp.where(nxt < 0, -2, nxt)
    return jnp.where(state == -1, -1, jnp.where(state == -2, -2, nxt))


def mask_probs(probs: jax.Array, ok: jax.Array) -> jax.Array:
    """probs f32[..., V], ok bool[..., V] -> probs restricted to ok and renormalised.

    A position with no allowed mass left (a dead state, or the sampler cut every allowed token)
    falls back to uniform over the allowed tokens, so the draw still respects the constraint."""
    masked = jnp.where(ok, probs, 0.0)
    total = masked.sum(-1, keepdims=True)
    uniform = ok / jnp.maximum(ok.sum(-1, keepdims=True), 1)
    return jnp.where(total > 0, masked / jnp.where(total > 0, total, 1.0), uniform)


def chain_states(tables: Tables, state: jax.Array, tokens: jax.Array) -> jax.Array:
    """state int32[], tokens int32[G] -> int32[G+1]: the state before each window position
    (position 0: before x1, position i: after x1..xi)."""

    def step(s, t):
        s2 = advance(tables, s, t)
        return s2, s2

    _, after = jax.lax.scan(step, state, tokens)
    return jnp.concatenate([state[None], after])


def tree_states(tables: Tables, state: jax.Array, tokens: jax.Array, parents: jax.Array) -> jax.Array:
    """state int32[], tokens int32[N], parents int32[N] (-1 = root, parent index < node index)
    -> int32[1+N]: window position 0 is the root (state), position 1+i is after node i, each
    node's state advanced from its parent's."""
    out = jnp.concatenate([state[None], jnp.zeros(tokens.shape, jnp.int32)])

    def body(i, out):
        parent_state = out[parents[i] + 1]
        return out.at[i + 1].set(advance(tables, parent_state, tokens[i]))

    return jax.lax.fori_loop(0, tokens.shape[0], body, out)


def valid_prefix(tables: Tables, state: jax.Array, tokens: jax.Array, num_proposed: jax.Array) -> jax.Array:
    """state int32[], tokens int32[G], num_proposed int32[] -> int32[]: how many leading drafts
    the constraint allows. A deterministic drafter (n-gram, suffix: one-hot q) is cut here
    instead of masked, which keeps its q exact: the cut depends only on the context, never on
    the acceptance draw. A cut draft counts as "removed by the mask" in the metrics."""
    ok = chain_states(tables, state, tokens)[1:] != -2  # [G]
    first_bad = jnp.argmin(jnp.concatenate([ok, jnp.array([False])]))
    return jnp.minimum(first_bad, num_proposed).astype(jnp.int32)
