"""Draft trees as data: the verify window a proposal becomes, and static tree shapes.

A proposal is N nodes per row (see `drafters.base.Proposal`): `tokens[B, N]`, `parents[B, N]`
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

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError


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
    try:
        paths = [tuple(int(r) for r in c) for c in choices]
    except (TypeError, ValueError):
        raise JaxspecError(
            f"tree choices {choices!r} are invalid: give a list of paths of ranks, "
            "e.g. [[0], [1], [0, 0]]"
        ) from None
    if not paths:
        raise JaxspecError("tree choices are empty: give at least one path, e.g. [[0]]")
    seen = set(paths)
    if len(seen) != len(paths):
        raise JaxspecError(f"tree choices {choices!r} repeat a path: list each node once")
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
