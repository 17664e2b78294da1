"""Logit adjustments a request asks for: OpenAI `logit_bias` and vLLM's three penalties.

Applied to raw logits before `logits_to_probs`, and -- for speculation to stay lossless -- to the
target's AND the drafter's logits at each position, with the counts of the tokens generated up to
that position. Definitions as vLLM's (`vllm/model_executor/layers/utils.apply_penalties`):

- repetition r (1 = off, in [0.01, 100]: 1e-300 is 0 in float32, a division by zero): tokens seen in the prompt or the generated text get logit / r if
  positive, logit * r otherwise;
- frequency f (0 = off, in [-2, 2]): logit -= f * (times the token was generated);
- presence p (0 = off, in [-2, 2]): logit -= p * (1 if generated at all);
- logit_bias {token id: bias in [-100, 100]}: added last.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError


def bias_vector(logit_bias: dict | None, vocab: int) -> np.ndarray:
    """OpenAI `logit_bias` ({"id": bias}, keys strings or ints) -> f32[V] (host, validated)."""
    out = np.zeros(vocab, np.float32)
    for key, value in (logit_bias or {}).items():
        try:
            tok, bias = int(key), float(value)
        except (TypeError, ValueError):
            raise JaxspecError(
                f"logit_bias entry {key!r}: {value!r} is invalid: map token ids to numbers"
            ) from None
        if not 0 <= tok < vocab:
            raise JaxspecError(f"logit_bias token {key!r} is out of range: use ids in [0, {vocab})")
        if not -100.0 <= bias <= 100.0:
            raise JaxspecError(f"logit_bias value {value!r} is out of range: use [-100, 100]")
        out[tok] = bias
    return out


REPETITION_RANGE = (0.01, 100.0)  # logits scaled by at most 100x either way stay finite


def check_penalties(presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> None:
    """Host-side validation with the ranges OpenAI / vLLM accept."""
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= float(v) <= 2.0:
            raise JaxspecError(f"{name}={v!r} is out of range: use [-2, 2] (0 = off)")
    low, high = REPETITION_RANGE
    if not low <= float(repetition) <= high:
        raise JaxspecError(f"repetition_penalty={repetition!r} is out of range: use "
                           f"[{low:g}, {high:g}] (1 = off)")


def adjust(
    logits: jax.Array,
    generated_counts: jax.Array,
    prompt_mask: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
    repetition: jax.Array,
    bias: jax.Array,
) -> jax.Array:
    """f32[..., V] logits -> adjusted f32[..., V].

    generated_counts int32[..., V] (occurrences among generated tokens before this position),
    prompt_mask bool[..., V] (token occurs in the prompt), presence / frequency / repetition f32
    scalars or broadcastable, bias f32[V] (or broadcastable)."""
    logits = logits.astype(jnp.float32)
    counts = generated_counts.astype(jnp.float32)
    seen = prompt_mask | (generated_counts > 0)
    rep = jnp.asarray(repetition, jnp.float32)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - jnp.asarray(frequency, jnp.float32) * counts
    logits = logits - jnp.asarray(presence, jnp.float32) * (generated_counts > 0)
    return logits + bias


def counts_along(tokens: jax.Array, vocab: int) -> jax.Array:
    """int32[..., T] generated tokens -> int32[..., T, V]: counts of each token strictly before
    each position (what the penalties see when scoring position t)."""
    onehot = jax.nn.one_hot(tokens, vocab, dtype=jnp.int32)  # [..., T, V]
    return jnp.cumsum(onehot, axis=-2) - onehot
