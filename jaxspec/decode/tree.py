"""Draft trees as data: the verify window a proposal becomes, and static tree shapes.

A proposal is N nodes per row (see `decode.drafter.Proposal`): `tokens[B, N]`, `parents[B, N]`
(index of the parent node, -1 = the root = the last committed token), `num_proposed[B]` (nodes
at index >= it are padding). Parents come before their children (parents[i] < i), and siblings
are tried by the acceptance rule in index order. A chain is `parents = i - 1`; plain decoding is
N = 0.

The window the target verifies in one forward (T = 1 + N; window index 0 is the root, 1 + i is
node i):

    tokens     int32[B, T]    [last committed token, node tokens...]
    positions  int32[B, T]    cache.lengths + depth (the root at depth 0 sits at L - 1)
    mask       bool[B, T, T]  mask[b, t, j]: window entry j is an ancestor of t, or t itself

so each node attends the committed prefix (cache slots < cache.lengths) and its own path, in
depth order: exactly what plain decoding attends once that path is committed.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError, short


class Window(NamedTuple):
    tokens: jax.Array  # int32[B, T]
    positions: jax.Array  # int32[B, T]
    mask: jax.Array  # bool[B, T, T] ancestors-and-self
    depth: jax.Array  # int32[B, T] 0 for the root


def chain_parents(batch: int, num_nodes: int) -> jax.Array:  # int32[B, N]: node i's parent is i-1
    return jnp.broadcast_to(jnp.arange(num_nodes, dtype=jnp.int32) - 1, (batch, num_nodes))


def ancestors(parents: jax.Array, num_nodes: jax.Array) -> jax.Array:
    """parents int32[B, N], num_nodes int32[B] -> bool[B, 1+N, 1+N] ancestor-or-self over the window.

    Padding nodes (index >= num_nodes) and malformed parents (not in -1..i-1) hang off the root:
    no real node ever attends them. Reachability by repeated squaring of the parent relation
    (ceil(log2(T)) boolean matmuls of [T, T])."""
    b, n = parents.shape
    t = n + 1
    idx = jnp.arange(n, dtype=jnp.int32)
    ok = (parents >= -1) & (parents < idx[None]) & (idx[None] < num_nodes[:, None])
    par = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.where(ok, parents + 1, 0)], axis=1)
    reach = jnp.eye(t, dtype=jnp.int32)[None] | jax.nn.one_hot(par, t, dtype=jnp.int32)  # [B, T, T]
    for _ in range(max(1, math.ceil(math.log2(t)))):
        reach = (jnp.einsum("bij,bjk->bik", reach, reach) > 0).astype(jnp.int32)
    return reach > 0


def build_window(last: jax.Array, cache_lengths: jax.Array, tokens, parents, num_nodes) -> Window:
    """last int32[B] (last committed token), cache_lengths int32[B] (= committed - 1), a
    proposal's tokens/parents [B, N] and num_nodes [B] -> the verify Window (T = 1 + N)."""
    mask = ancestors(parents, num_nodes)
    depth = jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1  # [B, T]
    win_tokens = jnp.concatenate([last[:, None], tokens], axis=1).astype(jnp.int32)
    return Window(win_tokens, cache_lengths[:, None] + depth, mask, depth)


def gather_path(x: jax.Array, path: jax.Array, axis: int) -> jax.Array:
    """Pick window entries along `axis` of x ([..., B, T, ...] with B just before `axis`) by
    path int32[B, P] -> the same array with P entries there."""
    axis = axis % x.ndim
    idx = path.reshape((1,) * (axis - 1) + path.shape + (1,) * (x.ndim - axis - 1))
    return jnp.take_along_axis(x, idx, axis=axis)


# ---- static trees (Medusa-style choices) -----------------------------------------------------


