"""Lossless speculative acceptance (Leviathan et al. 2023; Chen et al. 2023), one row, vmapped.

Draft x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), tested without a
division as u * q < p. At the first rejection the next token is drawn from
norm(max(0, p_n - q_n)); if every proposed draft is accepted it is drawn from p_n (the bonus).
The emitted tokens then have exactly the target law. q and p must both come from
`sampling.logits_to_probs` with the same params; a deterministic drafter (n-gram) passes one-hot q.

Greedy is the limit: with one-hot p and q a draft is accepted iff it equals the target argmax,
and the next token is the target argmax (tests/test_acceptance.py checks the rule reduces to that).
A greedy program walks that limit directly on the target's argmax tokens (`accept_tree_greedy`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decode.sampling import draw


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
    resid = jnp.maximum(p_n - q_n, 0.0)  # unnormalised: draw normalises
    resid = jnp.where(jnp.sum(resid) > 0.0, resid, p_n)
    return n, draw(u[g], resid)


accept = jax.vmap(accept_row)  # [B, G], [B, G, V], [B, G+1, V], [B], keys[B]


# ---- draft trees ---------------------------------------------------------------------------------
#
# Rule (one row). Walk from the root; at the current node c with target distribution p_c, keep a
# residual r (unnormalised, mass Z; r = p_c on arrival) and try c's children x_1, x_2, ... in index
# order, child i having been proposed from q_i:
#     accept x_i  with probability min(1, (r(x_i) / Z) / q_i(x_i))     (tested as u·q·Z < r)
#     reject:     r <- max(0, r - Z·q_i)                               (the residual, updated)
# On acceptance move to x_i (r = p_{x_i}) and repeat; when c's children are exhausted, draw the
# next token from r (the bonus when no child was rejected).
#
# Proof that the emitted token at c has law p_c. Let r_0 = p_c. One try is a standard speculative
# step of target r_{i-1}/Z against proposal q_i, with x_i ~ q_i independent of everything decided
# before (x_i is a function of the committed prefix and the drafter's own randomness only; a
# deterministic child -- top-k, a static tree, prompt lookup -- is the one-hot q_i = δ(x_i)):
#     P(accept, token = x) = q_i(x) min(1, r(x)/(Z q_i(x))) = min(q_i(x), r(x)/Z)
#     P(reject) = 1 - Σ_x min(q_i(x), r(x)/Z) = Σ_x max(0, r(x)/Z - q_i(x)) = Z'/Z
# and on rejection we continue with r' = max(0, r - Z q_i) ∝ max(0, r/Z - q_i), so by induction on
# the number of remaining children the continuation emits x with probability r'(x)/Z' (the base
# case -- no child left -- draws from r' directly). Total:
#     min(q_i(x), r(x)/Z) + (Z'/Z)·(max(0, r(x)/Z - q_i(x))·Z/Z') = r(x)/Z.
# So each depth emits p_c's law whatever the children were, and the next depth conditions on the
# token emitted: the sequence has the target's law (the chain rule above is the one-child case).
# Duplicated siblings are harmless: after x is rejected r(x) = 0, so a second x is rejected.
# i.i.d. sampled siblings (SpecInfer) are the case q_i = q for all i. Deterministic siblings must
# use the one-hot q_i: testing them against a shared q would bias the law (residual r - Z·q
# removes mass the one-hot proposal never put there).
#
# Greedy is the limit: one-hot p and q accept a child iff it is the target argmax; a rejected
# child's residual max(0, p - Z δ(x)) is p again, so the walk follows the deepest path matching
# the target's argmax and emits that argmax next -- plain greedy decoding, token for token.


def accept_tree_row(
    tokens: jax.Array,  # int32[N] node tokens
    parents: jax.Array,  # int32[N] parent node, -1 = root (parents[i] < i)
    q: jax.Array,  # f32[N, V] the distribution node i was proposed from (one-hot if deterministic)
    p: jax.Array,  # f32[1+N, V] target probs at window entries (0 = root, 1+i = node i)
    num_nodes: jax.Array,  # int32[]: nodes >= this are padding
    key: jax.Array,
    path_len: int,  # static: the deepest path + 1 (the root)
    update_residual: bool = True,  # False: the broken variant the distribution test must catch
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (path int32[path_len]: window indices of the root and the accepted nodes, garbage
    past n; n int32[] accepted nodes; next_token int32[]). The row emits the path's tokens then
    next_token. Uses the same uniforms as `accept_row` (u[i] tests node i, u[N] draws), so a chain
    accepts exactly as `accept_row` does."""
    n_nodes, v = q.shape
    u = jax.random.uniform(key, (n_nodes + 1,))
    toks = jnp.clip(tokens, 0, v - 1)

    def body(i, carry):
        cur, r, z, n, path = carry  # cur: window index of the current node; z = mass of r
        x = toks[i]
        is_child = (parents[i] + 1 == cur) & (i < num_nodes)
        ok = is_child & (u[i] * q[i, x] * z < r[x])
        rejected = is_child & ~ok
        resid = jnp.maximum(r - z * q[i], 0.0) if update_residual else r
        r = jnp.where(ok, p[i + 1], jnp.where(rejected, resid, r))
        z = jnp.where(ok, 1.0, jnp.where(rejected, jnp.sum(resid), z))  # p rows sum to 1
        path = jnp.where(ok, path.at[jnp.minimum(n + 1, path_len - 1)].set(i + 1), path)
        return jnp.where(ok, i + 1, cur), r, z, n + ok.astype(jnp.int32), path

    carry = (jnp.int32(0), p[0], jnp.float32(1.0), jnp.int32(0), jnp.zeros((path_len,), jnp.int32))
    cur, r, _, n, path = jax.lax.fori_loop(0, n_nodes, body, carry) if n_nodes else carry
    r = jnp.where(jnp.sum(r) > 0.0, r, p[cur])  # an all-zero residual has probability 0
    return path, n, draw(u[n_nodes], r)


