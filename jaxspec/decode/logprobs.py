"""Log-probabilities of emitted tokens, and the top-k alternatives (OpenAI `logprobs`).

Pure functions over logits; the verify step calls them on the target's logits at the position
where each token was accepted or resampled, so a speculative run reports the same numbers as a
plain one. Two modes, as vLLM's `logprobs_mode`:

- "raw" (the default; vLLM's and OpenAI's): log_softmax of the target's unprocessed logits --
  independent of temperature / top-k / top-p, so a greedy and a sampled run agree.
- "processed": log of `logits_to_probs` (temperature, top-k, top-p, min-p applied): the law the
  token was actually drawn from; tokens cut by the filters get -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decode.sampling import SamplingParams, logits_to_probs
from jaxspec.errors import JaxspecError

MODES = ("raw", "processed")


def log_probs(logits: jax.Array, sp: SamplingParams | None = None, mode: str = "raw") -> jax.Array:
    """f32[..., V] logits -> f32[..., V] log-probabilities under `mode` (see module doc)."""
    if mode not in MODES:
        raise JaxspecError(f"logprobs mode {mode!r} is unknown: use one of {', '.join(MODES)}")
    logits = logits.astype(jnp.float32)
    if mode == "raw":
        return jax.nn.log_softmax(logits, axis=-1)
    if sp is None:
        raise JaxspecError("logprobs mode 'processed' needs the SamplingParams: pass sp=")
    return jnp.log(logits_to_probs(logits, sp))


def token_logprobs(logp: jax.Array, tokens: jax.Array, k: int):
    """Chosen-token logprob and the top-k alternatives.

    logp: f32[..., V] (from `log_probs`); tokens: int32[...] (the emitted ones); k: static, >= 0.
    Returns (chosen f32[...], top_ids int32[..., k], top_values f32[..., k]); the top-k are in
    descending order, first index on ties (as `lax.top_k`)."""
    if not isinstance(k, int) or k < 0 or k > logp.shape[-1]:
        raise JaxspecError(f"logprobs k={k!r} is invalid: pass an int in [0, {logp.shape[-1]}]")
    chosen = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    values, ids = jax.lax.top_k(logp, k)
    return chosen, ids.astype(jnp.int32), values


def scored(
    logits: jax.Array,
    tokens: jax.Array,
    k: int,
    sp: SamplingParams | None = None,
    mode: str = "raw",
):
    """`token_logprobs(log_probs(logits, sp, mode), tokens, k)`: logits f32[..., V] at the
    positions that emitted `tokens` int32[...]."""
    return token_logprobs(log_probs(logits, sp, mode), tokens, k)


def emitted_along_path(path_tokens: jax.Array, num_acc: jax.Array, next_token: jax.Array):
    """The tokens one verify step emits, slot by slot: int32[B, D+1] with slot i < num_acc the
    accepted node's token (path_tokens[:, i + 1]) and slot num_acc the resampled / bonus token;
    later slots repeat next_token (the caller masks them with num_acc).

    path_tokens int32[B, D+1] (window tokens along the accepted path, root first), num_acc int32[B],
    next_token int32[B]."""
    shifted = jnp.concatenate([path_tokens[:, 1:], next_token[:, None]], axis=1)  # [B, D+1]
    slot = jnp.arange(shifted.shape[1])[None]
    return jnp.where(slot < num_acc[:, None], shifted, next_token[:, None]).astype(jnp.int32)


def path_scored(
    logits: jax.Array,
    path: jax.Array,
    path_tokens: jax.Array,
    num_acc: jax.Array,
    next_token: jax.Array,
    k: int,
    sp: SamplingParams | None = None,
    mode: str = "raw",
):
    """Logprobs of a verify step's emitted tokens, for chain and tree windows alike.

    logits f32[B, T, V]: the target over the window (node j's logits predict its child);
    path int32[B, D+1]: window node indices along the accepted path (root first, as
    `acceptance.accept_tree` returns). The token in slot i was predicted by node path[:, i], so
    its logprob is read there -- the same position plain decoding scores it at.
    Returns `token_logprobs` over [B, D+1] (slots > num_acc are padding)."""
    nodes = jnp.clip(path, 0, logits.shape[1] - 1)  # slots past num_acc hold garbage indices
    at = jnp.take_along_axis(logits, nodes[:, :, None], axis=1)  # [B, D+1, V]
    return scored(at, emitted_along_path(path_tokens, num_acc, next_token), k, sp, mode)
