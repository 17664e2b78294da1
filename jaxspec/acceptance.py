"""Lossless speculative acceptance (Leviathan et al. 2023; Chen et al. 2023), one row, vmapped.

Draft x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), tested without a
division as u * q < p. At the first rejection the next token is drawn from
norm(max(0, p_n - q_n)); if every proposed draft is accepted it is drawn from p_n (the bonus).
The emitted tokens then have exactly the target law. q and p must both come from
`sampling.logits_to_probs` with the same params; a deterministic drafter (n-gram) passes one-hot q.

Greedy is the limit: with one-hot p and q a draft is accepted iff it equals the target argmax,
and the next token is the target argmax. `greedy_accept_row` is that special case on argmax ids,
which spares the verifier building [G+1, V] one-hots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.sampling import _draw


def accept_row(
    draft_tokens: jax.Array,  # int32[G]
    q: jax.Array,  # f32[G, V] draft probs
    p: jax.Array,  # f32[G+1, V] target probs
    num_proposed: jax.Array,  # int32[], 0..G: drafts at positions >= this are padding
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Returns (n: int32[] accepted prefix in 0..num_proposed, next_token: int32[]).

    The row emits draft_tokens[:n] followed by next_token. At the stopping position
    n == num_proposed the token is drawn from p[n] directly (bonus; also when num_proposed < G).
    """
    g, v = q.shape
    u = jax.random.uniform(key, (g + 1,))  # [G] acceptance tests, [1] the final draw
    tokens = jnp.clip(draft_tokens, 0, v - 1)[:, None]  # padding ids may be out of range
    q_t = jnp.take_along_axis(q, tokens, axis=-1)[:, 0]  # [G]
    p_t = jnp.take_along_axis(p[:g], tokens, axis=-1)[:, 0]  # [G]
    ok = u[:g] * q_t < p_t  # u < p/q, i.e. prob min(1, p/q)
    ok &= jnp.arange(g) < num_proposed
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)), dtype=jnp.int32)  # accepted prefix
    rejected = n < num_proposed  # implies n < G
    q_n = jnp.where(rejected, q[jnp.minimum(n, g - 1)], 0.0)  # [V]
    p_n = p[n]  # [V]
    resid = jnp.maximum(p_n - q_n, 0.0)  # unnormalised: _draw normalises
    resid = jnp.where(jnp.sum(resid) > 0.0, resid, p_n)
    return n, _draw(u[g], resid)


def greedy_accept_row(
    draft_tokens: jax.Array,  # int32[G]
    target_argmax: jax.Array,  # int32[G+1]
    num_proposed: jax.Array,  # int32[], 0..G
) -> tuple[jax.Array, jax.Array]:
    """Greedy fast path: same (n, next_token) as `accept_row` on one-hot p and q, no key."""
    g = draft_tokens.shape[0]
    ok = (draft_tokens == target_argmax[:g]) & (jnp.arange(g) < num_proposed)
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)), dtype=jnp.int32)
    return n, target_argmax[n].astype(jnp.int32)


accept = jax.vmap(accept_row)  # [B, G], [B, G, V], [B, G+1, V], [B], keys[B]
greedy_accept = jax.vmap(greedy_accept_row)  # [B, G], [B, G+1], [B]
