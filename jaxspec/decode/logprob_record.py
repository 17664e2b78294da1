"""The emitted tokens' logprobs, recorded inside the decode loop (`DecodeState.logprobs`).

Indexed like `DecodeState.tokens`: slot t holds the logprob of tokens[b, t] and its top-k
alternatives, read from the target's logits at the position that emitted it (prefill's last
prompt position for the first token, then each verify step's path: `logprobs.path_scored`), so
a speculative run records what plain decoding records. None in the state when the spec asks for
none (`LoopSpec.logprobs == 0`): the program is then the one without logprobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Record:
    chosen: jax.Array  # f32[B, W] the token's logprob (slots outside the generated span: 0)
    top_ids: jax.Array  # int32[B, W, k]
    top_values: jax.Array  # f32[B, W, k] descending


def empty(batch: int, capacity: int, k: int) -> Record:
    return Record(jnp.zeros((batch, capacity), jnp.float32),
                  jnp.zeros((batch, capacity, k), jnp.int32),
                  jnp.zeros((batch, capacity, k), jnp.float32))


def write(rec: Record | None, start: jax.Array, count: jax.Array, scored) -> Record | None:
    """Slots start[b] .. start[b] + count[b] - 1 set from `scored` = (chosen f32[B, S], top_ids
    int32[B, S, k], top_values f32[B, S, k]) (its first count[b] entries; S >= count)."""
    if rec is None:
        return None
    chosen, ids, values = scored
    b, s = chosen.shape
    w = rec.chosen.shape[1]
    idx = jnp.arange(s)[None]
    pos = jnp.where(idx < count[:, None], start[:, None] + idx, w)  # [B, S]; w: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], pos.shape)
    return Record(rec.chosen.at[rows, pos].set(chosen, mode="drop"),
                  rec.top_ids.at[rows, pos].set(ids, mode="drop"),
                  rec.top_values.at[rows, pos].set(values, mode="drop"))


def row_entries(rec, row: int, start: int, stop: int) -> list[dict]:
    """Host side, fetched (numpy) record: one {"logprob", "top": [(id, logprob), ...]} per
    generated token of `row` (slots start..stop-1)."""
    chosen = np.asarray(rec.chosen[row, start:stop], np.float64)
    ids = np.asarray(rec.top_ids[row, start:stop])
    values = np.asarray(rec.top_values[row, start:stop], np.float64)
    return [{"logprob": float(c), "top": [(int(i), float(v)) for i, v in zip(ii, vv)]}
            for c, ii, vv in zip(chosen, ids, values)]