def accept_tree(tokens, parents, q, p, num_nodes, keys, path_len: int, update_residual=True):
    """[B, N], [B, N], [B, N, V], [B, 1+N, V], [B], keys[B] -> path [B, P], n [B], next [B]."""
    row = lambda *a: accept_tree_row(*a, path_len, update_residual)  # noqa: E731
    return jax.vmap(row)(tokens, parents, q, p, num_nodes, keys)


def accept_tree_greedy_row(
    tokens: jax.Array,  # int32[N] node tokens
    parents: jax.Array,  # int32[N] parent node, -1 = root
    target: jax.Array,  # int32[1+N] the target's argmax at window entries (sampling.greedy_tokens)
    num_nodes: jax.Array,  # int32[]
    path_len: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`accept_tree_row` for one-hot p (a greedy program), from the target's argmax tokens alone:
    a child is accepted iff it is its parent entry's argmax, and the next token is the argmax at
    the last accepted entry -- the greedy limit of the rule (module docstring), with no
    vocabulary-sized residual or draw. Same outputs as `accept_tree_row` on the one-hot p."""
    n_nodes = tokens.shape[0]

    def body(i, carry):
        cur, n, path = carry
        is_child = (parents[i] + 1 == cur) & (i < num_nodes)
        ok = is_child & (tokens[i] == target[cur]) & (target[cur] >= 0)  # -1: a NaN row
        path = jnp.where(ok, path.at[jnp.minimum(n + 1, path_len - 1)].set(i + 1), path)
        return jnp.where(ok, i + 1, cur), n + ok.astype(jnp.int32), path

    carry = (jnp.int32(0), jnp.int32(0), jnp.zeros((path_len,), jnp.int32))
    cur, n, path = jax.lax.fori_loop(0, n_nodes, body, carry) if n_nodes else carry
    return path, n, target[cur]


def accept_tree_greedy(tokens, parents, target, num_nodes, path_len: int):
    """[B, N], [B, N], int32[B, 1+N] argmax tokens, [B] -> path [B, P], n [B], next [B]."""
    row = lambda *a: accept_tree_greedy_row(*a, path_len)  # noqa: E731
    return jax.vmap(row)(tokens, parents, target, num_nodes)


def root_token(p_root: jax.Array, keys: jax.Array, num_nodes: int) -> jax.Array:
    """p_root f32[B, V], keys[B] -> int32[B]: the token `accept_tree` emits for a window of
    `num_nodes` (static) node slots none of which is real -- drawn from p_root with the same
    uniform (u[N]). Adaptive speculation's plain steps skip the window but keep the draw."""

    def row(p, key):
        return draw(jax.random.uniform(key, (num_nodes + 1,))[num_nodes], p)

    return jax.vmap(row)(p_root, keys)