def check_choices(choices) -> tuple[tuple[int, ...], ...]:
    """A static tree as a list of paths of ranks, e.g. [[0], [1], [0, 0], [0, 1], [1, 0]]: node
    [0, 1] is the 2nd-ranked candidate at depth 2 under the 1st-ranked one at depth 1. Returns
    the paths sorted by (depth, path) -- parents before children, siblings by rank -- or raises
    a one-line JaxspecError naming the fix."""
    def rank(r):  # an integer (numpy ints too), never a bool or a string
        if isinstance(r, (bool, str, bytes)):
            raise TypeError(r)
        return operator.index(r)

    try:
        paths = [tuple(rank(r) for r in c) for c in choices]
    except (TypeError, ValueError):
        raise JaxspecError(
            f"tree choices {short(choices)} are invalid: give a list of paths of integer ranks, "
            "e.g. [[0], [1], [0, 0]]"
        ) from None
    if not paths:
        raise JaxspecError("tree choices are empty: give at least one path, e.g. [[0]]")
    seen = set(paths)
    if len(seen) != len(paths):
        raise JaxspecError(f"tree choices {short(choices)} repeat a path: list each node once")
    for p in paths:
        if not p or min(p) < 0:
            raise JaxspecError(f"tree choice {list(p)} is invalid: ranks are integers >= 0")
        if len(p) > 1 and p[:-1] not in seen:
            raise JaxspecError(
                f"tree choice {list(p)} has no parent {list(p[:-1])} in the choices: add it"
            )
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def static_layout(choices: tuple[tuple[int, ...], ...]):
    """Sorted choices -> (parents int32[N], depth int32[N] (1-based), rank int32[N]) as Python
    tuples (static: part of the drafter's hash)."""
    index = {p: i for i, p in enumerate(choices)}
    parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in choices)
    return parents, tuple(len(p) for p in choices), tuple(p[-1] for p in choices)


def chain_choices(depth: int, width: int = 1) -> tuple[tuple[int, ...], ...]:
    """`width` top candidates at depth 1, each followed by a top-1 chain down to `depth`."""
    return check_choices([(w,) + (0,) * d for w in range(width) for d in range(depth)])


# ---- dynamic trees (EAGLE-2) -------------------------------------------------------------------
#
# Shared by the drafters that grow a tree from their own distributions (eagle, draft_model).
# Candidates are made level by level: depth 1 holds top_k children of the root; at each further
# level the top_k candidates of the newest level by score are expanded, each into top_k children;
# finally the best `budget` candidates by score form the tree, in creation order (topological,
# siblings by rank). A candidate's score is its parent's plus the parent distribution's rank-j
# log-probability (j = its sibling index): for top_k children exactly the path log-probability.
#
# Children forms (`children`), tried by `acceptance.accept_tree` in sibling order:
#   top_k                the top_k tokens, each a deterministic proposal (one-hot q)
#   sampled              top_k i.i.d. draws from the sampling distribution q (SpecInfer): q_j = q
#   without_replacement  Gumbel-top-k: draws from q without replacement; sibling j reports
#                        q_j = q with siblings 0..j-1 removed, renormalised (recursive rejection
#                        sampling). Past q's support the siblings are the likeliest remaining
#                        tokens by log-probability, deterministic given the earlier ones (q_j =
#                        their one-hot).
#
# Why sampled children stay lossless here (the acceptance proof in acceptance.py needs, at every
# node c the walk reaches, that sibling j's token is distributed as its reported q_j given all the
# walk has seen: the path, the earlier siblings, which nodes exist):
#   1. Scores never read a candidate's own token: a candidate's score is a function of its
#      ancestors' distributions and of its sibling index only (rank-j values of the parent's
#      sorted log-probabilities). Which candidates are expanded and which are kept is a function
#      of the scores, i.e. never of the token whose existence it decides.
#   2. Ties go to the earlier-made candidate (lax.top_k keeps the lower index), and a score only
#      falls along a path and along a sibling list, so the kept set is ancestor-closed and keeps
#      a prefix of every sibling list: the walk never meets sibling j without siblings < j (a
#      dropped earlier sibling would leave q_j conditioned on a token the walk never saw).
#   3. Any candidate whose token depends on node x (x's descendants, its later siblings under
#      without-replacement draws and their descendants) scores <= x and is made after x, so it
#      never outranks x or any node the walk met before x: x's existence and everything the walk
#      knows when it tries x are independent of x's token given the earlier-made candidates, and
#      x's token is a fresh draw from q_x (its own key). Hence P(x = t | walk so far) = q_x(t).
# Greedy sampling makes q one-hot: `sampled` then proposes top_k copies of the argmax, and
# `without_replacement` the argmax followed by the next tokens by log-probability (= top_k).

