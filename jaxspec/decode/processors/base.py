"""The logits-and-commit interface every extra of the step goes through (penalties and
logit_bias, the grammar mask, the logprob record): a processor is a static (hashable) object of
pure hooks over its own carry, a field of `DecodeState` (None there: the processor is off and
the program carries none of its code).

Where the loop calls each hook (decode/speculate.py; prefill.py for the first token):

    propose(carry, proposal, keys, active) -> (proposal, carry)   after the drafter proposed
    prepare(carry, tokens, parents) -> aux                         before verify: per-entry data
    adjust(carry, aux, logits, tokens, mask) -> logits             the verified entries' logits
    read(spec, sp, carry, logits, adjusted) -> f32[B, T, ...]       what commit needs from them
    commit(spec, sp, carry, aux, read, step: Committed) -> carry   after the accepted path

Every hook has a neutral default, so a processor defines only what it changes. `adjust` must
keep speculation lossless: entry j's logits are adjusted as plain decoding would adjust them had
j's path been committed (tokens int32[B, T] and mask bool[B, T, T] are the window's, as
`tree.Window`).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax


class Committed(NamedTuple):
    """What one step (or prefill's first token) committed, per row."""

    tokens: jax.Array  # int32[B, W] committed tokens after the step
    prev_lengths: jax.Array  # int32[B] before the step
    lengths: jax.Array  # int32[B] after it (tokens[prev:lengths] are new)
    count: jax.Array  # int32[B] tokens emitted (lengths - prev_lengths)
    path: jax.Array  # int32[B, P] window entries kept, root first
    path_tokens: jax.Array  # int32[B, P] their tokens
    num_accepted: jax.Array  # int32[B] drafted nodes kept
    next_token: jax.Array  # int32[B] the target's token after them


class Processor:
    """Neutral hooks; a processor overrides the ones it needs (module docstring)."""

    field: ClassVar[str]  # the DecodeState field holding this processor's carry

    def start(self, carry, prompt: jax.Array, lengths: jax.Array):
        """Prefill, before the first token's logits: prompt int32[B, P], lengths int32[B]."""
        return carry

    def propose(self, carry, proposal, keys: jax.Array, active: jax.Array):
        return proposal, carry

    def prepare(self, carry, tokens: jax.Array, parents: jax.Array) -> Any:
        """tokens / parents int32[B, N] the proposal's nodes -> data for adjust and commit."""
        return None

    def adjust(self, carry, aux, logits: jax.Array, tokens: jax.Array, mask: jax.Array):
        return logits

    def read(self, spec, sp, carry, logits: jax.Array, adjusted: jax.Array) -> Any:
        """logits / adjusted f32[B, T, V] -> per-entry data [B, T, ...] for commit, or None."""
        return None

    def commit(self, spec, sp, carry, aux, read, step: Committed):
        return carry

    def __eq__(self, other):  # stateless: one per class (hashable, part of no jit key)
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))
