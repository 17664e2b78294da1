"""Penalties and logit_bias inside the decode loop: per-row settings and the counts they read.

`decode.logit_bias.adjust` is the transform (vLLM's presence / frequency / repetition penalties
and OpenAI's logit_bias); this module carries what it needs through the loop, as part of the
decode state (`DecodeState.penalties`, None when every row has them off: the program is then
the one without them):

    settings per row    presence f32[B], frequency f32[B], repetition f32[B], bias f32[B, V]
    counts              int32[B, V] committed generated tokens; bool[B, V] the prompt's tokens

Lossless speculation: the target's logits at verify window entry j are adjusted with the counts
of the path that entry continues -- the committed tokens plus the drafted nodes from the root
down to j (`window_logits`) -- so each position sees exactly the counts plain decoding would see
there had that path been committed. Penalising from the committed counts alone (the broken
variant `committed_only=True`, which tests/test_penalties.py sees fail) gives a drafted position
the wrong law. The drafter keeps drawing from its own, unpenalised law and reports it: the
acceptance rule needs q to be the law a node was drawn from, not the target's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode import logit_bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Penalties:
    presence: jax.Array  # f32[B] 0 = off
    frequency: jax.Array  # f32[B] 0 = off
    repetition: jax.Array  # f32[B] 1 = off
    bias: jax.Array  # f32[B, V]
    counts: jax.Array  # int32[B, V] generated (committed) tokens so far
    prompt_mask: jax.Array  # bool[B, V] tokens of the row's prompt


OFF = (0.0, 0.0, 1.0, None)  # (presence, frequency, repetition, logit_bias): a row without any


def is_off(setting) -> bool:
    presence, frequency, repetition, bias = setting
    return presence == 0.0 and frequency == 0.0 and repetition == 1.0 and not bias


def make(settings, vocab: int, always: bool = False) -> Penalties | None:
    """Host side: one (presence, frequency, repetition, logit_bias dict) per row, validated (a
    one-line JaxspecError naming the fix) -> Penalties with empty counts, or None when every row
    has them all off (the loop then carries no penalty code at all) unless `always` (the
    serving state, whose rows come and go, always carries them)."""
    settings = [tuple(s) for s in settings]
    for presence, frequency, repetition, _ in settings:
        logit_bias.check_penalties(presence, frequency, repetition)
    bias = np.stack([logit_bias.bias_vector(s[3], vocab) for s in settings])  # validates
    if not always and all(is_off(s) for s in settings):
        return None
    b = len(settings)
    col = lambda i: jnp.asarray([float(s[i]) for s in settings], jnp.float32)  # noqa: E731
    return Penalties(col(0), col(1), col(2), jnp.asarray(bias), jnp.zeros((b, vocab), jnp.int32),
                     jnp.zeros((b, vocab), bool))


def with_prompt(pen: Penalties, prompt: jax.Array, lengths: jax.Array) -> Penalties:
    """The rows' prompt tokens (prompt int32[B, P] right-padded, lengths int32[B]) marked."""
    b, p = prompt.shape
    valid = jnp.arange(p)[None] < lengths[:, None]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, p))
    cols = jnp.where(valid, prompt, pen.prompt_mask.shape[1])  # padding: dropped
    mask = jnp.zeros_like(pen.prompt_mask).at[rows, cols].set(True, mode="drop")
    return dataclasses.replace(pen, prompt_mask=mask, counts=jnp.zeros_like(pen.counts))


def _adjust(pen: Penalties, logits: jax.Array, counts: jax.Array) -> jax.Array:
    """logits f32[B, ..., V] with counts int32[B, ..., V] -> adjusted (per-row settings)."""
    extra = (1,) * (logits.ndim - 2)
    per_row = lambda x: x.reshape(x.shape[:1] + extra + (1,))  # noqa: E731  f32[B] -> [B, 1.., 1]
    mask = pen.prompt_mask.reshape(pen.prompt_mask.shape[:1] + extra + pen.prompt_mask.shape[1:])
    bias = pen.bias.reshape(pen.bias.shape[:1] + extra + pen.bias.shape[1:])
    return logit_bias.adjust(logits, counts, mask, per_row(pen.presence),
                             per_row(pen.frequency), per_row(pen.repetition), bias)


def row_logits(pen: Penalties | None, logits: jax.Array) -> jax.Array:
    """logits f32[B, V] at the position after every committed token (prefill's first token)."""
    return logits if pen is None else _adjust(pen, logits, pen.counts)


def window_logits(pen: Penalties | None, logits: jax.Array, tokens: jax.Array, mask: jax.Array,
                  committed_only: bool = False) -> jax.Array:
    """The verify window's logits f32[B, T, V] adjusted per entry: entry j continues the
    committed tokens and the window tokens of j's ancestors-and-self past the root (tokens
    int32[B, T], mask bool[B, T, T] as `tree.Window`). committed_only: the broken variant."""
    if pen is None:
        return logits
    v = logits.shape[-1]
    counts = jnp.broadcast_to(pen.counts[:, None], logits.shape)
    if not committed_only and tokens.shape[1] > 1:
        path = mask[:, :, 1:].astype(jnp.int32)  # [B, T, T-1] nodes on entry j's path
        onehot = jax.nn.one_hot(tokens[:, 1:], v, dtype=jnp.int32)  # [B, T-1, V]
        counts = counts + jnp.einsum("btn,bnv->btv", path, onehot)
    return _adjust(pen, logits, counts)


def commit(pen: Penalties | None, tokens: jax.Array, prev: jax.Array, new: jax.Array,
           most: int) -> Penalties | None:
    """Counts after a step committed tokens[b, prev[b]:new[b]] (at most `most` per row)."""
    if pen is None:
        return None
    b, w = tokens.shape
    idx = prev[:, None] + jnp.arange(most)[None]  # [B, most]
    got = jnp.take_along_axis(tokens, jnp.minimum(idx, w - 1), axis=1)
    v = pen.counts.shape[1]
    got = jnp.where(idx < new[:, None], got, v)  # not committed: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], got.shape)
    return dataclasses.replace(pen, counts=pen.counts.at[rows, got].add(1, mode="drop"))