CHILDREN = ("top_k", "sampled", "without_replacement")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicTreeDrafter:
    """Fields of a drafter that grows EAGLE-2 dynamic trees (eagle, draft_model): expand the
    tree_top_k best nodes per level into tree_top_k children, tree_levels levels, keep the best
    tree_budget nodes; tree_top_k = 0: a chain. Keyword-only, so subclasses keep their own
    positional fields."""

    tree_top_k: int = 0
    tree_levels: int = 0
    tree_budget: int = 0
    tree_children: str = "top_k"  # top_k | sampled | without_replacement (CHILDREN)

    @property
    def tree_nodes(self) -> int | None:
        return self.tree_budget if self.tree_top_k else None

    @property
    def tree_depth(self) -> int | None:
        return self.tree_levels if self.tree_top_k else None


def dynamic_fields(tree_config) -> dict:
    """The `speculative.tree` section (kind dynamic) as the fields a dynamic-tree drafter takes
    (eagle, draft_model): `dataclasses.replace(drafter, **dynamic_fields(spec.tree))`."""
    return {
        "tree_top_k": tree_config.top_k,
        "tree_levels": tree_config.depth,
        "tree_budget": tree_config.budget,
        "tree_children": tree_config.children,
    }


class Frontier(NamedTuple):
    """The candidates a level expands, K = top_k of them."""

    ids: jax.Array  # int32[B, K] draft-vocabulary ids
    parent: jax.Array  # int32[B, K] index of each one's parent in the previous frontier (-1: root)


class DynamicTree(NamedTuple):
    ids: jax.Array  # int32[B, N] draft-vocabulary ids of the kept nodes (topological order)
    parents: jax.Array  # int32[B, N] parent node, -1 = root
    q: jax.Array  # f32[B, N, Nd] the distribution each node was proposed from (draft vocabulary)


def draw_children(logp, q, k: int, children: str, keys):
    """logp f32[B, F, Nd] (scores), q f32[B, F, Nd] (sampling distribution; None for top_k),
    keys [B] -> (score increments f32[B, F, K], child ids int32[B, F, K]). The increments are
    the sorted top-k log-probabilities whatever the form (see rule 1 above)."""
    inc, top = jax.lax.top_k(logp, k)
    if children == "top_k":
        return inc, top.astype(jnp.int32)
    f = logp.shape[1]
    logq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)
    if children == "sampled":
        draw = lambda key, lq: jax.random.categorical(key, lq, axis=-1, shape=(k, f))
        return inc, jnp.moveaxis(jax.vmap(draw)(keys, logq), 1, 2).astype(jnp.int32)
    if children != "without_replacement":
        raise ValueError(f"children={children!r}: use one of {', '.join(CHILDREN)}")
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logq.shape[1:]))(keys)
    drawn = jax.lax.top_k(logq + gumbel, k)[1]  # Gumbel-top-k: ordered draws without replacement
    rest = jax.lax.top_k(jnp.where(q > 0, -jnp.inf, logp), k)[1]  # past the support
    support = jnp.sum(q > 0, axis=-1, keepdims=True)  # [B, F, 1]
    j = jnp.arange(k)
    past = jnp.take_along_axis(rest, jnp.clip(j - support, 0, k - 1), axis=-1)
    return inc, jnp.where(j < support, drawn, past).astype(jnp.int32)


def without_earlier(q, ids, earlier):
    """q f32[B, N, Nd], ids int32[B, N], earlier int32[B, N, K] (ids of the earlier siblings,
    Nd where absent) -> q with the earlier siblings removed, renormalised; one-hot of ids where
    nothing is left (a deterministic sibling past q's support)."""
    b, n, nd = q.shape
    rows = jnp.arange(b)[:, None, None]
    cols = jnp.arange(n)[None, :, None]
    rest = q.at[rows, cols, earlier].set(0.0, mode="drop")
    mass = jnp.sum(rest, axis=-1, keepdims=True)
    return jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), jax.nn.one_hot(ids, nd))


