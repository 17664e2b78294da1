"""Structured output's grammar as a processor (carry: `constrain.loop.Grammar` in
`DecodeState.grammar`): the drafts put under the constraint (`propose`, constrain/draft.py),
each window entry masked with the state along its own path, the state advanced along the
accepted path (constrain/loop.py).

The work runs only in steps where some row is constrained (`lax.cond` on the rows' states, a
traced predicate): a server carries the grammar in every program (serving.structured, on by
default) and its plain rows skip the draft masking, the window's state walk and the [B, T, V]
mask; a free row's outputs are the same either way (state -1 allows every token)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.constrain import draft as grammar_draft, loop as grammar_loop
from jaxspec.decode.processors.base import Processor


def _any_constrained(carry) -> jax.Array:
    """bool[]: some row of the batch holds a constraint (state >= 0; free -1, dead -2)."""
    return jnp.any(carry.state >= 0)


def _like(ref, tree):
    """`tree` cast leaf by leaf to `ref`'s dtypes (both branches of a cond must agree)."""
    return jax.tree.map(lambda r, x: x.astype(r.dtype), ref, tree)


class GrammarProcessor(Processor):
    field = "grammar"

    def propose(self, carry, proposal, keys, active):
        def masked():
            new, g = grammar_draft.mask_proposal(carry, proposal, keys, active)
            return _like(proposal, new), g.num_masked, g.num_proposed

        # only the proposal and the counters leave the cond: the table (16 MB on a server)
        # passed through a branch would be copied every step
        new, num_masked, num_proposed = jax.lax.cond(
            _any_constrained(carry), masked,
            lambda: (proposal, carry.num_masked, carry.num_proposed))
        return new, carry._replace(num_masked=num_masked, num_proposed=num_proposed)

    def prepare(self, carry, tokens, parents):
        b, n = tokens.shape
        free = lambda: jnp.broadcast_to(carry.state[:, None], (b, 1 + n))  # noqa: E731
        if n == 0:
            return carry.state[:, None]  # [B, 1] the root alone
        return jax.lax.cond(_any_constrained(carry),
                            lambda: grammar_loop.window_states(carry, tokens, parents), free)

    def adjust(self, carry, aux, logits, tokens, mask):
        states = aux[:, :logits.shape[1]]  # [B, T]
        return jax.lax.cond(
            _any_constrained(carry),
            lambda: grammar_loop.mask_logits(logits, grammar_loop.allowed_mask(carry, states)),
            lambda: logits)

    def commit(self, spec, sp, carry, aux, read, step):
        return grammar_loop.after_step(carry, aux, step.path, step.num_accepted,
                                       step.next_token, step.count)


GRAMMAR = GrammarProcessor()
