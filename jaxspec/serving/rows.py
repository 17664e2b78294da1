"""One request's row inside the batch's DecodeState: which axis of every state leaf is the
batch (found by tracing the state at two batch sizes: nothing here names a drafter's or the
controller's fields), a row's fresh state spliced into a slot, and the initial all-free state.

A leaf without a batch axis (the base key, the controller's batch-wide cost table) is the
batch's and is kept when a row is spliced in."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

NO_AXIS = -1


def batch_axes(make_state) -> tuple[int, ...]:
    """The batch axis of every leaf of `make_state(batch)` (NO_AXIS where none), leaf order.
    make_state is traced (jax.eval_shape) at batch 2 and 3: nothing is computed."""
    two, three = (jax.eval_shape(lambda b=b: make_state(b)) for b in (2, 3))

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        return diff[0] if diff else NO_AXIS

    return tuple(axis(a, b) for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(three)))


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnames=("state",))
def insert_row(state, row, slot: jax.Array, axes: tuple[int, ...]):
    """`row` (a batch-1 state) into slot `slot` (int32[]) of `state`; batch-wide leaves kept."""
    s_leaves, treedef = jax.tree.flatten(state)
    r_leaves = jax.tree.leaves(row)

    def put(s, r, a):
        if a == NO_AXIS:
            return s
        return jax.lax.dynamic_update_slice_in_dim(s, r.astype(s.dtype), slot * r.shape[a], a)

    return jax.tree.unflatten(treedef, [put(s, r, a) for s, r, a in zip(s_leaves, r_leaves, axes)])


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnames=("state",))
def insert_rows(state, new, slots: jax.Array, axes: tuple[int, ...]):
    """`new` (an N-row state) into slots `slots` (int32[N], distinct) of `state`; batch-wide
    leaves kept, as `insert_row` keeps them (batched admission's splice)."""
    s_leaves, treedef = jax.tree.flatten(state)
    r_leaves = jax.tree.leaves(new)

    def put(s, r, a):
        if a == NO_AXIS:
            return s
        return s.at[_index(s, a) + (slots,)].set(r.astype(s.dtype))

    return jax.tree.unflatten(treedef, [put(s, r, a) for s, r, a in zip(s_leaves, r_leaves, axes)])


def tile_rows(row, batch: int, axes: tuple[int, ...]):
    """A `batch`-row state of copies of `row` (batch-wide leaves taken from it), every row done:
    the scheduler's state before any request, its slots all free."""
    leaves, treedef = jax.tree.flatten(row)
    # a copy even at batch 1 (concatenating one array returns it): the state is donated to
    # insert_row next to the row it was made from, and one buffer cannot be both
    tiled = [x if a == NO_AXIS else jnp.concatenate([x] * batch, axis=a) if batch > 1
             else jnp.copy(x) for x, a in zip(leaves, axes)]
    state = jax.tree.unflatten(treedef, tiled)
    return dataclasses.replace(state, done=jnp.ones_like(state.done))


@functools.partial(jax.jit, donate_argnames=("state",))
def release_rows(state, free: jax.Array):
    """Mark the slots `free` (bool[B]) done: the loop computes nothing useful for them and
    their tokens are never read again."""
    return dataclasses.replace(state, done=state.done | free)


def _index(x: jax.Array, axis: int) -> tuple:
    return (slice(None),) * axis


@functools.partial(jax.jit, static_argnames=("axes",))
def take_rows(state, idx: jax.Array, axes: tuple[int, ...]):
    """The rows `idx` (int32[W]) of `state`, in that order: a W-row state (batch-wide leaves
    kept). The scheduler's narrower device call over the live rows (`put_rows` undoes it)."""
    leaves, treedef = jax.tree.flatten(state)
    taken = [x if a == NO_AXIS else jnp.take(x, idx, axis=a) for x, a in zip(leaves, axes)]
    return jax.tree.unflatten(treedef, taken)


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnames=("state",))
def put_rows(state, sub, idx: jax.Array, axes: tuple[int, ...]):
    """`sub` (a W-row state from `take_rows(state, idx)`, since advanced) written back into rows
    `idx` of `state`; batch-wide leaves are sub's (what the narrower call left)."""
    s_leaves, treedef = jax.tree.flatten(state)
    r_leaves = jax.tree.leaves(sub)

    def put(s, r, a):
        if a == NO_AXIS:
            return r
        return s.at[_index(s, a) + (idx,)].set(r.astype(s.dtype))

    return jax.tree.unflatten(treedef, [put(s, r, a) for s, r, a in zip(s_leaves, r_leaves, axes)])
