"""The grammar inside the decode loop: a per-row automaton state carried in `DecodeState.grammar`,
the logit mask of every verify position, and the state after a step's accepted path.

One table serves a whole batch: each constraint's states are stacked (`batch_grammar` offsets
them), a row holds its own start state, and -1 is an unconstrained row (every token allowed, the
state stays -1), so constrained and free rows share one compiled program. The table is an
argument (a device array), never a constant: a new schema of the same padded size reuses the
program.

Lossless: the target's logits at window position j are masked with the state reached along j's
own path (`window_states`: the root's is the row's state, node i's is advanced from its parent's),
before `logits_to_probs`, so p is the constrained law (greedy: the constrained argmax). The
drafts reach verify already under the mask (constrain/draft.py: each node's q masked in its
parent's state, a disallowed token redrawn or dropped), counted in `num_masked`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


UNCONSTRAINED = -1  # a row's state: every token allowed
DEAD = -2  # after a disallowed token (only ever on a rejected draft node)


class Grammar(NamedTuple):
    """A batch's constraints. The table is stored by token class: tokens whose column of the
    dense next[S, V] table is identical share one (`class_of`), so next[s, t] ==
    next_by_class[s, class_of[t]]; a JSON automaton's ~49k tokens fall into a few hundred
    classes (docs/structured.md: the sizes)."""

    next_by_class: jax.Array  # int32[S, C] next state, -1 = not allowed (all constraints stacked)
    class_of: jax.Array  # int32[V] each token's class
    accepting: jax.Array  # bool[S]
    state: jax.Array  # int32[B] each row's state after its committed tokens (-1: free row)
    num_masked: jax.Array  # int32[B] drafted tokens the constraint disallowed (draft.py)
    num_proposed: jax.Array  # int32[B] draft nodes proposed in constrained steps (the fraction's base)


def allowed_mask(g: Grammar, states: jax.Array) -> jax.Array:
    """states int32[...] -> bool[..., V]; free (-1) and dead (-2) positions allow every token
    (a dead position follows a rejected node: its p is never used, and must stay finite)."""
    row = g.next_by_class[jnp.maximum(states, 0)][..., g.class_of]  # [..., V]
    return jnp.where(states[..., None] < 0, True, row >= 0)


def advance(g: Grammar, state: jax.Array, token: jax.Array) -> jax.Array:
    """state int32[...], token int32[...] -> int32[...]: -1 stays -1, a disallowed token -> -2."""
    nxt = g.next_by_class[jnp.maximum(state, 0), g.class_of[token]]
    nxt = jnp.where(nxt < 0, DEAD, nxt)
    return jnp.where(state < 0, state, nxt)


def mask_logits(logits: jax.Array, ok: jax.Array | None) -> jax.Array:
    """logits f32[..., V], ok bool[..., V] (None: no constraint) -> disallowed set to -inf."""
    if ok is None:
        return logits
    return jnp.where(ok, logits, -jnp.inf)


def window_states(g: Grammar, tokens: jax.Array, parents: jax.Array) -> jax.Array:
    """tokens int32[B, N], parents int32[B, N] (-1 = root, parent < node) -> int32[B, 1+N]:
    the state after window entry j (entry 0, the last committed token: the row's state; node i:
    advanced from its parent's). p at entry j is masked with states[:, j]."""
    b, n = tokens.shape
    if n == 0:  # plain decoding: the root alone
        return g.state[:, None]
    out = jnp.concatenate([g.state[:, None], jnp.zeros((b, n), jnp.int32)], axis=1)
    rows = jnp.arange(b)

    def body(i, out):
        parent_state = out[rows, parents[:, i] + 1]
        return out.at[:, i + 1].set(advance(g, parent_state, jnp.clip(tokens[:, i], 0)))

    return jax.lax.fori_loop(0, n, body, out)


def after_step(g: Grammar, states: jax.Array, path: jax.Array, num_accepted: jax.Array,
               next_token: jax.Array, count: jax.Array) -> Grammar:
    """The grammar after a step that emitted `count` tokens (int32[B], `_emit`'s): path entries
    1..count while count <= num_accepted, else the whole accepted path and `next_token`. A
    rejected node's state is simply not read: the state rolls back with the cache.
    states [B, 1+N] (window_states), path int32[B, D+1] window entries (path[:, 0] = root)."""
    path_states = jnp.take_along_axis(states, path, axis=1)  # [B, D+1] after path entry k
    last = jnp.take_along_axis(path_states, num_accepted[:, None], axis=1)[:, 0]
    after_next = advance(g, last, next_token)
    within = jnp.take_along_axis(path_states, jnp.minimum(count, path.shape[1] - 1)[:, None], axis=1)[:, 0]
    state = jnp.where(count > num_accepted, after_next, within)  # count 0 (done): path_states[0]
    return g._replace(state=state.astype(jnp.int32))


def first_token(g: Grammar, token: jax.Array) -> Grammar:
    """The grammar after prefill's sampled token (int32[B])."""
    return g._replace(state=advance(g, g.state, token))


# ---- host side: a batch's table -------------------------------------------------------------

def stack_blocks(blocks: list, eos_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Host tables (next int32[S_r, V], accepting bool[S_r], initial) stacked in this order ->
    (next int32[S, V], accepting bool[S], each block's offset). Every EOS id is allowed exactly
    in accepting states (a self-loop)."""
    dense, acc, offsets, total = [], [], [], 0
    for nxt, accepting, _ in blocks:
        shifted = np.where(nxt >= 0, nxt + total, -1).astype(np.int32)
        accept_rows = np.flatnonzero(accepting)
        for e in eos_ids:
            if e < shifted.shape[1]:
                shifted[:, e] = -1
                shifted[accept_rows, e] = accept_rows + total
        dense.append(shifted)
        acc.append(np.asarray(accepting, bool))
        offsets.append(total)
        total += nxt.shape[0]
    return np.concatenate(dense), np.concatenate(acc), offsets


def padded_tables(dense: np.ndarray, acc: np.ndarray, states: int | None = None,
                  classes: int | None = None):
    """(next int32[S, V], accepting) -> (next_by_class int32[S', C'], class_of int32[V],
    accepting bool[S']) padded to `states` x `classes` (None: the next power of two >= 16);
    None when the tables do not fit the sizes asked for."""
    by_class, class_of = token_classes(dense)
    s_pad = states or _bucket(by_class.shape[0])
    c_pad = classes or _bucket(by_class.shape[1])
    if by_class.shape[0] > s_pad or by_class.shape[1] > c_pad:
        return None
    by_class = np.pad(by_class, [(0, s_pad - by_class.shape[0]), (0, c_pad - by_class.shape[1])],
                      constant_values=-1)
    return by_class, class_of, np.pad(acc, (0, s_pad - acc.shape[0]))


def batch_grammar(tables: list, rows: int, eos_ids: tuple[int, ...]) -> Grammar:
    """Per row: a constraint's host tables (next int32[S_r, V], accepting bool[S_r], initial
    int) or None for a free row; rows past the list are padding (free). The same tables object
    is stacked once. States and token classes are padded to powers of two, so batches of
    similar constraints share a program. Host (numpy) arrays: each run puts its own copy on
    device (the loop's state is donated)."""
    blocks, index = [], {}
    for t in tables:
        if t is not None and id(t) not in index:
            index[id(t)] = len(blocks)
            blocks.append(t)
    dense, acc, offsets = stack_blocks(blocks, eos_ids)
    starts = [UNCONSTRAINED if t is None else offsets[index[id(t)]] + int(t[2]) for t in tables]
    starts += [UNCONSTRAINED] * (rows - len(starts))
    by_class, class_of, acc = padded_tables(dense, acc)
    zeros = np.zeros((rows,), np.int32)
    return Grammar(by_class, class_of, acc, np.asarray(starts, np.int32), zeros, zeros)


def token_classes(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """next int32[S, V] -> (next_by_class int32[S, C], class_of int32[V]): tokens with
    identical columns share a class. Columns are grouped by two random projections (chunked
    matmuls: ~3 s for json_object's 1623 x 49152, where an exact sort of the columns took
    44 s), then checked exactly; a projection collision falls back to the exact sort."""
    s, v = dense.shape
    proj = np.random.default_rng(0).standard_normal((2, s))
    keys = np.zeros((2, v))
    for a in range(0, s, 64):
        keys += proj[:, a:a + 64] @ dense[a:a + 64].astype(np.float64)
    _, first, class_of = np.unique(keys.T, axis=0, return_index=True, return_inverse=True)
    class_of = class_of.reshape(-1).astype(np.int32)
    by_class = np.ascontiguousarray(dense[:, first])  # [S, C]
    if all(np.array_equal(np.take(by_class[a:a + 64], class_of, axis=1), dense[a:a + 64])
           for a in range(0, s, 64)):
        return by_class, class_of
    columns, class_of = np.unique(dense.T, axis=0, return_inverse=True)  # a collision: exact
    return np.ascontiguousarray(columns.T), class_of.reshape(-1).astype(np.int32)


def _bucket(n: int) -> int:
    """Padded to a power of two (>= 16): few distinct program shapes."""
    return max(16, 1 << max(n - 1, 0).bit_length())