def grow(expand, carry, root_logits, sp, keys, *, top_k: int, levels: int, budget: int,
         children: str = "top_k", reported_q: str = "exact"):
    """The dynamic tree (see above). root_logits f32[B, Nd]: the drafter's logits for depth 1;
    expand(carry, level, Frontier) -> (carry, logits f32[B, K, Nd]) runs the drafter on the
    frontier (level 0 = depth-1 nodes) and returns its logits for their children; keys [B].
    reported_q="shared" reports q un-renormalised for later without-replacement siblings (the
    broken variant the distribution test must catch). Returns (DynamicTree, carry)."""
    from jaxspec.decode.sampling import logits_to_probs  # keeps this module's imports to jax

    k = top_k
    b, nd = root_logits.shape
    level_keys = jax.vmap(lambda key: jax.random.split(key, levels))(keys)  # [B, levels]

    def dists(logits):  # [B, F, Nd] -> (log-probs, sampling distribution or None)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        if children == "top_k":
            return logp, None
        return logp, logits_to_probs(logits.reshape(-1, nd), sp).reshape(logits.shape)

    logp, q = dists(root_logits[:, None])
    inc, ids = draw_children(logp, q, k, children, level_keys[:, 0])  # [B, 1, K]
    cand_ids, scores = [ids.reshape(b, k)], [inc.reshape(b, k)]
    parents = [jnp.full((b, k), -1, jnp.int32)]  # candidate index of the parent
    qs, dist_of, sibling = [q], [np.zeros(k, np.int32)], [np.arange(k, dtype=np.int32)]
    front = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate ids
    front_parent = jnp.full((b, k), -1, jnp.int32)
    n_cand = k
    for level in range(levels - 1):
        all_ids = jnp.concatenate(cand_ids, axis=1)
        all_scores = jnp.concatenate(scores, axis=1)
        f_ids = jnp.take_along_axis(all_ids, front, axis=1)
        carry, logits = expand(carry, level, Frontier(f_ids, front_parent))
        logp, q = dists(logits)
        inc, ids = draw_children(logp, q, k, children, level_keys[:, level + 1])  # [B, K, K]
        child_score = (jnp.take_along_axis(all_scores, front, axis=1)[..., None] + inc).reshape(b, k * k)
        cand_ids.append(ids.reshape(b, k * k))
        scores.append(child_score)
        parents.append(jnp.repeat(front, k, axis=1))
        qs.append(q)
        dist_of.append(np.repeat(1 + level * k + np.arange(k, dtype=np.int32), k))
        sibling.append(np.tile(np.arange(k, dtype=np.int32), k))
        best = jax.lax.top_k(child_score, k)[1]  # [B, K] next frontier (within this level)
        front_parent = (best // k).astype(jnp.int32)
        front = (n_cand + best).astype(jnp.int32)
        n_cand += k * k
    all_ids = jnp.concatenate(cand_ids, axis=1)  # [B, M]
    score = jnp.concatenate(scores, axis=1)
    parent = jnp.concatenate(parents, axis=1)
    sel = jnp.sort(jax.lax.top_k(score, budget)[1], axis=1).astype(jnp.int32)  # [B, budget]
    node_of = jnp.full((b, n_cand), -2, jnp.int32)
    node_of = node_of.at[jnp.arange(b)[:, None], sel].set(jnp.arange(budget, dtype=jnp.int32))
    sel_parent = jnp.take_along_axis(parent, sel, axis=1)
    par = jnp.where(sel_parent < 0, -1, jnp.take_along_axis(node_of, jnp.maximum(sel_parent, 0), axis=1))
    out_ids = jnp.take_along_axis(all_ids, sel, axis=1)
    if children == "top_k":
        return DynamicTree(out_ids, par, jax.nn.one_hot(out_ids, nd, dtype=jnp.float32)), carry
    q_all = jnp.concatenate(qs, axis=1)  # [B, 1 + (levels-1) K, Nd]
    node_dist = jnp.asarray(np.concatenate(dist_of))[sel]  # [B, budget]
    q_nodes = jnp.take_along_axis(q_all, node_dist[..., None], axis=1)  # [B, budget, Nd]
    if children == "without_replacement" and reported_q == "exact":
        sib = jnp.asarray(np.concatenate(sibling))[sel]  # [B, budget]
        j = jnp.arange(k)
        earlier_cand = jnp.clip(sel[..., None] - sib[..., None] + j, 0, n_cand - 1)  # [B, N, K]
        earlier = jnp.take_along_axis(all_ids, earlier_cand.reshape(b, -1), axis=1).reshape(earlier_cand.shape)
        earlier = jnp.where(j < sib[..., None], earlier, nd)
        q_nodes = without_earlier(q_nodes, out_ids, earlier)
    return DynamicTree(out_ids, par, q_nodes), carry

