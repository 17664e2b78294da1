"""Drafts under the constraint: the one point where every drafter's proposal (tokens, q) is put
under the grammar before verify, whatever drafter made it (draft model, EAGLE, Medusa, MTP,
DFlash, layer skip, n-gram, suffix, prompt lookup; chains and trees alike).

Each node is judged in the state reached along its own path (its parent's state; the root's is
the row's). Its reported q becomes q restricted to the allowed tokens and renormalised, and its
token a draw from that masked q:
  - the drafted token is allowed: it is kept. Given that it is allowed, a draw from q is a draw
    from the masked q, so it is reported as drawn from the masked q, exactly.
  - it is not allowed and q has allowed mass: the token is redrawn from the masked q (a key of
    its own, independent of the acceptance draws), so the node's token again has the masked law.
    The nodes drafted below it were conditioned on the old token (an autoregressive drafter's
    later q), so they are dropped.
  - q has no allowed mass (a deterministic one-hot draft: n-gram, suffix, lookup, a greedy
    drafter's argmax): the node and its subtree are dropped. Nothing is lost in law: rejecting a
    disallowed one-hot draft would draw from max(0, p - q) = p, which the bonus draw does.
Every verified node then holds an allowed token with its masked q, so the acceptance rule (which
needs x ~ q, q any law fixed by the drafter's own randomness) emits exactly plain constrained
sampling's law. The redraw depends only on the node's q and its parent's state, so the states of
the kept nodes' parents are those along the drafted tokens (`loop.window_states`): one pass, no
per-node loop. Free rows (state -1) are left bit for bit as proposed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.constrain.loop import DEAD, Grammar, allowed_mask, window_states


class Drafts(NamedTuple):
    tokens: jax.Array  # int32[B, N]
    probs: jax.Array  # f32[B, N, V] the masked q each kept node's token has
    num_nodes: jax.Array  # int32[B] nodes kept (the rest are padding)
    parents: jax.Array | None  # int32[B, N] (None: a chain, as proposed)
    num_masked: jax.Array  # int32[B] drafted tokens the constraint disallowed (redrawn or dropped)
    num_proposed: jax.Array  # int32[B] nodes the drafter proposed


def mask_drafts(g: Grammar, tokens, q, parents, num_nodes, keys, report_masked: bool = True) -> Drafts:
    """tokens int32[B, N], q f32[B, N, V], parents int32[B, N] or None (a chain), num_nodes
    int32[B], keys [B] (the redraws') -> the proposal under the constraint (module docstring).
    report_masked=False reports the drafter's own q for the kept nodes: the broken variant the
    law test must catch."""
    b, n = tokens.shape
    chain = parents is None
    par = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n)) if chain else parents
    states = window_states(g, tokens, par)  # [B, 1+N] along the drafted tokens
    parent_state = jnp.take_along_axis(states, par + 1, axis=1)  # [B, N]
    ok = allowed_mask(g, parent_state)  # [B, N, V]
    masked_q = jnp.where(ok, q, 0.0)
    mass = jnp.sum(masked_q, axis=-1)  # [B, N]
    real = jnp.arange(n)[None] < num_nodes[:, None]
    alive = real & (parent_state != DEAD)  # no disallowed token above
    allowed_token = states[:, 1:] != DEAD
    redraw = alive & ~allowed_token & (mass > 0)
    keep = alive & (allowed_token | redraw)
    constrained = parent_state >= 0
    new_q = jnp.where(constrained[..., None], masked_q / jnp.where(mass > 0, mass, 1.0)[..., None], q)
    new_q = new_q if report_masked else q
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0x6D61736B), (n,)))(keys)
    drawn = jax.lax.cond(jnp.any(redraw), lambda: _draw(u, masked_q), lambda: tokens)
    new_tokens = jnp.where(redraw, drawn, tokens).astype(jnp.int32)
    masked = jnp.sum(alive & ~allowed_token, axis=1, dtype=jnp.int32)
    kept = jnp.sum(keep, axis=1, dtype=jnp.int32)
    if chain:  # a dropped node's descendants are every later node: `keep` is a prefix
        return Drafts(new_tokens, new_q, kept, None, masked, num_nodes)
    # a tree: the kept nodes moved to the front in order (parents renumbered), padding after
    order = jnp.argsort(~keep, axis=1, stable=True)  # [B, N]
    new_index = jnp.cumsum(keep, axis=1, dtype=jnp.int32) - 1
    moved_par = jnp.take_along_axis(par, order, axis=1)
    moved_par = jnp.where(moved_par < 0, -1, jnp.take_along_axis(new_index, jnp.maximum(moved_par, 0), axis=1))
    moved_par = jnp.where(jnp.arange(n)[None] < kept[:, None], moved_par, -1)
    return Drafts(jnp.take_along_axis(new_tokens, order, axis=1),
                  jnp.take_along_axis(new_q, order[..., None], axis=1), kept,
                  moved_par.astype(jnp.int32), masked, num_nodes)


def _draw(u, weights):
    """u f32[B, N] in [0, 1), weights f32[B, N, V] >= 0 -> int32[B, N]: inverse-CDF draws with
    P(i) = weights[i] / sum(weights); a zero-weight index (float rounding) steps to the heaviest."""
    c = jnp.cumsum(weights, axis=-1)
    total = c[..., -1:]
    t = jnp.minimum(u[..., None] * total, jnp.nextafter(total, jnp.float32(0)))
    i = jnp.minimum(jnp.sum(c <= t, axis=-1, dtype=jnp.int32), weights.shape[-1] - 1)
    hit = jnp.take_along_axis(weights, i[..., None], axis=-1)[..., 0] > 0
    return jnp.where(hit, i, jnp.argmax(weights, axis=-1)).astype(jnp.int32)


def mask_proposal(g: Grammar, proposal, keys, active):
    """A drafter's `Proposal` (decode/drafter.py) and the batch's Grammar -> (the proposal under
    the constraint, the Grammar with its counters advanced); `active` bool[B]: finished rows
    count nothing. keys [B]: the step's draft keys (the redraws fold in a constant of their own)."""
    num = jnp.where(active, proposal.num_proposed, 0)
    d = mask_drafts(g, proposal.tokens, proposal.probs, proposal.parents, num, keys)
    counted = g.state >= 0  # free rows report no constraint metrics
    g = g._replace(num_masked=g.num_masked + jnp.where(counted, d.num_masked, 0),
                   num_proposed=g.num_proposed + jnp.where(counted, d.num_proposed, 0))
    return proposal._replace(tokens=d.tokens, probs=d.probs, num_proposed=d.num_nodes,
                             parents=d.parents), g
