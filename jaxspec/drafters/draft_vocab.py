"""Draft vocabularies: a drafter that scores N of the target's V tokens carries `d2t` (int32[N],
draft index -> target id). Its draft distribution is scattered into the full vocabulary with zeros
elsewhere, so the acceptance rule sees a proper q over V."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError


def check_d2t(d2t, target_vocab: int, source: str) -> np.ndarray:
    """A valid map or a one-line error: 1-D integers, each a distinct id in 0..target_vocab-1
    (a duplicate would make q sum past 1; an id past the vocabulary would be emitted). The one
    check for every source: jaxspec checkpoints (train.load) and published layouts (formats)."""
    ids = np.asarray(d2t)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise JaxspecError(
            f"{source}: the draft vocabulary map must be a non-empty 1-D integer array, got "
            f"shape {ids.shape} of {ids.dtype}: re-export the drafter"
        )
    bad = ids[(ids < 0) | (ids >= target_vocab)]
    if bad.size:
        raise JaxspecError(
            f"{source}: the draft vocabulary maps to target id {int(bad[0])}, outside the target "
            f"vocabulary [0, {target_vocab}): use a drafter made for this target's tokenizer"
        )
    values, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise JaxspecError(
            f"{source}: target id {int(values[counts > 1][0])} appears "
            f"{int(counts[counts > 1][0])} times in the draft vocabulary map: a draft vocabulary "
            f"must list each target token once (re-export the drafter)"
        )
    return ids.astype(np.int32)


def scatter_to_target(probs_n: jax.Array, d2t: jax.Array | None, target_vocab: int) -> jax.Array:
    """f32[..., N] draft-vocabulary probs -> f32[..., V], zeros off the draft vocabulary
    (d2t None: the draft vocabulary is the target's, probs_n is returned as it is)."""
    if d2t is None:
        return probs_n
    full = jnp.zeros(probs_n.shape[:-1] + (target_vocab,), jnp.float32)
    return full.at[..., d2t].set(probs_n)
